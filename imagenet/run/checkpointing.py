"""What a run's checkpoint holds (``save``) and how a resume puts it back (``resume``): the
``Run`` to and from the pieces of ``imagenet.checkpoint``.

``save`` is collective (it gathers every rank's RNG state); only rank 0 writes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

import imagenet.launching.watchdog as watchdog
from imagenet.checkpoint import files, rundir
from imagenet.checkpoint.resume_from import broadcast_weights, check_ranks_agree, log_changes
from imagenet.checkpoint.rundir import to_host
from imagenet.checkpoint.states import (
    check_resumable,
    data_resume_point,
    ema_state,
    flags_kept,
    gather_rng,
    layout_kept,
    load_ema_state,
    model_state,
    optimizer_state,
    refuse_non_finite,
    restore_optimizer,
    restore_rng,
    resumed_best,
    rng_for_rank,
    same_optimizer,
    same_order,
)
from imagenet.errors import NonFiniteLossError, TrainerError, UsageError, on_every_rank
from imagenet.launching.preemption import StopFlag
from imagenet.launching.process_group import barrier
from imagenet.run.build import Run
from imagenet.run.outputs import Saved
from imagenet.settings.failpoints import failpoint
from imagenet.training.engine import EpochTotals, Step
from imagenet.training.models import is_sharded
from imagenet.training.optim import (
    EpochStart,
    ResumePoint,
    rebuild_schedule,
    schedule_steps,
)

log = logging.getLogger(__name__)

AfterStep = Callable[[Step, Callable[[], None]], bool]  # the engine's Hooks.after_step


class Checkpointer:
    """The epoch loop's saves: every --save-every steps and at a stop (``after_step``, the
    engine's hook), the trained epoch before its validation, the validated epoch with the best
    files; the background write waited for on leaving. ``stop`` hears how long each save took
    (the time limit's estimate of the next one)."""

    def __init__(self, run: Run, stop: StopFlag) -> None:
        self.run, self.stop = run, stop
        self.after_step = saver(run, stop)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.run.writer.wait_quietly()  # an error on its way: the write under way still finishes

    def trained(self, steps_before: int) -> None:
        """The trained epoch saved before it is validated (when it trained a step since
        ``steps_before``): a signal or an error during validation loses none of it (a resume
        then only validates)."""
        if self.run.step.global_step > steps_before:
            self.stop.saved(save(self.run, is_best=False))

    def epoch_done(self, validated: dict[str, dict[str, float]], record: dict[str, Any]) -> None:
        """The validated epoch saved, ``record`` with it (its validation and best added): the
        best files first, when they improve (``track_best``)."""
        run = self.run
        is_best, is_best_ema = track_best(run, validated, record)
        run.last_record, run.train_totals = record, None
        self.stop.saved(save(run, is_best, epoch_done=True, is_best_ema=is_best_ema,
                             score=record["val_acc1"]))

    def finish(self) -> None:
        """The last checkpoint on disk before the run says it is done (collective)."""
        self.stop.drain()
        finish_saves(self.run)

    def non_finite(self, exc: NonFiniteLossError) -> NonFiniteLossError:
        """``exc`` (a loss gone NaN/inf) naming the last good checkpoint, once it is on disk."""
        self.run.writer.wait_quietly()  # the last good checkpoint may still be on its way to disk
        from imagenet.checkpoint.states import last_good

        return on_every_rank(NonFiniteLossError(f"{exc}; {last_good(self.run.output_dir)}"))


def saver(run: Run, stop: StopFlag) -> AfterStep:
    """The ``after_step`` hook: mid-epoch saving (--save-every) and preemption."""

    def after_step(step: Step, check_finite: Callable[[], None]) -> bool:
        stopping = stop.should_stop()
        every = run.cfg.save_every
        if stopping or (every and step.step_in_epoch % every == 0
                        and step.step_in_epoch < run.engine.opts.steps_per_epoch):
            check_finite()
            stop.saved(save(run, is_best=False))
        return stopping

    return after_step


def track_best(run: Run, validated: dict[str, dict[str, float]],
               record: dict[str, Any]) -> tuple[bool, bool]:
    """Add ``{prefix}val_*`` and ``best_{prefix}acc1`` to ``record``; whether the model and the
    EMA are the best so far. Only once every validation is done: a best recorded before a stop
    would be saved without its file."""
    improved = {}
    for prefix, best in (("", run.best), ("ema_", run.best_ema)):
        if best is None or prefix not in validated:
            continue
        record.update({f"{prefix}val_{k}": v for k, v in validated[prefix].items()})
        improved[prefix] = best.update(validated[prefix]["acc1"])
        record[f"best_{prefix}acc1"] = best.acc1
    return improved.get("", False), improved.get("ema_", False)


def comm_hook_state(run: Run) -> dict[str, Any] | None:
    """--ddp-comm-hook's checkpointable state (PowerSGD's: ``training.comm_hooks``), or None."""
    if run.cfg.ddp_comm_hook == "none":
        return None
    from imagenet.training.comm_hooks import hook_state

    return hook_state(run.engine.parts.model)


def checkpoint_state(run: Run, epoch_done: bool, weights: bool = True) -> dict[str, Any]:
    """The full run state; classic keys first. Collective: every rank must call it.

    ``epoch_done``: the epoch is trained *and* validated, so a resume starts the next one.
    Otherwise (epoch, step_in_epoch) says where training continues; step_in_epoch equal to
    steps_per_epoch means only the epoch's validation is left (a signal at its last step).
    ``weights=False`` (--sharded-checkpoint, whose shards hold them): no model, optimizer or
    EMA tensors.
    """
    states = gather_rng(run.dist.rank, run.dist.world_size)
    trained = None if epoch_done else epoch_so_far(run)  # collective too
    parts, step, layout = run.engine.parts, run.step, run.layout
    epoch, step_in_epoch = (step.epoch + 1, 0) if epoch_done else (step.epoch, step.step_in_epoch)
    images = 0 if epoch_done else run.images_trained()
    ema = parts.ema
    return {
        # The classic's meaning: the epoch to start at. Mid-epoch it is the current epoch.
        "epoch": epoch,
        "step_in_epoch": step_in_epoch,
        "global_step": step.global_step,
        "arch": run.cfg.arch,
        "state_dict": model_state(run.raw_model) if weights else None,
        "best_acc1": float(run.best.acc1),
        "optimizer": optimizer_state(run.raw_model, parts.optimizer) if weights else None,
        "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
        "ema": None if ema is None else ema_state(ema) if weights else
        {"n_averaged": ema.n_averaged.clone()},
        "best_ema_acc1": float(run.best_ema.acc1) if run.best_ema is not None else None,
        "num_classes": run.data.num_classes,
        "classes": run.data.classes,
        "train_class_counts": run.data.train_counts,  # the per-class report of a later -e
        "aug_seed": run.aug_seed,
        "world_size": layout.world_size,
        "batch_size": layout.batch_size,
        "grad_accum_steps": layout.grad_accum_steps,
        "steps_per_epoch": run.engine.opts.steps_per_epoch,
        # The images of this epoch's order (seed, epoch) already trained, by all ranks; "start"
        # is the same per rank, for readers of older checkpoints.
        "sampler": {"seed": run.data.train.order_seed, "epoch": epoch, "images": images,
                    "start": images // layout.world_size},
        "rng": states,  # python, numpy, torch CPU and CUDA states of every rank, by rank
        "comm_hook": comm_hook_state(run),
        "config": run.cfg.to_dict(),
        # --distill-teacher: where it came from and its weights' digest, never the weights
        "distill_teacher": parts.teacher.record() if parts.teacher is not None else None,
        "run_id": run.run_id,  # a damaged checkpoint falls back to this run's files only
        # What the epoch's metrics.jsonl record needs: the training so far (every rank's sums
        # and seconds) and, once the epoch is done, the record itself (a kill before its line
        # is written loses nothing).
        "epoch_train": trained,
        "last_epoch": run.last_record if epoch_done else None,
    }


def epoch_so_far(run: Run) -> dict[str, float]:
    """The current epoch's training totals, every rank's together (collective)."""
    if run.train_totals is None:  # nothing trained yet in this process
        run.train_totals = EpochTotals.starting(run.dist.device)
    return run.train_totals.of_job()

def ema_weights_state(run: Run, ema: dict[str, Any]) -> dict[str, Any]:
    """model_best_ema.pth.tar: the EMA weights (``ema``: the checkpoint's EMA state) as a plain
    model checkpoint (``-e --resume``)."""
    assert run.best_ema is not None
    return {"epoch": run.step.epoch + 1, "arch": run.cfg.arch,
            "state_dict": {k[len("module."):]: v for k, v in ema.items()
                           if k.startswith("module.")},
            "best_acc1": float(run.best_ema.acc1), "ema": True,
            "num_classes": run.data.num_classes, "classes": run.data.classes,
            "train_class_counts": run.data.train_counts, "config": run.cfg.to_dict()}


def save(run: Run, is_best: bool, epoch_done: bool = False, is_best_ema: bool = False,
         score: float | None = None) -> float:
    """Save the run: its state copied off the model now, the files written by rank 0 in the
    background (``checkpoint.rundir.Writer``), atomically, the best files first when they improve.
    Returns the seconds it held up training, or the last whole write's if that was longer (the
    time limit's estimate of a save). Collective (it gathers every rank's RNG state).

    Best files are replaced before the checkpoint: a kill in between leaves a best file ahead of
    the checkpoint (``resumed_best`` adopts it), never a checkpoint whose best has no file.
    ``score``: the epoch's validation top-1 at an epoch's end; with --keep-checkpoints the
    checkpoint is also kept as checkpoint_epochNNN.pth.tar when it is among the best
    (``rundir.plan``).
    A save waits for the previous write; ``finish_saves`` waits for the last one.
    """
    start = time.perf_counter()
    watchdog.beat(f"saving a checkpoint at epoch {run.step.epoch}, step "
                  f"{run.step.step_in_epoch}")
    if run.cfg.sharded_checkpoint:  # every rank writes its shards: together, now
        save_sharded(run, is_best, epoch_done, is_best_ema, score)
        run.outputs.saved(saved_record(run, epoch_done))
        return time.perf_counter() - start
    payload = to_host(checkpoint_state(run, epoch_done))  # training may go on from here
    refuse_non_finite(payload, run.dist.is_main, run.output_dir, run.step.epoch,
                            run.step.step_in_epoch, settle=run.writer.wait_quietly)
    written = None
    if run.dist.is_main:
        out, entry = run.output_dir, epoch_entry(run, score)
        ema = ema_weights_state(run, payload["ema"]) if is_best_ema else None
        written = run.writer.wait()  # one write at a time: the previous one is in place first
        run.writer.submit(partial(write_checkpoint, out, payload, is_best, ema, entry,
                                  run.cfg.keep_checkpoints))
    # Uploaded (object storage) and reported (imagenet.train) once written: ``Outputs``
    run.outputs.saved(saved_record(run, epoch_done))
    watchdog.beat("checkpoint state copied; rank 0 writes it")
    return max(time.perf_counter() - start, written or 0.0)


def write_checkpoint(out: Path, payload: dict[str, Any], is_best: bool,
                     ema: dict[str, Any] | None, entry: rundir.Entry | None, keep: int) -> None:
    """Rank 0's files of a save (in the writer's thread): the EMA's best file, then the
    checkpoint with its copies (the best file, the history's), then the history pruned."""
    if ema is not None:
        files.atomic_save(ema, out / files.BEST_EMA)
    best = [out / files.BEST] if is_best else []
    kept = rundir.plan(out, keep, entry) if entry is not None else None
    files.atomic_save(payload, out / files.CHECKPOINT, copies=best + ([kept] if kept else []))
    if entry is not None:
        rundir.prune(out, sharded=False)
    failpoint("save.done")  # a fault placed once a checkpoint's files are in place (tests)


def finish_saves(run: Run) -> float | None:
    """Rank 0 waits for the write under way (its error raised), then every rank waits for rank
    0: no rank moves on to exit before the file is in place (under mp.spawn the first rank to
    exit makes the parent end the others, rank 0 included). Collective. The write's seconds."""
    seconds = run.writer.wait() if run.dist.is_main else None
    barrier()
    return seconds


def saved_record(run: Run, epoch_done: bool) -> Saved:
    """The checkpoint just written, as ``imagenet.train``'s ``on_checkpoint`` receives it."""
    step = run.step
    epoch, step_in_epoch = (step.epoch + 1, 0) if epoch_done else \
        (step.epoch, step.step_in_epoch)
    name = files.dcp_name(files.CHECKPOINT) if run.cfg.sharded_checkpoint else files.CHECKPOINT
    return Saved(run.output_dir / name, run.dist.rank, epoch, step_in_epoch, step.global_step,
                 epoch_done, float(run.best.acc1))


def save_sharded(run: Run, is_best: bool, epoch_done: bool, is_best_ema: bool,
                 score: float | None) -> None:
    """``save`` for --sharded-checkpoint: directories of shards instead of files. Collective."""
    from imagenet.checkpoint import sharded  # torch.distributed.checkpoint: only for these

    out = run.output_dir
    meta = checkpoint_state(run, epoch_done, weights=False)
    # Each rank checks the shards it is about to write; all stop if one holds NaN/inf.
    parts, is_main = run.engine.parts, run.dist.is_main
    local = sharded.local_tensors(sharded.sharded_state(run.raw_model, parts.optimizer, parts.ema))
    refuse_non_finite({**meta, **local}, True, out, run.step.epoch,
                                 run.step.step_in_epoch)
    if is_best_ema:
        assert parts.ema is not None
        sharded.save_ema_weights(parts.ema, {**ema_weights_state(run, {}), "state_dict": None},
                                 out / files.dcp_name(files.BEST_EMA), is_main)
    best = (out / files.dcp_name(files.BEST),) if is_best else ()
    kept = tuple(keep_epoch(run, score)) if is_main else ()
    sharded.save(run.raw_model, parts.optimizer, parts.ema, meta,
                 out / files.dcp_name(files.CHECKPOINT), is_main, copies=best + kept)
    if run.dist.is_main and score is not None and run.cfg.keep_checkpoints:
        rundir.prune(out, sharded=True)
    if is_main:
        failpoint("save.done")  # a fault placed once the checkpoint is in place (tests)


def epoch_entry(run: Run, score: float | None) -> rundir.Entry | None:
    """--keep-checkpoints at an epoch's end (``score``: its top-1): the history's entry of this
    epoch's checkpoint; None otherwise."""
    if score is None or not run.cfg.keep_checkpoints:
        return None
    return rundir.epoch_entry(run.step.epoch + 1, score, run.step.global_step,
                               run.cfg.sharded_checkpoint)


def keep_epoch(run: Run, score: float | None) -> list[Path]:
    """--keep-checkpoints, on rank 0 at an epoch's end: the history's index updated first; where
    the epoch's checkpoint must be copied when it is among the best ([] otherwise)."""
    entry = epoch_entry(run, score)
    if entry is None:
        return []
    path = rundir.plan(run.output_dir, run.cfg.keep_checkpoints, entry)
    return [path] if path is not None else []


def load_weights(run: Run, ckpt: dict[str, Any], path: Path) -> None:
    """The checkpoint's model (checked: these class names), optimizer and EMA into the
    (possibly sharded) run; a directory is --sharded-checkpoint's. Every rank reads and checks
    the same checkpoint: none fails alone."""
    parts = run.engine.parts
    if path.is_dir():  # resharded to this run
        from imagenet.checkpoint import sharded  # torch.distributed.checkpoint: only for these

        with flags_kept(parts.optimizer):
            sharded.load(run.raw_model, parts.optimizer, parts.ema, path, run.cfg.arch,
                          run.data.classes, with_optimizer=same_optimizer(ckpt, run.cfg))
        return
    files.load_model_state(run.raw_model, ckpt, path, run.cfg.arch)
    check_resumable(ckpt, path, run.data.classes)
    restore_optimizer(run.raw_model, parts.optimizer, ckpt, run.cfg)
    if parts.ema is None:
        return
    if isinstance(ckpt.get("ema"), dict):  # model_best_ema.pth.tar says "ema": True instead
        load_ema_state(parts.ema, ckpt["ema"])
    elif not is_sharded(parts.ema):  # no EMA state: it starts from the loaded weights
        parts.ema.module.load_state_dict(run.raw_model.state_dict())


def resume(run: Run) -> Path | None:
    """Continue from the checkpoint every rank agreed on, as the run this command line describes.

    Weights, optimizer moments, EMA, scaler, position, best accuracy and RNG come from the
    checkpoint; the hyper-parameters and the learning-rate schedule come from the flags, placed
    at the checkpoint's point in training (``imagenet.training.optim``). Returns the
    checkpoint's path (None: a fresh start).
    """
    check_ranks_agree(run.cfg, run.dist.world_size)
    found = run.continues.take()  # decided and read before the run was built
    if found is None:
        if run.cfg.evaluate and run.cfg.resume == "auto":
            remote = run.outputs.remote
            where = remote.output_url if remote is not None and remote.output_url else \
                run.output_dir
            raise on_every_rank(UsageError(
                f"-e --resume auto: no checkpoint in {where} to evaluate; give --resume PATH "
                "(a checkpoint, model_best.pth.tar, a state dict) or the --output-dir of a run"))
        if run.cfg.resume == "auto" or run.plan.restarted:
            log.info("=> no checkpoint in %s: starting fresh", run.output_dir)
        place_schedule(run, run.step.epoch, 0)  # --start-epoch N: epoch N's learning rate
        return None
    path, ckpt = found
    if path.resolve().parent == run.output_dir.resolve() and ckpt.get("run_id"):
        run.run_id = str(ckpt["run_id"])  # it continues the run OUTPUT_DIR records
    log.info("=> loading checkpoint '%s'", path)
    parts = run.engine.parts
    try:  # every rank holds the same checkpoint now: every rank stops here together
        load_weights(run, ckpt, path)
    except TrainerError as exc:
        raise on_every_rank(exc) from None
    steps_per_epoch = run.engine.opts.steps_per_epoch
    if not run.cfg.evaluate:  # -e only evaluates the weights: training flags do not matter
        from imagenet.training.distill import check_resumed

        try:  # the same teacher, or none on both sides
            check_resumed(ckpt, parts.teacher)
        except TrainerError as exc:
            raise on_every_rank(exc) from None
        log_changes(ckpt, run.cfg, run.layout, steps_per_epoch)
    if parts.scaler is not None and ckpt.get("scaler"):
        parts.scaler.load_state_dict(ckpt["scaler"])
    if ckpt.get("comm_hook"):  # PowerSGD's state (its own import: no other run has one)
        from imagenet.training.comm_hooks import load_hook_state

        load_hook_state(parts.model, ckpt["comm_hook"])
    run.best.acc1 = resumed_best(ckpt, path, run.output_dir, best_file=run.best.path.name)
    if run.best_ema is not None:
        run.best_ema.acc1 = resumed_best(ckpt, path, run.output_dir, "best_ema_acc1",
                                         run.best_ema.path.name)
    point = data_resume_point(ckpt, run.cfg, run.layout, steps_per_epoch, run.data.train)
    global_step = int(ckpt.get("global_step", point.epoch * steps_per_epoch))
    run.step = Step(point.epoch, point.step_in_epoch, global_step)
    run.epoch_start = EpochStart(point.epoch, point.images, point.step_in_epoch)
    if not run.cfg.evaluate:  # -e has no schedule to continue
        place_schedule(run, point.epoch, point.step_in_epoch)
    resume_epoch_record(run, ckpt, point)
    run.aug_seed = int(ckpt.get("aug_seed", run.aug_seed))
    # The data order of the epoch being continued, and its augmentation.
    order_seed = int(ckpt["sampler"]["seed"]) if ckpt.get("sampler") else run.data.train.order_seed
    run.data.train.reseed(order_seed, run.aug_seed)
    saved_rng = rng_for_rank(ckpt.get("rng"), run.dist.rank)
    restored = saved_rng is not None and same_layout(run, ckpt)
    if restored:
        restore_rng(saved_rng)
    if not run.cfg.evaluate:
        keep_seed(run, ckpt, restored)
    if not is_sharded(run.raw_model):  # sharded: loaded from rank 0's state already
        broadcast_weights(run.raw_model, parts.ema)
    log.info("=> loaded checkpoint '%s' (epoch %d, step %d, best Acc@1 %.3f)", path,
             run.step.epoch, run.step.step_in_epoch, run.best.acc1)
    if point.approximated:
        log_approximation(run, point, same_order(ckpt, run.cfg))
    return path


def resume_epoch_record(run: Run, ckpt: dict[str, Any], point: ResumePoint) -> None:
    """What the checkpoint holds of the epoch's record: the training so far, counted once (on
    rank 0) unless the epoch starts over; the last finished epoch's record."""
    continues = point.step_in_epoch > 0 or point.images > 0
    saved = ckpt.get("epoch_train") if continues and run.dist.is_main else None
    run.train_totals = EpochTotals.starting(run.dist.device, saved) if continues else None
    run.last_record = ckpt.get("last_epoch")


def keep_seed(run: Run, ckpt: dict[str, Any], rng_restored: bool) -> None:
    """A resume keeps the checkpoint's --seed, and says so when the flag differs.

    The data order, augmentation and training-step streams continue the checkpoint's: the run
    ends as a fresh run with that seed would. Another seed would describe another run from its
    first step, which no resume can give; half of each would reproduce neither.
    """
    config = ckpt.get("config") or {}
    if "seed" not in config or config["seed"] == run.cfg.seed:
        return
    saved = config["seed"]
    log.info("=> --seed %s is not applied: a resumed run keeps the checkpoint's seed %s (data "
             "order, augmentation, dropout); start a fresh run for another seed",
             "unset" if run.cfg.seed is None else run.cfg.seed, saved)
    # config.json and checkpoints say so
    run.plan = dataclasses.replace(run.plan, cfg=dataclasses.replace(run.cfg, seed=saved))
    if saved is not None and not rng_restored:  # as build_run seeds this rank's stream
        torch.manual_seed(saved + run.dist.rank)


def place_schedule(run: Run, epoch: int, step_in_epoch: int) -> None:
    """The learning-rate schedule of the flags, at (epoch, step_in_epoch) of this layout."""
    steps_per_epoch = run.engine.opts.steps_per_epoch
    done = schedule_steps(epoch, step_in_epoch, steps_per_epoch)
    if done == 0:
        return  # build_engine's schedule is already there
    parts = run.engine.parts
    parts.scheduler = rebuild_schedule(parts.optimizer, run.cfg, steps_per_epoch, done)
    log.info("=> learning-rate schedule from the flags at epoch %d, step %d of %d: lr %.6g",
             epoch, step_in_epoch, steps_per_epoch, parts.optimizer.param_groups[0]["lr"])


def log_approximation(run: Run, point: ResumePoint, order_kept: bool = True) -> None:
    """The one line that says what a mid-epoch resume with another layout approximates."""
    steps = run.engine.opts.steps_per_epoch
    if point.images == 0:  # tar shards, or another --ra-reps
        why = ("tar shards can only continue an epoch in the layout that began it" if order_kept
               else "--ra-reps changed, and the epoch's order with it")
        log.info("=> approximated: epoch %d was left after %.2f steps of this layout's global "
                 "batch %d; %s, so the epoch starts over (its schedule too) and those images "
                 "are trained again", point.epoch, point.exact_step, run.layout.global_batch, why)
        return
    size = run.data.train.order_size
    log.info("=> approximated: epoch %d was left after %d of its %d images, %.2f steps of this "
             "run's global batch %d; it continues with the %d images not yet trained, and the "
             "schedule from step %d of %d (less than a step away), so that the epoch ends "
             "exactly where a run with this layout throughout would", point.epoch, point.images,
             size, point.exact_step, run.layout.global_batch, size - point.images,
             point.step_in_epoch, steps)


def same_layout(run: Run, ckpt: dict[str, Any]) -> bool:
    """True when the checkpoint's world size, batch and accumulation match this run's."""
    return layout_kept(run.layout, ckpt)


