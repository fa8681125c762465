"""--hang-timeout: a rank that makes no progress is noticed, explained and ended.

Progress is a training step, a validation batch, a checkpoint save (``beat``); between them a
rank says what it is waiting for (``phase``). The clock starts once the model and the data are
built (``start_clock``: building is the start-up stages', under --dist-timeout). A compile, a
checkpoint load and an upload take minutes with nothing to show for them: the clock is paused
around each (``paused``), with a bound of its own (``pause_bound``), and a rank that waits for
a paused rank (in a collective) waits with it. A thread of each rank looks every second: once
the rank's last progress is older than --hang-timeout (and neither it nor a peer that answers
is paused), or a pause has outlasted its bound, the run hangs:

- the thread publishes "hang" in the rendezvous store, so that every rank's thread dumps its
  Python stacks (all threads) at once, however its main thread is stuck;
- it names the rank that stopped: one that no longer answers (stopped with SIGSTOP, killed, its
  node gone: its thread stopped publishing its heartbeat), else one waiting for its data (a
  loader worker blocked on a read), else every rank stuck in the same collective;
- a rank that no longer answers and runs on this host is continued (SIGCONT): its own thread
  then finds the hang and dumps its stacks, as every rank's does; it is killed if it has not
  ended within seconds; loader workers are asked for theirs (SIGUSR2: Python's faulthandler);
- the stacks go to OUTPUT_DIR/hang/ (rank{R}.txt, rank{R}-worker{PID}.txt, report.json; a
  second rank that found a hang, as both sides of a lost link do: report-rank{R}.json), one
  ``error:`` line says who stopped and where, and every process exits with the requeue code
  (143), its loader workers killed: a requeue resumes from the last checkpoint (``--resume
  auto``).

Until a hang, each rank's stack files wait in a folder of the temp folder, removed when the rank
ends; a rank killed with SIGKILL cannot remove it, so each start removes those whose rank is gone
(``remove_stale_stacks``).

The heartbeat is a key per rank in the store that mailboxes one rank's failure to the others
(``failures``); a single process needs none. No collective ever runs in the thread.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import fcntl
import json
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from imagenet.errors import Preempted, say_error
from imagenet.launching.preemption import STACKS_SIGNAL, process_exited

log = logging.getLogger(__name__)
T = TypeVar("T")

REQUEUE = Preempted.exit_code
LOOK = 1.0  # seconds between the thread's looks (at most; less for a short --hang-timeout)
SILENT = 10.0  # seconds without a heartbeat after which a rank no longer answers (at most
# half of --hang-timeout)
STORE_TIMEOUT = 10.0  # seconds for one store request of the thread
DUMP_WAIT = 3.0  # seconds for the other ranks to write their stacks before this rank exits
END_WAIT = 10.0  # seconds a continued (SIGCONT) stopped rank has to end itself before SIGKILL
HANG_DIR = "hang"
STALE_AFTER = 60.0  # seconds: a younger stack folder is never taken for a left-over one
STACKS_PREFIX = "imagenet-stacks-"  # TMPDIR/imagenet-stacks-RANK-XXXX: a rank's stack files
_dog: Watchdog | None = None
_stacks_dir: str | None = None  # where loader workers write their stacks (set before they start)
_reports: Path | None = None  # the run folder the last watch reported to (``exit_within``)
# A pause is a hang after max(PAUSE_AT_LEAST, PAUSE_TIMES x --hang-timeout) seconds: a cold
# compile takes minutes on a GPU, a checkpoint of a few GB on slow storage or a slow link too.
PAUSE_AT_LEAST = 1800.0
PAUSE_TIMES = 6


def pause_bound(timeout: float) -> float:
    """Seconds one pause (``paused``) may last under --hang-timeout ``timeout``."""
    return max(PAUSE_AT_LEAST, PAUSE_TIMES * timeout)


def start_clock(what: str) -> None:
    """The hang clock starts now (the model and the data are built); ``beat``s before it (the
    validation images checked in the background meanwhile) are not progress."""
    dog = _dog
    if dog is not None:
        dog.progress, dog.what = time.time(), what


def beat(what: str) -> None:
    """Progress: ``what`` was just done (a step, a validation batch, a save)."""
    dog = _dog
    if dog is not None:
        dog.what = what
        if dog.progress is not None:  # the clock has started
            dog.progress = time.time()


@contextlib.contextmanager
def paused(what: str) -> Iterator[None]:
    """The body (``what``: a compile, a checkpoint load, an upload) does not count toward
    --hang-timeout: the clock starts again at its end. It is a hang once it has lasted
    ``pause_bound``, ``what`` in the report. A pause inside one is part of it."""
    dog = _dog
    if dog is None or dog.paused is not None:
        yield
        return
    dog.paused_for, dog.paused = what, time.time()
    try:
        yield
    finally:
        if dog.progress is not None:
            dog.progress = time.time()
        dog.paused = None


def phase(what: str) -> None:
    """What this rank does or waits for now (not progress; said if it hangs there)."""
    dog = _dog
    if dog is not None:
        dog.what = what


def stand_down() -> None:
    """Stop this rank's watch from now on: the rank ends with a peer's failure (``failures``),
    and the store the watch talks to may have left with that peer (rank 0 hosts it), where each
    request would fail with torch's C++ warnings and their stack frames."""
    dog = _dog
    if dog is not None:
        dog.stop.set()


