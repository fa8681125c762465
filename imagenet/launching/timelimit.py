"""--time-limit: stop at a step boundary, saved, before the job's wall-clock limit; the next job
continues with --resume auto.

DURATION is seconds (``5400``), ``HH:MM:SS`` or ``D-HH:MM:SS``, counted from the start of
main.py (under --multiprocessing-distributed the parent's start; under torchrun and srun each
worker's own), or ``slurm``: the end time of this SLURM job, from SLURM_JOB_END_TIME when the
job's environment has it, else ``squeue -h -j $SLURM_JOB_ID -o %e``.

Rank 0 keeps the clock (``Deadline``). After every optimizer step and every validation batch it
asks whether the time left still covers ``margin``: two steps (the stop is agreed over the
ranks one step later, and a spare), two saves (the last one measured; before any, the
checkpoint's size at 50 MB/s) and ``EXIT_SECONDS`` to leave. When it does not, the stop is
agreed like a preemption (``preemption.StopFlag``): every rank stops after the same step, the
state is saved, one line says so and the process exits with code 143, as a preempted one does,
so that requeue scripts and chained jobs treat both alike. A job that starts after the last
epoch says "nothing left to train" and exits 0 at once (``nothing_left``).
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from imagenet.errors import RunError, TimeLimitReached, TrainerError, UsageError
from imagenet.launching.rendezvous import raise_agreed
from imagenet.settings.duration import parse_duration

if TYPE_CHECKING:
    from imagenet.launching.rendezvous import DistInfo
    from imagenet.settings.flags import Config

log = logging.getLogger(__name__)

STARTED_ENV = "IMAGENET_TRAINER_STARTED"  # a spawning main.py's start (unix time), for its ranks
EXIT_SECONDS = 10.0  # after the last save: loader workers, the process group, the exit
STEPS_REMEMBERED = 20  # the longest of the last 20 intervals between checks is "a step"
WRITE_BYTES_PER_SECOND = 50e6  # assumed for the first save, until one is measured
SQUEUE_TIMEOUT = 30.0  # seconds


def process_start(env: Mapping[str, str] = os.environ) -> float:
    """When this main.py started (unix time): the spawning parent's start for its ranks, else
    this process's start from /proc (the time of this call where there is no /proc)."""
    if env.get(STARTED_ENV):
        return float(env[STARTED_ENV])
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def slurm_end_time(env: Mapping[str, str]) -> float | None:
    """This SLURM job's end time (unix time); None when it has none (no time limit)."""
    if env.get("SLURM_JOB_END_TIME"):
        return float(env["SLURM_JOB_END_TIME"])
    job = env.get("SLURM_JOB_ID")
    if not job:
        raise UsageError("--time-limit slurm: this process does not run in a SLURM job (no "
                         "SLURM_JOB_ID); give a duration instead")
    command = ["squeue", "-h", "-j", job, "-o", "%e"]
    shown = " ".join(command)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SQUEUE_TIMEOUT,
                              env=dict(env))
    except FileNotFoundError:
        raise RunError(f"--time-limit slurm: `{shown}` cannot run (squeue is not on PATH); "
                       "give a duration instead") from None
    except subprocess.TimeoutExpired:
        raise RunError(f"--time-limit slurm: `{shown}` gave no answer in {SQUEUE_TIMEOUT:g} s; "
                       "give a duration instead") from None
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[0]
        raise RunError(f"--time-limit slurm: `{shown}` failed ({reason}); give a duration "
                       "instead")
    text = (done.stdout.strip().splitlines() or [""])[0].strip()
    if text in ("", "N/A", "NONE", "Unknown", "UNLIMITED"):
        return None
    try:  # squeue prints local time
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise RunError(f"--time-limit slurm: `{shown}` printed {text!r}, not an end time; give "
                       "a duration instead") from None


def end_time(cfg: Config, env: Mapping[str, str]) -> tuple[float, str] | None:
    """When --time-limit ends this run (unix time) and how to name that end; None: no limit."""
    if cfg.time_limit is None:
        return None
    if cfg.time_limit == "slurm":
        end = slurm_end_time(env)
        if end is None:
            log.warning("--time-limit slurm: SLURM job %s has no end time; training without a "
                        "time limit", env.get("SLURM_JOB_ID"))
            return None
        return end, f"the end of SLURM job {env.get('SLURM_JOB_ID', '?')} at {clock(end)}"
    end = process_start(env) + parse_duration(cfg.time_limit)
    return end, f"--time-limit {cfg.time_limit} at {clock(end)}"


def clock(when: float) -> str:
    """A unix time as the local wall clock, to the second."""
    return datetime.datetime.fromtimestamp(when).strftime("%Y-%m-%d %H:%M:%S")


