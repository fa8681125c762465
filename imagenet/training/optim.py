"""Optimizer, per-iteration learning-rate schedule, loss, EMA - all from torch."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.optim import lr_scheduler

from imagenet.errors import UsageError
from imagenet.settings.flags import Config
from imagenet.settings.launch import Layout
from imagenet.training.finetune import Head, in_module
from imagenet.training.fsdp import local_shards

log = logging.getLogger(__name__)

NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm,
               nn.modules.instancenorm._InstanceNorm, nn.LocalResponseNorm)


def param_groups(model: nn.Module, weight_decay: float, norm_weight_decay: float | None,
                 bias_weight_decay: float | None) -> list[dict]:
    """Parameters split by the weight decay they get (norm layers, biases, the rest)."""
    if norm_weight_decay is None and bias_weight_decay is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad],
                 "weight_decay": weight_decay}]
    groups: dict[str, list[nn.Parameter]] = {"other": [], "norm": [], "bias": []}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if isinstance(module, NORM_LAYERS) and norm_weight_decay is not None:
                groups["norm"].append(p)
            elif name == "bias" and bias_weight_decay is not None:
                groups["bias"].append(p)
            else:
                groups["other"].append(p)
    decay = {"other": weight_decay, "norm": norm_weight_decay, "bias": bias_weight_decay}
    return [{"params": ps, "weight_decay": decay[k]} for k, ps in groups.items() if ps]


def scale_backbone_lr(model: nn.Module, groups: list[dict], head: Head, lr: float,
                      scale: float) -> list[dict]:
    """--backbone-lr-scale: each group split into the classifier ``head``'s parameters (first,
    so the logged lr is theirs) and the rest at ``scale`` x ``lr``. ``lr_scale`` stays in the
    group: a rebuilt schedule (``position.rebuild_schedule``) starts each group from it."""
    in_head = {id(p) for name, p in model.named_parameters() if in_module(name, head)}
    heads, rest = [], []
    for group in groups:
        mine = [p for p in group["params"] if id(p) in in_head]
        others = [p for p in group["params"] if id(p) not in in_head]
        heads += [{**group, "params": mine, "lr_scale": 1.0}] if mine else []
        rest += [{**group, "params": others, "lr": lr * scale, "lr_scale": scale}] if others \
            else []
    return heads + rest


def build_optimizer(model: nn.Module, cfg: Config, head: Head | None = None,
                    fused: bool = False) -> torch.optim.Optimizer:
    """The optimizer named by --opt (classic default: SGD with momentum); ``head``: the
    classifier's name, for --backbone-lr-scale; ``fused``: torch's fused step (one kernel for
    all parameters) where --opt has one (``use_fused``)."""
    groups = param_groups(model, cfg.weight_decay, cfg.norm_weight_decay, cfg.bias_weight_decay)
    if head is not None and cfg.backbone_lr_scale != 1.0:
        groups = scale_backbone_lr(model, groups, head, cfg.lr, cfg.backbone_lr_scale)
    extra = {"fused": True} if fused and cfg.opt in FUSED else {}
    if cfg.opt in ("sgd", "sgd_nesterov"):
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum,
                               nesterov=cfg.opt == "sgd_nesterov", **extra)
    if cfg.opt == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, **extra)
    # RMSprop settings of torchvision's recipes (TF-style epsilon and decay).
    return torch.optim.RMSprop(groups, lr=cfg.lr, momentum=cfg.momentum, eps=0.0316, alpha=0.9)


FUSED = ("sgd", "sgd_nesterov", "adamw")  # --opt values with a fused step in torch


def use_fused(device_type: str, cfg: Config) -> bool:
    """Whether the optimizer steps fused: on CUDA (one kernel instead of a foreach chain over
    every parameter), not under --fsdp (its parameters are DTensors, whose fused step this torch
    does not promise); on the CPU the default foreach step keeps the tests' numbers."""
    return device_type == "cuda" and not cfg.fsdp and cfg.opt in FUSED


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config,
                    iters_per_epoch: int) -> lr_scheduler.LRScheduler:
    """The --lr-scheduler, stepped once per optimizer step so warm-up is smooth.

    With the classic flags this is StepLR(x0.1 every 30 epochs): per-iteration stepping gives the
    same learning rate as the classic's per-epoch stepping at every epoch.
    """
    warmup = cfg.lr_warmup_epochs * iters_per_epoch
    if cfg.lr_scheduler == "step":
        main = lr_scheduler.StepLR(optimizer, cfg.lr_step_size * iters_per_epoch, cfg.lr_gamma)
    elif cfg.lr_scheduler == "multistep":
        milestones = [m * iters_per_epoch - warmup for m in cfg.lr_milestones]
        main = lr_scheduler.MultiStepLR(optimizer, milestones, cfg.lr_gamma)
    elif cfg.lr_scheduler == "linear":
        main = lr_scheduler.LinearLR(optimizer, start_factor=1.0,
                                     end_factor=cfg.lr_min / cfg.lr if cfg.lr > 0 else 1.0,
                                     total_iters=max(1, (cfg.epochs - cfg.lr_warmup_epochs)
                                                     * iters_per_epoch))
    else:
        steps = max(1, (cfg.epochs - cfg.lr_warmup_epochs) * iters_per_epoch)
        # --backbone-lr-scale: each group's floor is scaled like its learning rate (LinearLR's
        # end factor is a fraction of each group's own already)
        floors = [cfg.lr_min * group.get("lr_scale", 1.0) for group in optimizer.param_groups]
        main = lr_scheduler.CosineAnnealingLR(optimizer, steps, eta_min=cfg.lr_min) \
            if len(set(floors)) <= 1 else CosineToFloors(optimizer, steps, floors)
    if warmup == 0:
        return main
    if cfg.lr_warmup_method == "linear":
        first = lr_scheduler.LinearLR(optimizer, start_factor=cfg.lr_warmup_decay,
                                      total_iters=warmup)
    else:
        first = lr_scheduler.ConstantLR(optimizer, factor=cfg.lr_warmup_decay, total_iters=warmup)
    return lr_scheduler.SequentialLR(optimizer, [first, main], milestones=[warmup])


