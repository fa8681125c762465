"""--time-limit's DURATION: seconds (``5400``), ``HH:MM:SS`` or ``D-HH:MM:SS``, or ``slurm``
(parsed here, checked with the other flags), and the end time it gives a run (resolved once, by
the plan; ``launching.timelimit`` keeps the clock)."""

from __future__ import annotations

import datetime
import math
import re
import subprocess
import time
from collections.abc import Mapping

from imagenet.errors import RunError, UsageError

_DURATION = re.compile(r"(?:(\d+)-)?(\d+):(\d\d):(\d\d)")
SQUEUE_TIMEOUT = 30.0  # seconds
FORMATS = "seconds (5400), HH:MM:SS (01:30:00), D-HH:MM:SS (1-12:00:00) or 'slurm'"


def parse_duration(text: str) -> float:
    """Seconds in ``text`` (seconds, HH:MM:SS or D-HH:MM:SS); UsageError naming --time-limit."""
    match = _DURATION.fullmatch(text.strip())
    if match:
        days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
        if minutes < 60 and seconds < 60:
            return ((days * 24 + hours) * 60 + minutes) * 60.0 + seconds
    else:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value > 0:
            return value
    raise UsageError(f"--time-limit '{text}' is not a duration: give {FORMATS}")


def parse_time_limit(value: str | None) -> None:
    """Check --time-limit's format (the flag's validation)."""
    if value is not None and value != "slurm":
        parse_duration(value)


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


def no_end_note(time_limit: str | None, env: Mapping[str, str]) -> str | None:
    """What to say when ``end_time`` found no end for --time-limit (None: nothing to say)."""
    if time_limit != "slurm":
        return None
    return (f"--time-limit slurm: SLURM job {env.get('SLURM_JOB_ID')} has no end time; "
            "training without a time limit")


def end_time(time_limit: str | None, env: Mapping[str, str], started: float | None = None
             ) -> tuple[float, str] | None:
    """When --time-limit ends this run (unix time) and how to name that end; None: no limit.
    ``started``: when main.py started (None: now)."""
    if time_limit is None:
        return None
    if time_limit == "slurm":
        end = slurm_end_time(env)
        if end is None:  # the plan notes it (``no_end_note``)
            return None
        return end, f"the end of SLURM job {env.get('SLURM_JOB_ID', '?')} at {clock(end)}"
    end = (time.time() if started is None else started) + parse_duration(time_limit)
    return end, f"--time-limit {time_limit} at {clock(end)}"


def clock(when: float) -> str:
    """A unix time as the local wall clock, to the second."""
    return datetime.datetime.fromtimestamp(when).strftime("%Y-%m-%d %H:%M:%S")
