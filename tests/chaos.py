"""The chaos matrix: seeded scenarios of launches, interruptions and resumes.

A scenario starts a tiny real training run (one process, --multiprocessing-distributed or
torchrun; 1 to 3 processes; two hosts in network namespaces), interrupts it (SIGKILL at a random
step after a checkpoint, SIGTERM in training or validation, SIGKILL while a checkpoint is
written; to the main process or to its whole process group) or meets it with a fault (a hang, a
full disk, a damaged checkpoint, a lost link, slow storage: tests/chaos_faults.py), resumes it
with a changed command line (or the same one), and holds the result against an uninterrupted run
of that final command line (docs/chaos.md lists the checks).

    python tests/chaos.py --seed S -n N [--first I] [--workdir DIR] [--keep]

prints one line per scenario and a summary; the exit code is 1 if any scenario deviates. The
uninterrupted reference runs are kept in WORKDIR/refs, keyed by their command line and the
trainer's source, and shared by the scenarios whose final command lines coincide.
tests/test_chaos.py runs a fixed slice in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import (  # noqa: E402
    MAIN,
    ROOT,
    TwoHosts,
    Unavailable,
    child_env,
    fault_at,
    prestarted_cmd,
    write_image_folder,
)

sys.path.insert(0, str(ROOT))  # the trainer's own checkpoint loader judges a checkpoint whole
import chaos_faults as faults  # noqa: E402

from imagenet.checkpoint import files  # noqa: E402
from imagenet.errors import CheckpointError  # noqa: E402

CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS = 3, 17, 5  # 51 training images: last batches of one
VAL_IMAGES = CLASSES * VAL_PER_CLASS
# 32 px: quick. A fault in validation is placed there by a failpoint (``placed_fault``), not
# timed into a validation made slow enough for a signal to land in it.
MODEL = ["-a", "squeezenet1_1", "--train-crop-size", "32", "--val-resize-size", "36",
         "--val-crop-size", "32", "-p", "1", "--wd", "1e-4", "--dist-timeout", "60"]
LEG_TIMEOUT = 300.0  # seconds for one command
ORPHAN_GRACE = 30.0  # seconds the processes of a killed launcher may take to stop (and save)
HANG_GRACE = 60.0  # seconds after --hang-timeout by which every process of a hung run is gone
PROGRESS = re.compile(r"^Epoch: \[(\d+)\]\[\s*(\d+)/(\d+)\]")
TEMP_FILE = re.compile(r"^\..*\.tmp")


# ---------------------------------------------------------------- what a scenario runs

@dataclass(frozen=True)
class Setup:
    """One command line of a scenario, as the flags a user would change."""

    launcher: str = "single"  # single | spawn (--multiprocessing-distributed) | torchrun |
    #                           hosts (one process on each of two hosts, --dist-url)
    world: int = 1  # processes
    batch: int = 8  # images per process and micro-batch
    accum: int = 1  # --grad-accum-steps
    epochs: int = 2
    lr: float = 0.02
    scheduler: str = "cosine"  # step | multistep | cosine
    warmup: int = 0  # --lr-warmup-epochs
    ema: bool = False
    shards: bool = False
    workers: int = 0  # loader workers per process
    save_every: int = 0  # --save-every (0: at epoch ends only)
    hang_timeout: int = 0  # --hang-timeout, seconds (0: the default, half of --dist-timeout)
    keep: int = 0  # --keep-checkpoints

    def describe(self) -> str:
        parts = [f"{self.launcher}x{self.world}", f"-b {self.batch}", f"--epochs {self.epochs}",
                 self.scheduler, f"accum {self.accum}" if self.accum > 1 else "",
                 f"warmup {self.warmup}" if self.warmup else "", "ema" if self.ema else "",
                 "shards" if self.shards else "folder", f"-j {self.workers}",
                 f"--save-every {self.save_every}" if self.save_every else "",
                 f"--hang-timeout {self.hang_timeout}" if self.hang_timeout else "",
                 f"--keep-checkpoints {self.keep}" if self.keep else ""]
        return " ".join(p for p in parts if p)


def schedule_flags(s: Setup) -> list[str]:
    """--lr-scheduler and its shape; milestones after the warm-up (the config insists)."""
    if s.scheduler == "step":
        return ["--lr-scheduler", "step", "--lr-step-size", "1", "--lr-gamma", "0.5"]
    if s.scheduler == "multistep":
        return ["--lr-scheduler", "multistep", "--lr-milestones", str(s.warmup + 1),
                "--lr-gamma", "0.3"]
    return ["--lr-scheduler", "cosine"]


def flags(s: Setup) -> list[str]:
    """main.py's flags for ``s`` (without the data, the output folder and --resume)."""
    per_node = s.world if s.launcher == "spawn" else 1  # spawn splits -b and -j per node
    out = [*MODEL, "-b", str(s.batch * per_node), "-j", str(s.workers * per_node),
           "--grad-accum-steps", str(s.accum), "--epochs", str(s.epochs), "--lr", str(s.lr),
           *schedule_flags(s), "--lr-warmup-epochs", str(s.warmup), "--seed", "0"]
    if s.ema:
        out += ["--model-ema", "--model-ema-steps", "2"]
    if s.save_every:
        out += ["--save-every", str(s.save_every)]
    if s.hang_timeout:
        out += ["--hang-timeout", str(s.hang_timeout)]
    if s.keep:
        out += ["--keep-checkpoints", str(s.keep)]
    if s.launcher == "spawn":
        out += ["--multiprocessing-distributed", "--nproc-per-node", str(s.world)]
    return out


