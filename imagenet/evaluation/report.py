"""Validation that says what is wrong: --tta-flip, the per-image predictions (--predictions) and
the per-class report, with -e and after the last epoch.

``Report`` takes each batch's outputs from ``validate.evaluate`` (``on_output``), keeps only
the top-5 on the device, and after the pass gathers every rank's rows to rank 0, which checks
that every validation image is there exactly once and writes the files
(``imagenet.reporting.results``). The predictions are the same outputs the printed top-1
counts, so the file's accuracy is that top-1.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import imagenet.reporting.results as results
from imagenet.checkpoint import disk
from imagenet.data.folder import Data
from imagenet.data.samplers import shard_batches
from imagenet.errors import RunError, TrainerError
from imagenet.launching.collectives import DistInfo, raise_agreed
from imagenet.reporting.logger import RunLogger
from imagenet.settings.flags import Config

log = logging.getLogger(__name__)


class FlipTTA(nn.Module):
    """--tta-flip: the mean of the softmax probabilities of each image and its mirror image,
    returned as their log: cross-entropy, top-k and softmax of it are those of the mean."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        plain = self.model(images).float().log_softmax(dim=1)
        mirrored = self.model(images.flip(3)).float().log_softmax(dim=1)
        return torch.logaddexp(plain, mirrored) - math.log(2)


def for_validation(model: nn.Module, cfg: Config) -> nn.Module:
    """The module a validation pass calls: ``model``, or with --tta-flip its flip average."""
    return FlipTTA(model) if cfg.tta_flip else model


# ---------------------------------------------------------------- which image is which

def sample_ids(loader: DataLoader) -> list[int]:
    """The dataset indices of this rank's validation images, in the loader's order."""
    batches = shard_batches(loader)
    if batches is not None:  # one stream, stored order: ids are positions
        plan = batches.plan(0)
        first = plan.stream_start[0]
        return list(range(first, first + sum(plan.sizes)))
    return list(loader.sampler)  # type: ignore[arg-type]


def sample_names(loader: DataLoader) -> Callable[[int], str]:
    """Dataset index -> what the predictions file calls the image: its path; for tar shards
    SHARD#N (the N-th sample of the shard)."""
    samples = getattr(loader.dataset, "samples", None)
    if samples is not None:
        return lambda i: str(samples[i][0])
    batches = shard_batches(loader)
    if batches is not None:
        urls, starts = batches.shards.urls, list(accumulate(batches.shards.counts, initial=0))

        def shard_member(i: int) -> str:
            s = bisect.bisect_right(starts, i) - 1
            return f"{urls[s]}#{i - starts[s]}"

        return shard_member
    return str


# ---------------------------------------------------------------- the report

class Report:
    """The predictions of one validation pass and what ``finish`` writes from them: the files
    go to ``output_dir`` (and ``predictions``), the confusion matrix to ``logger``'s TensorBoard
    under ``tag``."""

    def __init__(self, data: Data, dist: DistInfo, output_dir: Path, predictions: str | None,
                 tta_flip: bool, logger: RunLogger | None = None, tag: str = "val") -> None:
        self.data, self.dist, self.output_dir = data, dist, output_dir
        self.predictions, self.tta_flip = predictions, tta_flip
        self.logger, self.tag = logger, tag
        self.parts: list[tuple[torch.Tensor, ...]] = []  # per batch, on the device

    def add(self, output: torch.Tensor, target: torch.Tensor) -> None:
        """``validate.evaluate``'s ``on_output``: keep the batch's top classes (no host
        sync)."""
        top = output.topk(min(results.TOPK, output.shape[1]), dim=1)  # as topk_correct
        prob = output.float().softmax(dim=1).gather(1, top.indices)
        self.parts.append((target, top.indices, prob))

    def local(self) -> dict[str, torch.Tensor]:
        """This rank's rows on the CPU, with their dataset indices."""
        rows = {"ids": torch.tensor(sample_ids(self.data.val_loader), dtype=torch.long)}
        if self.parts:  # a rank may have no validation image
            rows.update(zip(("target", "top", "prob"),
                            (torch.cat(part).cpu() for part in zip(*self.parts))))
        outputs = len(rows.get("target", ()))
        if outputs != len(rows["ids"]):
            raise RunError(f"the validation pass gave {outputs} outputs for "
                           f"{len(rows['ids'])} images on rank {self.dist.rank}")
        return rows

    def finish(self, metrics: dict[str, float], epoch: int, global_step: int) -> None:
        """Gather the rows to rank 0, which writes the files and names the worst classes
        (recorded at ``epoch`` and ``global_step``). Collective: every rank calls it."""
        error, rows = None, {}
        try:
            rows = self.local()
        except TrainerError as exc:
            error = exc
        raise_agreed(error)  # before the gather: no rank may be left waiting in it
        gathered = gather_to_rank0(rows)
        if self.dist.is_main:
            try:
                self.write(merge(gathered, self.data.val_size), metrics, epoch, global_step)
            except TrainerError as exc:
                error = exc
            except OSError as exc:  # not a write (is_write_failure): say what it was
                error = RunError(f"cannot write the evaluation report: {exc}")
        raise_agreed(error)

    def write(self, preds: results.Predictions, metrics: dict[str, float], epoch: int,
              global_step: int) -> None:
        """The files, the TensorBoard image and the console lines (rank 0)."""
        classes = self.data.classes
        if abs(preds.acc1() - metrics["acc1"]) > 1e-6:
            log.warning("the predictions' top-1 %.3f differs from the validation's %.3f",
                        preds.acc1(), metrics["acc1"])
        confusion = results.confusion_matrix(preds.target, preds.pred, len(classes))
        rows = results.per_class(confusion, classes, self.data.train_counts)
        summary = {"images": len(preds.ids), "acc1": metrics["acc1"], "acc5": metrics["acc5"],
                   "mean_class_acc1": results.mean_class_acc1(rows), "classes": classes,
                   "tta_flip": self.tta_flip, "epoch": epoch, "global_step": global_step}
        with disk.output_errors(self.output_dir, "the per-class report"):
            written = results.write_per_class(self.output_dir, rows, confusion, classes,
                                              summary)
        if self.predictions:
            path = Path(self.predictions)
            with disk.output_errors(path.parent, path, "--predictions"):
                results.write_predictions(path, sample_names(self.data.val_loader), classes,
                                          preds)
            written.append(path)
        self.add_image(confusion, global_step)
        log.info(" * per class: mean Acc@1 %.3f over %d classes; worst: %s",
                 summary["mean_class_acc1"], sum(r["acc1"] is not None for r in rows),
                 results.worst_classes(rows))
        log.info(" * wrote %s", ", ".join(map(str, written)))

    def add_image(self, confusion: torch.Tensor, global_step: int) -> None:
        """The confusion matrix in TensorBoard (``{tag}/confusion_matrix``), when the logger
        writes TensorBoard events."""
        if self.logger is not None:
            self.logger.images(f"{self.tag}/confusion_matrix",
                               results.confusion_image(confusion), global_step)
            self.logger.flush()


def gather_to_rank0(rows: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]] | None:
    """Every rank's rows on rank 0 (None elsewhere). Collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [rows]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 \
        else None
    dist.gather_object(rows, gathered, dst=0)
    return gathered


def merge(gathered: list[dict[str, torch.Tensor]] | None, expected: int) -> results.Predictions:
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
    return results.Predictions(ids[order], target, top, prob)
