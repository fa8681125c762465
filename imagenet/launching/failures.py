"""One rank's failure stops every rank within seconds, with that rank's message.

mp.spawn's parent and torchrun's agent stop their own children when one fails, but ranks with no
common parent (a shared --dist-url across nodes, srun tasks, manual ranks) would otherwise wait in
their next collective until --dist-timeout. A rank that fails writes its error into a mailbox of
every other rank in the rendezvous store; each rank has a thread waiting on its own mailbox that
prints the same ``error:`` line, naming the rank that failed, and exits with the same code. A
collective that raises because a peer went away (gloo: "Connection closed by peer") is reported
with that peer's message too, not with a traceback.

A rank on the same host as the failing one exits only after it (plus ``GRACE`` seconds), so that
mp.spawn's parent and torchrun's agent report the rank that failed, not the first that followed.
Rank 0 hosts the store (under torchrun, whose agent hosts the rendezvous store and may be killed
first, a store of its own for the mailboxes): it leaves last, once every rank has said it is
done, so nobody loses its connection mid-message.

What ends a training process that does not end after its run.

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
import datetime
import faulthandler
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

import imagenet.launching.preemption as preemption
import imagenet.launching.watchdog as watchdog
from imagenet.errors import (
    DistributedError,
    Preempted,
    RunError,
    TrainerError,
    first_line,
    say_error,
)
from imagenet.launching.process_group import DistInfo, from_rank0
from imagenet.launching.watchdog import END_WAIT, HANG_DIR, LOOK, REQUEUE, write_report
from imagenet.settings.launch import Ranks
from imagenet.settings.plan import Plan

log = logging.getLogger(__name__)

GRACE = 2.0  # seconds a follower on the failing rank's host waits after that rank has exited
WAIT_FOR_EXIT = 30.0  # at most, for the failing rank to exit (it reports, then cleans up)
WAIT_FOR_DONE = 10.0  # at most, on rank 0, for every rank to be done with the store
PEER_MESSAGE_WAIT = 3.0  # after a failed collective, for the peer's message to arrive
DONE = b"done"


class PeerFailed(RunError):
    """Another rank failed; this one stops with its message and exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Failure:
    """What a failing rank tells the others."""

    rank: int
    code: int
    message: str
    host: str
    pid: int

    def error(self) -> PeerFailed:
        """The error the other ranks stop with."""
        return PeerFailed(f"rank {self.rank} failed: {self.message}", self.code)


def host_id() -> str:
    """This machine: its host name and boot id (containers may share a host name)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class SharedFate:
    """This rank's side of the protocol: its mailbox watcher, publishing, finishing."""

    def __init__(self, info: DistInfo, host: str, port: int, prefix: str,
                 timeout: float) -> None:
        self.server: dist.TCPStore | None = None  # the mailboxes' store, when rank 0 hosts it
        self.rank, self.world = info.rank, info.world_size
        self.prefix = prefix
        self.store = dist.TCPStore(host, port, is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        self.watcher_store = self.store.clone()  # a blocking get holds its connection
        # The mailbox wait lasts the whole run: a timeout would end it (and log a warning).
        self.watcher_store.set_timeout(datetime.timedelta(days=365))
        self._lock = threading.Lock()
        self._claimed = False
        self._thread = threading.Thread(target=self._watch, name="peer-failures", daemon=True)
        self._thread.start()

    def _key(self, *parts: object) -> str:
        return "/".join((self.prefix, *map(str, parts)))

    def claim(self) -> bool:
        """True for the first of this process's threads to handle a failure."""
        with self._lock:
            first, self._claimed = not self._claimed, True
            return first

    def claim_or_wait(self) -> None:
        """Claim the failure for the main thread, or wait while the watcher ends the process
        (it already stops it with a peer's error)."""
        if not self.claim():
            time.sleep(WAIT_FOR_EXIT + GRACE + WAIT_FOR_DONE)

    def _watch(self) -> None:
        """Wait on this rank's mailbox; a failure there ends the process like the failed rank."""
        try:
            value = self.watcher_store.get(self._key("mailbox", self.rank))
        except Exception:  # the store is gone: rank 0 died; the main thread's collective fails
            return
        if value == DONE or not self.claim():
            return
        failure = Failure(**json.loads(value))
        watchdog.stand_down()  # the failed rank may be rank 0, the store's host
        say_error(failure.error(), self.rank)
        self._done(wait_for_all=True)
        follow(failure)
        os._exit(failure.code)

    def publish(self, failure: Failure) -> None:
        """Tell every other rank that this one failed."""
        others = [self._key("mailbox", r) for r in range(self.world) if r != self.rank]
        try:
            self.store.multi_set(others, [json.dumps(asdict(failure))] * len(others))
        except Exception as exc:  # the store is gone too: the others' collectives fail anyway
            log.debug("could not publish the failure: %s", exc)

    def peer_failure(self, wait: float) -> Failure | None:
        """A failure another rank published to this one, waiting up to ``wait`` s for it."""
        key = self._key("mailbox", self.rank)
        deadline = time.monotonic() + wait
        try:
            while not self.store.check([key]) and time.monotonic() < deadline:
                time.sleep(0.05)
            value = self.store.get(key) if self.store.check([key]) else DONE
        except Exception:
            return None
        return None if value == DONE else Failure(**json.loads(value))

    def finish(self, wait_for_all: bool = True) -> None:
        """Release this rank's watcher and say it is done; rank 0 waits for everyone (unless a
        rank is known to be gone)."""
        try:
            self.store.set(self._key("mailbox", self.rank), DONE)
            self._thread.join(timeout=5)
            self._done(wait_for_all=wait_for_all and self.rank == 0)
        except Exception as exc:
            log.debug("store unavailable at the end: %s", exc)

    def _done(self, wait_for_all: bool) -> None:
        """Mark this rank done with the store; with ``wait_for_all``, wait (bounded) for all."""
        store = self.store if threading.current_thread() is not self._thread \
            else self.watcher_store
        store.set(self._key("done", self.rank), DONE)
        if not wait_for_all or self.rank != 0:
            return
        keys = [self._key("done", r) for r in range(self.world)]
        deadline = time.monotonic() + WAIT_FOR_DONE
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)


