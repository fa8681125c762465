"""The output folder's disk: free space, the file size limit, and one line for a write that
failed - the disk full, the folder gone or read-only, no permission, an I/O error - whatever file
it was (a checkpoint, metrics.jsonl, TensorBoard's events, a report): never a traceback."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
from collections.abc import Iterator
from pathlib import Path

from imagenet.errors import RunError

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
