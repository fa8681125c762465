"""One training process from start to end: build, resume, then the epoch loop (or -e)."""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torchvision
from torch import nn

import imagenet.checkpoint.rundir as rundir
import imagenet.data.transforms as transforms
import imagenet.launching.watchdog as watchdog
from imagenet.checkpoint.resume_from import Decided, decide
from imagenet.data.folder import shutdown_workers
from imagenet.data.index import image_check
from imagenet.data.prefetch import device_batches
from imagenet.errors import NonFiniteLossError, output_errors
from imagenet.launching.preemption import StopBetweenBatches, StopFlag, StopRequested
from imagenet.launching.process_group import DistInfo
from imagenet.reporting.logger import (
    FirstBatch,
    RunLogger,
    StartClock,
    print_val_progress,
    slow_stage,
)
from imagenet.run.build import Run, build_inputs, build_run, start_early
from imagenet.run.checkpointing import AfterStep, Checkpointer, resume
from imagenet.run.outputs import Outputs
from imagenet.run.preflight import (
    check_before_training,
    describe,
    describe_evaluation,
    finished,
    nothing_left,
)
from imagenet.run.stopping import Stop, cache_counts, keep_compiled
from imagenet.settings.failpoints import failpoint
from imagenet.settings.flags import get_args_parser
from imagenet.settings.images import image_backend
from imagenet.settings.plan import Plan
from imagenet.training.engine import EpochTotals, Hooks, Step, epoch_metrics, train_one_epoch
from imagenet.training.models import for_evaluation

if TYPE_CHECKING:  # validation is imported at the first one: nothing before the first step uses it
    from imagenet.evaluation.validate import Report

log = logging.getLogger(__name__)


def run_training(plan: Plan, dist: DistInfo, outputs: Outputs | None = None
                 ) -> dict[str, float]:
    """Train (or evaluate with -e) in this process; the entry point of every rank.

    ``outputs``: imagenet.train's caller's hooks (``imagenet.run.outputs``).
    """
    cfg, output_dir = plan.cfg, Path(plan.cfg.output_dir)
    outs = outputs or Outputs()
    if plan.staged is not None:  # object-storage URLs: mirrored through a local folder
        from imagenet.checkpoint.storage import Remote

        outs = replace(outs, remote=Remote.of(plan.staged))
    # Rank 0 of a training run holds OUTPUT_DIR's lock until the run ends (-e only reads). It
    # claims it once the data and the model are built (a mistyped data folder leaves no trace),
    # or first of all where OUTPUT_DIR is filled from elsewhere: an object-storage
    # --output-dir's staging folder, or the caller's checkpoint of this run.
    claims_first = outs.fills_output_dir and not cfg.evaluate
    with contextlib.ExitStack() as held:
        if claims_first:
            held.enter_context(rundir.claim_folder(output_dir, dist, plan.slurm_job))
        # Filled before anything reads OUTPUT_DIR: the check for a finished run, the early
        # start, -e --val-data's classes and the resume all see what the run continues.
        with output_errors(output_dir):
            outs.fill(cfg, dist, output_dir, plan.restarted)
        # The checkpoint the run continues, decided and read once (a --resume that does not
        # exist or cannot be read: an error now, before anything is built). Its read is the
        # start's "resume" stage, with applying it; the hang clock has not started yet.
        clock = StartClock.begin(plan.started)
        continues = decide(cfg.resume, output_dir, dist, cfg.sharded_checkpoint,
                           plan.restarted, repair=not cfg.evaluate)
        clock.mark("resume")
        finished = nothing_left(cfg, dist, continues)
        if finished:  # a chained job after the last epoch: leave at once
            log.info("%s", finished)
            return {}
        clock.mark("start")
        with contextlib.ExitStack() as services:  # ended before the output folder's claim
            run = start_run(plan, dist, continues, clock, services)
            run.outputs = replace(outs, written=run.writer.wait)
            if not (cfg.evaluate or claims_first):
                held.enter_context(rundir.claim_folder(output_dir, dist, plan.slurm_job))
            with output_errors(run.output_dir), run.outputs.uploading(dist):
                return resume_and_train(run)


