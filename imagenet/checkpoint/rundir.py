"""The output folder belongs to one run at a time: its lock, its history, its write checks, and
the checkpoint writes rank 0 makes into it in the background (``Writer``; --keep-checkpoints).

Only the writer (global rank 0 of a training run) takes the lock; ``-e`` and the tools read
without it and never delete anything. The lock is a POSIX record lock (``fcntl.lockf``) on
OUTPUT_DIR/.run.lock: the kernel drops it when the process dies, even by SIGKILL, so it is never
stale; it is not inherited by forked DataLoader workers; and NFS (v3 via lockd, v4 natively),
Lustre mounted with ``-o flock``, GPFS and CephFS share it between hosts. Where the filesystem
refuses locks, or is mounted so that they stay local to one host, the run says so and goes on.

A fresh run never erases an earlier run's record: checkpoints, metrics.jsonl, config.json, tb/
and trackers.json (its MLflow/W&B run ids) are moved to OUTPUT_DIR/previous/<start time of that
run>/ first (a sharded checkpoint that a kill left aside as .checkpoint.dcp.old too, under its
own name when it is the only one). Only a resume from a checkpoint of this folder continues its
record.

Checkpoint writes that do not hold up training: the state is copied off the model at the step
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

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from imagenet.checkpoint import files
from imagenet.errors import RunError, UsageError
from imagenet.launching.process_group import DistInfo, on_rank0
from imagenet.reporting.logger import CONFIG, METRICS, REPORTS, RUN_IDS

log = logging.getLogger(__name__)

LOCK = ".run.lock"
PREVIOUS = "previous"
TENSORBOARD = "tb"
# --sharded-checkpoint directories (a kill while one was replaced leaves the old one aside).
DIRECTORIES = tuple(files.dcp_name(n) for n in (files.CHECKPOINT, files.BEST, files.BEST_EMA))
# What one run writes; moved aside together when a fresh run starts in a used folder.
RECORD = (files.CHECKPOINT, files.BEST, files.BEST_EMA, METRICS, CONFIG, TENSORBOARD, RUN_IDS,
          *DIRECTORIES, *(files.aside(Path(n)).name for n in DIRECTORIES), files.HISTORY_INDEX,
          *REPORTS)
# --keep-checkpoints' epoch checkpoints (files, or --sharded-checkpoint directories)
RECORD_PATTERNS = (files.EPOCH_PATTERN, files.dcp_name(files.EPOCH_PATTERN))
# lockf's answers on filesystems without (working) locks: NFS without lockd, some FUSE, Lustre
# mounted without -o flock.
NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}
# FUSE filesystems whose locks are local to the host that mounted them.
HOST_LOCAL_FUSE = {"fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "fuse.goofys"}


@dataclass
class FolderLock:
    """The open lock file of OUTPUT_DIR; the lock lasts as long as it is open."""

    path: Path
    fd: int | None  # None: not held here (another rank's job, or a filesystem without locks)

    def release(self) -> None:
        """Close the lock file (which releases the lock); the file itself stays."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


