"""train_one_epoch and evaluate: return dicts of metrics; no files, no argv."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from imagenet.errors import NonFiniteLossError, RunError
from imagenet.metrics import DeviceSums, topk_correct
from imagenet.transforms import normalize

log = logging.getLogger(__name__)


@dataclass
class Step:
    """Where training is: ``epoch``, optimizer steps done in it, and in the whole run."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0


@dataclass
class TrainContext:
    """The objects one training step needs."""

    model: nn.Module  # possibly DDP / compiled
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: torch.device
    steps_per_epoch: int  # optimizer steps
    world_size: int = 1
    amp_dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None
    channels_last: bool = False
    grad_accum_steps: int = 1
    clip_grad_norm: float | None = None
    batch_transform: Callable | None = None  # MixUp / CutMix on the device batch
    ema: torch.optim.swa_utils.AveragedModel | None = None
    ema_steps: int = 32
    ema_warmup_epochs: int = 0  # the EMA copies the weights instead of averaging during warm-up
    print_freq: int = 10
    epochs: int = 1
    on_print: Callable[[dict], None] | None = None
    # Called after every optimizer step with a function that raises if a loss was not finite
    # (call it before saving); returns True to stop the epoch (preemption).
    after_step: Callable[[Step, Callable[[], None]], bool] | None = None
    job_start: float = field(default_factory=time.perf_counter)
    job_images: int = 0  # images (all ranks) trained by this process's job so far


