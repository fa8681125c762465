"""The training crop of every epoch: --train-crop-size throughout, or progressive resizing.

FFCV's fast ResNet recipes train at 160 px, grow to 192 px over a few late epochs and evaluate at
224-256 px: small crops early make those epochs cheap, and the test-time resolution gap (FixRes)
makes the larger evaluation crop score higher. The size is a pure function of the epoch
(``CropSchedule.size``): epochs up to START_EPOCH train at the start size, epochs from END_EPOCH
on at --train-crop-size, the ones between on the straight line, rounded to --train-crop-multiple
(default 32, FFCV's rounding and the total stride of torchvision's CNNs, so every stage of a
ResNet gets whole feature maps and few sizes - few compiled graphs - appear).

The plan holds the schedule (``Plan.crops``); the loaders (``data.resizing``), the device decoder
and ``--compile`` read it from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from imagenet.settings.flags import Config


@dataclass(frozen=True)
class CropSchedule:
    """The training crop of every epoch (see the module docstring)."""

    start: int  # px, up to ``first_epoch``
    end: int  # px, from ``last_epoch`` on (--train-crop-size)
    first_epoch: int = 0
    last_epoch: int = 0
    multiple: int = 32  # px; sizes between are rounded to it
    progressive: bool = True  # False: --train-crop-size throughout (no --train-crop-start)

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


def crop_schedule(cfg: Config) -> CropSchedule:
    """The schedule of the flags (not ``progressive`` without --train-crop-start)."""
    if cfg.train_crop_start is None or cfg.train_crop_ramp is None:
        size = cfg.train_crop_size
        return CropSchedule(size, size, 0, 0, cfg.train_crop_multiple, progressive=False)
    first, last = cfg.train_crop_ramp
    return CropSchedule(cfg.train_crop_start, cfg.train_crop_size, first, last,
                        cfg.train_crop_multiple)
