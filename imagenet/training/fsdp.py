"""Fully sharded data parallel (--fsdp): torch's FSDP2 ``fully_shard`` on a torchvision model.

Every rank keeps 1/N of the parameters, gradients and optimizer state; a unit's weights are
all-gathered just before it runs and its gradients reduce-scattered after its backward. The units
are the model's repeated blocks (``repeated_blocks``: one rule for every architecture), then the
root. The mesh is explicit, so CPU + gloo runs exactly like CUDA + NCCL.

The rest of the trainer sees ordinary modules; what differs is here: gradient sync during
accumulation, identical BatchNorm statistics before evaluation, and the state dicts gathered to
rank 0 for classic checkpoints (and put back from them).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:  # torch's FSDP and distributed checkpoint modules are imported when used
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from imagenet.errors import CheckpointError
from imagenet.settings.flags import Config

log = logging.getLogger(__name__)

# Layers that are never a unit of their own under rule 1 (they are what blocks are made of).
LEAF_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.Embedding, nn.LayerNorm,
               nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.MultiheadAttention)
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)  # looked into, never a unit
MAX_UNIT_SHARE = 0.25  # a unit above this share of the parameters is split into its blocks
MAX_ROOT_SHARE = 0.5  # the root keeping more than this gets its big layers as units
BIG_LAYER = 1_000_000  # parameters: a layer worth a unit of its own (rule 3)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}



def _options(gather: bool) -> StateDictOptions:
    """Classic checkpoints: rank 0 gets the whole state on the CPU, the other ranks nothing
    (``gather``); rank 0's whole state is put into every rank's shards (not ``gather``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True) if gather else \
        StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


# ---------------------------------------------------------------- which modules become units

