"""--keep-checkpoints N: the N best epoch checkpoints by top-1, their scores in checkpoints.json.

``checkpoint_epoch012.pth.tar`` is the checkpoint saved at the end of the 12th epoch (its
``epoch`` key says 12, the epoch a resume from it starts; metrics.jsonl calls the epoch trained
11). With --sharded-checkpoint they are directories, ``checkpoint_epoch012.dcp``. They are kept
besides checkpoint.pth.tar and model_best.pth.tar, ranked by the model's validation top-1 (the
later epoch first at a tie). Rank 0 decides against what is on disk, so the history survives
resumes and restarts; a fresh run moves it to previous/ with the rest of the earlier run.

An epoch end writes, in this order: the index with the new set (``plan``), the epoch's file (a
hard link of the new checkpoint, in place before checkpoint.pth.tar is replaced, like the best
file), then deletes the files that left the set (``prune``). A kill anywhere leaves at worst an
index entry whose file never came (dropped when the index is read) or a file no entry names
(deleted by the next ``prune``); the files themselves are always whole.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from imagenet.checkpoint import files

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
    """The kept checkpoints whose files exist, best first ([] without a readable index)."""
    try:
        raw = json.loads((folder / files.HISTORY_INDEX).read_text())["checkpoints"]
        entries = [Entry(str(e["file"]), int(e["epoch"]), float(e["acc1"]),
                         int(e["global_step"])) for e in raw]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring %s (%s): the checkpoint history starts again from the files it "
                    "keeps", folder / files.HISTORY_INDEX, exc)
        return []
    return ranked(e for e in entries if (folder / e.file).exists())


def ranked(entries) -> list[Entry]:
    """Best top-1 first; at a tie the later epoch (trained longer) first."""
    return sorted(entries, key=lambda e: (-e.acc1, -e.epoch))


def plan(folder: Path, keep: int, entry: Entry) -> Path | None:
    """Rank 0 at an epoch's end: the index with ``entry`` among the ``keep`` best, written now;
    the path the epoch's checkpoint must be copied to (None: not among them)."""
    others = [e for e in read_index(folder) if e.epoch != entry.epoch]  # a retrained epoch
    kept = ranked([*others, entry])[:keep]
    index = {"keep": keep, "ranked_by": "val_acc1", "checkpoints": [asdict(e) for e in kept]}
    files.atomic_write_text(folder / files.HISTORY_INDEX, json.dumps(index, indent=1) + "\n")
    return folder / entry.file if entry in kept else None


def prune(folder: Path, sharded: bool) -> None:
    """Delete the epoch checkpoints of this kind (files, or --sharded-checkpoint directories)
    that the index no longer names (after the save: rank 0). The other kind is left alone: a
    kept directory's unsharded file, say."""
    named = {e.file for e in read_index(folder)}
    pattern = files.dcp_name(files.EPOCH_PATTERN) if sharded else files.EPOCH_PATTERN
    for path in folder.glob(pattern):
        if path.name in named:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        log.debug("--keep-checkpoints: removed %s", path)


def epoch_entry(epoch: int, acc1: float, global_step: int, sharded: bool) -> Entry:
    """The entry of the checkpoint saved after ``epoch`` epochs."""
    return Entry(epoch_name(epoch, sharded), epoch, float(acc1), global_step)
