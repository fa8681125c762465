"""Room on the output folder's disk: free space, the file size limit, and one line for a write
that failed because of either (never the zip writer's traceback)."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
from collections.abc import Iterator
from pathlib import Path

from imagenet.errors import RunError

FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}  # no space, quota, file size limit


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


def write_failure(target: object, folder: Path, exc: OSError) -> str:
    """One line for a failed write of ``target``: why, and the room that is left."""
    if exc.errno == errno.EFBIG:
        limit = file_size_limit()
        why = "larger than the file size limit (ulimit -f" + (f" = {human(limit)})" if limit
                                                              else ")")
    else:
        why = exc.strerror or os.strerror(exc.errno or 0)
        with contextlib.suppress(OSError):
            free = free_bytes(folder)
            why += f" ({human(free)} free in {folder})" if free is not None else ""
    return f"cannot write {target}: {why}; free some space or give another --output-dir"


@contextlib.contextmanager
def full_disk_is_an_error(folder: Path) -> Iterator[None]:
    """Turn ENOSPC / EDQUOT / EFBIG met while writing into ``folder`` into one RunError."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in FULL:
            raise
        raise RunError(write_failure(exc.filename or f"into {folder}", folder, exc)) from None
