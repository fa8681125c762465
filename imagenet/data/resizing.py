"""Progressive resizing: the training crop grows from --train-crop-start to --train-crop-size.

FFCV's fast ResNet recipes train at 160 px, grow to 192 px over a few late epochs and evaluate at
224-256 px: small crops early make those epochs cheap, and the test-time resolution gap (FixRes)
makes the larger evaluation crop score higher. The size is a pure function of the epoch
(``CropSchedule.size``): epochs up to START_EPOCH train at the start size, epochs from END_EPOCH
on at --train-crop-size, the ones between on the straight line, rounded to --train-crop-multiple
(default 32, FFCV's rounding and the total stride of torchvision's CNNs, so every stage of a
ResNet gets whole feature maps and few sizes - few compiled graphs - appear).

Every training sample carries its epoch (the sampler's keys, the shard reader's items), and the
loader process that augments it builds that epoch's transform itself (``EpochCrop``): the size is
the same for any -j, constant within an epoch, and a resume mid-ramp trains the sizes the
uninterrupted run would. Validation sizes (--val-resize-size, --val-crop-size) are independent.
With --compile every size has static graphs of its own (``compiling``: one per batch shape),
compiled when the size first appears, rather than one dynamic-shape graph for all: a new size
costs one compile, never one per batch; ``crop_sizes`` tells ``compiling`` how many to make room
for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from imagenet.settings.flags import Config

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class CropSchedule:
    """The training crop of every epoch (see the module docstring)."""

    start: int  # px, up to ``first_epoch``
    end: int  # px, from ``last_epoch`` on (--train-crop-size)
    first_epoch: int
    last_epoch: int
    multiple: int  # px; sizes between are rounded to it

    def size(self, epoch: int) -> int:
        """The training crop of ``epoch``, pixels."""
        if epoch <= self.first_epoch:
            return self.start
        if epoch >= self.last_epoch:
            return self.end
        fraction = (epoch - self.first_epoch) / (self.last_epoch - self.first_epoch)
        exact = self.start + (self.end - self.start) * fraction
        rounded = round(exact / self.multiple) * self.multiple
        low, high = sorted((self.start, self.end))
        return min(max(rounded, low), high)

    def sizes(self, epochs: int) -> list[int]:
        """The distinct sizes of epochs 0 .. ``epochs`` - 1, in the order they come."""
        return list(dict.fromkeys(self.size(e) for e in range(epochs)))


def crop_schedule(cfg: Config) -> CropSchedule | None:
    """The schedule of the flags; None when the crop stays --train-crop-size throughout."""
    if cfg.train_crop_start is None or cfg.train_crop_ramp is None:
        return None
    first, last = cfg.train_crop_ramp
    return CropSchedule(cfg.train_crop_start, cfg.train_crop_size, first, last,
                        cfg.train_crop_multiple)


def train_sizes(cfg: Config) -> list[int]:
    """Every training crop size of the run, in order ([--train-crop-size] without a ramp)."""
    schedule = crop_schedule(cfg)
    return schedule.sizes(cfg.epochs) if schedule is not None else [cfg.train_crop_size]


def announce(cfg: Config, epoch: int) -> dict[str, int]:
    """With progressive resizing: log the epoch's crop; its metrics.jsonl field (else {})."""
    schedule = crop_schedule(cfg)
    if schedule is None:
        return {}
    size = schedule.size(epoch)
    log.info("=> epoch %d: training crop %d px (%d -> %d px over epochs %d-%d), validation %d "
             "px", epoch, size, schedule.start, schedule.end, schedule.first_epoch,
             schedule.last_epoch, cfg.val_crop_size)
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


def sized_by_epoch(cfg: Config, build: Callable[[int], Callable]) -> Callable:
    """``build(--train-crop-size)``, or an ``EpochCrop`` of ``build`` with progressive resizing."""
    schedule = crop_schedule(cfg)
    return build(cfg.train_crop_size) if schedule is None else EpochCrop(schedule, build)


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


def crop_sizes(cfg: Config) -> int:
    """How many training crop sizes the run uses (``compiling`` makes room for their graphs)."""
    sizes = train_sizes(cfg)
    if cfg.compile and len(sizes) > 1:
        log.info("=> --compile with progressive resizing: static graphs for each training crop "
                 "(%s px), each compiled in the first epoch that uses it",
                 ", ".join(map(str, sizes)))
    return len(sizes)
