"""What a validation got wrong, as files: the per-image predictions CSV, per-class accuracy and the
confusion matrix (CSV, JSON, a TensorBoard image), and the console's worst classes.

Pure functions of the gathered predictions (``Predictions``: every validation image once, in
dataset order, ``merge``); ``ReportFiles`` writes them where the run says, with the console's
lines. ``imagenet.evaluation.validate`` collects each rank's predictions (``Report``) and decides
when to write; --predictions FILE is checked before any work (``check_predictions_path``).
"""

from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from imagenet.errors import RunError, UsageError, output_errors
from imagenet.reporting.logger import CONFUSION_CSV, PER_CLASS_CSV, PER_CLASS_JSON, RunLogger

log = logging.getLogger(__name__)

TOPK = 5  # classes per image in the predictions file
WORST = 5  # classes named in the console summary
# The confusion matrix image: white (no image) to dark blue (every image of the row's class).
EMPTY_RGB, FULL_RGB, ABSENT_RGB = (255, 255, 255), (8, 48, 107), (200, 200, 200)
IMAGE_PX = 512  # the image's side, at most (cells of 1 to 32 px)


@dataclass(frozen=True)
class Predictions:
    """Every validation image's label and top-k classes, in dataset order (``ids``)."""

    ids: torch.Tensor  # (N,) dataset indices 0..N-1
    target: torch.Tensor  # (N,)
    top: torch.Tensor  # (N, k) class indices, best first
    prob: torch.Tensor  # (N, k) their softmax probabilities

    @property
    def pred(self) -> torch.Tensor:
        return self.top[:, 0]

    def acc1(self) -> float:
        """Top-1 in percent, as ``evaluation.validate.evaluate`` computes it."""
        return 100 * int((self.pred == self.target).sum()) / max(len(self.target), 1)


def merge(gathered: list[dict[str, torch.Tensor]] | None, expected: int) -> Predictions:
    """The ranks' rows in dataset order; RunError unless every image is there exactly once."""
    assert gathered is not None
    parts = [g for g in gathered if "target" in g]
    ids = torch.cat([g["ids"] for g in gathered])
    order = ids.argsort()
    if len(ids) != expected or not torch.equal(ids[order], torch.arange(expected)):
        raise RunError(f"the ranks' predictions cover {ids.unique().numel()} distinct images "
                       f"in {len(ids)} rows, but the validation set has {expected}")
    target, top, prob = (torch.cat([g[k] for g in parts])[order]
                         for k in ("target", "top", "prob"))
    return Predictions(ids[order], target, top, prob)


def confusion_matrix(target: torch.Tensor, pred: torch.Tensor, num_classes: int
                     ) -> torch.Tensor:
    """(C, C) image counts: row = the true class, column = the predicted one."""
    flat = target.long() * num_classes + pred.long()
    return torch.bincount(flat, minlength=num_classes ** 2).view(num_classes, num_classes)


def per_class(confusion: torch.Tensor, classes: Sequence[str],
              train_counts: Sequence[int] | None) -> list[dict[str, Any]]:
    """One row per class: its training and validation images, correct ones, accuracy (None
    without validation images) and the class it is most often mistaken for."""
    rows = []
    for i, name in enumerate(classes):
        row = confusion[i]
        images, correct = int(row.sum()), int(row[i])
        wrong = row.clone()
        wrong[i] = -1
        other = int(wrong.argmax())
        rows.append({
            "index": i, "class": name,
            "train_images": int(train_counts[i]) if train_counts is not None else None,
            "val_images": images, "correct": correct,
            "acc1": 100 * correct / images if images else None,
            "most_confused_with": classes[other] if images and wrong[other] > 0 else None,
            "confused_images": max(int(wrong[other]), 0) if images else 0})
    return rows


def mean_class_acc1(rows: Sequence[dict[str, Any]]) -> float:
    """The mean of the per-class accuracies (classes with validation images)."""
    accs = [r["acc1"] for r in rows if r["acc1"] is not None]
    return sum(accs) / max(len(accs), 1)


def worst_classes(rows: Sequence[dict[str, Any]], n: int = WORST) -> str:
    """'dog 40.0% (4/10; 120 training; most often taken for cat), ...': the ``n`` lowest
    accuracies below 100%."""
    scored = sorted((r for r in rows if r["acc1"] is not None and r["acc1"] < 100),
                    key=lambda r: (r["acc1"], -r["val_images"]))[:n]
    if not scored:
        return "none, every class 100%"
    parts = []
    for r in scored:
        train = f"; {r['train_images']} training" if r["train_images"] is not None else ""
        often = f"; most often taken for {r['most_confused_with']}" \
            if r["most_confused_with"] else ""
        parts.append(f"{r['class']} {r['acc1']:.1f}% ({r['correct']}/{r['val_images']}"
                     f"{train}{often})")
    return ", ".join(parts)