def start_run(plan: Plan, dist: DistInfo, continues: Decided, clock: StartClock,
              services: contextlib.ExitStack) -> Run:
    """Build the run (``run.build``) with the start's services, each ended by ``services``:
    the training loader starts on the batches the resume will continue while the model is
    built (``run.build.start_early``), the validation images are checked in the background
    (awaited by ``preflight``), --compile's graphs of a previous start are found
    (``training.compile_cache``, opened before anything compiles). ``clock`` times each stage."""
    cfg = plan.cfg
    inputs = build_inputs(plan, dist, continues)
    data = inputs.data
    # Loader workers ignore SIGTERM (preemption.ignore_stop_signals): stopped here, or
    # multiprocessing's exit handler would terminate them in vain and wait forever.
    services.callback(shutdown_workers, data.train_loader, data.val_loader)
    clock.mark("data", data.listed)
    early = start_early(plan, data, continues.ckpt)
    val_check = None
    if not cfg.evaluate:  # checked before training (preflight), meanwhile in the background
        val_check = image_check(data.val_loader.dataset, dist.rank, dist.world_size,
                                image_backend(cfg))
    if val_check is not None:
        services.callback(val_check.cancel)
        val_check.start()
    compiled = None
    if cfg.compile:
        from imagenet.training.compile_cache import graph_signature, open_cache

        compiled = open_cache(plan.cache_dir, graph_signature(cfg, plan.layout, data.num_classes,
                                                              dist.device), dist.is_main)
    if compiled is not None:  # None: no cache of its own (TORCHINDUCTOR_CACHE_DIR is set)
        services.callback(compiled.close)
    run = build_run(plan, dist, continues, inputs, compiled)
    run.clock, run.early, run.val_check = clock, early, val_check
    clock.mark("model", "compiled graphs from the cache" if compiled and compiled.reused else "")
    return run


def recorded_recipe(path: str | None) -> dict[str, Any]:
    """config.json's record of the --config file (``recipe.record``); main.py's parser is
    built again only for a run that has one (to read the file as the flags did)."""
    if path is None:
        return {}
    from imagenet.settings.recipe import record

    return record(path, get_args_parser())


def resume_and_train(run: Run) -> dict[str, float]:
    """Resume, check that the run can finish, then train (or evaluate with -e)."""
    derived = describe(run)
    # The hang clock starts here: building the model and the data is the start-up stages'.
    # Loading a checkpoint does not count toward --hang-timeout (slow storage, a large file).
    watchdog.start_clock("built the model and the data")
    with watchdog.paused("resuming from the checkpoint (reading and loading it)"):
        resumed = resume(run)
    watchdog.beat("resumed")
    if run.clock is not None:
        run.clock.mark("resume", "" if resumed is None else resumed.name)
    if run.cfg.evaluate:
        describe_evaluation(run, resumed)
        return evaluate_only(run)
    with slow_stage("checking the disk space and every validation image") as stage:
        check_before_training(run, resumed)
        stage.done = "disk space and validation images checked"
    # Scalars are logged at the number of completed steps: the checkpoint's global_step is the
    # last one that counts; later ones came from a killed run and are purged, as are their
    # metrics.jsonl lines. (A fresh run finds no earlier record: it was moved aside.)
    step = run.step.global_step
    with RunLogger(run.output_dir, run.dist.is_main, purge_step=step + 1 if step else 0,
                   log_to=run.cfg.log_to) as logger:
        logger.drop_epochs_from(run.step.epoch)
        if run.last_record is not None and not logger.has_epoch(run.last_record["epoch"]):
            log_epoch(logger, run.step, run.last_record)  # killed between its save and line
        started = datetime.datetime.now().isoformat(timespec="seconds")
        logger.write_config(run.cfg.to_dict(), {**derived, "started": started,
                                                "run_id": run.run_id,
                                                "torchvision_models": torchvision.__version__,
                                                **recorded_recipe(run.cfg.config)})
        watchdog.phase("reading the augmented samples for TensorBoard")
        log_augmented_samples(run, logger)
        if run.clock is not None:
            run.clock.mark("checks")
        return train(run, logger)


