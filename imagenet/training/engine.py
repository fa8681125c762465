"""train_one_epoch: returns a dict of metrics; no files, no argv, no flags (the validation
loop, which uses the same ``Engine``, is ``evaluation.validate``).

The contract is in the types: ``Parts`` (the objects a step uses and updates), ``Options`` (how
a step runs, frozen) and ``Hooks`` (what the caller wants done during an epoch).
``optim.build_engine`` makes the first two from the command line, for the trainer, the tests and
the benchmarks alike.
Nothing in a step waits for the device: losses, counts and the finiteness check stay on it until
a progress line or the epoch's end reads them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

import imagenet.launching.watchdog as watchdog
from imagenet.data.transforms import normalize
from imagenet.errors import NonFiniteLossError, on_every_rank
from imagenet.settings import devices
from imagenet.settings.failpoints import failpoint
from imagenet.training.meters import SUMS, DeviceSums, mean_loss, topk_correct
from imagenet.training.models import compiles, no_sync

if TYPE_CHECKING:
    from imagenet.training.distill import Teacher


@dataclass
class Step:
    """Where training is: ``epoch``, optimizer steps done in it, and in the whole run."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0


@dataclass(frozen=True)
class Options:
    """How a step runs; fixed for the whole run."""

    device: torch.device
    steps_per_epoch: int  # optimizer steps
    epochs: int = 1  # for the ETA of the run
    world_size: int = 1
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    amp_dtype: torch.dtype | None = None  # autocast dtype; None = fp32
    channels_last: bool = False
    clip_grad_norm: float | None = None
    ema_steps: int = 32  # optimizer steps between EMA updates
    ema_warmup_epochs: int = 0  # the EMA copies the weights instead of averaging during warm-up
    print_freq: int = 10  # steps between progress records


@dataclass
class Parts:
    """The objects a training step uses and updates."""

    model: nn.Module  # what the step calls: DDP / compiled / plain
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # stepped once per optimizer step
    scaler: torch.amp.GradScaler | None = None  # --amp fp16
    ema: torch.optim.swa_utils.AveragedModel | None = None
    batch_transform: Callable | None = None  # MixUp / CutMix on the device batch
    # --distill-teacher: sees each training batch after batch_transform; not in checkpoints
    teacher: Teacher | None = None


@dataclass
class Engine:
    """What train_one_epoch and evaluate need from the run."""

    parts: Parts
    opts: Options


@dataclass(frozen=True)
class Hooks:
    """Called by ``train_one_epoch``."""

    # Every ``print_freq`` steps and at the epoch's end, with a progress record (one host sync).
    on_progress: Callable[[dict], None] | None = None
    # After every optimizer step, with a function that raises if a loss so far was not finite
    # (call it before saving); returns True to end the epoch now (preemption).
    after_step: Callable[[Step, Callable[[], None]], bool] | None = None


@dataclass
class EpochTotals:
    """An epoch's training so far in this process: the sums on the device and the seconds.

    A resumed epoch starts from what the checkpoint says every rank had trained of it, on rank 0
    only (the ranks' sums are added up at the epoch's end: the earlier runs count once).
    """

    sums: DeviceSums
    seconds: float = 0.0

    @classmethod
    def starting(cls, device: torch.device, saved: dict[str, float] | None = None
                 ) -> EpochTotals:
        """Totals from zero, or from a checkpoint's ``of_job()``."""
        totals = cls(DeviceSums(SUMS, device), (saved or {}).get("seconds", 0.0))
        if saved:  # a checkpoint from before "weight": the images were the weight
            totals.sums.add(*(float(saved.get(name, saved["count"])) for name in SUMS))
        return totals

    def of_job(self) -> dict[str, float]:
        """The sums of every rank added up, and this rank's seconds (collective)."""
        return {**self.sums.summed(), "seconds": self.seconds}


