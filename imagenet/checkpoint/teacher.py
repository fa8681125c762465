"""--distill-teacher's model, read as --finetune reads a weights file (``build_teacher``): the
checkpoint stage reads the file and computes the weights' digest; ``training.distill`` holds
the teacher's part of the step."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from imagenet.checkpoint.files import state_digest
from imagenet.checkpoint.weights import read_agreed
from imagenet.errors import CheckpointError, UsageError
from imagenet.settings.flags import Config
from imagenet.training.distill import Teacher, is_file_source, pretrained_teacher
from imagenet.training.finetune import classifier_names
from imagenet.training.models import build_model, without_dropped_aux

log = logging.getLogger(__name__)


def build_teacher(cfg: Config, classes: list[str], device: torch.device) -> Teacher | None:
    """The --distill-teacher on ``device``, for data of ``classes``; None without the flag.
    Collective (every rank reads the file; all stop with the first rank's error)."""
    source = cfg.distill_teacher
    if not source:
        return None
    if is_file_source(source):
        model, arch = _from_file(cfg, Path(source), classes)
    else:
        model, arch = pretrained_teacher(source, len(classes)), source
    digest = state_digest(model.state_dict())
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.eval().requires_grad_(False)
    log.info("=> distilling from the teacher %s (-a %s, %s, %d parameters): %s, alpha %g%s",
             source, arch, digest[:19], sum(p.numel() for p in model.parameters()),
             cfg.distill_type, cfg.distill_alpha,
             f", temperature {cfg.distill_temperature:g}" if cfg.distill_type == "soft" else "")
    return Teacher(model, source, arch, digest, cfg.distill_alpha, cfg.distill_temperature,
                   cfg.distill_type)


def _from_file(cfg: Config, path: Path, classes: list[str]) -> tuple[nn.Module, str]:
    """The teacher of a weights file: its architecture (--distill-teacher-arch, the file's, or
    -a), its classes checked against the data's."""
    flag = "--distill-teacher"
    weights = read_agreed(path, flag)
    arch = cfg.distill_teacher_arch or weights.arch or cfg.arch
    model = build_model(arch, len(classes))
    state, _ = without_dropped_aux(weights.state, model)
    own = model.state_dict()
    for name in classifier_names(model, len(classes)):
        saved = state.get(f"{name}.weight")
        if saved is not None and saved.shape[0] != own[f"{name}.weight"].shape[0]:
            raise UsageError(f"{flag} {path} scores {saved.shape[0]} classes, this run's data "
                             f"has {len(classes)}: the teacher must be trained on the student's "
                             "classes")
    if weights.classes is not None and list(weights.classes) != list(classes):
        raise UsageError(f"{flag} {path} was trained on other class names (or another order) "
                         "than this run's data: its outputs would score the wrong classes")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[1].strip() if "\n" in str(exc) else str(exc)
        raise CheckpointError(f"{flag} {path} does not hold -a {arch} weights ({first}); name "
                              "its architecture with --distill-teacher-arch") from None
    return model, arch
