"""``-a timm/NAME``: a model from timm (``timm.create_model``), when timm is installed.

The model then goes where a torchvision model goes (class count, EMA, FSDP units, checkpoints,
--channels-last, --compile, export). NAME may carry a weight tag, e.g. ``timm/resnet50.a1_in1k``:
--pretrained loads those weights (else the model's default ones) through timm's own loader.
"""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from imagenet.errors import RunError, UsageError, first_line

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

TIMM_PREFIX = "timm/"  # -a timm/NAME: a timm model
INSTALL = "pip install 'imagenet-trainer[timm]' (or pip install timm)"
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # what we normalise by


def import_timm(arch: str) -> ModuleType:
    """timm, or the one line that says how to install it."""
    try:
        import timm
    except ImportError:
        raise UsageError(f"-a {arch} needs timm, which is not installed: {INSTALL}") from None
    return timm


def timm_name(arch: str) -> str:
    """'timm/resnet50.a1_in1k' -> 'resnet50.a1_in1k'."""
    return arch[len(TIMM_PREFIX):]


def check_timm_arch(arch: str, weights: str | None, pretrained: bool = False) -> None:
    """A timm model name (and weight tag) that exists; close names when it does not."""
    timm = import_timm(arch)
    name = timm_name(arch)
    base, _, tag = name.partition(".")
    if weights:
        raise UsageError(f"--weights names torchvision weights; for timm's, put the tag in the "
                         f"name and add --pretrained: -a timm/{base}.TAG --pretrained (tags: "
                         f"timm.list_pretrained('{base}.*'))")
    if not timm.is_model(base):
        close = difflib.get_close_matches(base, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(f'timm/{c}' for c in close)}?" if close else ""
        raise UsageError(f"-a/--arch: timm has no model '{base}'{hint} (choose from "
                         "timm.list_models())")
    tags = timm.list_pretrained(f"{base}.*")
    if pretrained and not tags:
        raise UsageError(f"-a {arch} --pretrained: timm has no pretrained weights for {base} "
                         "(drop --pretrained to train it from scratch)")
    if tag and name not in tags:
        known = f"; it has {', '.join(tags[:6])}" if tags else " (it has no pretrained weights)"
        raise UsageError(f"-a {arch}: timm has no weights tagged '{tag}' for {base}{known}")


def build_timm_model(arch: str, num_classes: int, pretrained: bool) -> nn.Module:
    """``timm.create_model`` with this data set's classes; --pretrained through timm's loader."""
    timm = import_timm(arch)
    name = timm_name(arch)
    if not pretrained:
        return timm.create_model(name, num_classes=num_classes)
    weights = timm.models.get_pretrained_cfg(name)
    log.info("=> using pre-trained model '%s' (timm weights %s.%s)", arch, weights.architecture,
             weights.tag)
    try:
        model = timm.create_model(name, pretrained=True, num_classes=num_classes)
    except Exception as exc:  # hub/HTTP/OSError/hash errors: all mean "could not get the file"
        raise RunError(f"cannot load pretrained weights {weights.architecture}.{weights.tag} "
                       f"for {arch} ({first_line(exc)}). Offline? {offline_advice(weights)}"
                       ) from None
    if (tuple(weights.mean), tuple(weights.std)) != (IMAGENET_MEAN, IMAGENET_STD):
        log.warning("timm's %s.%s weights were trained on inputs normalised with mean %s, std "
                    "%s; this trainer normalises with ImageNet's %s, %s (fine-tuning adapts, "
                    "the first steps start further off)", weights.architecture, weights.tag,
                    weights.mean, weights.std, IMAGENET_MEAN, IMAGENET_STD)
    return model


def offline_advice(weights) -> str:
    """Where timm looks for the weights file, and how to put it there."""
    if weights.hf_hub_id:
        from huggingface_hub.constants import HF_HUB_CACHE

        return (f"Put them in the Hugging Face cache {HF_HUB_CACHE} (HF_HOME="
                f"{os.environ.get('HF_HOME', '~/.cache/huggingface')}): copy it from a machine "
                f"that ran `hf download {weights.hf_hub_id}`")
    import torch

    file = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(weights.url or "")
    return (f"Put the file at {file} (TORCH_HOME={os.environ.get('TORCH_HOME', '~/.cache/torch')}"
            f"), downloaded elsewhere from {weights.url}")
