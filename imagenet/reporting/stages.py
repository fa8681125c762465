"""Start-up stages that take a while (listing a data set, starting loader workers, the first
batch) say what they are doing once they have lasted a few seconds, and how long they took.

``StartClock`` times each stage of this process's start, from the moment the process started to
the end of its first optimizer step; the trainer prints them in one line at that step and
config.json keeps every start's (``starts``)."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# A start-up stage that lasts longer than this says what it is doing (seconds). 0 shows every
# stage: useful to see where a start-up hangs.
NOTICE_AFTER_ENV = "IMAGENET_NOTICE_AFTER"
NOTICE_AFTER_DEFAULT = 5.0


def notice_after() -> float:
    """Seconds a start-up stage may take before it says what it does."""
    value = os.environ.get(NOTICE_AFTER_ENV, "")
    try:
        return float(value) if value else NOTICE_AFTER_DEFAULT
    except ValueError:
        return NOTICE_AFTER_DEFAULT


@dataclass
class Stage:
    """A start-up stage: ``done`` is printed at its end if its start was (the slow case)."""

    what: str
    done: str = ""
    announced: bool = False


@contextlib.contextmanager
def slow_stage(what: str) -> Iterator[Stage]:
    """Say '=> WHAT ...' once the body has run for ``notice_after()`` seconds, and then
    ``stage.done`` with the time when it ends; a fast body prints nothing."""
    stage, start, after = Stage(what), time.perf_counter(), notice_after()

    def announce() -> None:
        stage.announced = True
        log.info("=> %s ...", stage.what)

    timer = threading.Timer(after, announce)
    timer.daemon = True
    if after <= 0:
        announce()
    else:
        timer.start()
    try:
        yield stage
    finally:
        timer.cancel()
        if timer.is_alive():
            timer.join()  # an announcement under way is printed before the end line
    if stage.announced and stage.done:
        log.info("=> %s (%.1f s)", stage.done, time.perf_counter() - start)


class FirstBatch:
    """``loader``'s batches; starting its workers and waiting for its first batch are stages.
    ``iter()`` starts the loader at once (its workers begin to prefetch); the first ``next()``
    waits for the first batch."""

    def __init__(self, loader: Iterable, workers: int, name: str) -> None:
        self.loader, self.workers, self.name = loader, workers, name

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator:
        with slow_stage(f"starting the {self.name} loader ({self.workers} worker process(es))"
                        if self.workers else f"starting the {self.name} loader") as stage:
            batches = iter(self.loader)
            stage.done = f"{self.name} loader started"
        return _FirstWaited(batches, self.name)


class _FirstWaited:
    """An iterator whose first batch is a start-up stage."""

    def __init__(self, batches: Iterator, name: str) -> None:
        self.batches, self.name, self.first = batches, name, True

    def __iter__(self) -> _FirstWaited:
        return self

    def __next__(self):
        if not self.first:
            return next(self.batches)
        self.first = False
        with slow_stage(f"waiting for the first {self.name} batch (reading and decoding its "
                        "images)") as stage:
            batch = next(self.batches)  # StopIteration: an empty loader
            stage.done = f"first {self.name} batch ready"
        return batch


# The stages, in order, and how the start-up line names them.
STAGES = {"start": "Python, imports and joining the ranks", "data": "data set",
          "model": "model", "resume": "checkpoint", "checks": "checks and logs",
          "first_step": "first step"}


@dataclass
class StartClock:
    """The seconds each stage of this start took (see ``STAGES``)."""

    started: float  # unix time the process started (the plan's)
    seconds: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # a word on a stage: "folder index"
    last: float = field(default_factory=time.perf_counter)
    done: bool = False

    @classmethod
    def begin(cls, started: float) -> StartClock:
        """The clock of a start whose process started at ``started`` (unix time)."""
        clock = cls(started)
        clock.seconds["start"] = max(time.time() - started, 0.0)
        return clock

    def mark(self, stage: str, note: str = "") -> None:
        """``stage`` ends now (it began when the previous one ended)."""
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self.last
        self.last = now
        if note:
            self.notes[stage] = note

    def first_step(self) -> dict[str, Any] | None:
        """Call after each step: at the first, the start's record (else None)."""
        if self.done:
            return None
        self.done = True
        self.mark("first_step")
        return {"started": datetime.datetime.fromtimestamp(self.started).isoformat(
                    timespec="seconds"),
                "time_to_first_step_s": round(time.time() - self.started, 3),
                "stages_s": {k: round(v, 3) for k, v in self.seconds.items()},
                "notes": dict(self.notes)}

    @staticmethod
    def line(record: dict[str, Any]) -> str:
        """The start-up line of a start's record."""
        parts = []
        for stage, seconds in record["stages_s"].items():
            note = record["notes"].get(stage)
            parts.append(f"{STAGES.get(stage, stage)} {seconds:.1f} s"
                         + (f" ({note})" if note else ""))
        return (f"=> first step {record['time_to_first_step_s']:.1f} s after the process "
                f"started: {', '.join(parts)}")