def duration(seconds: float) -> str:
    """Seconds as '1 h 02 min', '3 min 20 s' or '12.5 s'."""
    if seconds >= 3600:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
    if seconds >= 60:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{seconds:.1f} s"


class Deadline:
    """Whether a run must stop now to save and exit before ``end`` (see the module docstring)."""

    def __init__(self, end: float, name: str, save_seconds: float,
                 now: Callable[[], float] = time.time) -> None:
        self.end, self.name, self.save_seconds, self.now = end, name, save_seconds, now
        self.intervals: deque[float] = deque(maxlen=STEPS_REMEMBERED)
        self.last = now()
        self.stopped_at: float | None = None

    @property
    def step_seconds(self) -> float:
        """A step, as the longest of the last intervals between checks."""
        return max(self.intervals, default=0.0)

    def margin(self) -> float:
        """Seconds a stop decided now still needs: two steps, two saves and the exit."""
        return 2 * self.step_seconds + 2 * self.save_seconds + EXIT_SECONDS

    def due(self) -> bool:
        """Called at every step boundary: True once the time left does not cover ``margin``."""
        now = self.now()
        self.intervals.append(now - self.last)
        self.last = now
        if now + self.margin() < self.end:
            return False
        self.stopped_at = now
        return True

    def saved(self, seconds: float) -> None:
        """A save took ``seconds``: the estimate from now on (and not a step)."""
        self.save_seconds = seconds
        self.last = self.now()

    def describe(self) -> str:
        """Why it stopped, for the one line."""
        left = self.end - (self.stopped_at if self.stopped_at is not None else self.now())
        when = f"{duration(left)} before" if left >= 0 else f"{duration(-left)} after"
        return (f"{when} {self.name} (a step takes up to {self.step_seconds:.1f} s, a save "
                f"{self.save_seconds:.1f} s)")


def deadline(cfg: Config, info: DistInfo, checkpoint_bytes: Callable[[], int],
             env: Mapping[str, str] = os.environ) -> Deadline | None:
    """Rank 0's Deadline for --time-limit (None on other ranks and without a limit);
    ``checkpoint_bytes()`` estimates what a save writes. Collective: rank 0's error is raised
    on every rank."""
    if cfg.time_limit is None:
        return None
    error, found = None, None
    if info.is_main:
        try:
            found = end_time(cfg, env)
        except TrainerError as exc:
            error = exc
    raise_agreed(error)
    if found is None:
        return None
    end, name = found
    left = end - time.time()
    log.info("=> time limit: stopping in time to save before %s (%s)", name,
             f"{duration(left)} from now" if left > 0 else "past already: one step, then stop")
    return Deadline(end, name, checkpoint_bytes() / WRITE_BYTES_PER_SECOND)


def reached(where: str, output_dir: Path, clock_: Deadline | None) -> TimeLimitReached:
    """The error that ends a run stopped by its time limit (its state is saved)."""
    details = f", {clock_.describe()}" if clock_ is not None else ""
    return TimeLimitReached(f"stopped {where}{details}; checkpoint saved in {output_dir}; "
                            "--resume auto continues")


def nothing_left(cfg: Config, info: DistInfo, restarted: bool) -> str | None:
    """The line that ends a job whose checkpoint to resume, one of OUTPUT_DIR (a chain's), has
    trained every epoch (None: there is training to do, or the resume decides). Rank 0 reads the
    checkpoint's position only. Collective."""
    if cfg.evaluate or (cfg.resume is None and not restarted):
        return None
    line = _finished(cfg, restarted) if info.is_main else None
    if info.distributed:
        holder = [line]
        dist.broadcast_object_list(holder, src=0)
        line = holder[0]
    return line


def _finished(cfg: Config, restarted: bool) -> str | None:
    """``nothing_left``'s answer on rank 0: never an error (the resume reports those)."""
    from imagenet.checkpoint import files  # here: cli imports this module, and stays light

    try:
        folder = Path(cfg.output_dir)
        path = files.resolve_resume(cfg.resume, folder, restarted, cfg.sharded_checkpoint)
        if path is None or path.resolve().parent != folder.resolve():
            return None  # a checkpoint from elsewhere: the resume checks it as usual
        meta = path / files.SHARDED_META if path.is_dir() else path
        ckpt = torch.load(meta, map_location="cpu", weights_only=True, mmap=True)
        epoch, best = int(ckpt.get("epoch", 0)), files.best_acc1_of(ckpt)
    except Exception:  # the resume itself says what is wrong with the file
        return None
    if epoch < cfg.epochs or ckpt.get("arch", cfg.arch) != cfg.arch:  # another -a: the resume
        return None  # refuses it with its own message
    return (f"=> nothing left to train: {path} has finished {epoch} of --epochs {cfg.epochs} "
            f"(best Acc@1 {best:.3f}); give a larger --epochs to train on")
