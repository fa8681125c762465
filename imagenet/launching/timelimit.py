"""--time-limit: stop at a step boundary, saved, before the job's wall-clock limit; the next job
continues with --resume auto.

DURATION is seconds (``5400``), ``HH:MM:SS`` or ``D-HH:MM:SS``, counted from the start of
main.py (under --multiprocessing-distributed the parent's start; under torchrun and srun each
worker's own; under ``imagenet.train`` its call), or ``slurm``: the end time of this SLURM
job, from SLURM_JOB_END_TIME when the job's environment has it, else ``squeue -h -j
$SLURM_JOB_ID -o %e``. The plan resolves it to an end time once
(``settings.choices.end_time``).

Under --compile the first step at a new crop size (progressive resizing) compiles graphs, as
long as the run's first step did (minutes on a GPU): before such an epoch the stop is agreed
with that much more room (the longest step so far), or the step would overrun the end.

Rank 0 keeps the clock (``Deadline``). After every optimizer step and every validation batch it
asks whether the time left still covers ``margin``: two steps (the stop is agreed over the
ranks one step later, and a spare), two saves (the last one measured; before any, the
checkpoint's size at 50 MB/s) and ``EXIT_SECONDS`` to leave. When it does not, the stop is
agreed like a preemption (``preemption.StopFlag``): every rank stops after the same step, the
state is saved, one line says so and the process exits with code 143, as a preempted one does,
so that requeue scripts and chained jobs treat both alike. A job that starts after the last
epoch says "nothing left to train" and exits 0 at once (``run.preflight.nothing_left``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from imagenet.errors import TimeLimitReached

log = logging.getLogger(__name__)

EXIT_SECONDS = 10.0  # after the last save: loader workers, the process group, the exit
STEPS_REMEMBERED = 20  # the longest of the last 20 intervals between checks is "a step"
WRITE_BYTES_PER_SECOND = 50e6  # assumed for the first save, until one is measured
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
        self.longest = 0.0  # the longest interval yet: a step that compiled graphs (--compile)
        self.last = now()
        self.stopped_at: float | None = None

    @property
    def step_seconds(self) -> float:
        """A step, as the longest of the last intervals between checks."""
        return max(self.intervals, default=0.0)

    def margin(self) -> float:
        """Seconds a stop decided now still needs: two steps, two saves and the exit."""
        return 2 * self.step_seconds + 2 * self.save_seconds + EXIT_SECONDS

    def due(self, ahead: float = 0.0) -> bool:
        """Called at every step boundary: True once the time left does not cover ``margin``
        (and ``ahead``: seconds the next step takes beyond a step, such as compiling)."""
        now = self.now()
        self.intervals.append(now - self.last)
        self.longest = max(self.longest, now - self.last)
        self.last = now
        if now + self.margin() + ahead < self.end:
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


def deadline(end_time: tuple[float, str] | None, is_main: bool,
             checkpoint_bytes: Callable[[], int]) -> Deadline | None:
    """Rank 0's Deadline for --time-limit (None on other ranks and without a limit);
    ``end_time``: the plan's (when, and its name); ``checkpoint_bytes()`` estimates what a save
    writes."""
    if end_time is None or not is_main:
        return None
    end, name = end_time
    left = end - time.time()
    log.info("=> time limit: stopping in time to save before %s (%s)", name,
             f"{duration(left)} from now" if left > 0 else "past already: one step, then stop")
    return Deadline(end, name, checkpoint_bytes() / WRITE_BYTES_PER_SECOND)


def reached(where: str, output_dir: Path, clock_: Deadline | None) -> TimeLimitReached:
    """The error that ends a run stopped by its time limit (its state is saved)."""
    details = f", {clock_.describe()}" if clock_ is not None else ""
    return TimeLimitReached(f"stopped {where}{details}; checkpoint saved in {output_dir}; "
                            "--resume auto continues")