def epoch_metrics(job: dict[str, float]) -> dict[str, float]:
    """An epoch's training metrics from ``EpochTotals.of_job()``."""
    count = max(job["count"], 1)
    return {"loss": mean_loss(job), "acc1": 100 * job["correct1"] / count,
            "acc5": 100 * job["correct5"] / count, "images": job["count"],
            "time": job["seconds"], "images_per_sec": job["count"] / max(job["seconds"], 1e-9)}


@dataclass
class _Sums:
    """Sums since the last progress record, and since the epoch began."""

    device: torch.device
    epoch: DeviceSums
    window: DeviceSums = field(init=False)

    def __post_init__(self) -> None:
        self.window = DeviceSums(SUMS, self.device)

    def add(self, *values) -> None:
        self.epoch.add(*values)
        self.window.add(*values)

    def restart(self) -> None:
        self.window = DeviceSums(SUMS, self.device)


@dataclass
class _Clock:
    """Times of the epoch and of the current progress window."""

    epoch_start: float
    window_start: float
    first_step: int  # step_in_epoch when this process began the epoch (resumed: not 0)
    window_first_step: int  # step_in_epoch when the current progress window began
    data_time: float = 0.0  # waiting for the loader in this window
    epoch_data_time: float = 0.0  # waiting for the loader since the epoch (re)started

    def restart(self, step_in_epoch: int) -> None:
        self.window_start, self.data_time = time.perf_counter(), 0.0
        self.window_first_step = step_in_epoch


def weighted(criterion: nn.Module, loss: torch.Tensor, target: torch.Tensor,
             images: int) -> tuple[torch.Tensor, torch.Tensor | int]:
    """A batch's mean ``loss`` as (sum, weight) that add up over batches and ranks.

    Cross-entropy with class weights (--class-balanced-loss) and class-index targets divides by
    the targets' weights, not by the image count: multiplied back by that weight, the sums give
    the weighted mean of all the images, whatever the batches (soft MixUp targets: by count).
    """
    weight = getattr(criterion, "weight", None)
    if weight is None or target.ndim != 1:
        return loss * images, images
    total = weight[target].sum()
    return loss * total, total


