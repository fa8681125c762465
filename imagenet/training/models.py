"""Build a torchvision model by name and load its weights; wrap it for training and unwrap it.

Crop sizes the model accepts, found by running it on the meta device (shapes only: no memory,
no arithmetic), so that a crop too small for ``-a`` fails before any data is read or process
started, naming the size the model needs.

The model answers for itself rather than a table: torchvision adds architectures, and a table
would have to know each one's pooling arithmetic. Measured on torchvision 0.29: convolutional
nets accept every size from a minimum up (AlexNet 63 px, Inception-v3 75 px, the rest 32 px or
less); ViT and MaxViT take only the size they were built for (224 px: their position
embeddings and attention partitions are fixed at construction, not interpolated at run time).

--compile: torch.compile with one static graph per batch shape, compiled in the first epoch.

Static shapes (``dynamic=False``): the last, smaller batch of an epoch and the validation
batches get graphs of their own, compiled once, in the first epoch. With torch's automatic
dynamic shapes the last batch would instead recompile the model for any batch size, and every
later step would run that dynamic graph (slower kernels, no CUDA graphs). Dynamo keeps at most
``recompile_limit`` graphs per Python function; under --fsdp every block's forward is a frame of
its own, so one function holds a graph per block shape and batch shape: ResNet-50 needs 32
(8 block shapes x train/eval x full/last batch; measured), beyond torch's default of 8, after
which the blocks silently run uncompiled. ``RECOMPILE_LIMIT`` leaves room for that, for every
training crop size of a progressive-resizing run (``resolution``): each size brings its own
graphs, compiled in the first epoch that uses it.

DDP is compiled from the outside (``torch.compile(DDP(model))``), as torch's DDP documentation
asks: Dynamo's DDPOptimizer then splits the graph at DDP's gradient buckets so that each
bucket's all-reduce overlaps the rest of the backward. Validation runs the model without DDP
(``models.for_evaluation``): its compiled twin is kept here, one per training model.

A call that compiles (``compiles``: a batch shape's first) does not count toward --hang-timeout:
the engine pauses the hang watch around it (``launching.watchdog.paused``).

What every start checks and says before any data is read or process started, main.py's
(``cli``) and ``imagenet.train``'s (``api``) alike.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel

from imagenet.errors import RunError, UsageError
from imagenet.launching.process_group import DistInfo
from imagenet.settings.choices import TIMM_PREFIX
from imagenet.settings.flags import Config
from imagenet.settings.plan import Plan

log = logging.getLogger(__name__)


def resolve_weights(arch: str, pretrained: bool, weights: str | None):
    """The torchvision weights enum member for --pretrained / --weights, or None."""
    if not pretrained and not weights:
        return None
    enum = torchvision.models.get_model_weights(arch)
    if pretrained:
        return enum.DEFAULT
    name = weights.split(".")[-1]  # accept 'IMAGENET1K_V1' and 'ResNet18_Weights.IMAGENET1K_V1'
    try:
        return enum[name]
    except KeyError:
        options = ", ".join(m.name for m in enum)
        raise UsageError(f"--weights {weights}: not a weight set of {arch} "
                         f"(choose from {options})") from None


def weights_file(weights) -> Path:
    """Where torch.hub caches (and looks for) a weights file."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(weights.url)


def build_model(arch: str, num_classes: int, pretrained: bool = False,
                weights: str | None = None) -> nn.Module:
    """torchvision model ``arch``; pretrained weights through torchvision's own loader. A
    timm/NAME arch is timm's (``imagenet.training.timm_models``)."""
    if arch.startswith(TIMM_PREFIX):
        from imagenet.training.timm_models import build_timm_model

        return build_timm_model(arch, num_classes, pretrained)
    chosen = resolve_weights(arch, pretrained, weights)
    if chosen is None:
        return torchvision.models.get_model(arch, weights=None, num_classes=num_classes,
                                            **NO_AUX_HEADS.get(arch, {}))
    log.info("=> using pre-trained model '%s' (%s)", arch, chosen)
    try:
        model = torchvision.models.get_model(arch, weights=chosen)
    except Exception as exc:  # urllib/OSError/hash errors: all mean "could not get the file"
        raise RunError(
            f"cannot load pretrained weights {chosen} for {arch}: {str(exc).splitlines()[0]}. "
            f"Offline? Put the file at {weights_file(chosen)} (TORCH_HOME="
            f"{os.environ.get('TORCH_HOME', '~/.cache/torch')}), downloaded elsewhere from "
            f"{chosen.url}") from None
    if num_classes != len(chosen.meta.get("categories") or []):
        replace_classifier(model, num_classes)
    return drop_aux_heads(model)


