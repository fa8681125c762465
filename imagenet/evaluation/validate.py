"""The validation loop: loss and top-1/top-5 of a model over the whole validation set, each
image counted once across the ranks (the count is checked), on the ``Engine`` the training step
uses (its device, precision and loss). Under --fsdp a rank with fewer batches joins the others'
last forwards. What sees each batch's outputs (the per-image report, TTA) is the caller's
(``report``).

-e --val-data FOLDER: another ImageFolder labelled with the checkpoint's classes (no DIR).

Validation that says what is wrong: --tta-flip, the per-image predictions (--predictions) and
the per-class report, with -e and after the last epoch.

``Report`` takes each batch's outputs from ``validate.evaluate`` (``on_output``), keeps only
the top-5 on the device, and after the pass gathers every rank's rows to rank 0, which checks
that every validation image is there exactly once (``reporting.results.merge``) and writes the
files (``reporting.results.ReportFiles``). The predictions are the same outputs the printed
top-1 counts, so the file's accuracy is that top-1.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable, Iterable
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import imagenet.launching.watchdog as watchdog
from imagenet.checkpoint.resume_from import Decided
from imagenet.data.folder import Data, build_transforms, folder_loaders, other_val_folder
from imagenet.data.index import IndexFiles
from imagenet.data.samplers import shard_batches
from imagenet.errors import RunError, TrainerError, UsageError, on_every_rank
from imagenet.launching.process_group import DistInfo, raise_agreed
from imagenet.reporting.logger import RunLogger
from imagenet.settings.failpoints import failpoint
from imagenet.settings.flags import Config
from imagenet.settings.images import image_backend
from imagenet.settings.plan import Plan
from imagenet.training.engine import Engine, autocast, compile_pause, to_device, weighted
from imagenet.training.meters import SUMS, DeviceSums, mean_loss, topk_correct
from imagenet.training.models import is_sharded

log = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(engine: Engine, model: nn.Module, loader: Iterable, expected_count: int,
             on_progress: Callable[[dict], None] | None = None,
             on_output: Callable[[torch.Tensor, torch.Tensor], None] | None = None
             ) -> dict[str, float]:
    """Loss and top-1/top-5 of ``model`` over the whole validation set, summed across ranks once.

    ``expected_count`` is the size of the validation set: the summed count must equal it.
    ``on_output(output, target)`` sees every batch (the per-image report).
    """
    opts, criterion = engine.opts, engine.parts.criterion
    model.eval()
    sums = DeviceSums(SUMS, opts.device)
    start = time.perf_counter()
    total_batches = len(loader)  # type: ignore[arg-type]
    sharded = is_sharded(model)
    if sharded:
        from imagenet.training import fsdp  # imported by --fsdp runs only

        fsdp.broadcast_buffers(model)  # rank 0's BatchNorm statistics, as under DDP
        rounds = _most_batches(total_batches, opts.device)
    spare, done = None, 0
    watchdog.beat("starting a validation")
    watchdog.phase(f"waiting for validation batch 1 of {total_batches}")
    for i, (images, target) in enumerate(loader):
        watchdog.phase(f"validation batch {i + 1} of {total_batches}")
        images, target = to_device(images, target, opts)
        spare, done = images[:1], i + 1
        with autocast(opts.device, opts.amp_dtype), \
                compile_pause(model, "the validation graph", images):
            output = model(images)
            loss = criterion(output.float(), target)
        correct = topk_correct(output, target)
        loss_sum, weight = weighted(criterion, loss.float(), target, images.shape[0])
        sums.add(loss_sum, correct[0], correct[1], images.shape[0], weight)
        if on_output is not None:
            on_output(output, target)
        watchdog.beat(f"validation batch {i + 1} of {total_batches} done")
        failpoint("validate.batch")  # a fault placed after a validation batch (tests)
        watchdog.phase(f"waiting for validation batch {i + 2} of {total_batches}")
        if on_progress is not None and ((i + 1) % opts.print_freq == 0 or i + 1 == total_batches):
            local = sums.read()
            on_progress({"batch": i + 1, "batches": total_batches,
                         "acc1": 100 * local["correct1"] / max(local["count"], 1),
                         "acc5": 100 * local["correct5"] / max(local["count"], 1),
                         "batch_time": (time.perf_counter() - start) / (i + 1)})
    if sharded:
        # Every forward all-gathers weights: a rank with fewer batches joins the others' last
        # forwards with a throw-away image (uncounted).
        for _ in range(rounds - done):
            with autocast(opts.device, opts.amp_dtype), \
                    compile_pause(model, "the validation graph", spare):
                model(spare)
    sums.all_reduce()
    totals = sums.read()
    count = int(round(totals["count"]))
    if count != expected_count:
        raise on_every_rank(RunError(
            f"validated {count} images but the validation set has {expected_count}; the "
            "validation shards are inconsistent across ranks"))
    return {"loss": mean_loss(totals),
            "acc1": 100 * totals["correct1"] / max(count, 1),
            "acc5": 100 * totals["correct5"] / max(count, 1), "count": count,
            "time": time.perf_counter() - start}


def _most_batches(batches: int, device: torch.device) -> int:
    """The largest validation batch count of any rank (one small all-reduce); every rank
    raises if one has none (it would have no image to join the others' forwards with)."""
    most = torch.tensor([batches, batches == 0], device=device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    if most[1]:
        raise RunError("a process has no validation images: --fsdp needs at least one image "
                       "per process in every rank's validation shard")
    return int(most[0].item())


# ---------------------------------------------------------------------------- -e's data


def checkpoint_classes(continues: Decided | None
                       ) -> tuple[Path, list[str] | None, list[int] | None]:
    """-e's checkpoint (``continues``, decided and read once), its class names and training
    images per class (either None when it does not record them)."""
    if continues is None or continues.path is None:
        raise UsageError("-e --val-data FOLDER evaluates a checkpoint and labels the folder's "
                         "images with its class names: give --resume PATH")
    meta = continues.ckpt or {}
    classes, counts = meta.get("classes"), meta.get("train_class_counts")
    return continues.path, list(classes) if classes else None, list(counts) if counts else None


def build_eval_data(plan: Plan, rank: int, aug_seed: int, pin_memory: bool,
                    indexes: IndexFiles | None = None, continues: Decided | None = None
                    ) -> Data:
    """-e --val-data FOLDER: that folder's images labelled with the checkpoint's classes; DIR
    is not read (nothing trains: the images stand in as the training set, which no step
    reads); ``indexes``: where its folder index is kept; ``continues``: the checkpoint -e
    evaluates (decided and read once)."""
    cfg = plan.cfg
    path, classes, counts = checkpoint_classes(continues)
    folder = Path(cfg.val_data)  # type: ignore[arg-type]
    if classes is None:
        classes = sorted(p.name for p in folder.iterdir() if p.is_dir()) \
            if folder.is_dir() else []
        log.info("=> %s names no classes: label i is the i-th class folder of %s in sorted "
                 "order, as the classic script assumes", path, folder)
    _, val_tf = build_transforms(cfg, plan.crops)
    val = other_val_folder(folder, classes, val_tf, image_backend(cfg), files=indexes)
    stand_in, val_loader = folder_loaders(cfg, val, val, rank, plan.layout, aug_seed, pin_memory)
    return Data(stand_in, val_loader, len(classes), list(classes), len(val), train_counts=counts)


# ------------------------------------------ TTA, per-image predictions and the per-class report

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
    """The predictions of one validation pass, gathered by ``finish`` to rank 0, which writes
    them (``reporting.results.ReportFiles``): the files to ``output_dir`` (and
    ``predictions``), the confusion matrix to ``logger``'s TensorBoard under ``tag``."""

    def __init__(self, data: Data, dist: DistInfo, output_dir: Path, predictions: str | None,
                 tta_flip: bool, logger: RunLogger | None = None, tag: str = "val") -> None:
        from imagenet.reporting import results  # the report's files: only a run that writes one

        self.data, self.dist = data, dist
        self.files = results.ReportFiles(output_dir, predictions, tta_flip, data.classes,
                                         data.train_counts, logger, tag)
        self.parts: list[tuple[torch.Tensor, ...]] = []  # per batch, on the device
        self.topk = results.TOPK

    def add(self, output: torch.Tensor, target: torch.Tensor) -> None:
        """``evaluate``'s ``on_output``: keep the batch's top classes (no host
        sync)."""
        top = output.topk(min(self.topk, output.shape[1]), dim=1)  # as topk_correct
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
        from imagenet.reporting import results

        error, rows = None, {}
        try:
            rows = self.local()
        except TrainerError as exc:
            error = exc
        raise_agreed(error)  # before the gather: no rank may be left waiting in it
        gathered = gather_to_rank0(rows)
        if self.dist.is_main:
            try:
                preds = results.merge(gathered, self.data.val_size)
                self.files.write(preds, sample_names(self.data.val_loader), metrics, epoch,
                                 global_step)
            except TrainerError as exc:
                error = exc
            except OSError as exc:  # not a write (is_write_failure): say what it was
                error = RunError(f"cannot write the evaluation report: {exc}")
        raise_agreed(error)


def gather_to_rank0(rows: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]] | None:
    """Every rank's rows on rank 0 (None elsewhere). Collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [rows]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 \
        else None
    dist.gather_object(rows, gathered, dst=0)
    return gathered