class CosineToFloors(lr_scheduler.CosineAnnealingLR):
    """CosineAnnealingLR with a floor (``eta_min``) per parameter group: torch's own update for
    each group, with that group's floor."""

    def __init__(self, optimizer: torch.optim.Optimizer, t_max: int,
                 floors: Sequence[float]) -> None:
        self.floors = list(floors)
        super().__init__(optimizer, t_max, eta_min=self.floors[0])

    def get_lr(self) -> list[float]:
        return self._each_floor(super().get_lr)

    def _get_closed_form_lr(self) -> list[float]:  # SequentialLR's step(0) at its milestone
        return self._each_floor(super()._get_closed_form_lr)

    def _each_floor(self, lrs_at: Callable[[], list[float]]) -> list[float]:
        lrs = []
        for i, floor in enumerate(self.floors):
            self.eta_min = floor
            lrs.append(lrs_at()[i])
        self.eta_min = self.floors[0]
        return lrs


def build_ema(model: nn.Module, cfg: Config,
              layout: Layout) -> torch.optim.swa_utils.AveragedModel | None:
    """EMA of the weights (torch's AveragedModel), updated every --model-ema-steps steps.

    As in torchvision's references, the per-step decay is rescaled to the update interval and the
    global batch so the averaging horizon in images stays the same.
    """
    if not cfg.model_ema:
        return None
    images_per_update = layout.global_batch * cfg.model_ema_steps
    adjust = images_per_update / cfg.epochs
    alpha = min(1.0, (1.0 - cfg.model_ema_decay) * adjust)
    # Built before --fsdp shards the model (a sharded module cannot be copied); the update then
    # runs on each rank's local shards.
    return torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=local_shards(torch.optim.swa_utils.get_ema_multi_avg_fn(1.0 - alpha)),
        use_buffers=True)


def build_criterion(cfg: Config, class_counts: Sequence[int] | None = None) -> nn.Module:
    """Cross-entropy with optional label smoothing (accepts MixUp's soft targets) and
    --class-balanced-loss weights from the training images per class."""
    weight = None
    if cfg.class_balanced_loss is not None:
        if not class_counts:
            raise UsageError("--class-balanced-loss needs the training images of each class: "
                             "an ImageFolder's train/ (tar shards do not list them)")
        weight = class_weights(class_counts, cfg.class_balanced_loss)
        log.info("=> class-balanced loss (BETA %g): class weights %.3g (%d images) to %.3g "
                 "(%d images)", cfg.class_balanced_loss, weight.min(),
                 class_counts[int(weight.argmin())], weight.max(),
                 class_counts[int(weight.argmax())])
    return nn.CrossEntropyLoss(weight=weight, label_smoothing=cfg.label_smoothing)


def class_weights(counts: Sequence[int], beta: float) -> torch.Tensor:
    """(1 - beta) / (1 - beta^n) per class of n images (Cui et al. 2019, "Class-Balanced Loss
    Based on Effective Number of Samples"), 1/n at beta = 1 (the limit); mean 1 over classes."""
    n = torch.tensor(list(counts), dtype=torch.float64).clamp(min=1)
    weights = 1 / n if beta >= 1.0 else (1 - beta) / (1 - beta ** n)
    return (weights * len(n) / weights.sum()).float()
