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
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

import imagenet.launching.processes as processes
import imagenet.launching.watchdog as watchdog
from imagenet.errors import (
    DistributedError,
    Preempted,
    RunError,
    TrainerError,
    first_line,
    say_error,
)
from imagenet.launching.collectives import DistInfo, from_rank0
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
    while not processes.process_exited(failure.pid) and time.monotonic() < deadline:
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
