"""Crop sizes the model accepts, found by running it on the meta device (shapes only: no memory,
no arithmetic), so that a crop too small for ``-a`` fails before any data is read or process
started, naming the size the model needs.

The model answers for itself rather than a table: torchvision adds architectures, and a table
would have to know each one's pooling arithmetic. Measured on torchvision 0.29: convolutional
nets accept every size from a minimum up (AlexNet 63 px, Inception-v3 75 px, the rest 32 px or
less); ViT and MaxViT take only the size they were built for (224 px: their position
embeddings and attention partitions are fixed at construction, not interpolated at run time).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from imagenet.errors import UsageError

log = logging.getLogger(__name__)

LARGEST = 1024  # px: the largest crop tried when looking for a model's minimum
BUILT_FOR = 224  # px: the size torchvision builds its models for, unless they say otherwise


def accepts(model: nn.Module, size: int) -> bool:
    """Whether ``model`` runs on a ``size`` x ``size`` image (on the meta device)."""
    try:
        with torch.no_grad():
            model(torch.empty(1, 3, size, size, device="meta"))
        return True
    except Exception:  # too small: RuntimeError (conv, pool), AssertionError (ViT), ValueError
        return False


def smallest_above(model: nn.Module, size: int) -> int | None:
    """The smallest size above ``size`` that ``model`` accepts, for models that accept every
    size from a minimum up; None when none up to LARGEST does."""
    if size >= LARGEST:
        return None
    high = size
    while not accepts(model, high := min(high * 2, LARGEST)):
        if high == LARGEST:
            return None
    low = size  # rejected; ``high`` accepted
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if accepts(model, middle) else (middle, high)
    return high


def check_crop_sizes(arch: str, crops: Mapping[str, int]) -> None:
    """UsageError naming the size ``-a``/``arch`` needs when a crop flag gives it one it cannot
    take (``crops``: the size each crop flag feeds the model, ``Plan.crop_flags``)."""
    from imagenet.training.models import build_model  # torchvision: imported only when a run starts

    try:
        with torch.device("meta"):
            model = build_model(arch, num_classes=10).eval()
    except Exception as exc:  # e.g. RegNet's init copies data; the real build reports errors
        log.debug("crop sizes not checked: -a %s cannot be built on the meta device (%s)",
                  arch, exc)
        return
    taken = {size: accepts(model, size) for size in set(crops.values())}  # one forward each
    bad = {flag: size for flag, size in crops.items() if not taken[size]}
    if not bad:
        return
    given = " and ".join(f"{flag} {size}" for flag, size in bad.items())
    least = smallest_above(model, max(bad.values()))
    if least is not None:
        wanted = " and ".join(f"{flag} {least}" for flag in bad)
        raise UsageError(f"{given}: too small for -a {arch}, which needs crops of at least "
                         f"{least} px; give {wanted} or more")
    built = getattr(model, "image_size", BUILT_FOR)
    if isinstance(built, int) and accepts(model, built):
        raise UsageError(f"{given}: -a {arch} takes crops of exactly {built} px (the size "
                         f"it is built for); give --train-crop-size {built} and "
                         f"--val-crop-size {built}")
    log.debug("crop sizes not checked: -a %s accepts none of the sizes tried", arch)