def _atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """``write(file)`` into a temp file next to ``path``, then replace ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)  # a staged --predictions URL's folder
    try:
        with open(tmp, "w", newline="") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_predictions(path: Path, names: Callable[[int], str], classes: Sequence[str],
                      preds: Predictions) -> None:
    """One row per image: path,target,pred,confidence, then the top classes and their
    probabilities ('|'-separated, best first)."""
    def write(f) -> None:
        out = csv.writer(f)
        out.writerow(["path", "target", "pred", "confidence", "top5", "top5_confidence"])
        for i, t, top, prob in zip(preds.ids.tolist(), preds.target.tolist(),
                                   preds.top.tolist(), preds.prob.tolist()):
            out.writerow([names(i), classes[t], classes[top[0]], f"{prob[0]:.6f}",
                          "|".join(classes[c] for c in top),
                          "|".join(f"{p:.6f}" for p in prob)])

    _atomic_write(path, write)


def write_per_class(folder: Path, rows: Sequence[dict[str, Any]], confusion: torch.Tensor,
                    classes: Sequence[str], summary: dict[str, Any]) -> list[Path]:
    """per_class.csv, per_class.json (with the confusion matrix) and confusion_matrix.csv
    (rows: true class, columns: predicted) in ``folder``."""
    def table(f) -> None:
        out = csv.DictWriter(f, fieldnames=list(rows[0]))
        out.writeheader()
        out.writerows({k: ("" if v is None else round(v, 4) if isinstance(v, float) else v)
                       for k, v in r.items()} for r in rows)

    def matrix(f) -> None:
        out = csv.writer(f)
        out.writerow(["true \\ predicted", *classes])
        out.writerows([name, *counts] for name, counts in zip(classes, confusion.tolist()))

    def document(f) -> None:
        json.dump({**summary, "per_class": list(rows),
                   "confusion_matrix": confusion.tolist()}, f)
        f.write("\n")

    paths = [folder / PER_CLASS_CSV, folder / PER_CLASS_JSON, folder / CONFUSION_CSV]
    for path, write in zip(paths, (table, document, matrix)):
        _atomic_write(path, write)
    return paths


def confusion_image(confusion: torch.Tensor) -> torch.Tensor:
    """The confusion matrix as a uint8 RGB image (3, H, W): each row scaled by its class's
    images (white 0 -> dark blue 1), rows of classes without images grey."""
    counts = confusion.double()
    totals = counts.sum(dim=1, keepdim=True)
    share = counts / totals.clamp(min=1)  # (C, C) in [0, 1]
    empty, full = torch.tensor(EMPTY_RGB).double(), torch.tensor(FULL_RGB).double()
    rgb = empty + share.unsqueeze(-1) * (full - empty)  # (C, C, 3)
    rgb[totals.squeeze(1) == 0] = torch.tensor(ABSENT_RGB).double()
    cell = max(1, min(32, IMAGE_PX // max(len(confusion), 1)))
    image = rgb.round().to(torch.uint8).permute(2, 0, 1)
    return image.repeat_interleave(cell, dim=1).repeat_interleave(cell, dim=2)


@dataclass(frozen=True)
class ReportFiles:
    """Where a validation's report goes: the files to ``output_dir`` (and ``predictions``), the
    confusion matrix to ``logger``'s TensorBoard under ``tag``."""

    output_dir: Path
    predictions: str | None  # --predictions FILE
    tta_flip: bool
    classes: Sequence[str]
    train_counts: Sequence[int] | None  # training images per class, when known
    logger: RunLogger | None = None
    tag: str = "val"

    def write(self, preds: Predictions, names: Callable[[int], str], metrics: dict[str, float],
              epoch: int, global_step: int) -> None:
        """The files, the TensorBoard image and the console lines (rank 0); ``names``: what the
        predictions file calls each image (``evaluation.validate.sample_names``)."""
        classes = self.classes
        if abs(preds.acc1() - metrics["acc1"]) > 1e-6:
            log.warning("the predictions' top-1 %.3f differs from the validation's %.3f",
                        preds.acc1(), metrics["acc1"])
        confusion = confusion_matrix(preds.target, preds.pred, len(classes))
        rows = per_class(confusion, classes, self.train_counts)
        summary = {"images": len(preds.ids), "acc1": metrics["acc1"], "acc5": metrics["acc5"],
                   "mean_class_acc1": mean_class_acc1(rows), "classes": classes,
                   "tta_flip": self.tta_flip, "epoch": epoch, "global_step": global_step}
        with output_errors(self.output_dir, "the per-class report"):
            written = write_per_class(self.output_dir, rows, confusion, classes,
                                              summary)
        if self.predictions:
            path = Path(self.predictions)
            with output_errors(path.parent, path, "--predictions"):
                write_predictions(path, names, classes, preds)
            written.append(path)
        self.add_image(confusion, global_step)
        log.info(" * per class: mean Acc@1 %.3f over %d classes; worst: %s",
                 summary["mean_class_acc1"], sum(r["acc1"] is not None for r in rows),
                 worst_classes(rows))
        log.info(" * wrote %s", ", ".join(map(str, written)))

    def add_image(self, confusion: torch.Tensor, global_step: int) -> None:
        """The confusion matrix in TensorBoard (``{tag}/confusion_matrix``), when the logger
        writes TensorBoard events."""
        if self.logger is not None:
            self.logger.images(f"{self.tag}/confusion_matrix",
                               confusion_image(confusion), global_step)
            self.logger.flush()


def check_predictions_path(path: Path) -> None:
    """--predictions FILE: a file (not a folder) in a folder that exists (made) and is writable."""
    if path.is_dir():
        raise UsageError(f"--predictions {path} is a folder; give a file name, e.g. "
                         f"{path / 'predictions.csv'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--predictions {path}: cannot create its folder "
                         f"({exc.strerror})") from None
    if not os.access(path.parent, os.W_OK):
        raise UsageError(f"--predictions {path}: its folder is not writable")