def evaluate_only(run: Run) -> dict[str, float]:
    """-e: one validation pass; the reports in OUTPUT_DIR, the numbers (TensorBoard: and the
    confusion matrix) to --log-to, whose trackers get runs of their own, never the evaluated
    training run's."""
    with RunLogger(run.output_dir, run.dist.is_main, log_to=run.cfg.log_to,
                   continues=False) as logger:
        logger.tracked_config(run.cfg.to_dict())
        metrics = validate(run, run.engine.parts.model, report=report_of(run, logger, "eval"))
        logger.scalars("eval", {k: metrics[k] for k in ("acc1", "acc5", "loss")},
                       run.step.global_step)
        logger.flush()
    return metrics


def train(run: Run, logger: RunLogger) -> dict[str, float]:
    """The epoch loop: train, validate, save (the best files with it), log."""
    start, record = time.perf_counter(), {}
    with Stop(run) as stop, Checkpointer(run, stop.flag) as saves, NextEpoch(run) as upcoming:
        failpoint("train.start")  # a fault placed as training starts (tests)
        hooks = Hooks(on_progress=logger.progress_hook(),
                      after_step=first_step_timed(run, logger, saves.after_step))
        try:
            for epoch in range(run.step.epoch, run.cfg.epochs):
                run.step.epoch, steps_before = epoch, run.step.global_step
                record = train_epoch(run, stop, hooks, upcoming)
                upcoming.load(epoch + 1)  # no empty pipeline at the next epoch's start
                saves.trained(steps_before)  # before its validation: a stop there loses none
                # After the last epoch: predictions, per-class accuracy, confusion matrix.
                report = report_of(run, logger) if epoch == run.cfg.epochs - 1 else None
                validated = validate_epoch(run, stop.flag, report)
                stop.after_validation(record)  # --compile: the epoch's graphs counted, kept
                saves.epoch_done(validated, record)  # the best files first, the record with it
                run.step.step_in_epoch = 0
                log_epoch(logger, run.step, record)
                run.outputs.logged(run.dist.is_main)
                failpoint("epoch.end")  # a fault placed at an epoch's end, once saved (tests)
                stop.after_save()  # signalled during the save: the epoch is saved, stop now
            saves.finish()  # the last checkpoint is on disk before the run says it is done
        except StopRequested as exc:  # the one exit of a stopped run: every rank, saved
            raise stop.exit(*exc.args) from None
        except NonFiniteLossError as exc:
            raise saves.non_finite(exc) from None
    if record:
        logger.hparams({k: v for k, v in run.cfg.to_dict().items() if v is not None},
                       {"hparam/best_acc1": run.best.acc1, "hparam/val_acc1": record["val_acc1"],
                        "hparam/val_loss": record["val_loss"]}, run.step.global_step)
    log.info("=> done in %.1f s; best Acc@1 %.3f", time.perf_counter() - start, run.best.acc1)
    finished(run)
    return {"best_acc1": run.best.acc1, **record}


def train_epoch(run: Run, stop: Stop, hooks: Hooks, upcoming: NextEpoch) -> dict[str, Any]:
    """Train the rest of epoch ``run.step.epoch`` (all of it, unless resumed mid-epoch) on the
    batches ``upcoming`` holds for it, if any; its record. StopRequested: a stop before the
    epoch (no time to compile a new crop size's graphs) or during its training."""
    crop = transforms.announce(run.plan.crops, run.step.epoch, run.cfg.val_crop_size)
    stop.before_epoch(crop.get("train_crop_px"))
    trained = train_rest_of_epoch(run, hooks, upcoming.batches)
    upcoming.batches = None  # used up
    record = {"epoch": run.step.epoch, "lr": run.engine.parts.optimizer.param_groups[0]["lr"],
              **prefixed("train_", trained), **crop}
    stop.after_training()  # a signal stopped training: every rank saved this step's state
    return record


