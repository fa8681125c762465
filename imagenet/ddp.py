"""Wrapping for training: SyncBatchNorm, torch.compile, DDP and its communication hooks."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from imagenet.config import Config
from imagenet.distributed import DistInfo

log = logging.getLogger(__name__)


def wrap(raw: nn.Module, cfg: Config, dist: DistInfo) -> nn.Module:
    """The module the training step calls: raw -> (SyncBN) -> (compiled) -> (DDP)."""
    model = raw
    if cfg.sync_bn and dist.distributed:
        # convert_sync_batchnorm returns a new module only for a bare BatchNorm root; torchvision
        # models are containers, so ``raw`` keeps the converted layers in place.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if cfg.compile:
        model = torch.compile(model)
    if not dist.distributed:
        return model
    device_ids = [dist.device.index] if dist.device.type == "cuda" else None
    model = DDP(model, device_ids=device_ids, bucket_cap_mb=cfg.bucket_cap_mb)
    register_comm_hook(model, cfg)
    return model


def register_comm_hook(model: DDP, cfg: Config) -> None:
    """Gradient compression with torch's built-in DDP hooks (--ddp-comm-hook)."""
    if cfg.ddp_comm_hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif cfg.ddp_comm_hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif cfg.ddp_comm_hook == "powersgd":
        state = powersgd.PowerSGDState(process_group=None,
                                       matrix_approximation_rank=cfg.powersgd_rank,
                                       start_powerSGD_iter=cfg.powersgd_start_iter,
                                       use_error_feedback=True, warm_start=True)
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        model._imagenet_hook_state = state  # type: ignore[attr-defined]


def hook_state(model: nn.Module) -> dict[str, Any] | None:
    """Checkpointable part of the comm hook state (None without a stateful hook)."""
    state = getattr(model, "_imagenet_hook_state", None)
    if state is None:
        return None
    return {"iter": state.iter}


def load_hook_state(model: nn.Module, saved: dict[str, Any] | None) -> None:
    """Restore what ``hook_state`` saved (error-feedback buffers re-warm)."""
    state = getattr(model, "_imagenet_hook_state", None)
    if state is not None and saved:
        state.iter = int(saved["iter"])