def command(s: Setup, data: Path, out: Path, resume: str | None = None,
            hosts: TwoHosts | None = None, forked: bool = False) -> list[str]:
    """The whole command line of ``s``, writing to ``out`` (``hosts``: where a two-host run's
    processes run). ``forked``: a one-node mp.spawn or single-process run forked from the
    pre-imported trainer (tests/prestart.py: the same bits as a plain start, without its
    imports), for the runs that are neither interrupted nor resumed."""
    args = [str(data), *flags(s), "--output-dir", str(out)]
    if resume:
        args += ["--resume", resume]
    if s.launcher == "hosts":
        if hosts is None:
            raise Unavailable("a two-host run without its hosts")
        return faults.on_two_hosts(hosts, [[sys.executable, MAIN, *args]] * s.world)
    if s.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(s.world), "--monitor-interval", "0.5", MAIN, *args]
    return prestarted_cmd(*args) if forked else [sys.executable, MAIN, *args]


@dataclass(frozen=True)
class Scenario:
    """A first command line, how it is interrupted, and the command line that resumes it."""

    name: str  # "seed:index"
    first: Setup
    final: Setup
    change: str  # what differs on resume ("none", "-b 8->5", ...)
    interrupt: str  # kill (at a step after a checkpoint) | term | kill-save | stop (a hang) |
    #                 fill (the disk) | link-down
    target: str  # main (the launcher's process) | group (every process of its session) | what
    #              a fault hits (rank R, the loader worker of rank R, disk, link)
    when: float  # where in the run (0-1 of its steps) the interruption is aimed
    where: str  # train | validation | ema-validation (the phase a SIGTERM is aimed at)
    delay: float  # seconds after the aimed-at line
    resume: str  # auto | path
    fault: str = "none"  # none | hang | full-disk | damaged | lost-link | slow-storage
    detail: str = ""  # the fault's own draw (bytes left, how damaged, mid-step or mid-save, MB/s)

    def describe(self) -> str:
        aim = f"{self.where}@{self.when:.2f}+{self.delay:.2f}s"
        fault = "" if self.fault == "none" else \
            f"{self.fault} ({self.detail}): " if self.detail else f"{self.fault}: "
        return (f"{self.name} {self.first.describe()} | {fault}{self.interrupt}->{self.target} "
                f"{aim} | change {self.change} | --resume {self.resume}")

    @property
    def in_a_save(self) -> bool:
        """Whether the interruption is aimed at a checkpoint's write (its temp file)."""
        return self.interrupt == "kill-save" or self.detail == "mid-save"


# ---------------------------------------------------------------- the seeded generator

LAUNCHES = [("single", 1)] * 4 + [("spawn", 2)] * 3 + [("torchrun", 2)] * 2 + \
    [("torchrun", 1), ("spawn", 1), ("spawn", 3)]
CHANGES = ["none"] * 4 + ["launch", "batch", "accum", "epochs", "lr", "schedule"]


FAULTS = ["hang", "full-disk", "damaged", "lost-link", "slow-storage"]
FAULT_SHARE = 0.4  # of the scenarios; the rest are the kills and SIGTERMs drawn as before
HANG_TIMEOUTS = [8, 15]  # --hang-timeout of a hang or a lost link, seconds


def scenario(seed: int, index: int) -> Scenario:
    """Scenario ``index`` of the matrix of ``seed``: the same pair always gives the same one.
    Whether it meets a fault is drawn apart (its own generator): a scenario without one is the
    one the matrix drew before the faults came."""
    sc, change, rng = interruption(seed, index)
    draw = random.Random(f"chaos-fault:{seed}:{index}")
    if draw.random() >= FAULT_SHARE:
        return sc
    return with_fault(sc, change, draw.choice(FAULTS), draw)


def interruption(seed: int, index: int) -> tuple[Scenario, str, random.Random]:
    """The scenario of a kill or SIGTERM, its change on resume, and its generator."""
    rng = random.Random(f"chaos:{seed}:{index}")
    launcher, world = rng.choice(LAUNCHES)
    first = Setup(launcher=launcher, world=world, batch=rng.choice([4, 5, 8]),
                  accum=rng.choice([1, 1, 2]), epochs=rng.choice([2, 3]),
                  lr=rng.choice([0.01, 0.02]), scheduler=rng.choice(["step", "multistep",
                                                                      "cosine"]),
                  warmup=rng.choice([0, 0, 1]), ema=rng.random() < 0.5,
                  shards=rng.random() < 0.3, workers=rng.choice([0, 0, 1]),
                  save_every=rng.choice([0, 2, 3]))
    change = rng.choice(CHANGES)
    final, said = changed(first, change, rng)
    interrupt = rng.choice(["kill", "kill", "term", "term", "kill-save"])
    where = "train" if interrupt != "term" else rng.choice(
        ["train", "train", "validation"] + ["ema-validation"] * first.ema)
    return Scenario(f"{seed}:{index}", first, final, said, interrupt,
                    rng.choice(["main", "group"]), round(rng.uniform(0.05, 0.95), 2), where,
                    round(rng.uniform(0, 0.3), 2), rng.choice(["auto", "path"])), change, rng