class NextEpoch:
    """The next epoch's batches, loading while this epoch validates and saves; closed on leaving
    when a stop or an error leaves them unused."""

    def __init__(self, run: Run) -> None:
        self.run, self.batches = run, None

    def __enter__(self) -> NextEpoch:
        return self

    def __exit__(self, *exc: object) -> None:
        close(self.batches)  # stopped before the next epoch: its batches are not needed

    def load(self, epoch: int) -> None:
        """Start loading epoch ``epoch``'s batches (``next_epoch_batches``), if there is one."""
        if epoch < self.run.cfg.epochs:
            self.batches = next_epoch_batches(self.run, epoch)


def train_rest_of_epoch(run: Run, hooks: Hooks, batches: Iterator | None = None
                        ) -> dict[str, float]:
    """Train the epoch from ``run.step.step_in_epoch`` on, continuing the same data order;
    the metrics of the whole epoch, every rank's (a resume's checkpoint holds the earlier part).
    ``batches``: the epoch's, already loading (``next_epoch_batches``)."""
    if run.train_totals is None:
        run.train_totals = EpochTotals.starting(run.dist.device)
    if run.step.step_in_epoch >= run.engine.opts.steps_per_epoch:
        # Resumed after the last step: only the validation is left.
        close(batches)
        return epoch_metrics(run.train_totals.of_job())
    if batches is None:
        batches = epoch_batches(run, run.step.epoch, run.images_trained())
    return train_one_epoch(run.engine, batches, run.step, hooks, run.train_totals)


def epoch_batches(run: Run, epoch: int, images: int) -> Iterator:
    """Epoch ``epoch``'s training batches after its first ``images`` images, on the device;
    their loading starts now (the workers prefetch, and with workers a thread decodes ahead:
    ``data.prefetch``), unless the start began it already (``run.build.EarlyBatches``)."""
    train = run.data.train
    train.continue_after(epoch, images)
    started = run.early.take((train.order_seed, train.aug_seed, epoch, images)) \
        if run.early is not None else None
    batches = started or FirstBatch(run.data.train_loader, run.layout.workers, "training")
    return iter(device_batches(batches, run.dist.device, run.data.train_finish,
                               threaded=run.layout.workers > 0))


def next_epoch_batches(run: Run, epoch: int) -> Iterator:
    """Epoch ``epoch``'s batches from its start, loading while this epoch validates and saves:
    the same batches in the same order as when the epoch begins (every sample's augmentation is
    a function of its seed, epoch and index), so a resume and an uninterrupted run agree."""
    return epoch_batches(run, epoch, 0)


def close(batches: Iterator | None) -> None:
    """Stop a batch thread that is no longer needed (see ``data.prefetch``)."""
    if batches is not None and hasattr(batches, "close"):
        batches.close()


def first_step_timed(run: Run, logger: RunLogger, after_step: AfterStep) -> AfterStep:
    """``after_step`` that also ends the start at its first step: the start-up line, the
    start's record in config.json; with --compile, the graphs compiled so far kept."""

    def timed(step: Step, check_finite: Callable[[], None]) -> bool:
        record = run.clock.first_step() if run.clock is not None else None
        if record is not None:
            if run.early is not None:
                record["notes"]["training_batches"] = run.early.outcome
            if run.cfg.compile:  # graphs compiled ("misses") and loaded by the first step
                record["compile_cache"] = cache_counts(run)
            log.info("%s", StartClock.line(record))
            logger.record_start(record)
        keep_compiled(run)
        return after_step(step, check_finite)

    return timed


def validate(run: Run, model: nn.Module, name: str = "", stop: StopFlag | None = None,
             report: Report | None = None) -> dict[str, float]:
    """Evaluate ``model`` on the whole validation set and print the classic summary line.

    With ``stop``, a signal ends it within a batch (StopRequested) on every rank. With
    ``report``, the per-image and per-class results are written too.
    """
    from imagenet.evaluation.validate import evaluate, for_validation

    loader = device_batches(FirstBatch(run.data.val_loader, run.layout.workers, "validation"),
                            run.dist.device, run.data.val_finish, threaded=run.layout.workers > 0)
    if stop is not None:
        # should_stop is collective: every rank asks as often as the largest shard has batches.
        largest_shard = math.ceil(run.data.val_size / run.dist.world_size)
        loader = StopBetweenBatches(loader, stop, math.ceil(largest_shard /
                                                            run.layout.batch_size))
    metrics = evaluate(run.engine, for_validation(for_evaluation(model), run.cfg), loader,
                       run.data.val_size,
                       partial(print_val_progress, ranks=run.dist.world_size)
                       if run.dist.is_main else None,
                       report.add if report is not None else None)
    log.info(" * %sAcc@1 %.3f Acc@5 %.3f  (%d images)", name, metrics["acc1"], metrics["acc5"],
             metrics["count"])
    if report is not None:
        report.finish(metrics, run.step.epoch, run.step.global_step)
    return metrics


