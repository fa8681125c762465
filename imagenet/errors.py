"""Exceptions that the entry points turn into one message and an exit code (``report``)."""

import faulthandler
import sys
import traceback

INTERRUPTED_EXIT_CODE = 130  # Ctrl-C before anything could be saved: the shell's code for SIGINT


class TrainerError(Exception):
    """A problem the user can fix; the message says what and how."""

    exit_code = 1
    label = "error"  # what the one line starts with

    def __init__(self, message: str = "") -> None:
        # A DataLoader worker's error is re-raised in the main process as
        # ``type(exc)("Caught X in DataLoader worker ...\nOriginal Traceback ...")``; keep only
        # the original one-line message so users see it, not a worker traceback.
        if "Original Traceback" in message:
            last = [line for line in message.strip().splitlines() if line.strip()][-1]
            message = last.split(": ", 1)[1] if ": " in last else last
        super().__init__(message)


def show_crash_stacks() -> None:
    """On a crash in C code (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL), print every thread's
    Python stack to stderr: a launcher then shows where the process was, not only its exit
    code (-11). Left as it is where already on, or where stderr is no file (a notebook)."""
    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable(all_threads=True)
    except (ValueError, RuntimeError, AttributeError, OSError):
        pass


def report(exc: TrainerError, debug: bool = False, rank: int = 0) -> int:
    """Print the one ``error:`` line (after the traceback with --debug); return the exit code."""
    if debug:
        traceback.print_exc()
    say_error(str(exc), rank, exc.label)
    return exc.exit_code


def say_error(message: str, rank: int = 0, label: str = "error") -> None:
    """Write one ``error:`` (or ``label:``) line to stderr in a single write.

    The ranks of a node share one stderr; with PYTHONUNBUFFERED ``print`` writes the text and
    its newline separately, so two ranks' lines could run together on one line.
    """
    tag = "" if rank == 0 else f"[rank {rank}] "
    sys.stderr.write(f"{tag}{label}: {message}\n")
    sys.stderr.flush()


def on_every_rank(exc: TrainerError) -> TrainerError:
    """Mark ``exc`` as raised by every rank at the same point (decided together, e.g. after an
    all-reduce): no rank has to tell the others (``failures``)."""
    exc.on_every_rank = True  # type: ignore[attr-defined]
    return exc


class UsageError(TrainerError):
    """Bad flags or paths on the command line (exit code 2, like argparse)."""

    exit_code = 2


class RunError(TrainerError):
    """A failure while running: data, checkpoint, distributed or numerical (exit code 1)."""

    exit_code = 1


class DataError(RunError):
    """A data set or image that cannot be used."""


class CheckpointError(RunError):
    """A checkpoint that cannot be read or does not fit the model."""


class DistributedError(RunError):
    """Processes that cannot find or talk to each other."""


class NonFiniteLossError(RunError):
    """The loss became NaN or infinite."""


class Preempted(RunError):
    """A signal asked the run to stop; a checkpoint was saved so a requeue resumes."""

    exit_code = 143  # documented in README: same as a process killed by SIGTERM


class TimeLimitReached(Preempted):
    """--time-limit stopped the run in time to save; the next job resumes (exit code 143 too:
    a requeue or the next job of a chain continues it, as after a preemption)."""

    label = "time limit"


class NonFiniteStateError(RunError):
    """Weights, BatchNorm statistics or optimizer state became NaN or infinite."""


def first_line(exc: BaseException) -> str:
    """``exc`` as one line: its type and the first line of its message."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
