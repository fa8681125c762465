"""run(): wires the pieces together - the epoch loop, best tracking, checkpoints."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from torch import nn

from imagenet import checkpoint as ckpt_io
from imagenet import ddp
from imagenet.config import Config
from imagenet.data import Data, build_data, shutdown_workers
from imagenet.distributed import DistInfo
from imagenet.engine import Step, TrainContext, evaluate, train_one_epoch
from imagenet.errors import Preempted
from imagenet.logger import RunLogger
from imagenet.models import build_model
from imagenet.optim import build_criterion, build_ema, build_optimizer, build_scheduler
from imagenet.preemption import StopFlag
from imagenet.progress import print_train_progress, print_val_progress
from imagenet.runstate import resume, save

log = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything one training process holds."""

    cfg: Config
    dist: DistInfo
    output_dir: Path
    data: Data
    ctx: TrainContext
    raw_model: nn.Module  # unwrapped: what checkpoints hold
    logger: RunLogger
    step: Step
    best_acc1: float = 0.0
    best_ema_acc1: float = 0.0  # --model-ema: the EMA weights' best top-1
    aug_seed: int = 0


def seed_process(seed: int | None, deterministic: bool) -> None:
    """Seed python, numpy and torch in this process; deterministic kernels when seeded."""
    if seed is None:
        torch.backends.cudnn.benchmark = True
        return
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def data_root(cfg: Config, output_dir: Path) -> Path:
    """The dataset folder: DIR, or the built-in demo data generated under OUTPUT_DIR."""
    if not cfg.demo:
        return Path(cfg.data)
    from imagenet.demo import make_demo_dataset

    return make_demo_dataset(output_dir / "demo-data")


