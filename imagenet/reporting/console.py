"""What the console tells a person around the training loop: the demo's settings and where
outputs go (start), what -e evaluates, and where a finished run's results are (start-up stages
that take a while: ``stages``). Every line goes through logging: rank 0 prints it, other ranks
drop it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from imagenet.settings.flags import DEMO_DEFAULTS, Config

if TYPE_CHECKING:
    from imagenet.run.build import Run

log = logging.getLogger(__name__)

def _flag(name: str) -> str:
    """The flag of a Config field as a user types it: '-b', '--lr'."""
    field = next(f for f in dataclasses.fields(Config) if f.name == name)
    return field.metadata["names"][0]


def startup_notes(cfg: Config) -> list[str]:
    """Lines for the start of a run: the demo's own settings, and outputs in the current folder."""
    notes = []
    if cfg.demo:
        settings = " ".join(f"{_flag(k)} {getattr(cfg, k)}" for k, v in DEMO_DEFAULTS.items()
                            if getattr(cfg, k) == v)
        notes.append(f"=> --demo: training on the built-in demo data in {cfg.data} (drawn "
                     "once, no download)")
        if settings:
            notes.append(f"=> --demo settings in place of the ImageNet defaults (flags you give "
                         f"win): {settings}")
    if not cfg.evaluate and Path(cfg.output_dir).resolve() == Path.cwd().resolve():
        notes.append(f"=> outputs (checkpoints, metrics.jsonl, config.json, tb/) go to the "
                     f"current folder {Path.cwd()} (--output-dir {cfg.output_dir}); give "
                     "--output-dir DIR to keep runs apart")
    return notes


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
    from imagenet.checkpoint import files

    out = run.output_dir.resolve()
    last = files.dcp_name(files.CHECKPOINT) if run.cfg.sharded_checkpoint else files.CHECKPOINT
    best = [f"{run.best.path.name} (best Acc@1 {run.best.acc1:.3f})"]
    if run.best_ema is not None:
        best.append(f"{run.best_ema.path.name} (EMA, best Acc@1 {run.best_ema.acc1:.3f})")
    log.info("=> outputs in %s: %s, %s (the last epoch; --resume auto continues it), "
             "metrics.jsonl, config.json", out, ", ".join(best), last)
    log.info("=> curves: tensorboard --logdir %s", out / "tb")
