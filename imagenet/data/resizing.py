"""Progressive resizing in the loaders: each training sample is cropped at its epoch's size.

The schedule itself (``settings.crops.CropSchedule``: --train-crop-start growing to
--train-crop-size over --train-crop-ramp) is the plan's. Every training sample carries its epoch
(the sampler's keys, the shard reader's items), and the loader process that augments it builds
that epoch's transform itself (``EpochCrop``): the size is the same for any -j, constant within
an epoch, and a resume mid-ramp trains the sizes the uninterrupted run would. Validation sizes
(--val-resize-size, --val-crop-size) are independent. With --compile every size has static
graphs of its own (``training.compiling``: one per batch shape), compiled when the size first
appears, rather than one dynamic-shape graph for all: a new size costs one compile, never one
per batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from imagenet.settings.crops import CropSchedule

log = logging.getLogger(__name__)


def announce(crops: CropSchedule, epoch: int, val_crop: int) -> dict[str, int]:
    """With progressive resizing: log the epoch's crop; its metrics.jsonl field (else {})."""
    if not crops.progressive:
        return {}
    size = crops.size(epoch)
    log.info("=> epoch %d: training crop %d px (%d -> %d px over epochs %d-%d), validation %d "
             "px", epoch, size, crops.start, crops.end, crops.first_epoch, crops.last_epoch,
             val_crop)
    return {"train_crop_px": size}


class EpochCrop:
    """A per-sample training transform whose crop size follows a ``CropSchedule``.

    ``build(size)`` makes the transform of one size (built once per size, in the process that
    runs it); the dataset sets ``epoch`` from the sample's key before calling (``follow_epoch``).
    """

    def __init__(self, schedule: CropSchedule, build: Callable[[int], Callable]) -> None:
        self.schedule, self.build = schedule, build
        self.epoch = 0
        self._built: dict[int, Callable] = {}

    def __call__(self, image: Any) -> Any:
        size = self.schedule.size(self.epoch)
        if size not in self._built:
            self._built[size] = self.build(size)
        return self._built[size](image)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.schedule}, {self.build(self.schedule.end)})"


def sized_by_epoch(crops: CropSchedule, build: Callable[[int], Callable]) -> Callable:
    """``build(--train-crop-size)``, or an ``EpochCrop`` of ``build`` with progressive resizing."""
    return EpochCrop(crops, build) if crops.progressive else build(crops.end)


def follow_epoch(holder: Any, epoch: int) -> None:
    """Point the ``EpochCrop`` transform of ``holder`` (a dataset) at ``epoch``, if it has one."""
    transform = getattr(holder, "transform", None)
    if isinstance(transform, EpochCrop):
        transform.epoch = epoch


class CornerCrop:
    """--dummy's stand-in for augmentation: the top-left ``size`` x ``size`` of the image."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image[..., :self.size, :self.size]