def amp_dtype(cfg: Config) -> torch.dtype | None:
    """torch dtype of --amp."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp or "")


def batch_transform(cfg: Config, num_classes: int) -> Callable | None:
    """MixUp and/or CutMix (torchvision v2), applied to the device batch."""
    from torchvision.transforms import v2

    chosen = []
    if cfg.mixup_alpha > 0:
        chosen.append(v2.MixUp(alpha=cfg.mixup_alpha, num_classes=num_classes))
    if cfg.cutmix_alpha > 0:
        chosen.append(v2.CutMix(alpha=cfg.cutmix_alpha, num_classes=num_classes))
    if not chosen:
        return None
    return chosen[0] if len(chosen) == 1 else v2.RandomChoice(chosen)


def build_run(cfg: Config, dist: DistInfo, batch_size: int, workers: int) -> Run:
    """Data, model, optimizer and loggers for this process (no resume yet)."""
    output_dir = Path(cfg.output_dir)
    if dist.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        ckpt_io.remove_stale_temp_files(output_dir)
    # Model init uses the same seed on every rank; augmentation gets its own per-sample seeds.
    seed_process(cfg.seed, deterministic=cfg.seed is not None)
    aug_seed = cfg.seed if cfg.seed is not None else random.SystemRandom().randrange(2**31)
    data = build_data(cfg, data_root(cfg, output_dir), dist.rank, dist.world_size, batch_size,
                      workers, aug_seed, pin_memory=dist.device.type == "cuda")
    raw = build_model(cfg.arch, data.num_classes, cfg.pretrained, cfg.weights).to(dist.device)
    if cfg.channels_last:
        raw = raw.to(memory_format=torch.channels_last)
    model = ddp.wrap(raw, cfg, dist)
    if cfg.seed is not None:  # per-rank stream for dropout / MixUp in the training step
        torch.manual_seed(cfg.seed + dist.rank)
    steps = -(-len(data.train_loader) // cfg.grad_accum_steps)
    optimizer = build_optimizer(raw, cfg)
    scaler = torch.amp.GradScaler(dist.device.type) if cfg.amp == "fp16" else None
    ctx = TrainContext(
        model=model, criterion=build_criterion(cfg), optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg, steps), device=dist.device,
        steps_per_epoch=steps, world_size=dist.world_size, amp_dtype=amp_dtype(cfg),
        scaler=scaler, channels_last=cfg.channels_last, grad_accum_steps=cfg.grad_accum_steps,
        clip_grad_norm=cfg.clip_grad_norm, batch_transform=batch_transform(cfg, data.num_classes),
        ema=build_ema(raw, cfg, dist.world_size, batch_size), ema_steps=cfg.model_ema_steps,
        ema_warmup_epochs=cfg.lr_warmup_epochs,
        print_freq=cfg.print_freq, epochs=cfg.epochs, on_print=print_train_progress)
    return Run(cfg, dist, output_dir, data, ctx, raw, RunLogger(output_dir, False),
               Step(epoch=cfg.start_epoch), aug_seed=aug_seed)


def validate(run: Run, model: nn.Module, name: str = "") -> dict[str, float]:
    """Evaluate ``model`` on the whole validation set and print the classic summary line."""
    metrics = evaluate(model, run.data.val_loader, run.ctx.criterion, run.dist.device,
                       run.data.val_size, run.cfg.channels_last, run.ctx.amp_dtype,
                       run.cfg.print_freq, print_val_progress if run.dist.is_main else None)
    log.info(" * %sAcc@1 %.3f Acc@5 %.3f  (%d images)", name, metrics["acc1"], metrics["acc5"],
             metrics["count"])
    return metrics


def make_after_step(run: Run, stop_flag: StopFlag) -> Callable:
    """Mid-epoch saving (--save-every) and preemption, checked after each optimizer step."""

    def after_step(step: Step, check_finite: Callable[[], None]) -> bool:
        stop = stop_flag.should_stop()
        every = run.cfg.save_every
        if stop or (every and step.step_in_epoch % every == 0
                    and step.step_in_epoch < run.ctx.steps_per_epoch):
            check_finite()
            save(run, is_best=False)
        return stop

    return after_step


def train_rest_of_epoch(run: Run) -> dict[str, float]:
    """Train the epoch from ``run.step.step_in_epoch`` on, continuing the same data order."""
    if run.step.step_in_epoch >= run.ctx.steps_per_epoch:
        return {}  # resumed after the last step: only the validation is left
    batches_done = run.step.step_in_epoch * run.cfg.grad_accum_steps
    run.data.train_sampler.set_epoch(run.step.epoch,
                                     start=batches_done * run.data.train_loader.batch_size)
    return train_one_epoch(run.ctx, run.data.train_loader, run.step)


def train(run: Run, stop_flag: StopFlag) -> dict[str, float]:
    """The epoch loop: train, validate, track the best, checkpoint, log."""
    cfg, ctx = run.cfg, run.ctx
    ctx.after_step = make_after_step(run, stop_flag)
    last: dict[str, float] = {}
    for epoch in range(run.step.epoch, cfg.epochs):
        run.step.epoch = epoch
        train_metrics = train_rest_of_epoch(run)
        if stop_flag.stopping:  # after_step saved this step's state on every rank
            stop_flag.drain()
            raise Preempted(f"stopped by {stop_flag.requested or 'a signal on another rank'} at "
                            f"epoch {epoch} step {run.step.step_in_epoch}; checkpoint saved in "
                            f"{run.output_dir}; resume with --resume auto")
        val = validate(run, ctx.model)
        record: dict[str, Any] = {"epoch": epoch, "lr": ctx.optimizer.param_groups[0]["lr"],
                                  **{f"train_{k}": v for k, v in train_metrics.items()},
                                  **{f"val_{k}": v for k, v in val.items()}}
        is_best = improves(val["acc1"], run.best_acc1, run.output_dir / ckpt_io.BEST)
        run.best_acc1 = max(val["acc1"], run.best_acc1)
        record["best_acc1"] = run.best_acc1
        is_best_ema = False
        if ctx.ema is not None:
            ema = validate(run, ctx.ema, name="EMA ")
            record.update({f"ema_val_{k}": v for k, v in ema.items()})
            is_best_ema = improves(ema["acc1"], run.best_ema_acc1,
                                   run.output_dir / ckpt_io.BEST_EMA)
            run.best_ema_acc1 = max(ema["acc1"], run.best_ema_acc1)
            record["best_ema_acc1"] = run.best_ema_acc1
        save(run, is_best, epoch_done=True, is_best_ema=is_best_ema)
        run.step.step_in_epoch = 0
        log_epoch(run, record)
        last = record
    stop_flag.drain()
    return last


def improves(acc1: float, best: float, best_file: Path) -> bool:
    """Whether this epoch's weights become the best file: top-1 beat the best so far, or nothing
    has scored yet and there is no best file (a first epoch at 0% still gets one)."""
    return acc1 > best or (best == 0.0 and not best_file.is_file())


def log_epoch(run: Run, record: dict[str, Any]) -> None:
    """Per-epoch TensorBoard scalars and one metrics.jsonl line.

    The scalars are logged at the global step (the epoch is a scalar too), like the per-step
    ones: a resume purges every tag from the checkpoint's step on, so no curve gets a duplicate
    or backwards point.
    """
    step = run.step.global_step
    for prefix in ("train_", "val_", "ema_val_"):  # "val_" does not match "ema_val_"
        values = {k[len(prefix):]: v for k, v in record.items() if k.startswith(prefix)}
        run.logger.scalars(f"epoch/{prefix[:-1]}", values, step)
    run.logger.scalars("epoch", {k: record[k] for k in ("epoch", "lr", "best_acc1",
                                                        "best_ema_acc1") if k in record}, step)
    run.logger.epoch(record)
    run.logger.flush()


def log_augmented_samples(run: Run, count: int = 16) -> None:
    """A grid of training images as the model sees them, once at start (rank 0)."""
    if not run.dist.is_main or run.cfg.dummy:
        return
    dataset = run.data.train_loader.dataset
    indices = run.data.train_sampler.indices()[:count]
    images = torch.stack([dataset[(run.step.epoch, i)][0] for i in indices])
    grid = torchvision.utils.make_grid(images, nrow=8)
    run.logger.images("train/augmented_samples", grid, run.step.global_step)


def describe(run: Run, batch_size: int, workers: int) -> dict[str, Any]:
    """Derived quantities, printed at start-up and stored in config.json."""
    d = run.dist
    info = {"world_size": d.world_size, "batch_per_process": batch_size,
            "global_batch": batch_size * d.world_size * run.cfg.grad_accum_steps,
            "workers_per_process": workers, "device": str(d.device), "backend": d.backend,
            "num_classes": run.data.num_classes,
            "train_images": len(run.data.train_sampler.indices()) * d.world_size,
            "val_images": run.data.val_size,
            "steps_per_epoch": run.ctx.steps_per_epoch}
    log.info("=> %s on %s: global batch %d = %d process(es) x %d images x %d accumulation "
             "step(s); %d loader worker(s) per process; %d classes, %d val images",
             run.cfg.arch, d.device, info["global_batch"], d.world_size, batch_size,
             run.cfg.grad_accum_steps, workers, run.data.num_classes, run.data.val_size)
    return info


def run_training(cfg: Config, dist: DistInfo, batch_size: int, workers: int) -> dict[str, float]:
    """Train (or evaluate with -e) in this process; the entry point of every rank."""
    run = build_run(cfg, dist, batch_size, workers)
    try:
        return train_or_evaluate(run, batch_size, workers)
    finally:
        # Loader workers ignore SIGTERM (preemption.ignore_stop_signals): stop them here, or
        # multiprocessing's exit handler would terminate them in vain and wait forever.
        shutdown_workers(run.data.train_loader, run.data.val_loader)


def train_or_evaluate(run: Run, batch_size: int, workers: int) -> dict[str, float]:
    """Resume, then validate (-e) or train to the last epoch."""
    cfg, dist = run.cfg, run.dist
    info = describe(run, batch_size, workers)
    resume(run)
    if cfg.evaluate:
        return validate(run, run.ctx.model)
    # Scalars are logged at the number of completed steps: the checkpoint's global_step is the
    # last one that counts; later ones came from a killed run (or, starting fresh in a used
    # folder, from an older run) and are purged, as are their metrics.jsonl lines.
    step = run.step.global_step
    run.logger = RunLogger(run.output_dir, dist.is_main, purge_step=step + 1 if step else 0)
    run.logger.drop_epochs_from(run.step.epoch)
    run.logger.write_config(cfg.to_dict(), {**info, "torchvision_models": torchvision.__version__})
    run.ctx.on_print = _tb_progress(run) if dist.is_main else None
    log_augmented_samples(run)
    stop_flag = StopFlag()
    stop_flag.install()
    start = time.perf_counter()
    try:
        last = train(run, stop_flag)
    finally:
        stop_flag.uninstall()
        run.logger.close()
    if last and dist.is_main:
        final = {"hparam/best_acc1": run.best_acc1, "hparam/val_acc1": last["val_acc1"],
                 "hparam/val_loss": last["val_loss"]}
        logger = RunLogger(run.output_dir, True)
        logger.hparams({k: v for k, v in cfg.to_dict().items() if v is not None}, final,
                       run.step.global_step)
        logger.close()
    log.info("=> done in %.1f s; best Acc@1 %.3f", time.perf_counter() - start, run.best_acc1)
    return {"best_acc1": run.best_acc1, **last}


def _tb_progress(run: Run) -> Callable[[dict], None]:
    """Print the progress line and send the step scalars to TensorBoard."""

    def on_print(record: dict) -> None:
        print_train_progress(record)
        run.logger.scalars("step", {k: record[k] for k in ("loss", "lr", "images_per_sec",
                                                             "data_wait")},
                           record["global_step"])

    return on_print
