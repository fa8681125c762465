"""The state dicts of a model, its optimizer and EMA - plain, DDP and FSDP alike (FSDP gathers
to rank 0) - and how a saved one goes back without overwriting the flags' hyper-parameters.
``run.checkpointing`` assembles a run's checkpoint from them.

RNG states in checkpoints: every rank's captured, gathered to rank 0, and restored.

Stored as tensors and plain containers only, so checkpoints load with ``weights_only=True``.

Only good state is written or resumed: every tensor finite, the class names the same.

A diverging run can keep a finite loss for a step or two while its weights, BatchNorm running
statistics or momentum are already inf; the loss check alone would save that state. So each save
checks every floating-point tensor it is about to write (one host sync per save, none per step).
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.swa_utils import AveragedModel

from imagenet.checkpoint import files
from imagenet.errors import CheckpointError, NonFiniteStateError
from imagenet.launching.process_group import raise_agreed
from imagenet.settings import devices
from imagenet.settings.flags import Config
from imagenet.settings.launch import Layout
from imagenet.training.models import is_sharded, unwrap
from imagenet.training.optim import ResumePoint, resume_point

log = logging.getLogger(__name__)


def model_state(model: nn.Module) -> dict[str, Any]:
    """The unwrapped model's state_dict; sharded, gathered to rank 0 ({} elsewhere; collective)."""
    model = unwrap(model)
    if not is_sharded(model):
        return model.state_dict()
    from imagenet.training import fsdp  # imported by --fsdp runs only

    return fsdp.gathered_model_state(model)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The classic ``optimizer.state_dict()`` (keyed by parameter index) for every mode;
    sharded, gathered to rank 0 ({} elsewhere; collective)."""
    if is_sharded(model):
        from imagenet.training import fsdp  # imported by --fsdp runs only

        return fsdp.gathered_optimizer_state(unwrap(model), optimizer)
    return optimizer.state_dict()


def ema_state(ema: AveragedModel) -> dict[str, Any]:
    """``ema.state_dict()``; sharded, gathered to rank 0 ({} elsewhere; collective)."""
    if not is_sharded(ema):
        return ema.state_dict()
    from imagenet.training import fsdp  # imported by --fsdp runs only

    weights = fsdp.gathered_model_state(ema.module)
    if not weights:
        return {}
    return {"n_averaged": ema.n_averaged.clone(), **{f"module.{k}": v for k, v in weights.items()}}


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict[str, Any]) -> None:
    """Load a classic optimizer state_dict into the (possibly sharded) optimizer."""
    if is_sharded(model):
        from imagenet.training import fsdp  # imported by --fsdp runs only

        fsdp.load_optimizer_state(unwrap(model), optimizer, state)
    else:
        optimizer.load_state_dict(state)


def load_ema_state(ema: AveragedModel, state: dict[str, Any]) -> None:
    """Load ``ema.state_dict()`` into the (possibly sharded) EMA."""
    if not is_sharded(ema):
        ema.load_state_dict(state)
        return
    from imagenet.training import fsdp  # imported by --fsdp runs only

    fsdp.load_model_state(ema.module, {k[len("module."):]: v for k, v in state.items()
                                       if k.startswith("module.")})
    ema.n_averaged.copy_(state["n_averaged"])


def restore_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer,
                      ckpt: dict[str, Any], cfg: Config) -> None:
    """The saved optimizer state (momentum, Adam moments) with this command line's
    hyper-parameters (--lr, --wd, --momentum, ...), which a plain load would overwrite."""
    if not ckpt.get("optimizer") or not same_optimizer(ckpt, cfg):
        return
    with flags_kept(optimizer):
        try:
            load_optimizer_state(model, optimizer, ckpt["optimizer"])
        except (ValueError, CheckpointError) as exc:  # --norm-/--bias-weight-decay changed
            log.warning("the optimizer state does not fit this run's parameter groups (%s): "
                        "it starts afresh", exc)


def same_optimizer(ckpt: dict[str, Any], cfg: Config) -> bool:
    """Whether the checkpoint's optimizer state fits --opt (a warning when it does not)."""
    saved_opt = (ckpt.get("config") or {}).get("opt", "sgd")  # the classic used SGD
    if saved_opt != cfg.opt:
        log.warning("--opt changed from %s to %s: the optimizer state starts afresh", saved_opt,
                    cfg.opt)
    return saved_opt == cfg.opt


