"""The objects and options of a training step (``engine.Parts``, ``engine.Options``), from the
flags: the one place where they are made, for the trainer, the tests and the benchmarks alike."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import imagenet.data.transforms as T
from imagenet.settings.flags import Config
from imagenet.settings.launch import Layout
from imagenet.training.engine import Engine, Options, Parts
from imagenet.training.finetune import classifier_names
from imagenet.training.optim import (
    build_criterion,
    build_ema,
    build_optimizer,
    build_scheduler,
    use_fused,
)


def amp_dtype(amp: str | None) -> torch.dtype | None:
    """torch dtype of --amp."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp or "")


def build_engine(cfg: Config, raw: nn.Module, model: nn.Module, device: torch.device,
                 layout: Layout, steps_per_epoch: int, num_classes: int,
                 ema: AveragedModel | None = None,
                 class_counts: list[int] | None = None) -> Engine:
    """The objects and options of a training step, from the flags.

    ``raw`` is the plain (or sharded) model (optimizer, EMA), ``model`` what the step calls
    (DDP, compiled). ``ema``: built before --fsdp sharded ``raw``; None builds it from ``raw``.
    ``class_counts``: training images per class (--class-balanced-loss).
    """
    head = classifier_names(raw, num_classes) if cfg.backbone_lr_scale != 1.0 else None
    optimizer = build_optimizer(raw, cfg, head, fused=use_fused(device.type, cfg))
    parts = Parts(
        model=model, criterion=build_criterion(cfg, class_counts).to(device),
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg, steps_per_epoch),
        scaler=torch.amp.GradScaler(device.type) if cfg.amp == "fp16" else None,
        ema=ema if ema is not None else build_ema(raw, cfg, layout),
        batch_transform=T.batch_transform(cfg.mixup_alpha, cfg.cutmix_alpha, num_classes))
    opts = Options(
        device=device, steps_per_epoch=steps_per_epoch, epochs=cfg.epochs,
        world_size=layout.world_size, grad_accum_steps=layout.grad_accum_steps,
        amp_dtype=amp_dtype(cfg.amp), channels_last=cfg.channels_last,
        clip_grad_norm=cfg.clip_grad_norm, ema_steps=cfg.model_ema_steps,
        ema_warmup_epochs=cfg.lr_warmup_epochs, print_freq=cfg.print_freq)
    return Engine(parts, opts)
