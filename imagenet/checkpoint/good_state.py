"""Only good state is written or resumed: every tensor finite, the class names the same.

A diverging run can keep a finite loss for a step or two while its weights, BatchNorm running
statistics or momentum are already inf; the loss check alone would save that state. So each save
checks every floating-point tensor it is about to write (one host sync per save, none per step).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from imagenet.checkpoint import files
from imagenet.errors import CheckpointError, NonFiniteStateError
from imagenet.launching.collectives import raise_agreed

ADVICE = "Lower --lr, try --clip-grad-norm, or check the data"


def _floating(obj: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) of every floating-point tensor in nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            yield name, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _floating(value, f"{name}/{key}" if name else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _floating(value, f"{name}[{i}]")


def non_finite(obj: Any) -> list[str]:
    """Paths of the tensors in ``obj`` that hold a NaN or an infinity (one sync per device)."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for name, tensor in _floating(obj, ""):
        by_device[tensor.device].append((name, tensor))
    bad = []
    for items in by_device.values():
        finite = torch.stack([torch.isfinite(t).all() for _, t in items]).tolist()
        bad += [name for (name, _), ok in zip(items, finite) if not ok]
    return bad


def last_good(folder: Path) -> str:
    """What the run keeps after stopping on non-finite values: the file and where it resumes."""
    path = folder / files.CHECKPOINT
    if not path.is_file():
        return "no checkpoint had been saved yet"
    try:  # mmap: only the small entries are read
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        where = f" (it resumes at epoch {ckpt.get('epoch')}, step {ckpt.get('step_in_epoch', 0)})"
    except Exception:  # the message must not fail on a damaged file
        where = ""
    return f"the last good checkpoint, {path}{where}, is kept"


def refuse_non_finite(payload: dict[str, Any], is_main: bool, folder: Path, epoch: int,
                      step_in_epoch: int, settle: Callable[[], None] = lambda: None) -> None:
    """Stop every rank if what rank 0 is about to save holds NaN or inf. Collective.
    ``settle``: called before the message names the last good checkpoint (a write under way
    finishes first)."""
    error = None
    if is_main:
        bad = non_finite(payload)
        if bad:
            settle()
            error = NonFiniteStateError(
                f"the training state became NaN/infinite by epoch {epoch}, step {step_in_epoch} "
                f"({len(bad)} tensor(s), first {bad[0]}); training stopped without saving it; "
                f"{last_good(folder)}. {ADVICE}")
    raise_agreed(error)


def check_resumable(ckpt: dict[str, Any], path: Path, classes: Sequence[str]) -> None:
    """A checkpoint to resume or evaluate: finite, and trained on these class names in order."""
    bad = non_finite({"state_dict": ckpt["state_dict"], "optimizer": ckpt.get("optimizer"),
                      "ema": ckpt.get("ema")})
    if bad:
        raise CheckpointError(f"{path} holds NaN/infinite values in {len(bad)} tensor(s) "
                              f"(first {bad[0]}): it was saved by a run that diverged; use an "
                              "earlier checkpoint")
    saved = ckpt.get("classes")
    if saved is None or list(saved) == list(classes):
        return  # classic checkpoints and bare state_dicts carry no class names
    only_saved = sorted(set(saved) - set(classes))
    only_here = sorted(set(classes) - set(saved))
    if only_saved or only_here:
        diff = f"only in the checkpoint: {_few(only_saved)}; only in the data: {_few(only_here)}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(saved, classes)) if a != b)
        diff = (f"the same names in another order: label {i} is '{saved[i]}' in the "
                f"checkpoint but '{classes[i]}' in the data")
    raise CheckpointError(f"{path} was trained on other class names than the data's train/ "
                          f"folders ({diff}); its labels would be permuted. Rename the folders "
                          "back, or train afresh")


def _few(names: list[str], n: int = 5) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return (", ".join(repr(x) for x in names[:n]) + more) if names else "none"
