"""--finetune PATH and --freeze-backbone: start a run from weights it did not train.

``checkpoint.weights.read_weights`` reads the file (any checkpoint or state dict) into ``Weights``.
``fit_state`` decides what goes into the model: every tensor whose name and shape fit; the
classifier's rows matched by class name when both sides name their classes; a layer whose shape
differs is re-initialised and named. Any other missing or unexpected key is an error.

The classifier is found generically (``classifier_names``): timm's ``get_classifier()``, else
the last layer whose output is the class count (torchvision names it fc, classifier[-1],
heads.head, ...). The weights go into the plain model before anything wraps it (channels-last,
EMA copy, DDP, FSDP, torch.compile), so all of them start from the loaded weights.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from imagenet.errors import CheckpointError, TrainerError, UsageError
from imagenet.launching.process_group import raise_agreed
from imagenet.settings.flags import Config
from imagenet.training.models import without_dropped_aux

log = logging.getLogger(__name__)

COUNTER = "num_batches_tracked"  # BatchNorm's step counter: older files do not hold it


@dataclass(frozen=True)
class Weights:
    """A file's model weights (plain keys) and what it says about them."""

    state: dict[str, torch.Tensor]
    classes: list[str] | None  # the class names of the classifier's rows, if the file has them
    arch: str | None
    config: dict = field(default_factory=dict)  # the flags of the run that wrote it, if any


# ---------------------------------------------------------------- the classifier

Head = tuple[str, ...]  # the classifier's qualified module names (two for distilled models)


def classifier_names(model: nn.Module, num_classes: int) -> Head:
    """The qualified names of the layers that output the class scores.

    timm models say (``get_classifier()``; distilled ones have two heads); otherwise the last
    Linear or convolution whose output is ``num_classes`` wide (torchvision registers its
    classifier last: fc, classifier.6, heads.head, SqueezeNet's 1x1 conv classifier.1); else
    the last Linear.
    """
    named = {id(m): name for name, m in model.named_modules()}
    get = getattr(model, "get_classifier", None)
    if callable(get):
        heads = get()
        heads = heads if isinstance(heads, (tuple, list)) else (heads,)
        if all(isinstance(h, nn.Module) and id(h) in named and any(True for _ in h.parameters())
               for h in heads) and heads:
            return tuple(named[id(h)] for h in heads)
    wide = [name for name, m in model.named_modules() if _outputs(m) == num_classes]
    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if wide or linear:
        return ((wide or linear)[-1],)
    raise UsageError(f"cannot find the classifier of this model: no layer outputs "
                     f"{num_classes} class scores")


def _outputs(module: nn.Module) -> int | None:
    """Output features or channels of a Linear or convolution layer."""
    if isinstance(module, nn.Linear):
        return module.out_features
    if isinstance(module, nn.modules.conv._ConvNd):
        return module.out_channels
    return None


def in_module(key: str, head: Head) -> bool:
    """True for a state-dict key (or module name) inside one of the modules ``head`` names."""
    return any(key == m or key.startswith(m + ".") for m in head)


def contains(name: str, head: Head) -> bool:
    """True when module ``name`` holds one of ``head``'s modules (the root '' holds all)."""
    return any(not name or m == name or m.startswith(name + ".") for m in head)


# ---------------------------------------------------------------- fitting a file to the model

def head_rows(saved: Sequence[str] | None, classes: Sequence[str]) -> list[int | None] | None:
    """For each class of the data, its row in the file's classifier (None: the file has no such
    class); None when the rows need no matching (same names in the same order, or unnamed)."""
    if saved is None or list(saved) == list(classes):
        return None
    index = {name: i for i, name in enumerate(saved)}
    return [index.get(name) for name in classes]


