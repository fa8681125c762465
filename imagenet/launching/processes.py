"""The processes around a rank's hang watch (``watchdog``): a loader worker dies with its
training process, writes its Python stacks when a hang report asks for them (SIGUSR2) and keeps
quiet about the connection its dying parent closed; and what Linux says of a process (stopped,
exited)."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

STACKS_SIGNAL = signal.SIGUSR2  # a process asked for its Python stacks (faulthandler)


def worker_stacks(folder: str | None, parent: int | None = None) -> None:
    """In a loader worker (``worker_init_fn``): die with the training process ``parent`` (even
    blocked on a read that never returns), and write Python's stacks into ``folder`` when asked
    (SIGUSR2), so that a hang report shows where the worker was stuck."""
    die_with_parent(parent)
    if folder is None:
        return
    with contextlib.suppress(OSError):  # no stacks, but the worker runs
        path = Path(folder) / f"worker{os.getpid()}.txt"
        faulthandler.register(STACKS_SIGNAL, file=open(path, "w"), all_threads=True)


def die_with_parent(parent: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when the thread that started it exits (prctl
    PR_SET_PDEATHSIG; nothing elsewhere), and keep quiet about a connection lost as it dies.

    Linux sends that signal only for a parent that exits later: a spawned worker imports torch
    for seconds before it gets here, and a training process killed meanwhile (chaos 29013:23)
    left it running forever, adopted by init, which torch's worker loop then takes for its
    parent. So a worker whose parent is no longer ``parent`` (the training process that made
    the loader) exits here, at once."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent is not None and os.getppid() != parent:  # after the prctl: no gap left
        os._exit(0)
    _report_lost_connections_if_parent_lives(os.getppid())


LOST_CONNECTION_WAIT = 2.0  # s a lost connection's report waits for the parent's end


def _report_lost_connections_if_parent_lives(parent: int) -> None:
    """A loader worker's fd-sharing thread (multiprocessing.resource_sharer) reports a socket
    its parent closed through ``sys.excepthook``. When the parent is SIGKILLed (the OOM killer,
    a scheduler) the kernel closes its sockets before it sends this process its death signal,
    and the worker printed half a traceback in between (chaos ci:6). Such a report now waits
    until the parent is gone (then it says nothing: the worker is being killed or orphaned)
    or ``LOST_CONNECTION_WAIT`` has passed (then it is printed as before)."""
    report = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if issubclass(kind, (ConnectionError, EOFError)):
            deadline = time.monotonic() + LOST_CONNECTION_WAIT
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.01)
            if os.getppid() != parent:
                return
        report(kind, value, tb)

    sys.excepthook = hook


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (R, S, T for stopped, Z for a zombie, ...); None
    where it cannot be read (exited and reaped, no /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def process_exited(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting for its parent counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return process_state(pid) == "Z"
