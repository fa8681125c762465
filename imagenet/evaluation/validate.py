"""The validation loop: loss and top-1/top-5 of a model over the whole validation set, each
image counted once across the ranks (the count is checked), on the ``Engine`` the training step
uses (its device, precision and loss). Under --fsdp a rank with fewer batches joins the others'
last forwards. What sees each batch's outputs (the per-image report, TTA) is the caller's
(``report``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

import imagenet.launching.watchdog as watchdog
import imagenet.training.fsdp as fsdp
from imagenet.errors import RunError, on_every_rank
from imagenet.training.engine import (
    SUMS,
    Engine,
    autocast,
    compile_pause,
    mean_loss,
    to_device,
    weighted,
)
from imagenet.training.metrics import DeviceSums, topk_correct


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
    sharded = fsdp.is_sharded(model)
    if sharded:
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
