"""--distill-teacher: knowledge distillation from a fixed teacher (Hinton et al. 2015; DeiT).

The teacher is built like the student on every rank and device (--channels-last too), from a
file (a checkpoint of this trainer, a state dict, a torchvision .pth; read as --finetune reads
it) or an architecture name with its default pretrained weights. It stays in eval mode with no
gradients, is not wrapped (DDP: nothing of it to all-reduce; --fsdp: every rank holds the whole
teacher, which costs its weights' memory and no communication), and is not compiled.

It sees the very batch the student trains on, after augmentation and MixUp/CutMix (Beyer et al.
2022, "a good teacher is patient and consistent"), so its outputs are computed every step,
never cached. Its weights are never saved with the student's: a checkpoint records the flag's
value, the architecture and a digest of the weights (``record``), and a resume with another
teacher is refused (``check_resumed``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from imagenet.errors import UsageError

log = logging.getLogger(__name__)

FILE_SUFFIXES = (".pth", ".pt", ".tar", ".bin", ".safetensors", ".ckpt")


@dataclass
class Teacher:
    """The teacher model and how its outputs enter the loss."""

    model: nn.Module
    source: str  # --distill-teacher as given
    arch: str
    digest: str  # of its weights ("sha256:HEX")
    alpha: float
    temperature: float
    kind: str  # "soft" | "hard"

    def record(self) -> dict[str, str]:
        """What a checkpoint keeps of the teacher: where it came from, not its weights."""
        return {"source": self.source, "arch": self.arch, "digest": self.digest}

    def outputs(self, images: torch.Tensor) -> torch.Tensor:
        """The teacher's logits for the student's (augmented, mixed) batch; no graph."""
        with torch.no_grad():
            return self.model(images).float()

    def loss(self, label_loss: torch.Tensor, student: torch.Tensor,
             teacher: torch.Tensor) -> torch.Tensor:
        """(1 - alpha) x the label loss + alpha x the distillation loss.

        soft: KL(teacher || student) of the softmaxes at the temperature T, x T^2 (so that its
        gradients keep their size as T changes), averaged over the batch; hard: cross-entropy
        to the teacher's top class.
        """
        student = student.float()
        if self.kind == "hard":
            term = nn.functional.cross_entropy(student, teacher.argmax(dim=1))
        else:
            t = self.temperature
            term = nn.functional.kl_div(nn.functional.log_softmax(student / t, dim=1),
                                        nn.functional.log_softmax(teacher / t, dim=1),
                                        reduction="batchmean", log_target=True) * (t * t)
        return (1 - self.alpha) * label_loss + self.alpha * term


def is_file_source(source: str) -> bool:
    """Whether --distill-teacher names a file (or a --sharded-checkpoint folder) rather than an
    architecture."""
    return Path(source).exists() or source.endswith(FILE_SUFFIXES) or (
        "/" in source and not source.startswith("timm/"))


def pretrained_teacher(arch: str, num_classes: int) -> nn.Module:
    """An architecture's default pretrained weights, which must score ``num_classes``."""
    from imagenet.settings.choices import TIMM_PREFIX, check_arch
    from imagenet.training.models import build_model, resolve_weights

    try:
        check_arch(arch, None, pretrained=True)
    except UsageError as exc:
        raise UsageError(f"--distill-teacher {arch}: no such file, and {exc}") from None
    if arch.startswith(TIMM_PREFIX):
        from imagenet.settings.choices import import_timm, timm_name

        cfg = import_timm(arch).models.get_pretrained_cfg(timm_name(arch))
        scored = int(getattr(cfg, "num_classes", 0) or 0)
    else:
        scored = len(resolve_weights(arch, True, None).meta.get("categories") or [])
    if scored != num_classes:
        raise UsageError(f"--distill-teacher {arch}: its pretrained weights score {scored} "
                         f"classes, this run's data has {num_classes}; give a teacher trained "
                         "on the student's classes (a checkpoint file)")
    return build_model(arch, num_classes, pretrained=True)


def check_resumed(ckpt: dict[str, Any], teacher: Teacher | None) -> None:
    """UsageError when the checkpoint was trained with another teacher than this run's (or
    with one and this run has none, or the other way round)."""
    saved = ckpt.get("distill_teacher")
    mine = teacher.record() if teacher is not None else None
    if (saved or {}).get("digest") == (mine or {}).get("digest"):
        return
    if saved is None:
        raise UsageError(f"--distill-teacher {mine['source']}: the checkpoint was trained "
                         "without a teacher; a resume continues that run (--finetune starts a "
                         "distilled one from its weights)")
    if mine is None:
        raise UsageError(f"the checkpoint was trained with --distill-teacher {saved['source']} "
                         f"({saved['digest'][:19]}); give that teacher to resume it")
    raise UsageError(f"--distill-teacher {mine['source']} ({mine['digest'][:19]}) is not the "
                     f"teacher the checkpoint was trained with ({saved['source']}, "
                     f"{saved['digest'][:19]}); give that teacher to resume it, or start a new "
                     "run")