def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _outermost_repeated(model: nn.Module) -> list[nn.Module]:
    """Rule 1: the outermost submodules whose class occurs twice or more in ``model``, that hold
    parameters and are neither leaf layers nor plain containers (those are looked into)."""
    counts = Counter(type(m) for m in model.modules())
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if (counts[type(child)] >= 2 and not isinstance(child, LEAF_LAYERS + CONTAINERS)
                    and any(True for _ in child.parameters())):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules sharded as units of their own (disjoint), before the root. One rule for
    every torchvision classifier instead of a table per architecture:

    1. the outermost repeated blocks (``_outermost_repeated``): ResNet's BasicBlock/Bottleneck,
       ViT's EncoderBlock, ConvNeXt's CNBlock, Swin's blocks and patch merging, RegNet's
       ResBottleneckBlock, DenseNet's _DenseLayer, EfficientNet's MBConv, ...;
    2. a unit holding more than MAX_UNIT_SHARE of the parameters is replaced by rule 1 applied
       inside it (MaxViT's stages -> their layers);
    3. if the root would still hold more than MAX_ROOT_SHARE, every remaining layer of at least
       BIG_LAYER parameters becomes a unit too (VGG and AlexNet are plain layers; one of their
       Linear layers still holds most of the model, and nothing can split it).
    """
    total = max(_numel(model), 1)
    units = _outermost_repeated(model)
    i = 0
    while i < len(units):
        inner = _outermost_repeated(units[i]) if _numel(units[i]) > MAX_UNIT_SHARE * total \
            else []
        if inner:
            units[i:i + 1] = inner  # look at the first of them next
        else:
            i += 1
    inside = {id(p) for unit in units for p in unit.parameters()}
    if sum(p.numel() for p in model.parameters() if id(p) not in inside) > MAX_ROOT_SHARE * total:
        for module in model.modules():
            own = list(module.parameters(recurse=False))
            if (isinstance(module, LEAF_LAYERS) and own and id(own[0]) not in inside
                    and sum(p.numel() for p in own) >= BIG_LAYER):
                units.append(module)
    return units


def describe_units(model: nn.Module, units: Sequence[nn.Module]) -> str:
    """'Bottleneck x16 + root (98% of the parameters in the blocks)'."""
    names = Counter(type(u).__name__ for u in units)
    share = sum(_numel(u) for u in units) / max(_numel(model), 1)
    blocks = ", ".join(f"{name} x{n}" for name, n in names.items()) or "no repeated blocks"
    return f"{blocks} + root ({100 * share:.0f}% of the parameters in the blocks)"


# ---------------------------------------------------------------- sharding

def mixed_precision(cfg: Config) -> MixedPrecisionPolicy:
    """--amp: weights gathered and used in bf16/fp16; gradients reduced in --fsdp-reduce-dtype
    (fp32 unless asked). The sharded fp32 weights stay what the optimizer updates."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param = DTYPES[cfg.amp] if cfg.amp else None
    reduce = DTYPES[cfg.fsdp_reduce_dtype] if cfg.fsdp_reduce_dtype else (
        torch.float32 if param is not None else None)
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def shard(model: nn.Module, cfg: Config, device: torch.device,
          units: list[nn.Module] | None = None) -> DeviceMesh:
    """Shard ``model`` in place over all ranks: its ``units`` (default: ``repeated_blocks``),
    then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cfg.fsdp_cpu_offload \
        else OffloadPolicy()
    policy = mixed_precision(cfg)
    zero3 = cfg.fsdp_zero != 2
    if units is None:
        units = repeated_blocks(model)  # before any sharding changes the module classes
    common = {"mesh": mesh, "offload_policy": offload, "reshard_after_forward": zero3}
    if policy.param_dtype is not None:
        # BatchNorm keeps fp32 weights, as FSDP1 did by default: CPU batch_norm rejects bf16
        # weights next to fp32 running statistics. All of them form one small unit.
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if norms:
            fully_shard(norms, mp_policy=MixedPrecisionPolicy(cast_forward_inputs=False),
                        **common)
    for unit in units:
        fully_shard(unit, mp_policy=policy, **common)
    # The root's weights are needed first in the backward: never freed after the forward.
    fully_shard(model, mp_policy=policy, **{**common, "reshard_after_forward": False})
    return mesh


def fsdp_root(model: nn.Module) -> FSDPModule | None:
    """The FSDP root inside ``model`` (itself, or under torch.compile / AveragedModel)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:  # never imported in this process: nothing is sharded
        return None
    for module in model.modules():
        if isinstance(module, fsdp.FSDPModule):
            return module
    return None


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulating micro-batches: gradients stay unsharded and local, no reduce-scatter."""
    root = fsdp_root(model)
    assert root is not None
    root.set_requires_gradient_sync(False)
    root.set_is_last_backward(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)
        root.set_is_last_backward(True)


@torch.no_grad()
def broadcast_buffers(model: nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm statistics), as DDP does before a forward.

    Under FSDP each rank updates its statistics from its own batches; evaluation, the EMA and
    a sharded checkpoint must all use the same ones.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def local_shards(fn: Callable) -> Callable:
    """An AveragedModel ``multi_avg_fn`` that works on each rank's local shards.

    The EMA copy and the model are sharded by the same rule, so their local shards pair up;
    torch's foreach kernels do not mix DTensors with plain tensors (buffers) otherwise.
    """

    def on_local(averaged: list, current: list, n_averaged: torch.Tensor) -> None:
        fn(_local(averaged), _local(current), n_averaged)

    return on_local


def _local(tensors: list) -> list:
    from torch.distributed.tensor import DTensor

    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


# ---------------------------------------------------------------- classic checkpoint state

def gathered_model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full state_dict (plain keys, CPU tensors) on rank 0, {} elsewhere. Collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_options(gather=True))


def load_model_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put rank 0's full ``state`` into the sharded ``module``. Collective."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    # torch writes into the dict it is given: a shallow copy keeps the caller's intact.
    set_model_state_dict(module, dict(state) if dist.get_rank() == 0 else {},
                         options=_options(gather=False))


def parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each optimizer parameter, in the classic state_dict's index order."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def by_index(state: dict, names: Sequence[str]) -> dict:
    """Optimizer state keyed by parameter name (torch's distributed format) -> the classic
    ``optimizer.state_dict()`` format keyed by position."""
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[k]: v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                             for g in state["param_groups"]]}


def by_name(state: dict, names: Sequence[str]) -> dict:
    """The classic optimizer state (keyed by position) -> keyed by parameter name."""
    def name(key):
        return key if isinstance(key, str) else names[key]

    return {"state": {name(k): v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [name(k) for k in g["params"]]}
                             for g in state["param_groups"]]}


def gathered_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The classic optimizer state_dict of the whole model on rank 0, {} elsewhere.
    Collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_options(gather=True))
    return by_index(state, parameter_names(model, optimizer)) if state else {}


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict) -> None:
    """Put a classic optimizer state_dict (rank 0's) into the sharded optimizer. Collective.

    Every rank holds ``state`` (they all read the file) and checks it first: a mismatch must
    fail on all ranks, not on rank 0 alone while the others wait in the broadcast.
    """
    saved = [len(g["params"]) for g in state["param_groups"]]
    own = [len(g["params"]) for g in optimizer.param_groups]
    if saved != own:
        raise CheckpointError(f"the checkpoint's optimizer has parameter groups of sizes "
                              f"{saved}, this run's {own} (other --norm-weight-decay / "
                              "--bias-weight-decay?)")
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    named = by_name(state, parameter_names(model, optimizer)) if dist.get_rank() == 0 else {}
    set_optimizer_state_dict(model, optimizer, named, options=_options(gather=False))