@contextlib.contextmanager
def flags_kept(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Load the saved optimizer state inside: this command line's hyper-parameters (--lr, --wd,
    --momentum, ...), which a load overwrites, are put back after it."""
    own = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    yield
    for group, flags in zip(optimizer.param_groups, own):
        params = group["params"]
        group.clear()  # the saved settings, initial_lr included, give way to the flags'
        group.update(flags, params=params)


def layout_kept(layout: Layout, ckpt: dict[str, Any]) -> bool:
    """True when the checkpoint's world size, batch and accumulation match ``layout``."""
    return (ckpt.get("world_size") == layout.world_size
            and ckpt.get("batch_size") == layout.batch_size
            and ckpt.get("grad_accum_steps", 1) == layout.grad_accum_steps)


def same_order(ckpt: dict[str, Any], cfg: Config) -> bool:
    """True when the checkpoint's epochs have this run's order (the same --ra-reps)."""
    return int((ckpt.get("config") or {}).get("ra_reps", 1)) == cfg.ra_reps


def data_resume_point(ckpt: dict[str, Any], cfg: Config, layout: Layout, steps_per_epoch: int,
                      train: Any) -> ResumePoint:
    """Where a resume of ``ckpt`` puts the training data ``train`` (a ``TrainData``) under this
    run's flags and layout: the one answer the early start of the loader
    (``run.build.start_early``) and the resume itself (``run.checkpointing``) both use."""
    kept = same_order(ckpt, cfg)
    return resume_point(ckpt, steps_per_epoch, layout, layout_kept(layout, ckpt) and kept,
                        train.order_size if train.continues_any_layout and kept else None)


def resumed_best(ckpt: dict[str, Any], path: Path, output_dir: Path, key: str = "best_acc1",
                 best_file: str = files.BEST) -> float:
    """``key`` of the checkpoint, or of ``best_file`` next to it if that is higher.

    Best files are written before checkpoint.pth.tar; a kill in between leaves one ahead, and
    forgetting its accuracy would let a worse epoch overwrite it.
    """
    best = files.best_acc1_of(ckpt, key)
    if path.resolve().parent != output_dir.resolve():
        return best
    on_disk = files.best_acc1_on_disk(output_dir, best_file)
    if on_disk is not None and on_disk > best:
        log.info("=> %s records best Acc@1 %.3f (the checkpoint %.3f): keeping the higher",
                 best_file, on_disk, best)
        return on_disk
    return best


# ------------------------------------------------------------------ every rank's random streams

def capture_rng() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, CUDA per device)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                  float(gauss)),
        "torch": torch.get_rng_state(),
    }
    if devices.rng_device() is not None:
        # This process's device only: a restart may see fewer GPUs per process (torchrun with
        # 8 visible -> srun --gpus-per-task=1), and the others' streams are not this rank's.
        state["cuda_device"] = devices.get_rng_state()
    return state


def cuda_state_to_restore(state: dict[str, Any], device: int, devices: int
                          ) -> torch.Tensor | None:
    """The saved CUDA RNG state for this process's device ``device`` of ``devices`` visible.

    Older checkpoints hold every visible device's state ("cuda"); only an entry for ``device``
    applies, and one that this process cannot see is skipped instead of raising IndexError.
    """
    if "cuda_device" in state:
        return state["cuda_device"]
    every = state.get("cuda") or []
    return every[device] if device < min(len(every), devices) else None


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what ``capture_rng`` returned (checkpoints without numpy/cuda entries too)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    used = devices.rng_device()
    if used is not None:
        cuda = cuda_state_to_restore(state, *used)
        if cuda is not None:
            devices.set_rng_state(cuda)