def to_device(images: torch.Tensor, target: torch.Tensor, ctx: TrainContext
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 batch -> normalised float on the device (non_blocking from pinned memory)."""
    images = images.to(ctx.device, non_blocking=True)
    target = target.to(ctx.device, non_blocking=True)
    return normalize(images, channels_last=ctx.channels_last), target


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast for --amp, or nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _micro_batches(loader: Iterable, k: int) -> Iterable[list]:
    """Group the loader's batches into optimizer steps of ``k`` micro-batches."""
    group: list = []
    for batch in loader:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []
    if group:
        yield group


def _optimizer_step(ctx: TrainContext, step: Step) -> None:
    """Unscale, clip, step, update the schedule and the EMA."""
    if ctx.clip_grad_norm is not None:
        if ctx.scaler is not None:
            ctx.scaler.unscale_(ctx.optimizer)  # clip the true gradients, not scaled ones
        nn.utils.clip_grad_norm_(ctx.model.parameters(), ctx.clip_grad_norm)
    if ctx.scaler is not None:
        ctx.scaler.step(ctx.optimizer)
        ctx.scaler.update()
    else:
        ctx.optimizer.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    ctx.scheduler.step()
    if ctx.ema is not None and (step.global_step + 1) % ctx.ema_steps == 0:
        ctx.ema.update_parameters(ctx.model)
        if step.epoch < ctx.ema_warmup_epochs:
            # As torchvision's references: the next update copies the weights, so the average
            # starts from the warmed-up model rather than from the random init.
            ctx.ema.n_averaged.fill_(0)


def train_one_epoch(ctx: TrainContext, loader: Iterable, step: Step) -> dict[str, float]:
    """Train from ``step.step_in_epoch`` to the end of the epoch; return the epoch's metrics."""
    ctx.model.train()
    sums = DeviceSums(("loss", "correct1", "correct5", "count"), ctx.device)
    window = DeviceSums(("loss", "correct1", "correct5", "count"), ctx.device)
    bad_step = torch.full((), -1, dtype=torch.long, device=ctx.device)
    start = time.perf_counter()
    tick, data_time, last_loss = start, 0.0, torch.zeros((), device=ctx.device)
    window_start, first_step = start, step.step_in_epoch
    for group in _micro_batches(loader, ctx.grad_accum_steps):
        data_time += time.perf_counter() - tick
        for i, (images, target) in enumerate(group):
            images, target = to_device(images, target, ctx)
            hard_target = target
            if ctx.batch_transform is not None:
                images, target = ctx.batch_transform(images, target)
            last_micro = i == len(group) - 1
            sync = ctx.model.no_sync() if (not last_micro and hasattr(ctx.model, "no_sync")) \
                else contextlib.nullcontext()
            with sync:
                with autocast(ctx.device, ctx.amp_dtype):
                    output = ctx.model(images)
                    loss = ctx.criterion(output, target)
                scaled = loss / len(group)
                (ctx.scaler.scale(scaled) if ctx.scaler is not None else scaled).backward()
            detached = loss.detach().float()
            correct = topk_correct(output.detach(), target if target.ndim == 2 else hard_target)
            n = images.shape[0]
            for s in (sums, window):
                s.add(detached * n, correct[0], correct[1], n)
            last_loss = detached
            # Record (without a host sync) the first step whose loss was not finite.
            bad_step = torch.where((bad_step < 0) & ~torch.isfinite(detached),
                                   torch.full_like(bad_step, step.step_in_epoch), bad_step)
        _optimizer_step(ctx, step)
        step.step_in_epoch += 1
        step.global_step += 1
        ctx.job_images += sum(b[0].shape[0] for b in group) * ctx.world_size
        stop = ctx.after_step(step, partial(check_finite, bad_step, step.epoch)) \
            if ctx.after_step is not None else False
        if step.step_in_epoch % ctx.print_freq == 0 or step.step_in_epoch == ctx.steps_per_epoch:
            check_finite(bad_step, step.epoch)
            now = time.perf_counter()
            _report(ctx, step, window, last_loss, sums, now - window_start, data_time,
                    now - start, first_step)
            window = DeviceSums(window.names, ctx.device)
            window_start, data_time = now, 0.0
        if stop:
            break
        tick = time.perf_counter()
    check_finite(bad_step, step.epoch)
    totals = sums.read()
    count = max(totals["count"], 1)
    elapsed = time.perf_counter() - start
    return {"loss": totals["loss"] / count, "acc1": 100 * totals["correct1"] / count,
            "acc5": 100 * totals["correct5"] / count, "images": totals["count"],
            "time": elapsed,
            "images_per_sec": totals["count"] * ctx.world_size / max(elapsed, 1e-9)}


def check_finite(bad_step: torch.Tensor, epoch: int) -> None:
    """Stop with a named epoch and step if any loss so far was NaN or infinite."""
    bad = int(bad_step.item())
    if bad >= 0:
        raise NonFiniteLossError(
            f"the loss became NaN/infinite at epoch {epoch}, step {bad}; training stopped and "
            "the last good checkpoint is kept. Lower --lr, try --clip-grad-norm, or check the data")


def _report(ctx: TrainContext, step: Step, window: DeviceSums, last_loss: torch.Tensor,
            sums: DeviceSums, window_time: float, data_time: float, epoch_time: float,
            first_step: int) -> None:
    """Read the window back (one sync) and hand a progress record to ``on_print``."""
    w, total = window.read(), sums.read()
    n, steps_in_window = max(w["count"], 1), max(step.step_in_epoch - first_step, 1)
    done_here = step.step_in_epoch - first_step
    per_step = epoch_time / max(done_here, 1)
    remaining_epoch = (ctx.steps_per_epoch - step.step_in_epoch) * per_step
    remaining_run = remaining_epoch + (ctx.epochs - step.epoch - 1) * ctx.steps_per_epoch * per_step
    job_elapsed = time.perf_counter() - ctx.job_start
    record = {
        "epoch": step.epoch, "step": step.step_in_epoch, "steps": ctx.steps_per_epoch,
        "global_step": step.global_step, "loss": float(last_loss.item()),
        "loss_avg": total["loss"] / max(total["count"], 1), "acc1": 100 * w["correct1"] / n,
        "acc5": 100 * w["correct5"] / n, "lr": ctx.optimizer.param_groups[0]["lr"],
        "batch_time": window_time / min(steps_in_window, ctx.print_freq),
        "data_time": data_time / min(steps_in_window, ctx.print_freq),
        "data_wait": data_time / max(window_time, 1e-9),
        "images_per_sec": ctx.job_images / max(job_elapsed, 1e-9),
        "eta_epoch": remaining_epoch, "eta_run": remaining_run,
    }
    if ctx.device.type == "cuda":
        record["max_mem_gb"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
    if ctx.on_print is not None:
        ctx.on_print(record)


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable, criterion: nn.Module, device: torch.device,
             expected_count: int, channels_last: bool = False, amp_dtype: torch.dtype | None = None,
             print_freq: int = 10, on_print: Callable[[dict], None] | None = None
             ) -> dict[str, float]:
    """Loss and top-1/top-5 over the whole validation set, summed across ranks once."""
    model.eval()
    sums = DeviceSums(("loss", "correct1", "correct5", "count"), device)
    start = time.perf_counter()
    total_batches = len(loader)  # type: ignore[arg-type]
    for i, (images, target) in enumerate(loader):
        images = normalize(images.to(device, non_blocking=True), channels_last=channels_last)
        target = target.to(device, non_blocking=True)
        with autocast(device, amp_dtype):
            output = model(images)
            loss = criterion(output.float(), target)
        correct = topk_correct(output, target)
        sums.add(loss.float() * images.shape[0], correct[0], correct[1], images.shape[0])
        if on_print is not None and ((i + 1) % print_freq == 0 or i + 1 == total_batches):
            local = sums.read()
            on_print({"batch": i + 1, "batches": total_batches,
                      "acc1": 100 * local["correct1"] / max(local["count"], 1),
                      "acc5": 100 * local["correct5"] / max(local["count"], 1),
                      "batch_time": (time.perf_counter() - start) / (i + 1)})
    sums.all_reduce()
    totals = sums.read()
    count = int(round(totals["count"]))
    if count != expected_count:
        raise RunError(f"validated {count} images but the validation set has {expected_count}; "
                       "the validation shards are inconsistent across ranks")
    return {"loss": totals["loss"] / max(count, 1),
            "acc1": 100 * totals["correct1"] / max(count, 1),
            "acc5": 100 * totals["correct5"] / max(count, 1), "count": count,
            "time": time.perf_counter() - start}


def barrier() -> None:
    """Wait for all ranks (no-op without a process group)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
