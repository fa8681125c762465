"""--time-limit's DURATION: seconds (``5400``), ``HH:MM:SS`` or ``D-HH:MM:SS``, or ``slurm``
(parsed here, checked with the other flags; ``timelimit`` keeps the clock)."""

from __future__ import annotations

import math
import re

from imagenet.errors import UsageError

_DURATION = re.compile(r"(?:(\d+)-)?(\d+):(\d\d):(\d\d)")
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