def with_fault(sc: Scenario, change: str, fault: str, rng: random.Random) -> Scenario:
    """``sc`` meeting ``fault`` instead of its kill or SIGTERM (its launch, options, change on
    resume and aim kept where the fault allows)."""
    first, how = sc.first, {"where": "train"}
    if fault == "hang":  # a rank stopped; at one process its loader worker (-j 1)
        first = dataclasses.replace(first, hang_timeout=rng.choice(HANG_TIMEOUTS),
                                    workers=first.workers if first.world > 1 else 1)
        rank = rng.randrange(first.world)
        how.update(interrupt="stop", target=f"the loader worker of rank {rank}"
                   if first.world == 1 else f"rank {rank}")
    elif fault == "full-disk":
        how.update(interrupt="fill", target="disk", detail=rng.choice(["2 MB left",
                                                                       "0 MB left"]))
    elif fault == "damaged":  # after a SIGKILL; an older checkpoint kept
        first = dataclasses.replace(first, keep=rng.choice([1, 2]))
        how.update(interrupt="kill", resume="auto", detail=rng.choice(["flip", "truncate"]))
    elif fault == "lost-link":
        first = dataclasses.replace(first, launcher="hosts", world=2,
                                    hang_timeout=rng.choice(HANG_TIMEOUTS))
        how.update(interrupt="link-down", target="link",
                   detail=rng.choice(["mid-step", "mid-save"]))
    else:  # slow storage: a SIGKILL while a slow write is under way, or a SIGTERM
        how.update(interrupt=rng.choice(["kill-save", "kill-save", "term"]),
                   detail=f"{rng.choice([1, 2])} MB/s")
        if how["interrupt"] == "term":
            how["where"] = rng.choice(["train", "validation"])
    final, said = changed(first, change, rng)
    return dataclasses.replace(sc, first=first, final=final, change=said, fault=fault, **how)


def changed(s: Setup, change: str, rng: random.Random) -> tuple[Setup, str]:
    """``s`` with one change a user makes on resume, and how to say it."""
    if change == "launch":
        options = [x for x in LAUNCHES if x != (s.launcher, s.world)]
        launcher, world = rng.choice(options)
        return dataclasses.replace(s, launcher=launcher, world=world), \
            f"{s.launcher}x{s.world}->{launcher}x{world}"
    if change == "batch":
        batch = rng.choice([b for b in (4, 5, 6, 8) if b != s.batch])
        return dataclasses.replace(s, batch=batch), f"-b {s.batch}->{batch}"
    if change == "accum":
        accum = 2 if s.accum == 1 else 1
        return dataclasses.replace(s, accum=accum), f"--grad-accum-steps {s.accum}->{accum}"
    if change == "epochs":
        return dataclasses.replace(s, epochs=s.epochs + 1), f"--epochs {s.epochs}->{s.epochs + 1}"
    if change == "lr":
        return dataclasses.replace(s, lr=s.lr * 2), f"--lr {s.lr}->{s.lr * 2}"
    if change == "schedule":
        other = rng.choice([x for x in ("step", "multistep", "cosine") if x != s.scheduler])
        return dataclasses.replace(s, scheduler=other), f"--lr-scheduler {s.scheduler}->{other}"
    return s, "none"


# ---------------------------------------------------------------- processes

class Leg:
    """One command in a session of its own; every process it starts is tagged, so that
    torchrun's workers (in sessions of their own) and orphans are found too."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.cmd, self.log, self.token = cmd, log, uuid.uuid4().hex
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True, cwd=ROOT,
                                     env=child_env(PYTHONUNBUFFERED="1", CHAOS_TOKEN=self.token,
                                                   **(env or {})))
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.lines.append("")  # end of output
            self.changed.notify_all()

    def next_line(self, seen: int, deadline: float) -> str | None:
        """Line number ``seen`` once printed; None at the end of the output or the deadline."""
        with self.changed:
            while len(self.lines) <= seen:
                if not self.changed.wait(timeout=max(deadline - time.monotonic(), 0)):
                    return None
            return self.lines[seen] or None

    def wait_for(self, text: str, timeout: float = LEG_TIMEOUT) -> bool:
        """Whether a line containing ``text`` is printed (False: the output ended first)."""
        seen, deadline = 0, time.monotonic() + timeout
        while (line := self.next_line(seen, deadline)) is not None:
            if text in line:
                return True
            seen += 1
        return False

    def send(self, sig: int, group: bool) -> None:
        try:
            (os.killpg if group else os.kill)(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float = LEG_TIMEOUT) -> int | None:
        """The exit code; None (everything killed) after ``timeout`` seconds. The log is
        written now and again by ``write_log`` (orphans may print after their launcher)."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            code = None
        self.reader.join(timeout=10)
        self.write_log(code)
        return code

    def write_log(self, code: int | None) -> None:
        self.log.write_text(f"$ {' '.join(self.cmd)}\n{self.output}\n[exit {code}]\n")

    def pids(self) -> list[int]:
        """The live processes started by this leg (orphans included)."""
        return tagged(self.token)

    def kill_all(self) -> None:
        self.send(signal.SIGKILL, group=True)
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    @property
    def output(self) -> str:
        return "".join(self.lines)


def tagged(token: str) -> list[int]:
    """Live (not zombie) processes whose CHAOS_TOKEN is ``token``."""
    return [pid for pid, _, _ in faults.processes(token)]