def stacks_dir() -> str | None:
    """Where this rank's loader workers write their stacks (None: no hang watch)."""
    return _stacks_dir


def _on_stacks_signal(handler: Any) -> tuple[bool, Any]:
    """Handle SIGUSR2 with ``handler``: whether it could (only the main thread can set a
    handler), and the handler it had (None: one not set from Python)."""
    if threading.current_thread() is not threading.main_thread():
        return False, None
    return True, signal.signal(STACKS_SIGNAL, handler)


def remove_stale_stacks(tmp: str | None = None) -> list[str]:
    """Remove the stack folders that ranks killed without a word (SIGKILL, the OOM killer, a
    preemption's last signal) left in the temp folder. A live rank holds a lock on its own
    stack file (``Watchdog``); the kernel drops it with the process, so a folder whose file
    can be locked is left over. Folders made in the last minute are not looked at (a rank
    starting beside this one may not hold its lock yet), nor folders of another user. What
    was removed."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(STACKS_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(tmp, name)
        try:
            if os.stat(path).st_uid != os.getuid() or not _left_over(path):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _left_over(folder: str) -> bool:
    """Whether no live process holds ``folder``'s rank file (see ``remove_stale_stacks``)."""
    if time.time() - os.stat(folder).st_mtime < STALE_AFTER:
        return False
    owned = [n for n in os.listdir(folder) if n.startswith("rank")]
    if not owned:
        return True
    with open(os.path.join(folder, owned[0]), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
    return True


class _keep_going:
    """Suppress OSError: a report that cannot be written must not stop the run."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, *_: object) -> bool:
        return kind is not None and issubclass(kind, OSError)


class Watchdog:
    """This rank's watch (see the module docstring)."""

    def __init__(self, timeout: float, rank: int, world: int, output_dir: Path,
                 store: dist.Store | None = None, prefix: str = "imagenet/hang",
                 host: str = "") -> None:
        self.timeout, self.rank, self.world = timeout, rank, world
        self.output_dir, self.store, self.prefix, self.host = output_dir, store, prefix, host
        self.started = time.time()
        self.progress: float | None = None  # wall time of the last progress (None: not yet)
        self.what = "starting"
        self.paused: float | None = None  # wall time the pause under way began (``paused``)
        self.paused_for = ""  # what the pause waits for
        self.waited = 0.0  # when the clock last ran out while this rank or a peer was paused
        remove_stale_stacks()
        self.stacks = Path(tempfile.mkdtemp(prefix=f"{STACKS_PREFIX}{rank}-"))
        self.own = open(self.stacks / f"rank{rank}.txt", "w")
        with _keep_going():  # held while this process lives: the folder is not left over
            fcntl.flock(self.own, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._asked = _on_stacks_signal(self._dump)  # (set, the previous handler)
        self.stop = threading.Event()
        self._pending: threading.Thread | None = None  # a store request still in flight
        self.thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)

    def start(self) -> Watchdog:
        global _dog, _stacks_dir, _reports
        _dog, _stacks_dir, _reports = self, str(self.stacks), self.output_dir
        # The first heartbeat now, not one look later: a rank stopped in its first second (a
        # tiny epoch) is then named with its pid and host, not "no heartbeat yet".
        self._publish(time.time())
        self.thread.start()
        return self

    def close(self) -> None:
        """The run ended (however): stop watching, drop the stack files."""
        global _dog, _stacks_dir
        self.stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=5)
        _dog, _stacks_dir = None, None
        set_here, before = self._asked
        if set_here:
            _on_stacks_signal(signal.SIG_DFL if before is None else before)
        self.own.close()  # a SIGUSR2 that still comes to _dump (another thread) finds it closed
        shutil.rmtree(self.stacks, ignore_errors=True)

    def _dump(self, *_: object) -> None:
        """SIGUSR2 (a person's ``kill -USR2``): every thread's stacks into this rank's file.
        A Python handler, so with the GIL held: faulthandler's own handler walks the threads
        without it while they run, and crashed the process (SIGSEGV) when one of them ended
        meanwhile (chaos seed 29003, scenario 24)."""
        if self.own.closed:
            return
        with _keep_going():
            faulthandler.dump_traceback(file=self.own, all_threads=True)
            self.own.flush()

    # ---------------------------------------------------------------- the thread

    def _key(self, *parts: object) -> str:
        return "/".join((self.prefix, *map(str, parts)))

    def _watch(self) -> None:
        look = min(LOOK, max(self.timeout / 10, 0.05))
        while not self.stop.wait(look):
            now = time.time()
            self._publish(now)
            told = self._told_of_hang()
            if told is not None:
                self._end(told, found=False)
            # In this order: a pause's end sets the progress first (``paused``)
            since, progress = self.paused, self.progress
            if since is not None and now - since > pause_bound(self.timeout):
                self._end(self._mine(), found=True)
            if progress is not None and now - max(progress, self.waited) > self.timeout:
                self._out_of_time(now, since is not None)

    def _out_of_time(self, now: float, paused: bool) -> None:
        """No progress for --hang-timeout: a hang, unless this rank (``paused``) or a peer that
        answers is paused (then the clock runs again from now; a silent peer is a hang all the
        same)."""
        stopped = self._who_stopped(now)
        if stopped["silent"] or not (paused or stopped.get("paused")):
            self._end(stopped, found=True)
        self.waited = now

    def _mine(self) -> dict:
        """This rank's state, as its heartbeat says it and a hang report names it."""
        since = self.paused
        return {"rank": self.rank, "what": self.paused_for if since is not None else self.what,
                "progress": self.progress, "paused": since, "pid": os.getpid(),
                "host": self.host, "silent": False}

    def _ask(self, call: Callable[..., T], *args: object) -> T:
        """One store request, in a thread of its own: a store across a lost link can block a
        request for as long as TCP retries (many minutes; the store's timeout bounds only
        some), and this thread must keep its own clock. TimeoutError after STORE_TIMEOUT
        seconds, and at once while an earlier request is still blocked."""
        if self.stop.is_set():
            raise TimeoutError("the watch has stopped")
        if self._pending is not None and self._pending.is_alive():
            raise TimeoutError("the store did not answer an earlier request")
        result: dict[str, Any] = {}

        def request() -> None:
            try:
                result["value"] = call(*args)
            except Exception as exc:  # handed to the caller
                result["error"] = exc

        self._pending = threading.Thread(target=request, name="hang-watchdog-store",
                                         daemon=True)
        self._pending.start()
        self._pending.join(STORE_TIMEOUT)
        if self._pending.is_alive():
            raise TimeoutError(f"the store did not answer in {STORE_TIMEOUT:g} s")
        if "error" in result:
            raise result["error"]
        return result["value"]

    def _publish(self, now: float) -> None:
        if self.store is None:
            return
        beat = {**self._mine(), "alive": now}
        with _keep_going(), _store_errors():
            self._ask(self.store.set, self._key("heartbeat", self.rank), json.dumps(beat))

    def _told_of_hang(self) -> dict | None:
        """The rank another rank found stopped, once one did (None: no hang so far)."""
        if self.store is None:
            return None
        try:
            if self._ask(self.store.check, [self._key("hang")]):
                return json.loads(self._ask(self.store.get, self._key("hang")))
        except Exception:  # the store does not answer: this rank's own clock decides
            return None
        return None

    def _heartbeats(self) -> dict[int, dict] | None:
        """Every rank's last heartbeat (None: the store does not answer)."""
        keys = [self._key("heartbeat", r) for r in range(self.world)]
        try:
            present = [r for r, key in enumerate(keys) if self._ask(self.store.check, [key])]
            values = self._ask(self.store.multi_get, [keys[r] for r in present]) \
                if present else []
        except Exception:
            return None
        return {r: json.loads(v) for r, v in zip(present, values)}

    def _who_stopped(self, now: float) -> dict:
        """Which rank stopped, and where (see the module docstring)."""
        if self.store is None or self.world == 1:
            return self._mine()
        beats = self._heartbeats()
        if beats is None:  # the store's host (rank 0) does not answer: it stopped
            return {"rank": 0, "what": "unknown (its store does not answer: it stopped, or the "
                    "network to it is down)", "progress": None,
                    "pid": None, "host": None, "silent": True}
        # Silent for half the timeout at most: a rank that stopped when the progress did has
        # been silent for the whole timeout when the hang is found (a live rank's heartbeat is
        # never older than a few looks).
        after = max(min(SILENT, self.timeout / 2), 3 * LOOK)
        silent = [r for r in range(self.world)
                  if r not in beats or now - beats[r]["alive"] > after]
        if silent:
            r = silent[0]
            beat = beats.get(r, {})
            return {"rank": r, "what": beat.get("what", "unknown (no heartbeat yet)"),
                    "progress": beat.get("progress"), "pid": beat.get("pid"),
                    "host": beat.get("host"), "silent": True}
        paused = [r for r in range(self.world) if r != self.rank and beats[r].get("paused")]
        if paused:  # compiling, loading, uploading: the others wait for it
            return {**beats[paused[0]], "rank": paused[0], "silent": False}
        waiting = [r for r in range(self.world) if beats[r]["what"].startswith("waiting for")]
        r = waiting[0] if waiting else min(beats, key=lambda q: beats[q]["progress"] or 0)
        return {**beats[r], "rank": r, "silent": False}

    def _end(self, stopped: dict, found: bool) -> None:
        """Dump stacks, name the rank that stopped, end every process of this rank with the
        requeue code. ``found``: this rank found it (else another rank told it)."""
        report = self.output_dir / HANG_DIR
        with _keep_going():
            report.mkdir(parents=True, exist_ok=True)
            faulthandler.dump_traceback(file=self.own, all_threads=True)
            self.own.flush()
        # The report and the line first: a launcher that sees a rank die meanwhile (torchrun
        # ends every worker then) must not take them with it.
        line = describe(stopped, self.timeout, time.time(), report)
        if found:
            if self.store is not None:
                with _store_errors():
                    self._ask(self.store.set, self._key("hang"), json.dumps(stopped))
            with _keep_going():
                write_report(report, {**stopped, "found_by": self.rank,
                                       "hang_timeout": self.timeout, "message": line,
                                       "pause_bound": pause_bound(self.timeout),
                                       "at": datetime.datetime.now().isoformat(
                                           timespec="seconds")}, self.rank, self.started)
        say_error(line, self.rank)
        if found:
            self._ask_stacks(stopped)
        self._ask_worker_stacks()
        time.sleep(DUMP_WAIT if self.world > 1 else 0.5)  # their stacks, on disk
        with _keep_going():
            for path in self.stacks.iterdir():
                name = path.name if path.name.startswith("rank") else \
                    f"rank{self.rank}-{path.name}"
                shutil.copyfile(path, report / name)
        shutil.rmtree(self.stacks, ignore_errors=True)
        if found and stopped.get("silent"):
            _end_if_here(stopped, self.host)
        # The loader workers die with this process (``die_with_parent``): killed here first,
        # their death would raise in the main thread, which is still running.
        os._exit(REQUEUE)

    def _ask_stacks(self, stopped: dict) -> None:
        """A rank on this host that no longer answers: continue it for its stacks. Its own
        watch then finds the hang published and writes them, as every rank does (``_end``)."""
        pid = stopped.get("pid")
        if not stopped.get("silent") or pid is None or stopped.get("host") != self.host:
            return
        with _keep_going():
            os.kill(pid, signal.SIGCONT)

    def _ask_worker_stacks(self) -> None:
        for child in multiprocessing.active_children():
            with _keep_going():
                os.kill(child.pid, STACKS_SIGNAL)


