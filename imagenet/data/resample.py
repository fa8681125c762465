"""One batched crop-resize-flip for the device path: every image of a batch cut to its own window
and resized to one size with an antialiasing filter, in a few kernels per batch instead of a few
per image.

The filters are torchvision's (``resize(..., antialias=True)``, PIL's): a triangle (bilinear) or
Keys cubic (bicubic, a = -0.5) stretched by the downscaling factor, centred on each output
pixel, normalised over the source pixels of the window. Resizing is separable, so a whole
batch is two matrix products: ``out[n] = Wy[n] @ (image[n] @ Wx[n].T)``, where ``Wy[n]`` (size x
rows) and ``Wx[n]`` (size x columns) hold each output pixel's weights over the source rows and
columns. Outside the window the weights are zero, so cropping costs nothing; a flipped image
has the rows of ``Wx`` reversed. The images are padded into one tensor (the padding gets weight
zero), in groups of similar sizes bounded in memory.

The result differs from torchvision's uint8 resize of each image only by rounding (within one
grey level): like it (and PIL), the horizontal pass is held to 0..255 before the vertical one,
which matters where a bicubic upscale overshoots; its arithmetic is fixed-point, ours float.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

CUBIC_A = -0.5  # Keys' cubic, as PIL and torchvision's antialiased bicubic
GROUP_ELEMENTS = 96 * 2**20  # padded float32 values per group (384 MB): bounds the memory
FILTERS = ("bilinear", "bicubic")


@dataclass(frozen=True)
class Windows:
    """Per image, along one axis: the source window [start, start + length) that a resize to
    ``out_full`` pixels maps, and the first of the ``size`` output pixels kept."""

    start: torch.Tensor  # (N,) int
    length: torch.Tensor  # (N,) int
    out_full: torch.Tensor  # (N,) int
    first: torch.Tensor  # (N,) int


def _filter(x: torch.Tensor, interpolation: str) -> torch.Tensor:
    """The resampling kernel at distances ``x`` (in filter units)."""
    x = x.abs()
    if interpolation == "bilinear":
        return (1 - x).clamp_(min=0)
    a = CUBIC_A
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def axis_weights(w: Windows, size: int, padded: int, interpolation: str = "bilinear",
                 device: torch.device | None = None) -> torch.Tensor:
    """(N, size, padded) float32: output pixel o of image n over source pixel j (0 outside the
    window); each row sums to 1."""
    start, length, out_full, first = (t.to(device=device, dtype=torch.float64)[:, None, None]
                                      for t in (w.start, w.length, w.out_full, w.first))
    scale = length / out_full  # source pixels per output pixel
    support = scale.clamp(min=1.0)  # the filter stretched when downscaling (antialiasing)
    o = torch.arange(size, device=device, dtype=torch.float64)[None, :, None]
    j = torch.arange(padded, device=device, dtype=torch.float64)[None, None, :]
    centre = start + (first + o + 0.5) * scale
    weights = _filter((j + 0.5 - centre) / support, interpolation)
    inside = (j >= start) & (j < start + length)
    weights = torch.where(inside, weights, torch.zeros_like(weights))
    return (weights / weights.sum(dim=2, keepdim=True)).float()


def resample(images: Sequence[torch.Tensor], rows: Windows, cols: Windows, size: int,
             flip: torch.Tensor, interpolation: str = "bilinear") -> torch.Tensor:
    """(N, C, size, size) uint8 from uint8 CHW ``images`` of any sizes: each image's window
    (``rows``, ``cols``) resized to ``size`` x ``size``, mirrored where ``flip``."""
    if interpolation not in FILTERS:
        raise ValueError(f"batched resampling supports {FILTERS}, not {interpolation!r}")
    n = len(images)
    device = images[0].device
    channels = images[0].shape[0]
    out = torch.empty((n, channels, size, size), dtype=torch.uint8, device=device)
    for group in size_groups([tuple(image.shape[-2:]) for image in images]):
        height = max(images[i].shape[-2] for i in group)
        width = max(images[i].shape[-1] for i in group)
        index = torch.tensor(group, device=device)
        padded = torch.zeros((len(group), channels, height, width), dtype=torch.float32,
                             device=device)
        for k, i in enumerate(group):  # one copy per image: the batch's only per-image kernel
            padded[k, :, :images[i].shape[-2], :images[i].shape[-1]].copy_(images[i])
        picked = torch.tensor(group)
        wy = axis_weights(_take(rows, picked), size, height, interpolation, device)
        wx = axis_weights(_take(cols, picked), size, width, interpolation, device)
        mirrored = flip.to(device=device, dtype=torch.bool)[index][:, None, None]
        wx = torch.where(mirrored, wx.flip(1), wx)
        # Across first, then held to 0..255 and down: torchvision's uint8 resize (and PIL)
        # keeps the horizontal pass in uint8. A bicubic upscale overshoots; clamped only at the
        # end, high-contrast pixels came out up to ~20 grey levels off. (Not rounded here: the
        # rounding of the fixed-point kernel is not ours, and float stays closer to it.)
        across = (padded @ wx.transpose(1, 2)[:, None]).clamp_(0, 255)
        resized = wy[:, None] @ across
        out.index_copy_(0, index, resized.round_().clamp_(0, 255).to(torch.uint8))
    return out


def _take(w: Windows, picked: torch.Tensor) -> Windows:
    return Windows(w.start[picked], w.length[picked], w.out_full[picked], w.first[picked])


def size_groups(shapes: Sequence[tuple[int, int]], budget: int = GROUP_ELEMENTS
                ) -> list[list[int]]:
    """Image indices in groups of similar sizes (largest first) whose padded tensor stays within
    ``budget`` values per channel x 3; every image is in exactly one group."""
    order = sorted(range(len(shapes)), key=lambda i: shapes[i][0] * shapes[i][1], reverse=True)
    groups: list[list[int]] = []
    height = width = 0
    for i in order:
        h, w = shapes[i]
        if groups and (len(groups[-1]) + 1) * max(height, h) * max(width, w) * 3 <= budget:
            groups[-1].append(i)
            height, width = max(height, h), max(width, w)
        else:
            groups.append([i])
            height, width = h, w
    return groups
