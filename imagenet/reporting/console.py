"""What the console tells a person before a run starts: the demo's settings and where outputs go
(start-up stages that take a while: ``stages``; what a run says about itself: ``run.announce``).
Every line goes through logging: rank 0 prints it, other ranks drop it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from imagenet.settings.flags import DEMO_DEFAULTS, Config

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
