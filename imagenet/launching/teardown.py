"""What ends a training process that does not end after its run.

The hang watch (``watchdog``) closes when the run returns. What follows (the failure
mailboxes' last handshake, the process group's destroy, the interpreter's exit) is watched here:

- ``exit_within``: each process that ends with the run arms a timer as the watch closes; still
  alive --hang-timeout later, it writes its Python stacks to OUTPUT_DIR/hang/rank{R}-exit.txt,
  says so in one line and exits with the requeue code (the run's files are complete);
- ``StoppedChildren``: a stopped process runs no timer, so mp.spawn's parent looks at its
  children and ends one stopped (SIGSTOP) for longer than --hang-timeout and a margin.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from imagenet.errors import say_error
from imagenet.launching import processes, watchdog
from imagenet.launching.watchdog import END_WAIT, HANG_DIR, LOOK, REQUEUE, write_report
from imagenet.settings.launch import Ranks

__all__ = ["LOOK", "StoppedChildren", "exit_within", "is_stopped"]

EXIT_AT_LEAST = 30.0  # seconds: a short --hang-timeout (or --dist-timeout) must not end a
# teardown that is only slow (loader workers, the process group) on a loaded machine


def exit_within(timeout: float, rank: int, output_dir: Path | None = None) -> None:
    """After the watch closed (the run ended, however): a process of its own that is still
    alive ``timeout`` seconds (at least ``EXIT_AT_LEAST``) later is stuck in its teardown (a
    process group's destroy, a thread that never ends, the interpreter's exit). Its Python
    stacks go to OUTPUT_DIR/hang/rank{R}-exit.txt, one line names it, and it exits with the
    requeue code: the run's files were complete when the watch closed, so a requeue's
    ``--resume auto`` finds the finished run. A daemon timer: a process that exits in time
    never sees it. Only for processes that end with the run (never ``imagenet.train``'s
    caller)."""
    if timeout <= 0:
        return
    timeout = max(timeout, EXIT_AT_LEAST)
    folder = (output_dir or watchdog.reports() or Path(".")) / HANG_DIR

    def end() -> None:
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f"rank{rank}-exit.txt", "w") as own:
                faulthandler.dump_traceback(file=own, all_threads=True)
        say_error(f"hang: rank {rank} (pid {os.getpid()}) had not exited {timeout:g} s "
                  f"(--hang-timeout) after its run ended; its Python stacks are in {folder}; "
                  f"exit {REQUEUE} (the run's files are complete: a requeue finds the finished "
                  "run)", rank)
        os._exit(REQUEUE)

    timer = threading.Timer(timeout, end)
    timer.daemon = True
    timer.name = "exit-watch"
    timer.start()


def is_stopped(pid: int) -> bool:
    """True while ``pid`` is stopped (SIGSTOP, a terminal's stop) on Linux; False elsewhere."""
    return processes.process_state(pid) in ("T", "t")


class StoppedChildren:
    """A spawned child stopped (SIGSTOP) for longer than --hang-timeout and a margin is ended.

    While every rank trains, the others' hang watches find a stopped rank within
    --hang-timeout and end it (``watchdog``); the margin leaves that to them. Nothing else sees
    a child stopped when its run had ended (its watch closed, the other children exited 0:
    chaos seed 29008, scenario 3) or the only child of a node: then mp.spawn's join waited
    forever. Here the child is continued for its stacks (its watch, or its ``exit_within``
    timer, then ends it with the requeue code), killed if it has not ended within
    ``END_WAIT`` seconds, and one line names it; the job exits with the requeue code.
    """

    MARGIN = 30.0  # seconds beyond --hang-timeout: the ranks' own watches go first

    def __init__(self, hang_timeout: float, ranks: Callable[[int], Ranks], output_dir: Path
                 ) -> None:
        """``output_dir``: the run's local folder, where the report goes (an object-storage
        --output-dir's staging folder: the plan's)."""
        self.hang_timeout, self.ranks, self.output_dir = hang_timeout, ranks, output_dir
        self.since: dict[int, float] = {}  # child index -> when it was first seen stopped
        self.ended: int | None = None  # the child this ended

    def look(self, processes: Sequence) -> None:
        timeout = self.hang_timeout
        if timeout <= 0 or self.ended is not None:
            return
        now = time.monotonic()
        for index, process in enumerate(processes):
            if process.is_alive() and is_stopped(process.pid):
                self.since.setdefault(index, now)
            else:
                self.since.pop(index, None)
        late = [i for i, t in self.since.items() if now - t > timeout + self.MARGIN]
        if late:
            self.end(late[0], processes[late[0]], now - self.since[late[0]])

    def end(self, index: int, process, quiet: float) -> None:
        self.ended = index
        rank = self.ranks(index).rank
        folder = self.output_dir / HANG_DIR
        line = (f"hang: rank {rank} (training process {index} of this node, pid {process.pid}) "
                f"was stopped (SIGSTOP) for {quiet:.0f} s, over --hang-timeout "
                f"{self.hang_timeout:g}; continued it for its Python stacks (in {folder}), "
                f"then ended it; exit {REQUEUE} so that a requeue resumes from the "
                "last checkpoint (or finds the finished run)")
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
            write_report(folder, {"rank": rank, "pid": process.pid, "silent": True,
                                  "what": "stopped (SIGSTOP)", "found_by": "spawn",
                                  "hang_timeout": self.hang_timeout, "message": line},
                         rank, time.time() - quiet)
        say_error(line)
        with contextlib.suppress(OSError):
            os.kill(process.pid, signal.SIGCONT)
        process.join(END_WAIT)
        if process.is_alive():
            process.kill()
