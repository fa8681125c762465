"""Exceptions that the entry points turn into one message and an exit code (``report``), and
the one line for a write into the output folder that failed.

A write that fails - the disk full, the folder gone or read-only, no permission, an I/O error -
becomes one ``RunError`` that names the file (a checkpoint, metrics.jsonl, TensorBoard's events,
a report) and what to do, whatever file it was: never a traceback (``output_errors``). The
output folder's free space and the file size limit are read here too (the preflight's check).
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import os
import resource
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

INTERRUPTED_EXIT_CODE = 130  # Ctrl-C before anything could be saved: the shell's code for SIGINT


class TrainerError(Exception):
    """A problem the user can fix; the message says what and how."""

    exit_code = 1
    label = "error"  # what the one line starts with

    def __init__(self, message: str = "") -> None:
        # A DataLoader worker's error is re-raised in the main process as
        # ``type(exc)("Caught X in DataLoader worker ...\nOriginal Traceback ...")``; keep only
        # the original one-line message so users see it, not a worker traceback.
        if "Original Traceback" in message:
            last = [line for line in message.strip().splitlines() if line.strip()][-1]
            message = last.split(": ", 1)[1] if ": " in last else last
        super().__init__(message)


def show_crash_stacks() -> None:
    """On a crash in C code (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL), print every thread's
    Python stack to stderr: a launcher then shows where the process was, not only its exit
    code (-11). Left as it is where already on, or where stderr is no file (a notebook)."""
    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable(all_threads=True)
    except (ValueError, RuntimeError, AttributeError, OSError):
        pass


def report(exc: TrainerError, debug: bool = False, rank: int = 0) -> int:
    """Print the one ``error:`` line (after the traceback with --debug); return the exit code."""
    if debug:
        traceback.print_exc()
    say_error(str(exc), rank, exc.label)
    return exc.exit_code


def say_error(message: str, rank: int = 0, label: str = "error") -> None:
    """Write one ``error:`` (or ``label:``) line to stderr in a single write.

    The ranks of a node share one stderr; with PYTHONUNBUFFERED ``print`` writes the text and
    its newline separately, so two ranks' lines could run together on one line.
    """
    tag = "" if rank == 0 else f"[rank {rank}] "
    sys.stderr.write(f"{tag}{label}: {message}\n")
    sys.stderr.flush()


def on_every_rank(exc: TrainerError) -> TrainerError:
    """Mark ``exc`` as raised by every rank at the same point (decided together, e.g. after an
    all-reduce): no rank has to tell the others (``failures``)."""
    exc.on_every_rank = True  # type: ignore[attr-defined]
    return exc


class UsageError(TrainerError):
    """Bad flags or paths on the command line (exit code 2, like argparse)."""

    exit_code = 2


class RunError(TrainerError):
    """A failure while running: data, checkpoint, distributed or numerical (exit code 1)."""

    exit_code = 1


class DataError(RunError):
    """A data set or image that cannot be used."""


class CheckpointError(RunError):
    """A checkpoint that cannot be read or does not fit the model."""


class DistributedError(RunError):
    """Processes that cannot find or talk to each other."""


class NonFiniteLossError(RunError):
    """The loss became NaN or infinite."""


class Preempted(RunError):
    """A signal asked the run to stop; a checkpoint was saved so a requeue resumes."""

    exit_code = 143  # documented in README: same as a process killed by SIGTERM


class TimeLimitReached(Preempted):
    """--time-limit stopped the run in time to save; the next job resumes (exit code 143 too:
    a requeue or the next job of a chain continues it, as after a preemption)."""

    label = "time limit"


class NonFiniteStateError(RunError):
    """Weights, BatchNorm statistics or optimizer state became NaN or infinite."""


def first_line(exc: BaseException) -> str:
    """``exc`` as one line: its type and the first line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


# ------------------------------------------------------ the output folder's disk and a failed write

FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # no space, quota, file size limit
# What a write into the output folder can meet besides a full disk, and what to say about it.
BROKEN = {errno.EROFS: "the file system is read-only now (remounted read-only after an error?)",
          errno.EACCES: "permission denied (the folder's permissions changed?)",
          errno.EPERM: "operation not permitted (the folder's permissions changed?)",
          errno.EIO: "input/output error (the disk or the network file system failed)",
          errno.ESTALE: "stale file handle (the network file system lost the folder)"}


def human(n: float) -> str:
    """Bytes as '45.2 MB' (powers of 1000, as df -H and file managers show)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def free_bytes(folder: Path) -> int | None:
    """Bytes this user may still write on ``folder``'s filesystem; None when it does not say
    (some FUSE and network filesystems report no blocks at all)."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize if st.f_blocks else None


def file_size_limit() -> int | None:
    """The largest file this process may write (ulimit -f), None when unlimited.

    A write past it fails with EFBIG: CPython ignores SIGXFSZ from start-up, which would
    otherwise kill the process without a word.
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def write_failure(target: object, folder: Path, exc: OSError,
                  flag: str = "--output-dir") -> str:
    """One line for a failed write of ``target`` into ``folder``: why, and what to do (``flag``
    names the flag that chose the place)."""
    if exc.errno == errno.EFBIG:
        limit = file_size_limit()
        why = "larger than the file size limit (ulimit -f" + (f" = {human(limit)})" if limit
                                                              else ")")
    elif exc.errno in BROKEN:
        return (f"cannot write {target}: {BROKEN[exc.errno]}; the run stopped; fix {folder} or "
                f"give another {flag}, then --resume auto")
    elif exc.errno == errno.ENOENT and (gone := _gone(exc, folder)) is not None:
        return (f"cannot write {target}: {gone} is gone (deleted or unmounted while the run "
                "was writing to it); the run stopped with nothing more to save there")
    else:
        why = exc.strerror or os.strerror(exc.errno or 0)
        with contextlib.suppress(OSError):
            free = free_bytes(folder)
            why += f" ({human(free)} free in {folder})" if free is not None else ""
    return f"cannot write {target}: {why}; free some space or give another {flag}"


def _gone(exc: OSError, folder: Path) -> Path | None:
    """The folder that vanished under a write that met ENOENT: ``folder`` itself or the
    outermost missing folder inside it on the way to the file; None when nothing is missing."""
    if not folder.exists():
        return folder
    if not exc.filename:
        return None
    missing = None
    for parent in Path(os.fsdecode(exc.filename)).parents:
        if parent == folder or not parent.is_relative_to(folder):
            break
        if not parent.exists():
            missing = parent
    return missing


def is_write_failure(exc: OSError, folder: Path) -> bool:
    """True for an OSError of writing into ``folder`` (not, say, a data file that is missing)."""
    if exc.errno in FULL or exc.errno in BROKEN:
        return True
    if exc.errno != errno.ENOENT:
        return False
    name = os.fsdecode(exc.filename) if exc.filename else ""
    inside = bool(name) and Path(name).resolve().is_relative_to(folder.resolve())
    return inside or not folder.exists()


@contextlib.contextmanager
def output_errors(folder: Path, target: object = None,
                  flag: str = "--output-dir") -> Iterator[None]:
    """Turn a failed write into ``folder`` (``is_write_failure``) into one RunError line naming
    the file (the error's own, else ``target``, else the folder)."""
    try:
        yield
    except OSError as exc:
        if not is_write_failure(exc, folder):
            raise
        name = os.fsdecode(exc.filename) if exc.filename else target or f"into {folder}"
        raise RunError(write_failure(name, folder, exc, flag)) from None