class Background:
    """``fn(*args)`` in a thread; ``result()`` waits for it (and raises what it raised)."""

    def __init__(self, fn, *args) -> None:
        self._result, self._error = None, None

        def run() -> None:
            try:
                self._result = fn(*args)
            except BaseException as exc:  # handed to result()
                self._error = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def run_to_end(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> \
        tuple[int | None, str]:
    leg = Leg(cmd, log, env)
    code = leg.wait()
    return code, leg.output


# ---------------------------------------------------------------- the interruption

@dataclass
class Interrupted:
    """What happened to the first command line."""

    code: int | None
    output: str
    sent: str  # what was done, when ("" if nothing was)
    orphans: list[int] = field(default_factory=list)  # still running ORPHAN_GRACE s later
    pinned: int | None = None  # the global step of the checkpoint complete when it was done
    gone: float | None = None  # seconds from then until no process of the run was left
    problems: list[str] = field(default_factory=list)  # found right after it (fault checks)


def checkpoint_exists(out: Path) -> bool:
    return (out / "checkpoint.pth.tar").is_file()


class Trigger:
    """The interruption, done once: the checkpoint in place pinned first (no lost checkpoint),
    the time noted (a hung run's end is timed from it)."""

    def __init__(self, action, checkpoint: Path) -> None:
        self.action, self.checkpoint = action, checkpoint
        self.pin = faults.Pin()
        self.what: str | None = None
        self.at: float | None = None

    def __call__(self) -> None:
        if self.what is not None:
            return
        self.pin.take(self.checkpoint)
        self.at = time.monotonic()
        self.what = self.action()


def action(sc: Scenario, leg: Leg, view: Path, hosts: TwoHosts | None):
    """What the interruption of ``sc`` does to the run of ``leg`` (``view``: its output folder
    as the run sees it); each returns what it did."""
    if sc.interrupt == "stop":
        rank = int(sc.target.split()[-1])
        return lambda: faults.stop(leg.token, sc.first.launcher, rank,
                                   sc.target.startswith("the loader worker"), leg.proc.pid)
    if sc.interrupt == "fill":
        return lambda: faults.fill(view, int(sc.detail.split()[0]) * 1_000_000)
    if sc.interrupt == "link-down":
        return lambda: faults.take_link(hosts, up=False)
    sig = signal.SIGKILL if sc.interrupt.startswith("kill") else signal.SIGTERM

    def send() -> str:
        leg.send(sig, sc.target == "group")
        return signal.Signals(sig).name

    return send


def interrupt(sc: Scenario, cmd: list[str], out: Path, log: Path,
              env: dict[str, str] | None = None, hosts: TwoHosts | None = None) -> Interrupted:
    """Run the first command line and interrupt it as ``sc`` says."""
    placed = placed_fault(sc)
    if placed:
        env = {**(env or {}), "IMAGENET_FAILPOINTS": placed}
    leg = Leg(cmd, log, env)
    view = faults.seen_by(leg.proc.pid, out) if sc.fault == "full-disk" else out
    trigger = Trigger(action(sc, leg, view, hosts), view / "checkpoint.pth.tar")
    sent = fire_at_the_point(sc, leg, trigger) if placed else aim(sc, leg, view, trigger)
    timeout = LEG_TIMEOUT
    if sc.interrupt in ("stop", "link-down") and trigger.at is not None:  # a hang ends itself
        timeout = trigger.at + sc.first.hang_timeout + HANG_GRACE + 10 - time.monotonic()
    code = leg.wait(max(timeout, 1))
    grace = ORPHAN_GRACE
    if sc.first.hang_timeout and trigger.at is not None:  # a hang: timed from the fault
        grace = max(trigger.at + sc.first.hang_timeout + HANG_GRACE - time.monotonic(), grace)
    deadline = time.monotonic() + grace
    while leg.pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    orphans = leg.pids()
    gone = time.monotonic() - trigger.at if trigger.at is not None and not orphans else None
    leg.kill_all()
    leg.write_log(code)
    return Interrupted(code, leg.output, f"{trigger.what} {sent}" if sent else "", orphans,
                       trigger.pin.global_step(), gone)


def placed_fault(sc: Scenario) -> str | None:
    """The failpoint (``IMAGENET_FAILPOINTS``) at which rank 0 pauses itself (SIGSTOP) where
    ``sc`` aims its interruption at a named point: a checkpoint's write (the second or a later
    one: the first is whole in place; every epoch writes two at least), or the first batch of
    the aimed epoch's validation (of the model, or of its EMA). The interruption is then done
    from here while the run is paused there (``fire_at_the_point``), not at a line read late.
    None: aimed at a step of training (``aim``)."""
    s = sc.first
    if sc.in_a_save:
        return fault_at("save.write@0", 2 + int(sc.when * 2 * (s.epochs - 1)), "sigstop")
    if sc.interrupt != "term" or sc.where == "train":
        return None
    # Rank 0's validation batches (every world-th image, in batches of -b per process), each
    # validation of the model followed by its EMA's.
    batches = math.ceil(math.ceil(VAL_IMAGES / s.world) / s.batch)
    epoch = min(int(sc.when * s.epochs), s.epochs - 1)
    hit = epoch * batches * (1 + s.ema) + batches * (sc.where == "ema-validation") + 1
    return fault_at("validate.batch@0", hit, "sigstop")


def stopped(token: str) -> list[int]:
    """The processes of the leg tagged ``token`` that are stopped (SIGSTOP)."""
    found = []
    for pid in tagged(token):
        with contextlib.suppress(OSError, IndexError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
                found.append(pid)
    return found


def fire_at_the_point(sc: Scenario, leg: Leg, fire) -> str | None:
    """Once the leg has paused itself at its failpoint (``placed_fault``): ``fire``, then let
    it go on (SIGCONT); where that was, or None if the run ended first. On slow storage the
    write goes on first, and is interrupted half a second into its bytes (1 or 2 MB/s: a
    checkpoint takes 3 to 6 s)."""
    deadline = time.monotonic() + LEG_TIMEOUT
    while leg.proc.poll() is None and time.monotonic() < deadline:
        paused = stopped(leg.token)
        if paused:
            slow = sc.in_a_save and sc.fault == "slow-storage"
            if not slow:
                fire()
            for pid in paused:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            if slow:
                time.sleep(0.5)
                fire()
            if sc.in_a_save:
                return "during a save (rank 0 paused as it writes, a failpoint)"
            return f"in the {'EMA ' * (sc.where == 'ema-validation')}validation (rank 0 " \
                "paused after a batch, a failpoint)"
        time.sleep(0.02)
    return None


def aim(sc: Scenario, leg: Leg, out: Path, fire) -> str | None:
    """Follow the output to the aimed-at step of training (after the first checkpoint), wait
    ``sc.delay`` and ``fire``; where that was, or None if the run ended first. (Faults at a
    named point - a validation, a checkpoint's write - are placed by ``placed_fault``.)"""
    deadline = time.monotonic() + LEG_TIMEOUT
    seen = 0
    while (line := leg.next_line(seen, deadline)) is not None:
        seen += 1
        match = PROGRESS.match(line)
        if match:
            epoch, step, steps = map(int, match.groups())
            if (epoch * steps + step) / (sc.first.epochs * steps) < sc.when or \
                    not checkpoint_exists(out):
                continue
            time.sleep(sc.delay)
            fire()
            return f"after epoch {epoch} step {step}"
    return None


# ---------------------------------------------------------------- references and checks

def source_hash() -> str:
    """The trainer's code: a reference run by other code is not a reference."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "imagenet").rglob("*.py")) + [Path(MAIN)]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class References:
    """Uninterrupted runs of final command lines, run once and kept in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.code = source_hash()
        self.runs = 0

    def get(self, s: Setup, data: Path, hosts: TwoHosts | None = None) -> \
            tuple[Path, str | None]:
        """The output folder of ``s``'s uninterrupted run, and a problem with it (or None);
        ``hosts``: where a two-host run runs (not the scenario's: its link goes down). The
        reference leaves out --hang-timeout and --keep-checkpoints: they say what happens on a
        failure and what is kept, not what is trained (were they to change it, the scenario
        would deviate), so scenarios with and without them share it."""
        s = dataclasses.replace(s, hang_timeout=0, keep=0)
        key = hashlib.sha256(json.dumps([self.code, str(data), flags(s), s.launcher,
                                         s.world]).encode()).hexdigest()[:16]
        out = self.folder / key
        done = out / "chaos-reference-done"
        if not done.is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            self.runs += 1
            code, output = run_to_end(command(s, data, out / "run", hosts=hosts, forked=True),
                                      out / "log.txt")
            if code != 0:
                return out / "run", f"the uninterrupted run exited {code} (see {out}/log.txt)"
            done.write_text("ok\n")
        return out / "run", None


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


TORCHRUN_OWN = ("SignalException", "ChildFailedError")


def tracebacks(output: str, torchrun_own: bool) -> list[str]:
    """The last line of every Python traceback in ``output``; with ``torchrun_own``, torchrun's
    own SignalException (how its agent reports a SIGTERM) and ChildFailedError (how it reports
    workers that exited with a code) are not the trainer's."""
    found = []
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            last = next((x for x in lines[i + 1:] if x and not x.startswith(" ")), "?")
            if not (torchrun_own and any(name in last for name in TORCHRUN_OWN)):
                found.append(last)
    return found


def expected_first_codes(sc: Scenario) -> set[int]:
    """The exit codes the interrupted command may end with: what a requeue expects."""
    if sc.interrupt in ("kill", "kill-save"):
        return {-signal.SIGKILL}
    if sc.first.launcher == "torchrun":
        # torchrun's agent ends with its own code: SignalException on a SIGTERM, ChildFailedError
        # when its workers end with a code (143 after a SIGTERM or a hang, 1 on a full disk)
        return {1}
    return {1} if sc.interrupt == "fill" else {143}


def equal_tensors(a: dict, b: dict, where: str) -> list[str]:
    """Keys of two state dicts whose tensors differ (or are missing)."""
    bad = [k for k in b if k not in a or not (isinstance(b[k], torch.Tensor) and
                                              a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))
           and not (not isinstance(b[k], torch.Tensor) and a[k] == b[k])]
    return [f"{where}: {len(bad)} entries differ (e.g. {bad[0]})"] if bad else []


def evaluated(data: Path, best: Path, ema: bool, log: Path) -> str | None:
    """' * Acc@1' of ``main.py -e --resume best`` (one process, forked from the pre-imported
    trainer; None if it failed). Its report files go beside the log, not into the working
    directory."""
    cmd = prestarted_cmd(str(data), *MODEL, "-b", "8", "-j", "0", "-e", "--resume", str(best),
                         *(["--model-ema"] if ema else []), "--output-dir",
                         str(log.with_suffix("")))
    code, output = run_to_end(cmd, log)
    found = re.findall(r"^ \* Acc@1 (\S+) ", output, flags=re.M)
    return found[0] if code == 0 and len(found) == 1 else None


def check(sc: Scenario, data: Path, out: Path, first: Interrupted, resumed: tuple,
          ref: Path, logs: Path) -> list[str]:
    """Every deviation of the scenario from its uninterrupted reference."""
    bad: list[str] = list(first.problems)
    torchrun_own = sc.first.launcher == "torchrun" and sc.interrupt in ("term", "stop", "fill")
    if first.code not in expected_first_codes(sc):
        bad.append(f"interrupted run exited {first.code}, expected "
                   f"{sorted(expected_first_codes(sc))}")
    code, output, resumed_at = resumed
    if code != 0:
        bad.append(f"resumed run exited {code}")
    for name, text in (("interrupted", first.output), ("resumed", output)):
        bad += [f"traceback in the {name} run: {last}"
                for last in tracebacks(text, torchrun_own and name == "interrupted")]
        if re.search(r"^frame #\d+: ", text, flags=re.M):
            bad.append(f"C++ stack frames in the {name} run's output")
    if code != 0:
        return bad
    bad += check_records(sc, out, ref, resumed_at)
    bad += check_files(sc, data, out, ref, logs)
    return bad


def check_records(sc: Scenario, out: Path, ref: Path, resumed_at: int) -> list[str]:
    """metrics.jsonl: every epoch once, whole; the learning rate of the fresh run."""
    bad = []
    got, want = records(out), records(ref)
    epochs = [r.get("epoch") for r in got]
    if epochs != list(range(sc.final.epochs)):
        bad.append(f"metrics.jsonl epochs {epochs}")
    fields = ["train_loss", "train_images", "val_acc1", "val_count"] + \
        ["ema_val_acc1", "ema_val_count"] * sc.final.ema
    for record in got:
        missing = [f for f in fields if f not in record]
        if missing:
            bad.append(f"epoch {record.get('epoch')} lacks {missing}")
        for count in ("val_count", "ema_val_count"):
            if count in record and record[count] != VAL_IMAGES:
                bad.append(f"epoch {record['epoch']}: {count} {record[count]} != {VAL_IMAGES}")
    by_epoch = {r.get("epoch"): r for r in want}
    for record in got:
        epoch = record.get("epoch")
        if epoch is None or epoch < resumed_at or epoch not in by_epoch:
            continue
        if record.get("lr") != by_epoch[epoch].get("lr"):
            bad.append(f"lr at the end of epoch {epoch}: {record.get('lr')} != the fresh "
                       f"run's {by_epoch[epoch].get('lr')}")
        if sc.change == "none" and record.get("train_images") != by_epoch[epoch].get(
                "train_images"):
            bad.append(f"epoch {epoch}: train_images {record.get('train_images')} != "
                       f"{by_epoch[epoch].get('train_images')}")
    return bad


def check_files(sc: Scenario, data: Path, out: Path, ref: Path, logs: Path) -> list[str]:
    """The checkpoints: bitwise the reference's when nothing changed; the best files
    evaluate (-e) to the recorded best; no temp files left."""
    bad = []
    try:  # a damaged file is a deviation to report, not the harness's end (seed 29005:54)
        final = files.load_checkpoint(out / "checkpoint.pth.tar")
    except CheckpointError as exc:
        return [f"the final checkpoint.pth.tar does not load: {exc}"]
    lines = records(out)
    if sc.change == "none":
        want = load(ref / "checkpoint.pth.tar")
        bad += equal_tensors(final["state_dict"], want["state_dict"], "weights")
        if sc.final.ema:
            bad += equal_tensors(final["ema"], want["ema"], "EMA weights")
        for file in ("model_best.pth.tar", "model_best_ema.pth.tar")[:1 + sc.final.ema]:
            if (out / file).is_file() and (ref / file).is_file():
                bad += equal_tensors(load(out / file)["state_dict"],
                                     load(ref / file)["state_dict"], file)
        for key in ("best_acc1", "best_ema_acc1", "global_step"):
            if final.get(key) != want.get(key):
                bad.append(f"{key} {final.get(key)} != the fresh run's {want.get(key)}")
    evaluations = []
    for best_key, file, prefix in (("best_acc1", "model_best.pth.tar", "val_"),
                                   ("best_ema_acc1", "model_best_ema.pth.tar", "ema_val_")):
        if best_key == "best_ema_acc1" and not sc.final.ema:
            continue
        recorded = final.get(best_key)
        seen = max((r[f"{prefix}acc1"] for r in lines if f"{prefix}acc1" in r), default=None)
        if recorded != seen:
            bad.append(f"{best_key} {recorded} != the best of metrics.jsonl {seen}")
        if not (out / file).is_file():
            bad.append(f"no {file}")
            continue
        evaluations.append((file, recorded, Background(
            evaluated, data, out / file, best_key == "best_ema_acc1", logs / f"eval-{file}.txt")))
    for file, recorded, evaluation in evaluations:  # both at once
        acc1 = evaluation.result()
        if acc1 != f"{recorded:.3f}":
            bad.append(f"-e --resume {file} gives Acc@1 {acc1}, recorded {recorded:.3f}")
    left = [p.name for p in out.iterdir() if TEMP_FILE.match(p.name)]
    if left:
        bad.append(f"temp files left: {left}")
    return bad


def nothing_stopped(first: Interrupted) -> bool:
    """A hang aimed at a process that was not there (a loader worker that had finished its
    epoch): no hang happened, so there is nothing of one to check and the scenario is missed."""
    return "nothing stopped (" in first.sent


def fault_problems(sc: Scenario, out: Path, first: Interrupted) -> list[str]:
    """What the first command line left that the scenario's fault forbids: a lost checkpoint
    (every scenario); a hang's report, error lines and end; a full disk's one line; an injection
    that did not take."""
    bad = []
    if first.orphans:
        bad.append(f"{len(first.orphans)} process(es) of the interrupted run still running "
                   f"{ORPHAN_GRACE:.0f} s after it ended")
    lost = faults.lost_checkpoint(first.pinned, out / "checkpoint.pth.tar")
    if lost:
        bad.append(lost)
    errors = [x for x in first.output.splitlines() if re.match(r"(\[rank \d+\] )?error:", x)]
    # A run that ended with 0 had no hang to check: its fault came after the last collective
    # (a link taken down as the run ended: seed 29004, scenario 17), and the scenario is missed.
    if sc.interrupt in ("stop", "link-down") and not nothing_stopped(first) and first.code != 0:
        limit = sc.first.hang_timeout + HANG_GRACE
        if first.gone is None or first.gone > limit:
            took = f"{first.gone:.0f} s" if first.gone is not None else "not all gone"
            bad.append(f"the hung run's processes took longer than --hang-timeout + "
                       f"{HANG_GRACE:.0f} s = {limit:.0f} s to end ({took})")
        bad += faults.hang_report(out, int(sc.target.split()[-1])
                                  if sc.interrupt == "stop" else None)
        if not errors or any("error: hang: rank " not in x for x in errors) or \
                (sc.interrupt == "link-down" and len(errors) != sc.first.world):
            bad.append(f"the hang's error lines: {errors}")
    if sc.interrupt == "fill" and first.code == 0:  # filled after the last write (29005:43)
        bad += faults.finished_whole(out, sc.first.epochs)
    elif sc.interrupt == "fill":  # rank 0 writes; the others say its line, or that it failed
        own = [x for x in errors if x.startswith("error: cannot write ")]
        said = own[0].removeprefix("error: ") if len(own) == 1 else None
        if said is None or any(x not in own and re.sub(r"^\[rank \d+\] error: ", "", x)
                               not in (said, f"rank 0 failed: {said}") for x in errors):
            bad.append(f"the full disk's error lines (one 'cannot write' expected): {errors}")
    if sc.fault == "slow-storage" and faults.SLOW_STORAGE_LINE not in first.output:
        bad.append("the slow storage was not injected")
    return bad


def damaged_resume(sc: Scenario, data: Path, out: Path, folder: Path,
                   hosts: TwoHosts | None) -> tuple[int | None, str, int, str, list[str]]:
    """Damage checkpoint.pth.tar and resume (--resume auto): it names the damage in one line and
    falls back to the newest intact checkpoint; with none, it refuses in one error line, and
    the user removes the file and starts afresh. The exit code and output of the run that
    finished the job, the epoch it began in, what happened, and the deviations."""
    fallbacks = faults.intact_fallbacks(out)
    faults.damage(out / "checkpoint.pth.tar", sc.detail)
    cmd = command(sc.final, data, out, "auto", hosts)
    code, output = run_to_end(cmd, folder / "resumed.txt")
    if not fallbacks:
        errors = [x for x in output.splitlines() if x.startswith("error:")]
        bad = [] if code == 1 and len(errors) == 1 and "no intact checkpoint to fall back to" \
            in errors[0] else [f"resume without an intact checkpoint exited {code}, its error "
                               f"lines {errors}"]
        (out / "checkpoint.pth.tar").unlink()
        code, output = run_to_end(cmd, folder / "resumed-afresh.txt")
        return code, output, 0, "no intact checkpoint: refused, then started afresh", bad
    notices = re.findall(r"resuming from (\S+) instead, the newest intact checkpoint", output)
    newest = max(at["global_step"] for at in fallbacks.values())
    older = fallbacks.get(Path(notices[0])) if len(notices) == 1 else None
    if older is None or older["global_step"] != newest:
        return code, output, 0, "", [f"the damage notices {notices}: one naming the newest "
                                         f"intact checkpoint (step {newest}) expected"]
    return code, output, older["epoch"], f"fell back to {Path(notices[0]).name} (epoch " \
        f"{older['epoch']} step {older['step_in_epoch']})", []


def run_first(sc: Scenario, data: Path, folder: Path, hosts: TwoHosts | None) -> Interrupted:
    """The first command line, interrupted as ``sc`` says (with a full disk, on a tmpfs of its
    own, whose files come back to the output folder afterwards); the fault's checks run."""
    out = folder / "out"
    cmd, env, keep = command(sc.first, data, out, hosts=hosts), None, folder / "disk"
    if sc.fault == "full-disk":
        out.mkdir()
        keep.mkdir()
        cmd = faults.on_tmpfs(cmd, out, keep)
    if sc.fault == "slow-storage":
        env = faults.slow_storage_env(folder, float(sc.detail.split()[0]), ROOT)
    first = interrupt(sc, cmd, out, folder / "first.txt", env, hosts)
    if sc.fault == "full-disk":
        faults.move_back(keep, out)
    first.problems = fault_problems(sc, out, first)
    return first


@dataclass
class Outcome:
    scenario: Scenario
    deviations: list[str]
    note: str  # what was sent, where the resume began
    missed: str = ""  # why the scenario tested nothing (the run ended first, a skipped fault)
    seconds: float = 0.0

    def line(self) -> str:
        verdict = "DEVIATION: " + "; ".join(self.deviations) if self.deviations else \
            f"missed ({self.missed})" if self.missed else "ok"
        return f"{self.scenario.describe()} | {self.note} | {verdict} ({self.seconds:.0f} s)"


def prepare_data(workdir: Path) -> dict[str, Path]:
    """The JPEG folder and its tar shards (made once in ``workdir``)."""
    folder, shards = workdir / "data" / "folder", workdir / "data" / "shards"
    if not (shards / "_info.json").is_file():
        shutil.rmtree(workdir / "data", ignore_errors=True)
        write_image_folder(folder, classes=CLASSES, train_per_class=TRAIN_PER_CLASS,
                           val_per_class=VAL_PER_CLASS)
        subprocess.run([sys.executable, "-m", "imagenet.tools.prepare", "--from-folder",
                        str(folder), "--out", str(shards), "--shard-max-images", "12"],
                       cwd=ROOT, env=child_env(), check=True, capture_output=True, timeout=300)
    return {"folder": folder, "shards": shards}


def run_scenario(sc: Scenario, workdir: Path, refs: References) -> Outcome:
    """Interrupt, resume and check one scenario in ``workdir``/scenarios/<name>."""
    start = time.monotonic()
    data = prepare_data(workdir)["shards" if sc.first.shards else "folder"]
    folder = workdir / "scenarios" / sc.name.replace(":", "-")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        with contextlib.ExitStack() as stack:
            # The scenario's hosts, and others for its reference: the link of these goes down.
            hosts = [stack.enter_context(TwoHosts()) if s.launcher == "hosts" else None
                     for s in (sc.first, sc.final)]
            if sc.fault == "full-disk" and faults.full_disk_problem():
                raise Unavailable(faults.full_disk_problem())
            outcome = play(sc, data, folder, refs, hosts[0], hosts[1])
    except Unavailable as exc:
        outcome = Outcome(sc, [], "", missed=f"skipped: {exc}")
    outcome.seconds = time.monotonic() - start
    return outcome


def play(sc: Scenario, data: Path, folder: Path, refs: References, hosts: TwoHosts | None,
         ref_hosts: TwoHosts | None) -> Outcome:
    out = folder / "out"
    # The reference (if not cached yet) runs meanwhile: on 2 cores the wall time halves.
    reference = Background(refs.get, sc.final, data, ref_hosts)
    try:
        first = run_first(sc, data, folder, hosts)
        if not first.sent:
            return Outcome(sc, [], "", missed="the run ended before the aimed-at point")
        if nothing_stopped(first):
            return Outcome(sc, first.problems, first.sent, missed=first.sent)
        if not checkpoint_exists(out):
            return Outcome(sc, ["no checkpoint after the interruption", *first.problems],
                           first.sent)
        saved = load(out / "checkpoint.pth.tar")
        if first.code == 0 or (first.code == -signal.SIGTERM and
                               saved["epoch"] == sc.first.epochs):
            # The run finished all the same (the fault came too late to matter, or the signal
            # after the trainer's handlers were gone): nothing to test.
            return Outcome(sc, first.problems, first.sent,
                           missed=f"exit {first.code}: the run ended before it mattered")
        if sc.interrupt == "link-down":
            faults.take_link(hosts, up=True)
        at = f"resumed at epoch {saved['epoch']} step {saved['step_in_epoch']}"
        if sc.fault == "damaged":
            code, output, resumed_at, at, bad = damaged_resume(sc, data, out, folder, hosts)
            first.problems += bad
        else:
            resume = "auto" if sc.resume == "auto" else str(out / "checkpoint.pth.tar")
            code, output = run_to_end(command(sc.final, data, out, resume, hosts),
                                      folder / "resumed.txt")
            resumed_at = saved["epoch"]
        ref, problem = reference.result()
        if problem:
            return Outcome(sc, [problem], f"{first.sent}; {at}")
        bad = check(sc, data, out, first, (code, output, resumed_at), ref, folder)
        return Outcome(sc, bad, f"{first.sent}; {at}")
    finally:
        with contextlib.suppress(Exception):
            reference.result()  # never left running: its hosts go when this scenario ends


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, required=True, help="the matrix's seed")
    parser.add_argument("-n", type=int, default=10, help="scenarios to run (default 10)")
    parser.add_argument("--first", type=int, default=0, help="index of the first scenario")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where runs and the reference cache go (default: /tmp/chaos)")
    parser.add_argument("--keep", action="store_true", help="keep the output of ok scenarios")
    parser.add_argument("--list", action="store_true", help="print the scenarios, run nothing")
    args = parser.parse_args(argv)
    if args.list:
        for index in range(args.first, args.first + args.n):
            print(scenario(args.seed, index).describe())
        return 0
    workdir = args.workdir or Path("/tmp/chaos")
    refs = References(workdir / "refs")
    outcomes = []
    for index in range(args.first, args.first + args.n):
        outcome = run_scenario(scenario(args.seed, index), workdir, refs)
        print(outcome.line(), flush=True)
        if not outcome.deviations and not args.keep:
            shutil.rmtree(workdir / "scenarios" / outcome.scenario.name.replace(":", "-"),
                          ignore_errors=True)
        outcomes.append(outcome)
    deviating = [o for o in outcomes if o.deviations]
    print(f"{len(outcomes)} scenarios (seed {args.seed}): {counts(outcomes)}; by fault: "
          + "; ".join(f"{fault} {counts([o for o in outcomes if o.scenario.fault == fault])}"
                      for fault in ["none", *FAULTS])
          + f"; {refs.runs} reference run(s); {math.fsum(o.seconds for o in outcomes):.0f} s",
          flush=True)
    return 1 if deviating else 0


def counts(outcomes: list[Outcome]) -> str:
    deviating = sum(bool(o.deviations) for o in outcomes)
    missed = sum(bool(o.missed) and not o.deviations for o in outcomes)
    return f"{len(outcomes) - deviating - missed} ok, {deviating} with deviations, {missed} missed"


if __name__ == "__main__":
    sys.exit(main())