def gather_rng(rank: int, world_size: int) -> list[dict[str, Any]] | None:
    """Every rank's RNG state, on rank 0 (None elsewhere). Collective."""
    own = capture_rng()
    if world_size == 1 or not dist.is_initialized():
        return [own]
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(own, gathered, dst=0)
    return gathered


def rng_for_rank(saved: list[dict[str, Any]] | None, rank: int) -> dict[str, Any] | None:
    """The saved RNG state of ``rank``, if the checkpoint has one for it."""
    if not saved or rank >= len(saved):
        return None
    return saved[rank]


# -------------------------------- only finite state, with the same classes, is saved or resumed

ADVICE = "Lower --lr, try --clip-grad-norm, or check the data"


def _floating(obj: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) of every floating-point tensor in nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            yield name, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _floating(value, f"{name}/{key}" if name else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _floating(value, f"{name}[{i}]")


def non_finite(obj: Any) -> list[str]:
    """Paths of the tensors in ``obj`` that hold a NaN or an infinity (one sync per device)."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for name, tensor in _floating(obj, ""):
        by_device[tensor.device].append((name, tensor))
    bad = []
    for items in by_device.values():
        finite = torch.stack([torch.isfinite(t).all() for _, t in items]).tolist()
        bad += [name for (name, _), ok in zip(items, finite) if not ok]
    return bad


def last_good(folder: Path) -> str:
    """What the run keeps after stopping on non-finite values: the file and where it resumes."""
    path = folder / files.CHECKPOINT
    if not path.is_file():
        return "no checkpoint had been saved yet"
    try:  # mmap: only the small entries are read
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        where = f" (it resumes at epoch {ckpt.get('epoch')}, step {ckpt.get('step_in_epoch', 0)})"
    except Exception:  # the message must not fail on a damaged file
        where = ""
    return f"the last good checkpoint, {path}{where}, is kept"


def refuse_non_finite(payload: dict[str, Any], is_main: bool, folder: Path, epoch: int,
                      step_in_epoch: int, settle: Callable[[], None] = lambda: None) -> None:
    """Stop every rank if what rank 0 is about to save holds NaN or inf. Collective.
    ``settle``: called before the message names the last good checkpoint (a write under way
    finishes first)."""
    error = None
    if is_main:
        bad = non_finite(payload)
        if bad:
            settle()
            error = NonFiniteStateError(
                f"the training state became NaN/infinite by epoch {epoch}, step {step_in_epoch} "
                f"({len(bad)} tensor(s), first {bad[0]}); training stopped without saving it; "
                f"{last_good(folder)}. {ADVICE}")
    raise_agreed(error)


def check_resumable(ckpt: dict[str, Any], path: Path, classes: Sequence[str]) -> None:
    """A checkpoint to resume or evaluate: finite, and trained on these class names in order."""
    bad = non_finite({"state_dict": ckpt["state_dict"], "optimizer": ckpt.get("optimizer"),
                      "ema": ckpt.get("ema")})
    if bad:
        raise CheckpointError(f"{path} holds NaN/infinite values in {len(bad)} tensor(s) "
                              f"(first {bad[0]}): it was saved by a run that diverged; use an "
                              "earlier checkpoint")
    saved = ckpt.get("classes")
    if saved is None or list(saved) == list(classes):
        return  # classic checkpoints and bare state_dicts carry no class names
    only_saved = sorted(set(saved) - set(classes))
    only_here = sorted(set(classes) - set(saved))
    if only_saved or only_here:
        diff = f"only in the checkpoint: {_few(only_saved)}; only in the data: {_few(only_here)}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(saved, classes)) if a != b)
        diff = (f"the same names in another order: label {i} is '{saved[i]}' in the "
                f"checkpoint but '{classes[i]}' in the data")
    raise CheckpointError(f"{path} was trained on other class names than the data's train/ "
                          f"folders ({diff}); its labels would be permuted. Rename the folders "
                          "back, or train afresh")


def _few(names: list[str], n: int = 5) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return (", ".join(repr(x) for x in names[:n]) + more) if names else "none"
