"""Where a run is in training, in epochs and images rather than in steps of one layout.

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

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from imagenet.data.samplers import train_batches
from imagenet.settings.flags import Config
from imagenet.settings.launch import Layout
from imagenet.training.engine import Step
from imagenet.training.optim import build_scheduler


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