def prepare_folder(folder: Path) -> None:
    """Create OUTPUT_DIR if needed and make sure this process can write files in it."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--output-dir {folder} is a file, not a folder; give a folder for the "
                         "checkpoints and logs")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--output-dir {folder}: cannot create it ({exc.strerror}); give a "
                         "folder you can write") from None
    probe = folder / f".write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--output-dir {folder} is not writable ({exc.strerror}); give a folder "
                         "you can write, or fix its permissions") from None


def lock_folder(folder: Path, slurm_job: str | None = None) -> FolderLock:
    """Take OUTPUT_DIR's lock for this process's life, or refuse naming the run that holds it."""
    path = folder / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise UsageError(f"cannot open the lock file {path} ({exc.strerror}); give a folder "
                         "you can write") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            raise RunError(f"--output-dir {folder} is in use by another run ({holder(path)}); "
                           "wait for it to end, or give another --output-dir") from None
        if exc.errno not in NO_LOCKS:
            raise
        log.warning("cannot lock %s (%s): this filesystem does not support file locks, so a "
                    "second run on this folder would not be refused; do not start two",
                    path, exc.strerror)
        return FolderLock(path, None)
    caveat = host_local_locks(folder)
    if caveat:
        log.warning("file locks on %s are seen by this host only (%s): a run started on "
                    "another host would not be refused", folder, caveat)
    with contextlib.suppress(OSError):  # a full disk: said by the space check, not here
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder_record(slurm_job)).encode() + b"\n")
    return FolderLock(path, fd)


def claim_folder(folder: Path, info: DistInfo, slurm_job: str | None = None) -> FolderLock:
    """Rank 0 makes ``folder`` (OUTPUT_DIR), checks it can write there and takes its lock for the
    run; then (and only then) removes temp files a killed writer left. Collective.

    Called once the data and the model are built: a mistyped data folder leaves no trace. Where
    OUTPUT_DIR is filled before the run reads it (an object-storage --output-dir's staging
    folder, a caller's checkpoint: ``run.outputs``), before that.
    """

    def claim() -> FolderLock:
        prepare_folder(folder)
        lock = lock_folder(folder, slurm_job)
        if lock.fd is not None:  # without a lock, a temp file may be another writer's
            files.remove_stale_temp_files(folder)
        return lock

    return on_rank0(info, claim) or FolderLock(folder / LOCK, None)


def holder_record(slurm_job: str | None = None) -> dict[str, object]:
    """Who holds the lock, as written into the lock file (``slurm_job``: its SLURM job id)."""
    record: dict[str, object] = {"host": socket.gethostname(), "pid": os.getpid(),
                                 "started": datetime.datetime.now().isoformat(timespec="seconds")}
    if slurm_job:
        record["slurm_job"] = slurm_job
    return record


def holder(path: Path, tries: int = 10) -> str:
    """The lock file's holder, for the refusal message."""
    for _ in range(tries):  # the holder writes its name just after locking: wait a moment
        try:
            record = json.loads(path.read_text())
            text = f"host {record['host']}, pid {record['pid']}, started " \
                   f"{str(record['started']).replace('T', ' ')}"
            return text + (f", SLURM job {record['slurm_job']}" if "slurm_job" in record else "")
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.1)
    return f"its holder is not named in {path}"


def host_local_locks(folder: Path, mountinfo: str | None = None) -> str | None:
    """Why locks on ``folder``'s filesystem would not be seen from other hosts, if they would not.

    From /proc/self/mountinfo: NFS mounted with ``nolock`` / ``local_lock=``, Lustre mounted with
    ``localflock``, FUSE filesystems that lock locally only.
    """
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    target, best = str(folder.resolve()), None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 10:
            continue
        mount_point = fields[4].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) >= len(best[0])):
            best = (mount_point, line)
    if best is None:
        return None
    mount_options = best[1].split()[5].split(",")
    fstype, _source, super_options = best[1].split(" - ", 1)[1].split()[:3]
    options = set(mount_options) | set(super_options.split(","))
    if fstype.startswith("nfs"):
        local = sorted(o for o in options if o in ("nolock", "local_lock=all",
                                                   "local_lock=posix"))
        return f"{fstype} mounted with {local[0]}" if local else None
    if fstype == "lustre" and "localflock" in options:
        return "lustre mounted with localflock"
    if fstype in HOST_LOCAL_FUSE:
        return f"{fstype} keeps locks on the host that takes them"
    return None


def move_previous_run(folder: Path) -> Path | None:
    """Move an earlier run's record to OUTPUT_DIR/previous/<its start time>; returns that folder.

    A rename within the folder's filesystem: instant, and nothing is copied or deleted.
    """
    present = [folder / name for name in RECORD if (folder / name).exists()]
    present += sorted(path for pattern in RECORD_PATTERNS for path in folder.glob(pattern))
    if not present:
        return None
    stamp = started_at(folder, present).strftime("%Y-%m-%d_%H-%M-%S")
    dest = folder / PREVIOUS / stamp
    for n in range(2, 1000):
        if not dest.exists():
            break
        dest = folder / PREVIOUS / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    for path, name in [(path, kept_name(path, folder)) for path in present]:  # names first
        os.replace(path, dest / name)
    return dest


def kept_name(path: Path, folder: Path) -> str:
    """The name ``path`` keeps in previous/: its own, except for a directory a kill left aside
    (.checkpoint.dcp.old) with no directory of its own name: that is the run's checkpoint."""
    for name in DIRECTORIES:
        if path.name == files.aside(Path(name)).name and not (folder / name).exists():
            return name
    return path.name


def started_at(folder: Path, present: list[Path]) -> datetime.datetime:
    """When the run recorded in ``folder`` started: config.json says so (written at start)."""
    try:
        started = json.loads((folder / CONFIG).read_text())["started"]
        return datetime.datetime.fromisoformat(started)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # an older or damaged config.json: its time of writing is the run's start
    config = folder / CONFIG
    when = config.stat().st_mtime if config.is_file() else min(p.stat().st_mtime for p in present)
    return datetime.datetime.fromtimestamp(when)


# -------------------------------------------------- checkpoint writes that do not hold up training

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