@dataclass
class Fit:
    """What goes into the model, and what did not come from the file."""

    state: dict[str, torch.Tensor]  # the whole state dict to load
    reinit: dict[str, str]  # key -> why it keeps the model's initial values
    rows_kept: int | None = None  # classifier rows matched by class name (None: not matched)
    dropped: list[str] = field(default_factory=list)  # the file's classifier keys not used

    def describe(self, classes: int) -> str:
        """'re-initialised fc.weight, fc.bias (1000 classes in the file, 5 here)' etc."""
        parts = []
        if self.reinit:
            parts.append("re-initialised " + ", ".join(f"{k} ({why})"
                                                       for k, why in self.reinit.items()))
        if self.rows_kept is not None:
            parts.append(f"the classifier rows of {self.rows_kept} of the {classes} classes "
                         f"taken from the file by class name")
        if self.dropped:
            parts.append(f"not used: {', '.join(self.dropped)}")
        return "; ".join(parts) or "every tensor loaded"

    def outside(self, head: Head) -> list[str]:
        """Re-initialised keys that are not the classifier's."""
        return [k for k in self.reinit if not in_module(k, head)]


def fit_state(own: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], head: Head,
              rows: list[int | None] | None) -> Fit:
    """What to load into a model whose state is ``own``, from the file's ``saved``: every
    tensor that fits; the classifier ``head``'s rows matched by ``rows`` (``head_rows``); the
    model's own values where a shape differs or the classifier is not in the file.

    Raises CheckpointError for a missing or unexpected key outside the classifier.
    """
    missing = [k for k in own if k not in saved and not in_module(k, head)
               and not k.endswith(COUNTER)]
    unexpected = [k for k in saved if k not in own and not in_module(k, head)]
    if missing or unexpected:
        raise CheckpointError(f"the weights do not fit this model: missing {_few(missing)}; "
                              f"unexpected {_few(unexpected)} (another -a/--arch?)")
    fit = Fit({}, {}, dropped=[k for k in saved if k not in own])
    for key, mine in own.items():
        theirs = saved.get(key)
        if theirs is not None and rows is not None and in_module(key, head) \
                and theirs.ndim >= 1 and theirs.shape[1:] == mine.shape[1:]:
            theirs = _pick_rows(theirs, mine, rows)
            fit.rows_kept = sum(r is not None for r in rows)
        if theirs is None and key.endswith(COUNTER):
            fit.state[key] = mine
        elif theirs is None:
            fit.state[key] = mine  # as the model initialised it
            fit.reinit[key] = "not in the file"
        elif theirs.shape != mine.shape:
            fit.state[key] = mine
            fit.reinit[key] = f"{tuple(theirs.shape)} in the file, {tuple(mine.shape)} here"
        else:
            fit.state[key] = theirs
    if fit.rows_kept == 0:  # no class in common: the classifier is simply new
        fit.reinit.update({k: "other class names" for k in own if in_module(k, head)
                           and k in saved and k not in fit.reinit})
        fit.rows_kept = None
    return fit


def _pick_rows(theirs: torch.Tensor, mine: torch.Tensor, rows: list[int | None]
               ) -> torch.Tensor:
    """``mine`` with row i replaced by ``theirs[rows[i]]`` wherever the file has that class."""
    picked = mine.clone()
    for i, j in enumerate(rows):
        if j is not None and j < theirs.shape[0]:
            picked[i] = theirs[j]
    return picked


