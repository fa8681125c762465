"""Where a run's files go besides OUTPUT_DIR, and who hears of each checkpoint (``Run.outputs``).

- ``remote``: --output-dir / --resume on object storage (``storage``): OUTPUT_DIR is a local
  staging folder, which rank 0 fills before the resume and uploads after every save, every
  epoch's log lines and at the end.
- ``on_checkpoint``: ``imagenet.train``'s caller (``examples/ray_train.py`` reports to Ray
  Train), called on every rank after every save: the same number of times on every rank.
- ``resume_from``: a checkpoint that holds this run's latest state (Ray's
  ``get_checkpoint()``): rank 0 makes it OUTPUT_DIR/checkpoint.pth.tar (a --sharded-checkpoint
  directory: checkpoint.dcp/) before the resume, so the run continues it as its own,
  metrics.jsonl and TensorBoard record included.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import imagenet.checkpoint.rundir as rundir
from imagenet.checkpoint import files
from imagenet.launching.process_group import DistInfo, on_rank0
from imagenet.settings.flags import Config

if TYPE_CHECKING:  # object-storage URLs only: built by run.trainer when the plan has them
    from imagenet.checkpoint.storage import Remote

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Saved:
    """A checkpoint just written, as ``imagenet.train``'s ``on_checkpoint`` receives it."""

    path: Path  # rank 0's file (or --sharded-checkpoint directory); may not exist elsewhere
    rank: int
    epoch: int  # where a resume starts, as the checkpoint's "epoch": the next epoch when done
    step_in_epoch: int
    global_step: int
    epoch_done: bool  # trained and validated: written at the end of an epoch
    best_acc1: float


@dataclass
class Outputs:
    """What happens to a run's output besides OUTPUT_DIR (see the module docstring)."""

    remote: Remote | None = None
    on_checkpoint: Callable[[Saved], None] | None = None
    resume_from: Path | None = None
    written: Callable[[], object] | None = None  # waits until the last checkpoint is on disk
    _pending: Saved | None = None  # saved, not yet published (an epoch's end: its log first)

    def saved(self, saved: Saved) -> None:
        """After a save, before any rank goes on (or exits after a signal): rank 0 uploads,
        then every rank tells the caller. At the end of an epoch both wait for the epoch's
        metrics.jsonl line (``logged``): a checkpoint that is past an epoch is never published
        before that epoch's line, which a resume from it could not write again."""
        self._pending = saved
        if not saved.epoch_done:
            self.logged(saved.rank == 0)

    def logged(self, is_main: bool) -> None:
        """After an epoch's log lines (and a mid-epoch save): rank 0 uploads what changed, then
        every rank tells the caller of the checkpoint saved since the last call; both once the
        checkpoint is on disk (``written``: saves are written in the background)."""
        if self._pending is not None and self.written is not None and \
                (self.remote is not None or self.on_checkpoint is not None):
            self.written()
        if self.remote is not None and is_main:
            self.remote.push()
        saved, self._pending = self._pending, None
        if saved is not None and self.on_checkpoint is not None:
            self.on_checkpoint(saved)

    @property
    def fills_output_dir(self) -> bool:
        """OUTPUT_DIR is filled before the run reads it (``fill``): the same on every rank."""
        return self.remote is not None or self.resume_from is not None

    def fill(self, cfg: Config, dist: DistInfo, output_dir: Path, restarted: bool) -> None:
        """Before anything reads OUTPUT_DIR: rank 0 fills the staging folder from the URL and
        adopts ``resume_from`` (every rank raises its error). ``restarted``: torchrun
        restarted the job (it continues OUTPUT_DIR's checkpoint). Collective."""
        if self.fills_output_dir:
            on_rank0(dist, lambda: self.prepare(cfg, output_dir, restarted))

    @contextlib.contextmanager
    def uploading(self, dist: DistInfo) -> Iterator[None]:
        """Around the resume and the training: rank 0 uploads what is in the staging folder at
        the end, however the run ends, then frees the local copies the URLs now hold."""
        uploads = self.remote is not None and dist.is_main
        try:
            yield
        except BaseException:
            if uploads:
                with contextlib.suppress(Exception):  # the run's own error is the one to see
                    self.remote.push()  # type: ignore[union-attr]
                    self.remote.release()  # type: ignore[union-attr]
            raise
        if uploads:
            self.remote.push()  # type: ignore[union-attr]
            self.remote.release()  # type: ignore[union-attr]

    def prepare(self, cfg: Config, output_dir: Path, restarted: bool) -> None:
        """Rank 0: fill the staging folder from the URL, and adopt ``resume_from``."""
        if self.remote is not None:
            rundir.prepare_folder(output_dir)  # -e's (a training run's folder is claimed)
            own = str(output_dir / files.CHECKPOINT)
            continuing = cfg.resume in ("auto", own) or restarted
            self.remote.attach(continuing, training=not cfg.evaluate)
        if self.resume_from is not None and not cfg.evaluate:
            log.info("=> resuming from %s (the caller's checkpoint of this run)",
                     self.resume_from)
            source = Path(self.resume_from)
            if source.is_dir():  # --sharded-checkpoint's checkpoint.dcp/
                files.atomic_copy_dir(source, output_dir / files.dcp_name(files.CHECKPOINT))
            else:
                files.atomic_copy(source, output_dir / files.CHECKPOINT)