def to_device(images: torch.Tensor, target: torch.Tensor, opts: Options
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 batch -> normalised float on the device (non_blocking from pinned memory)."""
    images = images.to(opts.device, non_blocking=True)
    target = target.to(opts.device, non_blocking=True)
    return normalize(images, channels_last=opts.channels_last), target


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast for --amp, or nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def compile_pause(model: nn.Module, what: str, *batches: torch.Tensor
                   ) -> contextlib.AbstractContextManager:
    """Around a call of ``model`` that compiles (--compile: a batch shape's first call): the
    hang watch paused, the shape said; otherwise nothing."""
    if not compiles(model, *batches):
        return contextlib.nullcontext()
    shape = "x".join(map(str, batches[0].shape))
    return watchdog.paused(f"compiling {what} for batch shape {shape} (--compile)")


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


def _forward_backward(engine: Engine, group: list, sums: _Sums, bad_step: torch.Tensor,
                      step: Step) -> torch.Tensor:
    """Forward and backward over one optimizer step's micro-batches; returns the last loss."""
    parts, opts = engine.parts, engine.opts
    loss = torch.zeros((), device=opts.device)
    for i, (images, target) in enumerate(group):
        images, target = to_device(images, target, opts)
        hard_target = target
        if parts.batch_transform is not None:
            images, target = parts.batch_transform(images, target)
        last_micro = i == len(group) - 1
        # DDP all-reduces (FSDP reduce-scatters) on the last micro-batch only.
        with contextlib.nullcontext() if last_micro else no_sync(parts.model):
            with autocast(opts.device, opts.amp_dtype):
                output = parts.model(images)
                loss = parts.criterion(output, target)
                if parts.teacher is not None:  # the same augmented, mixed images
                    loss = parts.teacher.loss(loss, output, parts.teacher.outputs(images))
            scaled = loss / len(group)
            (parts.scaler.scale(scaled) if parts.scaler is not None else scaled).backward()
        loss = loss.detach().float()
        correct = topk_correct(output.detach(), target if target.ndim == 2 else hard_target)
        loss_sum, weight = weighted(parts.criterion, loss, target, images.shape[0])
        sums.add(loss_sum, correct[0], correct[1], images.shape[0], weight)
        # Record (without a host sync) the first step whose loss was not finite.
        bad_step.copy_(torch.where((bad_step < 0) & ~torch.isfinite(loss),
                                   torch.full_like(bad_step, step.step_in_epoch), bad_step))
    return loss


def _optimizer_step(engine: Engine, step: Step) -> None:
    """Unscale, clip, step, update the schedule and the EMA."""
    parts, opts = engine.parts, engine.opts
    if opts.clip_grad_norm is not None:
        if parts.scaler is not None:
            parts.scaler.unscale_(parts.optimizer)  # clip the true gradients, not scaled ones
        nn.utils.clip_grad_norm_(parts.model.parameters(), opts.clip_grad_norm)
    if parts.scaler is not None:
        parts.scaler.step(parts.optimizer)
        parts.scaler.update()
    else:
        parts.optimizer.step()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.scheduler.step()
    if parts.ema is not None and (step.global_step + 1) % opts.ema_steps == 0:
        parts.ema.update_parameters(parts.model)
        if step.epoch < opts.ema_warmup_epochs:
            # As torchvision's references: the next update copies the weights, so the average
            # starts from the warmed-up model rather than from the random init.
            parts.ema.n_averaged.fill_(0)


def train_one_epoch(engine: Engine, loader: Iterable, step: Step, hooks: Hooks = Hooks(),
                    totals: EpochTotals | None = None) -> dict[str, float]:
    """Train from ``step.step_in_epoch`` to the end of the epoch; return the epoch's metrics,
    every rank's together.

    ``loader`` yields the epoch's remaining micro-batches; ``step`` is advanced in place, and so
    are ``totals`` (the epoch so far, which a checkpoint may read after any step).
    """
    opts = engine.opts
    engine.parts.model.train()
    totals = totals if totals is not None else EpochTotals.starting(opts.device)
    sums = _Sums(opts.device, totals.sums)
    bad_step = torch.full((), -1, dtype=torch.long, device=opts.device)
    start, seconds_before = time.perf_counter(), totals.seconds
    clock = _Clock(start, start, step.step_in_epoch, step.step_in_epoch)
    devices.reset_peak_memory(opts.device)  # the epoch's peak, reported at its end
    loss = torch.zeros((), device=opts.device)
    tick = start
    where = f"of epoch {step.epoch}, step {step.step_in_epoch + 1} of {opts.steps_per_epoch}"
    watchdog.beat(f"starting epoch {step.epoch} at step {step.step_in_epoch}")
    watchdog.phase(f"waiting for the training batch {where}")
    for group in _micro_batches(loader, opts.grad_accum_steps):
        waited = time.perf_counter() - tick
        clock.data_time += waited
        clock.epoch_data_time += waited
        watchdog.phase(f"training step {where} (forward, backward, gradient reduction)")
        with compile_pause(engine.parts.model, "the training step", *(x for x, _ in group)):
            loss = _forward_backward(engine, group, sums, bad_step, step)
        _optimizer_step(engine, step)
        step.step_in_epoch += 1
        step.global_step += 1
        failpoint("train.step")  # a fault placed after a trained step (tests)
        where = f"of epoch {step.epoch}, step {step.step_in_epoch + 1} of {opts.steps_per_epoch}"
        watchdog.beat(f"epoch {step.epoch}, step {step.step_in_epoch} trained")
        totals.seconds = seconds_before + time.perf_counter() - start
        check = partial(check_finite, bad_step, step.epoch)
        # The step's scalars are on disk before its checkpoint is written: a kill once that is
        # in place loses none of the steps it covers (the resume continues after them).
        if step.step_in_epoch % opts.print_freq == 0 or step.step_in_epoch == opts.steps_per_epoch:
            check()
            if hooks.on_progress is not None:
                hooks.on_progress(_progress(engine, step, sums, loss, clock))
            sums.restart()
            clock.restart(step.step_in_epoch)
        stop = hooks.after_step(step, check) if hooks.after_step is not None else False
        if stop:
            break
        watchdog.phase(f"waiting for the training batch {where}")
        tick = time.perf_counter()
    check_finite(bad_step, step.epoch)
    elapsed = time.perf_counter() - start
    totals.seconds = seconds_before + elapsed
    # data_wait: this process's share of the time it trained the epoch, spent waiting for data
    metrics = {**epoch_metrics(totals.of_job()),
               "data_wait": clock.epoch_data_time / max(elapsed, 1e-9)}
    if devices.has_memory_stats(opts.device):
        metrics["max_mem_gb"] = peak_memory_gb(opts.device)
    return metrics


def peak_memory_gb(device: torch.device) -> float:
    """The most device memory this process's tensors held since the last reset, GiB; the
    largest of every rank's (collective with a process group)."""
    peak = torch.tensor(devices.peak_memory_gb(device), device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)


def check_finite(bad_step: torch.Tensor, epoch: int) -> None:
    """Stop with a named epoch and step if any loss so far, on any rank, was NaN or infinite.

    Every rank checks at the same steps, so every rank stops here, with the same message.
    """
    bad = first_bad_step_of_all_ranks(bad_step)
    if bad >= 0:
        raise on_every_rank(NonFiniteLossError(
            f"the loss became NaN/infinite at epoch {epoch}, step {bad}; training stopped. "
            "Lower --lr, try --clip-grad-norm, or check the data"))


def first_bad_step_of_all_ranks(bad_step: torch.Tensor) -> int:
    """The earliest step any rank recorded in ``bad_step`` (-1: none). Collective, one sync."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return int(bad_step.item())
    none = torch.iinfo(torch.long).max
    earliest = torch.where(bad_step < 0, torch.full_like(bad_step, none), bad_step)
    dist.all_reduce(earliest, op=dist.ReduceOp.MIN)
    bad = int(earliest.item())
    return -1 if bad == none else bad


def _progress(engine: Engine, step: Step, sums: _Sums, loss: torch.Tensor,
              clock: _Clock) -> dict:
    """The progress record (reads the sums back: one sync)."""
    opts = engine.opts
    w, total = sums.window.read(), sums.epoch.read()
    now = time.perf_counter()
    window_time = now - clock.window_start
    n = max(w["count"], 1)
    done_here = step.step_in_epoch - clock.first_step
    steps_in_window = max(step.step_in_epoch - clock.window_first_step, 1)  # the last: fewer
    per_step = (now - clock.epoch_start) / max(done_here, 1)
    remaining_epoch = (opts.steps_per_epoch - step.step_in_epoch) * per_step
    remaining_run = remaining_epoch + (opts.epochs - step.epoch - 1) * opts.steps_per_epoch \
        * per_step
    record = {
        "epoch": step.epoch, "step": step.step_in_epoch, "steps": opts.steps_per_epoch,
        "global_step": step.global_step, "loss": float(loss.item()),
        "loss_avg": mean_loss(total), "acc1": 100 * w["correct1"] / n,
        "acc5": 100 * w["correct5"] / n, "lr": engine.parts.optimizer.param_groups[0]["lr"],
        "batch_time": window_time / steps_in_window,
        "data_time": clock.data_time / steps_in_window,
        "data_wait": clock.data_time / max(window_time, 1e-9),
        "images": w["count"] * opts.world_size,  # all ranks, this window
        # this window's images over its time (not since the run began: compiling, validation
        # and saves would count)
        "images_per_sec": w["count"] * opts.world_size / max(window_time, 1e-9),
        "eta_epoch": remaining_epoch, "eta_run": remaining_run,
    }
    if devices.has_memory_stats(opts.device):
        record["max_mem_gb"] = devices.peak_memory_gb(opts.device)
    return record