def report_of(run: Run, logger: RunLogger | None = None, tag: str = "val") -> Report:
    """The per-image and per-class report of a validation of ``run``."""
    from imagenet.evaluation.validate import Report

    return Report(run.data, run.dist, run.output_dir, run.cfg.predictions, run.cfg.tta_flip,
                  logger, tag)


def validate_epoch(run: Run, stop: StopFlag, report: Report | None = None
                   ) -> dict[str, dict[str, float]]:
    """The model's validation metrics (key ""), and its EMA's ("ema_") with --model-ema;
    ``report``: the model's per-image and per-class results. StopRequested: a stop during it."""
    try:
        validated = {"": validate(run, run.engine.parts.model, "", stop, report)}
        if run.engine.parts.ema is not None:
            validated["ema_"] = validate(run, run.engine.parts.ema, "EMA ", stop)
    except StopRequested:  # validation is not saved state; the trained epoch is
        raise StopRequested("during the validation of") from None
    return validated


def prefixed(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` with every key prefixed."""
    return {f"{prefix}{k}": v for k, v in metrics.items()}


def log_epoch(logger: RunLogger, step: Step, record: dict[str, Any]) -> None:
    """Per-epoch TensorBoard scalars and one metrics.jsonl line.

    The scalars are logged at the global step (the epoch is a scalar too), like the per-step
    ones: a resume purges every tag after the checkpoint's step, so no curve gets a backwards
    point. The scalars are on disk before the line: the epoch's checkpoint is already written,
    so a kill in between is mended by the resume, which finds no line and logs both again (at
    worst a point twice, at the same step with the same value; never one missing).
    """
    for prefix in ("train_", "val_", "ema_val_"):  # "val_" does not match "ema_val_"
        values = {k[len(prefix):]: v for k, v in record.items() if k.startswith(prefix)}
        logger.scalars(f"epoch/{prefix[:-1]}", values, step.global_step)
    logger.scalars("epoch", {k: record[k] for k in ("epoch", "lr", "best_acc1", "best_ema_acc1")
                             if k in record}, step.global_step)
    logger.flush()
    failpoint("log.epoch")  # a fault placed between an epoch's two records (tests)
    logger.epoch(record)  # last: a resume that finds no line writes the scalars again
    if "train_images_per_sec" in record:
        wait, compiled = record.get("train_data_wait"), record.get("compiled_graphs")
        loaded = record.get("compile_cache_hits")
        memory = record.get("train_max_mem_gb")
        log.info("=> epoch %d trained at %.1f img/s%s%s%s", record["epoch"],
                 record["train_images_per_sec"],
                 "" if wait is None else f", waiting for data {100 * wait:.0f}% of the time",
                 "" if compiled is None else f"; {compiled} graph(s) compiled" if not loaded
                 else f"; {compiled} graph(s) traced, their code loaded from the compile cache "
                      f"({loaded} hit(s), {record['compile_cache_misses']} miss(es))",
                 "" if memory is None else f"; peak device memory {memory:.1f} GB")


def log_augmented_samples(run: Run, logger: RunLogger, count: int = 16) -> None:
    """A grid of training images as the model sees them, once at start (rank 0)."""
    if not run.dist.is_main or run.cfg.dummy:
        return
    images = run.data.train.preview(run.step.epoch, count)
    grid = torchvision.utils.make_grid(images, nrow=8)
    logger.images("train/augmented_samples", grid, run.step.global_step)
