"""What a run says about itself: the derived settings at start-up (also stored in config.json),
what -e evaluates, and where a finished run's results are. Every line goes through logging:
rank 0 prints it, other ranks drop it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from imagenet.checkpoint import files
from imagenet.run.build import Run
from imagenet.settings.choices import tracker_names
from imagenet.training.cpu_features import native_bf16, slow_bf16_warning

log = logging.getLogger(__name__)


def describe(run: Run) -> dict[str, Any]:
    """Derived quantities, printed at start-up and stored in config.json."""
    d, layout = run.dist, run.layout
    info = {"world_size": d.world_size, "batch_per_process": layout.batch_size,
            "global_batch": layout.global_batch, "workers_per_process": layout.workers,
            "device": str(d.device), "backend": d.backend,
            "num_classes": run.data.num_classes,
            "train_images": run.data.train.images,
            "val_images": run.data.val_size,
            "steps_per_epoch": run.engine.opts.steps_per_epoch, "lr": run.cfg.lr}
    if run.plan.lr_rule is not None:
        info["lr_rule"] = run.plan.lr_rule
    if run.outputs.remote is not None and run.outputs.remote.output_url:
        info["output_url"] = run.outputs.remote.output_url  # output_dir: its staging folder
    if not run.cfg.evaluate:  # -e says what it evaluates once the weights are loaded
        log.info("=> %s on %s: global batch %d = %d process(es) x %d images x %d accumulation "
                 "step(s); %d loader worker(s) per process; %d classes, %d val images",
                 run.cfg.arch, d.device, layout.global_batch, d.world_size, layout.batch_size,
                 layout.grad_accum_steps, layout.workers, run.data.num_classes,
                 run.data.val_size)
        if run.plan.lr_rule is not None:
            log.info("=> learning rate %g = %s", run.cfg.lr, run.plan.lr_rule)
    slow_bf16 = slow_bf16_warning(run.cfg.amp, d.device.type, native_bf16())
    if slow_bf16 and d.is_main:
        log.warning("%s", slow_bf16)
    return info


def weights_source(run: Run, resumed: Path | None) -> str:
    """Where the evaluated weights come from."""
    cfg = run.cfg
    if resumed is not None:
        return f"checkpoint '{resumed}' (after {run.step.epoch} epoch(s))"
    if cfg.weights or cfg.pretrained:
        return f"torchvision weights {cfg.weights or 'DEFAULT'}"
    return "random initial weights"


def describe_evaluation(run: Run, resumed: Path | None) -> None:
    """What -e evaluates: the weights, the data, its images and classes, and how it runs."""
    cfg, d = run.cfg, run.dist
    data = ("synthetic --dummy data" if cfg.dummy else f"the images of {cfg.val_data}"
            if cfg.val_data else f"the validation split of {cfg.data}")
    log.info("=> evaluating %s with %s on %s: %d images, %d classes; batches of %d per process "
             "x %d process(es) on %s", cfg.arch, weights_source(run, resumed), data,
             run.data.val_size, run.data.num_classes, run.layout.batch_size, d.world_size,
             d.device)
    if resumed is None and not (cfg.weights or cfg.pretrained):
        log.warning("=> -e without --resume, --pretrained or --weights evaluates an untrained "
                    "model: expect chance accuracy")


def finished(run: Run) -> None:
    """Where a finished run's results are: the folder, the best checkpoint, the curves."""
    remote = run.outputs.remote
    out = remote.output_url if remote is not None and remote.output_url else \
        str(run.output_dir.resolve())
    last = files.dcp_name(files.CHECKPOINT) if run.cfg.sharded_checkpoint else files.CHECKPOINT
    best = [best_file(run.best.path, run.best.acc1)]
    if run.best_ema is not None:
        best.append(best_file(run.best_ema.path, run.best_ema.acc1, "EMA, "))
    log.info("=> outputs in %s: %s, %s (the last epoch; --resume auto continues it), "
             "metrics.jsonl, config.json", out, ", ".join(best), last)
    if "tensorboard" in tracker_names(run.cfg.log_to):
        log.info("=> curves: tensorboard --logdir %s/tb", out)


def best_file(path: Path, acc1: float, what: str = "") -> str:
    """A best file and its top-1 for the last line; or why the folder has none (a resume from
    another folder's checkpoint whose best no epoch here beat)."""
    if path.exists():
        return f"{path.name} ({what}best Acc@1 {acc1:.3f})"
    return (f"no {path.name} ({what}no epoch of this run beat the best Acc@1 {acc1:.3f} of "
            "the checkpoint it resumed, whose folder has that file)")
