"""SIGTERM / SIGUSR1 / SIGINT: finish the step, save once, exit with PREEMPT_EXIT_CODE.

A signal only sets a flag, as does --time-limit (``timelimit.Deadline``, on rank 0) when the time
left no longer covers a step and a save; the training loop asks ``should_stop()`` after each
optimizer step. With several ranks the flag is OR-ed across ranks (one small all-reduce on a gloo
side group, started one step and read the next, so it never stalls the GPU) so that every rank
stops after the same step and the collective checkpoint save cannot deadlock. A second signal
exits at once.

The same signal can arrive twice within milliseconds (SLURM signals every process of a job step
and the --multiprocessing-distributed parent forwards it too); a repeat within
``DUPLICATE_WINDOW`` seconds counts as one delivery. DataLoader workers ignore these signals: the
training process decides when to stop and shuts them down itself. A training process whose
launcher (torchrun's agent, mp.spawn's parent) dies stops the same way (``stop_when_orphaned``).

The processes around a rank's hang watch (``watchdog``): a loader worker dies with its
training process, writes its Python stacks when a hang report asks for them (SIGUSR2) and keeps
quiet about the connection its dying parent closed; and what Linux says of a process (stopped,
exited).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sized
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from imagenet.errors import Preempted

if TYPE_CHECKING:
    from imagenet.launching.timelimit import Deadline


log = logging.getLogger(__name__)

PREEMPT_EXIT_CODE = Preempted.exit_code  # "saved on a signal; requeue to resume"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
DUPLICATE_WINDOW = 1.0  # seconds
TIME_LIMIT = "the time limit"  # StopFlag.requested when --time-limit asked for the stop
# What each rank contributes to the agreement (the largest wins): go on, a signal, the time limit.
GO_ON, SIGNALLED, TIMED_OUT = 0, 1, 2
LAUNCHER_POLL = 0.5  # seconds between checks that the launcher (parent) is alive
ORPHANED = "the loss of its launcher"  # the reason of a stop asked by stop_when_orphaned
_training: StopFlag | None = None  # the training loop's flag, installed or stopping
_orphaned: int | None = None  # the pid of this process's launcher once it died
_quiet_after_training = False  # main.py's processes: SIGINT is ignored once training ended


def ignore_interrupts_after_training() -> None:
    """In a process of main.py's: once training has ended, SIGINT is ignored, not put back.

    There is nothing left to stop then, and mp.spawn's children get SIGINT when their parent
    dies: as a KeyboardInterrupt it broke the shutdown (a finished rank reported as failed,
    tracebacks from exit handlers; chaos 18006:36, 18006:97). A library caller
    (``imagenet.train``) keeps its own handler.
    """
    global _quiet_after_training
    _quiet_after_training = True


def ignore_stop_signals(_worker_id: int = 0) -> None:
    """DataLoader ``worker_init_fn``: a signal to the process group must not kill the workers.

    They start with these signals blocked (``stop_signals_blocked``): one sent before this runs
    stays pending, and is discarded once ignored.
    """
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Hold SIGTERM/SIGUSR1/SIGINT back in this thread (they arrive on leaving); processes
    started inside begin with them blocked."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def stop_when_orphaned(launcher: int, poll: float = LAUNCHER_POLL) -> threading.Thread:
    """Stop this process as if preempted (finish the step, save, exit 143) once ``launcher`` is
    no longer its parent (it died: SIGKILL, out of memory), instead of training on alone in a
    session of its own while holding the output folder's lock.

    The stop is asked of the training loop's flag (``StopFlag.request``), now or when the loop
    starts, never by a signal: a signal would end a stop already under way (torch's own
    parent-death SIGINT to mp.spawn's children, or one agreed with another rank) unsaved.
    """

    def watch() -> None:
        global _orphaned
        while os.getppid() == launcher:
            time.sleep(poll)
        _orphaned = launcher
        if _training is not None:
            _stop_orphan(_training)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread


def _stop_orphan(flag: StopFlag) -> None:
    """Ask ``flag`` to stop for the launcher's death (once; not if a stop is under way)."""
    if _orphaned is not None and flag.request(ORPHANED):
        log.warning("the launcher of this process (pid %d) is gone: finishing this step, "
                    "saving a checkpoint, then exiting with code %d", _orphaned,
                    PREEMPT_EXIT_CODE)


class StopRequested(Exception):
    """Raised by ``StopBetweenBatches`` on every rank when a stop was agreed."""


class StopFlag:
    """Set by the signal handlers (or the ``deadline``); agreed across ranks by ``should_stop``."""

    def __init__(self, deadline: Deadline | None = None) -> None:
        self.requested: str | None = None  # name of the first signal received here
        self.stopping = False  # should_stop() has returned True: every rank stops
        self.deadline = deadline  # --time-limit, on the rank that keeps the clock
        self.timed_out = False  # the agreed stop came from the time limit
        self._first: tuple[int, float] | None = None
        self._group = None
        self._pending: tuple[torch.Tensor, object] | None = None
        self._previous: dict[int, object] = {}
        self._stopped = False  # the stop is over (saved); a later signal exits at once

    def install(self) -> None:
        """Catch the preemption signals in this process (from its main thread only: a caller
        that runs training in another thread, such as Ray Train, handles stops itself)."""
        global _training
        _training = self
        _stop_orphan(self)  # the launcher died before training began
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # A CPU group for control messages: the flag lives on the host even with NCCL.
            self._group = dist.new_group(backend="gloo")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self._first is not None:
            sig, when = self._first
            if sig == signum and now - when < DUPLICATE_WINDOW:
                return  # the same delivery through a second path
            log.warning("second signal (%s): exiting now %s", name,
                        "(the checkpoint is saved)" if self._stopped else "without saving")
            os._exit(PREEMPT_EXIT_CODE)
        if self._stopped:  # agreed from another rank and saved: nothing is left to do
            os._exit(PREEMPT_EXIT_CODE)
        self._first = (signum, now)
        self.requested = name
        log.warning("%s received: finishing this step, saving a checkpoint, then exiting "
                    "with code %d", name, PREEMPT_EXIT_CODE)

    def _local(self, compiles: bool = False) -> int:
        """This rank's wish: GO_ON, SIGNALLED or TIMED_OUT (the deadline is asked here;
        ``compiles``: the next step compiles graphs, as long as the longest step so far)."""
        ahead = self.deadline.longest if compiles and self.deadline is not None else 0.0
        if self.requested is None and self.deadline is not None and self.deadline.due(ahead):
            self.requested = TIME_LIMIT
        if self.requested is None:
            return GO_ON
        return TIMED_OUT if self.requested == TIME_LIMIT else SIGNALLED

    def _agree(self, wish: int) -> None:
        if wish != GO_ON:
            self.stopping = True
            self.timed_out = self.timed_out or wish == TIMED_OUT

    @property
    def by_time_limit(self) -> bool:
        """True when the stop is the time limit's (not a signal's, on this rank)."""
        return self.requested == TIME_LIMIT or (self.requested is None and self.timed_out)

    @property
    def reason(self) -> str:
        """What stopped the run, as the one line says it."""
        if self.by_time_limit:
            return TIME_LIMIT
        return self.requested or "a signal on another rank"

    def saved(self, seconds: float) -> None:
        """A save took ``seconds`` (the time limit's estimate of the next one)."""
        if self.deadline is not None:
            self.deadline.saved(seconds)
    def request(self, reason: str) -> bool:
        """Ask for a stop as a first signal would, without one; False (nothing done) if a stop
        was asked for already."""
        if self.requested is not None or self.stopping:
            return False
        self.requested = reason
        return True

    def should_stop(self) -> bool:
        """True on every rank once any rank was signalled (agreed one step later)."""
        wish = self._local()
        if self._group is None:
            self._agree(wish)
            return self.stopping
        agreed = GO_ON
        if self._pending is not None:
            flag, work = self._pending
            work.wait()  # type: ignore[attr-defined]
            agreed = int(flag.item())
        flag = torch.tensor([wish], dtype=torch.int32)
        self._pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group,
                                               async_op=True))
        self._agree(agreed)
        return self.stopping

    def settle(self, compiles: bool = False) -> bool:
        """Like ``should_stop``, but agreed at once (a blocking all-reduce): for the points
        where no later step would ask, such as the end of an epoch; ``compiles``: the next step
        compiles new graphs (the time limit keeps room for it)."""
        if self._group is None:
            self._agree(self._local(compiles))
            return self.stopping
        if self._pending is not None:
            flag, work = self._pending
            work.wait()  # type: ignore[attr-defined]
            self._agree(int(flag.item()))
            self._pending = None
        flag = torch.tensor([self._local(compiles)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        self._agree(int(flag.item()))
        return self.stopping

    def drain(self) -> None:
        """Finish the outstanding all-reduce so every rank issued the same collectives."""
        if self._pending is not None:
            self._pending[1].wait()  # type: ignore[attr-defined]
            self._pending = None

    def uninstall(self) -> None:
        """Put back the handlers that were there before ``install``.

        Not once a stop was asked for: until the process exits, a signal must still end it
        with PREEMPT_EXIT_CODE (a requeue checks for it), never as a KeyboardInterrupt.
        """
        if self.requested is not None or self.stopping:
            self._stopped = True
            return
        global _training
        _training = None
        for sig, previous in self._previous.items():
            if sig == signal.SIGINT and _quiet_after_training:
                previous = signal.SIG_IGN
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


class StopBetweenBatches:
    """``loader``'s batches; before each, ``stop.should_stop()`` may raise StopRequested.

    should_stop is collective, so every rank must ask equally often: a rank whose shard has
    fewer than ``asks`` batches asks for the missing ones after its last batch. Every rank then
    sees the same answer at the same ask and leaves together.
    """

    def __init__(self, loader: Iterable, stop: StopFlag, asks: int) -> None:
        self.loader, self.stop, self.asks = loader, stop, asks

    def __len__(self) -> int:
        return len(self.loader) if isinstance(self.loader, Sized) else self.asks

    def __iter__(self) -> Iterator:
        asked = 0
        for batch in self.loader:
            asked += 1
            if self.stop.should_stop():
                raise StopRequested
            yield batch
        for _ in range(asked, self.asks):
            if self.stop.should_stop():
                raise StopRequested


# ------------------------------------------ the processes around a rank: stacks, parents, /proc

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
