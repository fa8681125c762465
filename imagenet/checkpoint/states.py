"""The state dicts of a model, its optimizer and EMA - plain, DDP and FSDP alike (FSDP gathers
to rank 0) - and how a saved one goes back without overwriting the flags' hyper-parameters.
``run.checkpointing`` assembles a run's checkpoint from them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import imagenet.training.fsdp as fsdp
from imagenet.checkpoint import files
from imagenet.errors import CheckpointError
from imagenet.settings.flags import Config
from imagenet.settings.launch import Layout
from imagenet.training.models import unwrap
from imagenet.training.position import ResumePoint, resume_point

log = logging.getLogger(__name__)


def model_state(model: nn.Module) -> dict[str, Any]:
    """The unwrapped model's state_dict; sharded, gathered to rank 0 ({} elsewhere; collective)."""
    model = unwrap(model)
    return fsdp.gathered_model_state(model) if fsdp.is_sharded(model) else model.state_dict()


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The classic ``optimizer.state_dict()`` (keyed by parameter index) for every mode;
    sharded, gathered to rank 0 ({} elsewhere; collective)."""
    if fsdp.is_sharded(model):
        return fsdp.gathered_optimizer_state(unwrap(model), optimizer)
    return optimizer.state_dict()


def ema_state(ema: AveragedModel) -> dict[str, Any]:
    """``ema.state_dict()``; sharded, gathered to rank 0 ({} elsewhere; collective)."""
    if not fsdp.is_sharded(ema):
        return ema.state_dict()
    weights = fsdp.gathered_model_state(ema.module)
    if not weights:
        return {}
    return {"n_averaged": ema.n_averaged.clone(), **{f"module.{k}": v for k, v in weights.items()}}


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict[str, Any]) -> None:
    """Load a classic optimizer state_dict into the (possibly sharded) optimizer."""
    if fsdp.is_sharded(model):
        fsdp.load_optimizer_state(unwrap(model), optimizer, state)
    else:
        optimizer.load_state_dict(state)


def load_ema_state(ema: AveragedModel, state: dict[str, Any]) -> None:
    """Load ``ema.state_dict()`` into the (possibly sharded) EMA."""
    if not fsdp.is_sharded(ema):
        ema.load_state_dict(state)
        return
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
    run's flags and layout: the one answer the early start of the loader (``run.startup``) and
    the resume itself (``run.checkpointing``) both use."""
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
