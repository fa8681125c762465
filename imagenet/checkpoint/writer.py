"""Checkpoint writes that do not hold up training: the state is copied off the model at the step
boundary (``to_host``), and rank 0 writes it in a thread of its own (``Writer``) while training
goes on. One write at a time: a save waits for the previous one; a stop, a time limit and the
end of the run wait for the write under way (``run.checkpointing.finish_saves``), and so does a
process that exits meanwhile (the thread is not a daemon). The files appear atomically, as
before (``files.atomic_save``): a kill during the write leaves the previous checkpoint whole.

--keep-checkpoints N: the N best epoch checkpoints by top-1, their scores in checkpoints.json.

``checkpoint_epoch012.pth.tar`` is the checkpoint saved at the end of the 12th epoch (its
``epoch`` key says 12, the epoch a resume from it starts; metrics.jsonl calls the epoch trained
11). With --sharded-checkpoint they are directories, ``checkpoint_epoch012.dcp``. They are kept
besides checkpoint.pth.tar and model_best.pth.tar, ranked by the model's validation top-1 (the
later epoch first at a tie). Rank 0 decides against what is on disk, so the history survives
resumes and restarts; a fresh run moves it to previous/ with the rest of the earlier run.

An epoch end writes, in this order: the index with the new set and the entries it evicts
(``plan``), the epoch's file (a hard link of the new checkpoint, in place before
checkpoint.pth.tar is replaced, like the best file), then deletes the files that left the set and
the evicted entries with them (``prune``). A kill in between leaves the index with its evicted
entries: read then, the kept set is the best of both whose files exist, so an epoch end whose
file never came evicts nothing (the resume trains that epoch again, maybe to a lower score), and
one whose file came evicts as planned. A file no entry names is deleted by the next ``prune``;
the files themselves are always whole.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from imagenet.checkpoint import files


def to_host(obj: Any) -> Any:
    """A copy of ``obj`` that training may go on from: every tensor copied to the CPU, every
    container new (the optimizer's groups, the schedule's lists), numpy arrays copied."""
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach()
        return tensor.to("cpu", copy=True) if tensor.device.type != "cpu" else tensor.clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, Mapping):
        return {key: to_host(value) for key, value in obj.items()}
    if isinstance(obj, tuple):
        return tuple(to_host(value) for value in obj)
    if isinstance(obj, list):
        return [to_host(value) for value in obj]
    return obj


class Writer:
    """Rank 0's checkpoint writes, one at a time, in a thread of their own."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.seconds: float | None = None  # how long the last finished write took

    def submit(self, write: Callable[[], None]) -> None:
        """Start ``write`` once the write under way (if any) has finished; its error is raised
        by the next ``submit`` or ``wait``."""
        self.wait()

        def run() -> None:
            start = time.perf_counter()
            try:
                write()
            except BaseException as exc:  # raised in the training thread by wait()
                self.error = exc
            finally:
                self.seconds = time.perf_counter() - start

        self.thread = threading.Thread(target=run, name="checkpoint-writer")
        self.thread.start()

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def wait(self) -> float | None:
        """Wait for the write under way; raise its error; the seconds it took (None: none)."""
        thread, self.thread = self.thread, None
        if thread is None:
            return None
        thread.join()
        error, self.error = self.error, None
        if error is not None:
            raise error
        return self.seconds

    def wait_quietly(self) -> None:
        """``wait``, its error dropped: on a path that already ends with an error of its own."""
        try:
            self.wait()
        except Exception:
            pass


# ------------------------------------------- --keep-checkpoints N: the N best epoch checkpoints

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    """One kept checkpoint and its scores."""

    file: str
    epoch: int  # epochs done: the checkpoint's "epoch" key
    acc1: float  # validation top-1 of the model (not the EMA), percent
    global_step: int


def epoch_name(epoch: int, sharded: bool) -> str:
    """The file (or --sharded-checkpoint directory) name of the checkpoint after ``epoch``."""
    name = files.EPOCH_FILE.format(epoch)
    return files.dcp_name(name) if sharded else name


def read_index(folder: Path) -> list[Entry]:
    """The kept checkpoints whose files exist, best first ([] without a readable index); after
    an unfinished epoch end, the best ``keep`` of its kept and evicted entries."""
    try:
        index = json.loads((folder / files.HISTORY_INDEX).read_text())
        entries, evicting = (_entries(index.get(key, [])) for key in ("checkpoints", "evicting"))
        keep = int(index.get("keep", len(entries)))
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring %s (%s): the checkpoint history starts again from the files it "
                    "keeps", folder / files.HISTORY_INDEX, exc)
        return []
    present = [e for e in [*entries, *evicting] if (folder / e.file).exists()]
    return ranked(present)[:keep] if evicting else ranked(present)


def _entries(raw: list) -> list[Entry]:
    return [Entry(str(e["file"]), int(e["epoch"]), float(e["acc1"]), int(e["global_step"]))
            for e in raw]


def ranked(entries) -> list[Entry]:
    """Best top-1 first; at a tie the later epoch (trained longer) first."""
    return sorted(entries, key=lambda e: (-e.acc1, -e.epoch))


def plan(folder: Path, keep: int, entry: Entry) -> Path | None:
    """Rank 0 at an epoch's end: the index with ``entry`` among the ``keep`` best, written now;
    the path the epoch's checkpoint must be copied to (None: not among them)."""
    others = [e for e in read_index(folder) if e.epoch != entry.epoch]  # a retrained epoch
    kept = ranked([*others, entry])[:keep]
    evicted = [e for e in others if e not in kept]  # until ``prune``: see the module docstring
    write_index(folder, keep, kept, evicted)
    return folder / entry.file if entry in kept else None


def write_index(folder: Path, keep: int, kept: list[Entry], evicting: list[Entry]) -> None:
    """checkpoints.json, atomically."""
    index = {"keep": keep, "ranked_by": "val_acc1", "checkpoints": [asdict(e) for e in kept]}
    if evicting:
        index["evicting"] = [asdict(e) for e in evicting]
    files.atomic_write_text(folder / files.HISTORY_INDEX, json.dumps(index, indent=1) + "\n")


def prune(folder: Path, sharded: bool) -> None:
    """Delete the epoch checkpoints of this kind (files, or --sharded-checkpoint directories)
    that the index no longer names (after the save: rank 0). The other kind is left alone: a
    kept directory's unsharded file, say."""
    kept = read_index(folder)
    named = {e.file for e in kept}
    pattern = files.dcp_name(files.EPOCH_PATTERN) if sharded else files.EPOCH_PATTERN
    for path in folder.glob(pattern):
        if path.name in named:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        log.debug("--keep-checkpoints: removed %s", path)
    try:
        index = json.loads((folder / files.HISTORY_INDEX).read_text())
    except (OSError, ValueError):
        return
    if isinstance(index, dict) and index.get("evicting"):  # the epoch end is complete now
        write_index(folder, int(index.get("keep", len(kept))), kept, [])


def epoch_entry(epoch: int, acc1: float, global_step: int, sharded: bool) -> Entry:
    """The entry of the checkpoint saved after ``epoch`` epochs."""
    return Entry(epoch_name(epoch, sharded), epoch, float(acc1), global_step)