def write_report(folder: Path, report: dict, rank: int, since: float) -> None:
    """report.json, unless another rank of this run (written after ``since``) wrote it first (a
    lost link: each side finds the other silent): then report-rank{R}.json beside it."""
    path = folder / "report.json"
    with contextlib.suppress(OSError):
        if path.stat().st_mtime >= since:
            path = folder / f"report-rank{rank}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")


class _store_errors:
    """Suppress a store that does not answer (its host stopped): the thread goes on."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, *_: object) -> bool:
        return kind is not None and issubclass(kind, Exception)


def _end_if_here(stopped: dict, host: str, within: float = END_WAIT) -> None:
    """The rank that stopped, when it runs on this host: continued for its stacks
    (``Watchdog._ask_stacks``), its own watch ends it with the requeue code; killed if it has
    not within ``within`` seconds (nothing else would: a stopped process ignores SIGTERM)."""
    pid = stopped.get("pid")
    if not pid or stopped.get("host") != host:
        return
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and not process_exited(pid):
        time.sleep(0.1)
    with _keep_going():
        os.kill(pid, signal.SIGKILL)


def describe(stopped: dict, timeout: float, now: float, report: Path) -> str:
    """The one line of a hang."""
    since = stopped.get("progress")
    quiet = f"{now - since:.0f} s" if since else "a while"
    how = (f"stopped answering (its last progress {quiet} ago)" if stopped.get("silent") else
           f"made no progress for {quiet} (--hang-timeout {timeout:g})")
    if stopped.get("paused") and not stopped.get("silent"):
        how = (f"was paused for {now - stopped['paused']:.0f} s, longer than a compile, a "
               f"checkpoint load or an upload may take ({pause_bound(timeout):g} s: the larger "
               f"of {PAUSE_AT_LEAST:g} s and {PAUSE_TIMES} x --hang-timeout {timeout:g})")
    place = f" (host {stopped['host'].split('/')[0]}, pid {stopped['pid']})" \
        if stopped.get("host") and stopped.get("pid") else ""
    return (f"hang: rank {stopped['rank']} {how}; it was at: {stopped.get('what') or 'unknown'}"
            f"{place}; every rank's Python stacks are in {report}; exit {REQUEUE} so that a "
            "requeue resumes from the last checkpoint")


def reports() -> Path | None:
    """The run folder the last watch reported to (an object-storage run's staging folder)."""
    return _reports


def start(timeout: float, rank: int, world: int, output_dir: Path,
          store: dist.Store | None = None, prefix: str = "imagenet/hang",
          host: str = "") -> Watchdog | None:
    """This rank's watchdog (None with --hang-timeout 0)."""
    if timeout <= 0:
        return None
    if store is not None:
        store = store.clone() if hasattr(store, "clone") else store
        store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT))
    return Watchdog(timeout, rank, world, output_dir, store, prefix, host).start()

