"""--compile: torch.compile with one static graph per batch shape, compiled in the first epoch.

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
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

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