def follow(failure: Failure) -> None:
    """Let the failed rank exit first when it runs on this host (see the module docstring)."""
    if failure.host != host_id():
        return
    deadline = time.monotonic() + WAIT_FOR_EXIT
    while not preemption.process_exited(failure.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(GRACE)


def rank0_store(info: DistInfo, host: str, timeout: float) -> tuple[dist.TCPStore | None,
                                                                    int | None]:
    """A store on rank 0 for the mailboxes, and its port on every rank (None: use the
    rendezvous store). Collective.

    torchrun's agent hosts the rendezvous store, and a SIGKILL to the agent leaves its workers
    to stop on their own (``preemption.stop_when_orphaned``): on the agent's store, every
    mailbox would break at once, with torch's C++ warnings. Rank 0 leaves last, as the store's
    host does without torchrun. ``host`` (MASTER_ADDR) is rank 0's node under torchrun.
    """
    server = None
    if info.is_main:
        try:
            server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        except Exception as exc:  # e.g. no free port: the rendezvous store will do
            log.debug("no store of rank 0's for the failure mailboxes: %s", exc)
    return server, from_rank0(server.port if server is not None else None)


def start(plan: Plan, info: DistInfo) -> SharedFate | None:
    """This rank's mailbox on the rendezvous store; None without a process group or TCP store."""
    if not info.distributed:
        return None
    host, port = plan.meet.host, plan.meet.port
    if not host or port is None:
        return None
    prefix = f"imagenet/failures/attempt_{plan.restarts}"
    timeout = min(plan.cfg.dist_timeout, 60.0)
    server = None
    if plan.agent_store:
        server, own_port = rank0_store(info, host, timeout)
        port = own_port or port
    try:
        fate = SharedFate(info, host, port, prefix, timeout=timeout)
        fate.server = server  # kept open until this process ends
        return fate
    except Exception as exc:  # no TCP store to reach: fall back to the launchers' own handling
        log.debug("no failure mailbox: %s", exc)
        return None


def exit_code_of(exc: BaseException) -> int:
    """The exit code a rank ends with for ``exc``."""
    if isinstance(exc, TrainerError):
        return exc.exit_code
    return 130 if isinstance(exc, KeyboardInterrupt) else 1


def describe(exc: BaseException) -> str:
    """The message other ranks print for this rank's ``exc``."""
    return str(exc) if isinstance(exc, TrainerError) else \
        f"{first_line(exc)} (traceback in that rank's log)"


LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe",
             "socket timeout", "timed out", "nccl")


def lost_a_peer(exc: BaseException) -> bool:
    """True when ``exc`` is a collective that failed because another rank went away."""
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError)
                                               and any(s in text for s in LOST_PEER))


@contextlib.contextmanager
def stop_together(plan: Plan, info: DistInfo) -> Iterator[None]:
    """Run the body so that a failure on any rank stops every rank with the same message, and a
    hang every rank (``watchdog``)."""
    fate = start(plan, info)
    dog = watchdog.start(plan.hang_timeout, info.rank, info.world_size,
                         Path(plan.cfg.output_dir), fate.store if fate else None,
                         f"imagenet/hang/attempt_{plan.restarts}", host_id())
    try:
        with _fate(fate, info):
            yield
    finally:
        if dog is not None:
            dog.close()


@contextlib.contextmanager
def _fate(fate: SharedFate | None, info: DistInfo) -> Iterator[None]:
    """``stop_together``'s failure mailboxes around the body."""
    if fate is None:
        yield
        return
    try:
        yield
    except TrainerError as exc:
        if isinstance(exc, Preempted) or getattr(exc, "on_every_rank", False):
            fate.finish()  # every rank stops here together: nothing to tell the others
            raise
        fate.claim_or_wait()
        fate.publish(Failure(info.rank, exc.exit_code, str(exc), host_id(), os.getpid()))
        fate.finish()
        raise
    except BaseException as exc:
        fate.claim_or_wait()
        lost = lost_a_peer(exc)
        peer = fate.peer_failure(wait=PEER_MESSAGE_WAIT if lost else 0.0)
        if peer is None and not lost:  # this rank's own failure (a bug): tell the others first
            fate.publish(Failure(info.rank, exit_code_of(exc), describe(exc), host_id(),
                                 os.getpid()))
            fate.finish()
            raise
        fate.finish(wait_for_all=peer is not None)  # a rank that vanished never says done
        if peer is not None:
            watchdog.stand_down()
            follow(peer)
            raise peer.error() from None
        raise DistributedError(
            f"lost contact with another rank ({first_line(exc)}); it exited without a message "
            "(killed, out of memory?): see its log") from None
    else:
        fate.finish()


# ---------------------------------------------------- a process that does not end after its run

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
    return preemption.process_state(pid) in ("T", "t")


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
