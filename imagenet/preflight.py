"""Before the first training step: claim the output folder, keep an earlier run's record.

Rank 0 decides what only it sees (the output folder, its lock); every rank then raises the same
error, or none does, so no rank starts training while another has stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from imagenet import rundir
from imagenet.build import Run
from imagenet.checkpoint import files
from imagenet.config import Config
from imagenet.distributed import DistInfo, raise_agreed
from imagenet.errors import RunError, TrainerError

log = logging.getLogger(__name__)

Result = TypeVar("Result")


def on_rank0(info: DistInfo, check: Callable[[], Result]) -> Result | None:
    """``check()`` on rank 0; its TrainerError is raised on every rank. Collective."""
    error, result = None, None
    if info.is_main:
        try:
            result = check()
        except TrainerError as exc:
            error = exc
        except Exception as exc:
            # A bug: the other ranks must not wait for rank 0 forever; rank 0 keeps the cause.
            error = RunError(f"rank 0 failed its start-up checks ({type(exc).__name__}: {exc})")
            error.__cause__ = exc
    raise_agreed(error)
    return result


def claim_output_dir(cfg: Config, info: DistInfo) -> rundir.FolderLock:
    """Rank 0 makes OUTPUT_DIR, checks it can write there and takes its lock for the run; then
    (and only then) removes temp files a killed writer left. Collective.

    Called once the data and the model are built: a mistyped data folder leaves no trace.
    """
    folder = Path(cfg.output_dir)

    def claim() -> rundir.FolderLock:
        rundir.prepare_folder(folder)
        lock = rundir.lock_folder(folder)
        if lock.fd is not None:  # without a lock, a temp file may be another writer's
            files.remove_stale_temp_files(folder)
        return lock

    return on_rank0(info, claim) or rundir.FolderLock(folder / rundir.LOCK, None)


def check_before_training(run: Run, resumed: Path | None) -> None:
    """Rank 0 moves an earlier run's record aside. Collective."""
    on_rank0(run.dist, lambda: keep_history(run.output_dir, resumed))


def continues_folder(folder: Path, resumed: Path | None) -> bool:
    """True when the run resumes a checkpoint of OUTPUT_DIR, so it continues that record."""
    return resumed is not None and resumed.resolve().parent == folder.resolve()


def keep_history(folder: Path, resumed: Path | None) -> None:
    """A fresh run in a used folder: move the earlier run's record to previous/<start time>."""
    if continues_folder(folder, resumed):
        return
    moved = rundir.move_previous_run(folder)
    if moved is not None:
        log.info("=> %s held an earlier run: moved its checkpoints, metrics.jsonl, config.json "
                 "and tb/ to %s (this run starts fresh; --resume auto continues a run instead)",
                 folder, moved)
