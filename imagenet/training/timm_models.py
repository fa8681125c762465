"""``-a timm/NAME``: a model from timm (``timm.create_model``), when timm is installed.

The model then goes where a torchvision model goes (class count, EMA, FSDP units, checkpoints,
--channels-last, --compile, export). NAME may carry a weight tag, e.g. ``timm/resnet50.a1_in1k``:
--pretrained loads those weights (else the model's default ones) through timm's own loader.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from imagenet.errors import RunError, first_line
from imagenet.settings.choices import import_timm, timm_name

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # what we normalise by


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
