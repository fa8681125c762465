"""Optimizer, per-iteration learning-rate schedule, loss, EMA - all from torch.

The objects and options of a training step (``engine.Parts``, ``engine.Options``), from the
flags: the one place where they are made, for the trainer, the tests and the benchmarks alike.

Where a run is in training, in epochs and images rather than in steps of one layout.

An epoch's training order is one global permutation of (seed, epoch); the sampler strides it
across ranks like DistributedSampler, so W ranks that each trained n samples trained exactly its
first n x W items. A checkpoint records the epoch and that image count, and a resume continues
with the rest of the same permutation in whatever layout (world size, -b, --grad-accum-steps) it
has now.

The learning-rate schedule is never restored: it is rebuilt from the flags and replayed to the
resumed point, so a resumed run follows the schedule its command line describes. At an epoch
boundary that is exactly where a fresh run with this command line would be. Mid-epoch with
another global batch the images trained are not always a whole number of the new steps: the
schedule resumes at the step from which the rest of the epoch ends exactly on the boundary,
which is less than one step from the images seen (``ResumePoint.approximated``). Tar shards give
each rank a contiguous stretch of the epoch instead: another layout starts that epoch over.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import lr_scheduler
from torch.optim.swa_utils import AveragedModel

import imagenet.data.transforms as T
from imagenet.data.samplers import train_batches
from imagenet.errors import UsageError
from imagenet.settings.flags import Config
from imagenet.settings.launch import Layout
from imagenet.training.engine import Engine, Options, Parts, Step

if TYPE_CHECKING:
    from imagenet.training.distill import Teacher
    from imagenet.training.finetune import Head


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


TRUST_OPTIMIZERS = ("lamb", "lars")  # --opt values that scale each layer's step by a trust ratio


def trust_groups(model: nn.Module, cfg: Config) -> list[dict]:
    """--opt lamb / lars: the weights adapt layer-wise with --wd; every one-dimensional
    parameter (biases, normalisation layers' scales and shifts) neither adapts nor decays, as
    in MLPerf's LARS and the ResNet Strikes Back LAMB recipe (timm's filter_bias_and_bn).
    --norm-weight-decay / --bias-weight-decay, where given, still decay those."""
    groups: dict[str, list[nn.Parameter]] = {"other": [], "norm": [], "bias": []}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            if p.ndim > 1:
                groups["other"].append(p)
            else:
                groups["bias" if name == "bias" else "norm"].append(p)
    decay = {"other": cfg.weight_decay, "norm": cfg.norm_weight_decay or 0.0,
             "bias": cfg.bias_weight_decay or 0.0}
    return [{"params": ps, "weight_decay": decay[k], "trust": k == "other"}
            for k, ps in groups.items() if ps]


def scale_backbone_lr(model: nn.Module, groups: list[dict], head: Head, lr: float,
                      scale: float) -> list[dict]:
    """--backbone-lr-scale: each group split into the classifier ``head``'s parameters (first,
    so the logged lr is theirs) and the rest at ``scale`` x ``lr``. ``lr_scale`` stays in the
    group: a rebuilt schedule (``rebuild_schedule``) starts each group from it."""
    from imagenet.training.finetune import in_module

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
    groups = trust_groups(model, cfg) if cfg.opt in TRUST_OPTIMIZERS else \
        param_groups(model, cfg.weight_decay, cfg.norm_weight_decay, cfg.bias_weight_decay)
    if head is not None and cfg.backbone_lr_scale != 1.0:
        groups = scale_backbone_lr(model, groups, head, cfg.lr, cfg.backbone_lr_scale)
    extra = {"fused": True} if fused and cfg.opt in FUSED else {}
    if cfg.opt in ("sgd", "sgd_nesterov"):
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum,
                               nesterov=cfg.opt == "sgd_nesterov", **extra)
    if cfg.opt == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, **extra)
    if cfg.opt in TRUST_OPTIMIZERS:
        from imagenet.training.trust import Lamb, Lars

        if cfg.opt == "lamb":
            return Lamb(groups, lr=cfg.lr)
        return Lars(groups, lr=cfg.lr, momentum=cfg.momentum, trust_coef=cfg.lars_trust_coef)
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
    from imagenet.training.fsdp import local_shards

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
    if cfg.bce_loss:
        return BinaryCrossEntropy(cfg.label_smoothing, cfg.bce_target_thresh, weight)
    return nn.CrossEntropyLoss(weight=weight, label_smoothing=cfg.label_smoothing)


class BinaryCrossEntropy(nn.Module):
    """--bce-loss: one sigmoid per class against the one-hot targets (timm's
    BinaryCrossEntropy, as ResNet Strikes Back trains).

    Class-index targets become one-hot, MixUp/CutMix's mixed targets are taken as they are;
    both are smoothed to ``(1 - smoothing) x target + smoothing / classes`` (for one-hot
    targets timm's on and off values; mixing then smoothing equals smoothing then mixing),
    then, with ``threshold``, set to 1 above it and 0 elsewhere. ``class_weight``
    (--class-balanced-loss) scales each class's column; the mean is over every image and class,
    so a batch's loss x its images adds up over batches and ranks (``engine.weighted``).
    """

    def __init__(self, smoothing: float = 0.0, threshold: float | None = None,
                 class_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.smoothing, self.threshold = smoothing, threshold
        # not ``weight``: engine.weighted reads that as cross-entropy's per-target weight
        self.register_buffer("class_weight", class_weight)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        classes = logits.shape[-1]
        if target.ndim == 1:
            target = nn.functional.one_hot(target, classes)
        target = target.float()  # in fp32 under --amp too: autocast runs the loss in fp32
        if self.smoothing:
            target = target * (1 - self.smoothing) + self.smoothing / classes
        if self.threshold is not None:
            target = target.gt(self.threshold).float()
        return nn.functional.binary_cross_entropy_with_logits(logits, target,
                                                              weight=self.class_weight)


def class_weights(counts: Sequence[int], beta: float) -> torch.Tensor:
    """(1 - beta) / (1 - beta^n) per class of n images (Cui et al. 2019, "Class-Balanced Loss
    Based on Effective Number of Samples"), 1/n at beta = 1 (the limit); mean 1 over classes."""
    n = torch.tensor(list(counts), dtype=torch.float64).clamp(min=1)
    weights = 1 / n if beta >= 1.0 else (1 - beta) / (1 - beta ** n)
    return (weights * len(n) / weights.sum()).float()


# ------------------------------------------------- the step's parts and options, from the flags

def amp_dtype(amp: str | None) -> torch.dtype | None:
    """torch dtype of --amp."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp or "")


def build_engine(cfg: Config, raw: nn.Module, model: nn.Module, device: torch.device,
                 layout: Layout, steps_per_epoch: int, num_classes: int,
                 ema: AveragedModel | None = None,
                 class_counts: list[int] | None = None,
                 teacher: Teacher | None = None) -> Engine:
    """The objects and options of a training step, from the flags.

    ``raw`` is the plain (or sharded) model (optimizer, EMA), ``model`` what the step calls
    (DDP, compiled). ``ema``: built before --fsdp sharded ``raw``; None builds it from ``raw``.
    ``class_counts``: training images per class (--class-balanced-loss). ``teacher``:
    --distill-teacher's (``checkpoint.teacher.build_teacher``).
    """
    head = None
    if cfg.backbone_lr_scale != 1.0:  # the classifier keeps --lr
        from imagenet.training.finetune import classifier_names

        head = classifier_names(raw, num_classes)
    optimizer = build_optimizer(raw, cfg, head, fused=use_fused(device.type, cfg))
    parts = Parts(
        model=model, criterion=build_criterion(cfg, class_counts).to(device),
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg, steps_per_epoch),
        scaler=torch.amp.GradScaler(device.type) if cfg.amp == "fp16" else None,
        ema=ema if ema is not None else build_ema(raw, cfg, layout),
        batch_transform=T.batch_transform(cfg.mixup_alpha, cfg.cutmix_alpha, num_classes),
        teacher=teacher)
    opts = Options(
        device=device, steps_per_epoch=steps_per_epoch, epochs=cfg.epochs,
        world_size=layout.world_size, grad_accum_steps=layout.grad_accum_steps,
        amp_dtype=amp_dtype(cfg.amp), channels_last=cfg.channels_last,
        clip_grad_norm=cfg.clip_grad_norm, ema_steps=cfg.model_ema_steps,
        ema_warmup_epochs=cfg.lr_warmup_epochs, print_freq=cfg.print_freq)
    return Engine(parts, opts)


# --------------------------------------------------------- where a run is, in epochs and images

@dataclass(frozen=True)
class EpochStart:
    """Where this process began training ``epoch``: after ``images`` images of the epoch's order,
    counted as step ``step`` of this layout. Epochs it trains from their start need none."""

    epoch: int = -1
    images: int = 0
    step: int = 0


def images_trained(step: Step, start: EpochStart, global_batch: int, size: int) -> int:
    """Images of ``step.epoch``'s order trained once ``step.step_in_epoch`` steps are done."""
    if step.epoch == start.epoch:
        done = start.images + (step.step_in_epoch - start.step) * global_batch
    else:
        done = step.step_in_epoch * global_batch
    return min(done, size)


def steps_to_train(images: int, layout: Layout) -> int:
    """Optimizer steps in which ``layout`` trains ``images`` images of an epoch's order, counted
    as the loader counts them: each rank takes every world-size-th image (padded), its last
    batch is dropped when it would hold one image, and steps group --grad-accum-steps batches."""
    per_rank = -(-images // layout.world_size)
    return layout.optimizer_steps(train_batches(per_rank, layout.batch_size))


@dataclass(frozen=True)
class ResumePoint:
    """The resumed position in this run's layout."""

    epoch: int
    step_in_epoch: int  # in this layout; == steps per epoch: only the validation is left
    images: int  # of the epoch's order already trained (0: the epoch starts over)
    exact_step: float  # the checkpoint's images / this global batch: where they put us

    @property
    def approximated(self) -> bool:
        """True when the step is not where the images trained put this layout."""
        return self.step_in_epoch != self.exact_step


def saved_images(ckpt: dict[str, Any]) -> int:
    """Images of the checkpoint's epoch already trained (older checkpoints: per-rank start)."""
    sampler = ckpt.get("sampler") or {}
    if "images" in sampler:
        return int(sampler["images"])
    if "start" in sampler:
        return int(sampler["start"]) * int(ckpt.get("world_size") or 1)
    return 0


def resume_point(ckpt: dict[str, Any], steps_per_epoch: int, layout: Layout,
                 same_layout: bool, order_size: int | None) -> ResumePoint:
    """Where training continues in this layout.

    ``order_size``: the images of an epoch's order when the data can continue an epoch in any
    layout (an ImageFolder: the order is strided over the ranks); None when only the layout that
    began an epoch can continue it (tar shards): another one starts that epoch over.
    """
    epoch = int(ckpt.get("epoch", 0))
    if "global_step" not in ckpt:  # pytorch/examples' checkpoint: whole epochs only
        return ResumePoint(epoch, 0, 0, 0.0)
    step, images = int(ckpt.get("step_in_epoch", 0)), saved_images(ckpt)
    last = ResumePoint(epoch, steps_per_epoch, images, float(steps_per_epoch))
    if step >= int(ckpt.get("steps_per_epoch") or steps_per_epoch):
        return last  # a signal stopped the epoch's last step: only its validation is left
    if same_layout or images == 0:
        return ResumePoint(epoch, step, images, float(step))
    global_batch = layout.global_batch
    if order_size is None:
        return ResumePoint(epoch, 0, 0, images / global_batch)
    if images >= order_size:
        return last
    step = steps_per_epoch - steps_to_train(order_size - images, layout)
    return ResumePoint(epoch, step, images, images / global_batch)


def schedule_steps(epoch: int, step_in_epoch: int, steps_per_epoch: int) -> int:
    """Scheduler steps a run with this layout has taken at (epoch, step_in_epoch)."""
    return epoch * steps_per_epoch + step_in_epoch


def rebuild_schedule(optimizer: torch.optim.Optimizer, cfg: Config, steps_per_epoch: int,
                     steps_done: int) -> torch.optim.lr_scheduler.LRScheduler:
    """The --lr-scheduler of these flags, stepped ``steps_done`` times: the learning rate of
    every later step is exactly that of a run started fresh with the same flags and layout.

    Replaying (about 5 us a step: 2 s for 90 ImageNet epochs at 5,005 steps each) rather than a
    closed form keeps the values bit-identical to the fresh run's recursive ones.
    """
    for group in optimizer.param_groups:  # as build_optimizer leaves it: --lr, no schedule yet
        group.pop("initial_lr", None)
        group["lr"] = cfg.lr * group.get("lr_scale", 1.0)  # --backbone-lr-scale
    scheduler = build_scheduler(optimizer, cfg, steps_per_epoch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
        for _ in range(steps_done):
            scheduler.step()
    return scheduler