def _few(keys: list[str], n: int = 5) -> str:
    if not keys:
        return "none"
    more = f" and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def load_finetune(model: nn.Module, cfg: Config, classes: Sequence[str], head: Head,
                  weights: Weights) -> None:
    """--finetune: PATH's ``weights`` into the plain ``model``; one line says what was not
    loaded."""
    path = Path(cfg.finetune)  # type: ignore[arg-type]
    if weights.arch and weights.arch != cfg.arch:
        raise CheckpointError(f"--finetune {path} was saved for -a {weights.arch}, but this "
                              f"run uses -a {cfg.arch}; pass -a {weights.arch}")
    saved, aux = without_dropped_aux(weights.state, model)
    try:
        fit = fit_state(model.state_dict(), saved, head, head_rows(weights.classes, classes))
    except CheckpointError as exc:
        raise CheckpointError(f"--finetune {path}: {exc}") from None
    if aux:
        fit.dropped.append(f"the aux classifiers this model is built without ({len(aux)} "
                           "tensors)")
    model.load_state_dict(fit.state, strict=True)
    log.info("=> --finetune %s: %d of %d tensors from the file; %s", path,
             len(fit.state) - len(fit.reinit), len(fit.state), fit.describe(len(classes)))
    if fit.outside(head):
        log.warning("--finetune %s: layers outside the classifier %s do not fit and start "
                    "from their initial values: %s", path, ", ".join(head),
                    ", ".join(fit.outside(head)))


# ---------------------------------------------------------------- --freeze-backbone

class BackboneInEval:
    """Mixed into the model's class by --freeze-backbone: ``train()`` leaves every module
    outside the classifier (and its parent containers) in eval mode, so BatchNorm statistics
    stay as loaded and dropout is off. DDP, FSDP, torch.compile and the EMA copy all reach the
    model through ``train()``, so all of them keep it."""

    probe_head: Head

    def train(self, mode: bool = True):  # type: ignore[override]
        super().train(mode)  # type: ignore[misc]
        if mode:
            for name, module in self.named_modules():  # type: ignore[attr-defined]
                if not (in_module(name, self.probe_head) or contains(name, self.probe_head)):
                    module.training = False
        return self


def freeze_backbone(model: nn.Module, head: Head) -> None:
    """Only the classifier ``head`` trains (the optimizer gets nothing else); the rest keeps
    its weights and runs as in evaluation."""
    for name, p in model.named_parameters():
        p.requires_grad_(in_module(name, head))
    cls = type(model)
    model.__class__ = type(cls.__name__, (BackboneInEval, cls), {"probe_head": head})
    model.train(model.training)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("=> --freeze-backbone: a linear probe; only %s trains (%d of %d parameters)",
             ", ".join(head), trained, sum(p.numel() for p in model.parameters()))


# ---------------------------------------------------------------- the entry point

def prepare_model(model: nn.Module, cfg: Config, classes: Sequence[str],
                  weights: Weights | None = None) -> None:
    """--finetune (its file's ``weights``) and --freeze-backbone on the plain model, before
    anything wraps it. Collective: all ranks stop with the first rank's error, or none."""
    if not cfg.finetune and not cfg.freeze_backbone:
        return
    error = None
    try:
        head = classifier_names(model, len(classes))
        if cfg.finetune:
            assert weights is not None, "--finetune: read its file first (checkpoint.weights)"
            load_finetune(model, cfg, classes, head, weights)
        if cfg.freeze_backbone:
            if not (cfg.finetune or cfg.pretrained or cfg.weights):
                log.warning("--freeze-backbone without --finetune, --pretrained or --weights: "
                            "the classifier learns on randomly initialised features")
            freeze_backbone(model, head)
    except TrainerError as exc:
        error = exc
    raise_agreed(error)
    if cfg.finetune:
        assert weights is not None
        raise_agreed(other_copy(cfg.finetune, weights_sum(weights.state)))


def weights_sum(state: dict[str, torch.Tensor]) -> float:
    """A checksum of floating-point weights (tells two copies of a file apart)."""
    with torch.no_grad():
        return sum(float(t.double().sum()) for t in state.values() if t.is_floating_point())


def other_copy(path: str, checksum: float) -> CheckpointError | None:
    """An error if some rank read other weights than rank 0 (a node-local copy of the file
    that differs). Collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    every: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(every, checksum)
    other = next((r for r, c in enumerate(every) if c != every[0]), None)
    if other is None:
        return None
    return CheckpointError(f"--finetune {path}: rank {other} read other weights than rank 0 "
                           "(a different copy of the file on its node?); give every rank the "
                           "same file")