# GoogLeNet and Inception-v3 are built without their auxiliary classifiers, as torchvision builds
# them for its pretrained weights: in train mode they would return the aux logits too, which no
# loss here expects, and Inception-v3's aux head needs crops of ~300 px. torchvision's reference
# recipe trains them without aux losses as well. init_weights=True is torchvision's default today
# (it only warns that it may change).
NO_AUX_HEADS = {"googlenet": {"aux_logits": False, "init_weights": True},
                "inception_v3": {"aux_logits": False, "init_weights": True}}


AUX_HEADS = ("aux1", "aux2", "AuxLogits")  # GoogLeNet's two, Inception-v3's one


def drop_aux_heads(model: nn.Module) -> nn.Module:
    """GoogLeNet / Inception-v3 with pretrained weights, minus the aux classifiers (torchvision
    keeps Inception-v3's): train mode then returns plain logits, as eval mode does."""
    if getattr(model, "aux_logits", False):
        model.aux_logits = False
        for name in AUX_HEADS:
            if hasattr(model, name):
                setattr(model, name, None)
    return model


def without_dropped_aux(state: dict[str, torch.Tensor], model: nn.Module
                        ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``state`` less the keys of aux classifiers that ``model`` was built without (torchvision's
    GoogLeNet and Inception-v3 files hold them), and those keys."""
    dropped = [name for name in AUX_HEADS if hasattr(model, name)
               and getattr(model, name) is None]
    aux = [k for k in state if k.split(".", 1)[0] in dropped]
    return {k: v for k, v in state.items() if k not in aux}, aux


def replace_classifier(model: nn.Module, num_classes: int) -> None:
    """Swap the last Linear layer for one with ``num_classes`` outputs (fine-tuning)."""
    last_name, last = None, None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last_name, last = name, module
    if last is None:
        raise UsageError("cannot adapt the pretrained model to this data set's classes: "
                         "it has no Linear classifier")
    parent = model.get_submodule(last_name.rsplit(".", 1)[0]) if "." in last_name else model
    setattr(parent, last_name.rsplit(".", 1)[-1],
            nn.Linear(last.in_features, num_classes, bias=last.bias is not None))
    log.info("=> replaced classifier '%s' for %d classes", last_name, num_classes)


def wrap(raw: nn.Module, cfg: Config, dist: DistInfo, ema: AveragedModel | None = None,
         compile_backend: str | Callable = "inductor", sizes: Sequence[int] = ()) -> nn.Module:
    """The module the training step calls: raw -> (SyncBN) -> (DDP + comm hook) -> (compiled),
    or with --fsdp: raw (and ``ema``'s copy) sharded in place -> (compiled). ``sizes``: the
    run's training crops (the plan's; default --train-crop-size), each compiled statically."""
    sizes = list(sizes) or [cfg.train_crop_size]
    if cfg.compile and len(sizes) > 1:
        log.info("=> --compile with progressive resizing: static graphs for each training crop "
                 "(%s px), each compiled in the first epoch that uses it",
                 ", ".join(map(str, sizes)))
    model = raw
    if cfg.sync_bn and dist.distributed:
        # convert_sync_batchnorm returns a new module only for a bare BatchNorm root; torchvision
        # models are containers, so ``raw`` keeps the converted layers in place.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.fsdp and dist.distributed:
        return shard(model, cfg, dist, ema, compile_backend, len(sizes))
    if cfg.fsdp:
        log.info("=> one process: --fsdp has nothing to shard; training the whole model")
    if not dist.distributed:
        if cfg.ddp_comm_hook != "none":
            log.info("=> one process: --ddp-comm-hook %s has nothing to send", cfg.ddp_comm_hook)
        return compile_model(model, compile_backend, len(sizes), cfg.compile_mode) \
            if cfg.compile else model
    device_ids = None if dist.device.type == "cpu" else [dist.device.index]
    # Gradients are views into DDP's all-reduce buckets: no second copy of them in memory.
    model = DDP(model, device_ids=device_ids, bucket_cap_mb=cfg.bucket_cap_mb,
                gradient_as_bucket_view=True)
    settle_buckets(model, sizes[0])  # before a comm hook: it would count this step
    import imagenet.training.comm_hooks as comm_hooks

    comm_hooks.register_comm_hook(model, raw, cfg, dist.backend or "gloo")
    if dist.is_main:
        comm_hooks.log_payload(raw, cfg, dist.world_size)
    # Compiled from the outside: Dynamo splits the graph at DDP's buckets (see compiling).
    return compile_ddp(model, compile_backend, len(sizes), cfg.compile_mode) \
        if cfg.compile else model


def settle_buckets(model: DDP, crop_size: int) -> None:
    """Let DDP fix its gradient buckets now, with a backward that changes nothing.

    DDP all-reduces a process's first backward as one bucket and regroups the gradients after
    it, by the order they arrived. With 3+ processes the rounding of a sum depends on that
    grouping, so a resumed process's first step would end a few bits away from the uninterrupted
    run's (long regrouped) step. This backward of a zero loss gives every process, fresh or
    resumed, the same grouping for all its steps; the weights, buffers and RNG stay as they were.
    """
    module = model.module
    device = next(module.parameters()).device
    buffers = [b.detach().clone() for b in module.buffers()]  # BatchNorm statistics
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # dropout
        (model(torch.zeros(2, 3, crop_size, crop_size, device=device)).sum() * 0).backward()
    with torch.no_grad():
        for buffer, saved in zip(module.buffers(), buffers):
            buffer.copy_(saved)
    for param in module.parameters():
        param.grad = None


def for_evaluation(model: nn.Module) -> nn.Module:
    """The module to validate: without DDP, whose forward may broadcast buffers (a collective
    that a rank without validation batches would skip: a hang), and with rank 0's buffers
    (BatchNorm statistics) on every rank, so every rank validates the model that is saved."""
    twin = evaluation_twin(model)  # a compiled DDP's inner module, compiled too
    if twin is not None:
        model = twin
    elif isinstance(model, DDP):
        model = model.module
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)
    return model


def shard(model: nn.Module, cfg: Config, dist: DistInfo, ema: AveragedModel | None,
          compile_backend: str | Callable = "inductor", crop_sizes: int = 1) -> nn.Module:
    """--fsdp: shard ``model`` and the EMA's copy by the same rule, then compile."""
    from imagenet.training import fsdp  # imported by --fsdp runs only

    units = fsdp.describe_units(model, fsdp.repeated_blocks(model))  # before classes change
    for module in ([ema.module] if ema is not None else []) + [model]:
        fsdp.shard(module, cfg, dist.device)
    if dist.is_main:
        log.info("=> FSDP over %d processes (ZeRO-%d%s): %s", dist.world_size,
                 cfg.fsdp_zero or 3, ", CPU offload" if cfg.fsdp_cpu_offload else "", units)
    # Static shapes (compiling): also, with automatic dynamic shapes, inductor (torch 2.14, CPU)
    # fails to compile the backward of a recompiled FSDP graph ("Cannot convert expression to
    # float").
    return compile_model(model, compile_backend, crop_sizes, cfg.compile_mode) \
        if cfg.compile else model


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager:
    """No gradient communication in this block (an accumulating micro-batch): DDP's no_sync,
    FSDP's equivalent, or nothing for a single process."""
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if is_sharded(model):
        from imagenet.training import fsdp  # imported by --fsdp runs only

        return fsdp.no_gradient_sync(model)
    return contextlib.nullcontext()


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` is (or holds) an FSDP-sharded module. Only ``training.fsdp`` shards,
    and only a --fsdp run imports it: without it in this process, nothing is sharded."""
    fsdp = sys.modules.get("imagenet.training.fsdp")
    return fsdp is not None and fsdp.fsdp_root(model) is not None


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP and torch.compile wrappers."""
    while True:
        if isinstance(model, DDP):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


# ----------------------------------------------- crop sizes the model accepts (the meta device)

LARGEST = 1024  # px: the largest crop tried when looking for a model's minimum
BUILT_FOR = 224  # px: the size torchvision builds its models for, unless they say otherwise


def accepts(model: nn.Module, size: int) -> bool:
    """Whether ``model`` runs on a ``size`` x ``size`` image (on the meta device)."""
    try:
        with torch.no_grad():
            model(torch.empty(1, 3, size, size, device="meta"))
        return True
    except Exception:  # too small: RuntimeError (conv, pool), AssertionError (ViT), ValueError
        return False


def smallest_above(model: nn.Module, size: int) -> int | None:
    """The smallest size above ``size`` that ``model`` accepts, for models that accept every
    size from a minimum up; None when none up to LARGEST does."""
    if size >= LARGEST:
        return None
    high = size
    while not accepts(model, high := min(high * 2, LARGEST)):
        if high == LARGEST:
            return None
    low = size  # rejected; ``high`` accepted
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if accepts(model, middle) else (middle, high)
    return high


def check_crop_sizes(arch: str, crops: Mapping[str, int]) -> None:
    """UsageError naming the size ``-a``/``arch`` needs when a crop flag gives it one it cannot
    take (``crops``: the size each crop flag feeds the model, ``Plan.crop_flags``)."""
    from imagenet.training.models import build_model  # torchvision: imported only when a run starts

    try:
        with torch.device("meta"):
            model = build_model(arch, num_classes=10).eval()
    except Exception as exc:  # e.g. RegNet's init copies data; the real build reports errors
        log.debug("crop sizes not checked: -a %s cannot be built on the meta device (%s)",
                  arch, exc)
        return
    taken = {size: accepts(model, size) for size in set(crops.values())}  # one forward each
    bad = {flag: size for flag, size in crops.items() if not taken[size]}
    if not bad:
        return
    given = " and ".join(f"{flag} {size}" for flag, size in bad.items())
    least = smallest_above(model, max(bad.values()))
    if least is not None:
        wanted = " and ".join(f"{flag} {least}" for flag in bad)
        raise UsageError(f"{given}: too small for -a {arch}, which needs crops of at least "
                         f"{least} px; give {wanted} or more")
    built = getattr(model, "image_size", BUILT_FOR)
    if isinstance(built, int) and accepts(model, built):
        raise UsageError(f"{given}: -a {arch} takes crops of exactly {built} px (the size "
                         f"it is built for); give --train-crop-size {built} and "
                         f"--val-crop-size {built}")
    log.debug("crop sizes not checked: -a %s accepts none of the sizes tried", arch)


# -------------------------------------------------- --compile: one static graph per batch shape

RECOMPILE_LIMIT = 64  # graphs per function; see the module docstring

_EVALUATION: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()
_SHAPES: weakref.WeakKeyDictionary[nn.Module, set] = weakref.WeakKeyDictionary()  # ``compiles``


def compile_model(model: nn.Module, backend: str | Callable = "inductor",
                  crop_sizes: int = 1, mode: str = "default") -> nn.Module:
    """``model`` compiled with static shapes (a graph per batch shape), with room for the
    graphs of ``crop_sizes`` training crop sizes; ``mode``: inductor's (--compile-mode:
    "reduce-overhead" replays CUDA graphs), for the inductor backend only."""
    import torch._dynamo  # only when compiling: importing Dynamo takes a while

    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT * crop_sizes)
    if backend == "inductor" and mode != "default":
        return torch.compile(model, dynamic=False, backend=backend, mode=mode)
    return torch.compile(model, dynamic=False, backend=backend)


def compile_ddp(ddp: nn.Module, backend: str | Callable = "inductor",
                crop_sizes: int = 1, mode: str = "default") -> nn.Module:
    """A DDP module compiled from the outside, and its inner module compiled for validation."""
    compiled = compile_model(ddp, backend, crop_sizes, mode)
    _EVALUATION[compiled] = compile_model(ddp.module, backend, crop_sizes, mode)
    return compiled


def evaluation_twin(model: nn.Module) -> nn.Module | None:
    """The compiled module without DDP that validates ``model`` (from ``compile_ddp``)."""
    return _EVALUATION.get(model)


def compiles(model: nn.Module, *batches: torch.Tensor) -> bool:
    """Whether calling ``model`` on ``batches`` (a step's micro-batches) compiles: the first call
    of a compiled model with these batch shapes in this mode (training, evaluation), each of
    which gets a static graph of its own. An uncompiled model never compiles."""
    if not hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
        return False
    key = (model.training, *(tuple(batch.shape) for batch in batches))
    seen = _SHAPES.setdefault(model, set())
    if key in seen:
        return False
    seen.add(key)
    return True


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process so far (torch's own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def new_graphs(before: int, epoch: int, expected: bool) -> int:
    """Graphs compiled since ``before`` (``graphs_compiled``). Unless ``expected`` (this
    process's first epoch, or the first at a new crop size) any is a warning: a batch shape not
    seen before, each costing minutes on a GPU."""
    count = graphs_compiled() - before
    if count and not expected:
        log.warning("torch.compile compiled %d new graph(s) in epoch %d: a batch shape it had "
                    "not seen (e.g. a resumed epoch's last batch; --debug with "
                    "TORCH_LOGS=recompiles says which)", count, epoch)
    return count


# ----------------------------------- what every start checks first (main.py and imagenet.train)

def check_start(plan: Plan) -> None:
    """Say the plan's notes (warnings about the launch), then refuse crops the model cannot
    take (``UsageError``, found on the meta device). The plan itself refused the impossible
    launches (``settings.launch.plan_job``: the backend, --sync-bn's device)."""
    for note in plan.notes:
        log.warning("%s", note)
    check_crop_sizes(plan.cfg.arch, plan.crop_flags)
