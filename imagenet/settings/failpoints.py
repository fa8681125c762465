"""Failpoints: named points in the trainer where a fault is injected on request, as etcd's gofail
and TiKV's fail-rs do. For tests and for trying a job's fault handling by hand (docs/testing.md,
"Placing a fault").

``IMAGENET_FAILPOINTS="train.step=2*off->1*sigterm;save.write=error(ENOSPC)"`` arms points by
name; each point's actions are fail-rs's: ``[count*]action[(arg)]``, chained with ``->``. A
term with a count acts that many times, then the next term takes over; one without acts at every
hit; once every term is spent the point is off. ``name@RANK=...`` acts only in that rank.

Actions deliver the real thing, so what handles it is the trainer's own code:

- ``off``: nothing (with a count: skip that many hits);
- ``sigterm``, ``sigint``, ``sigusr1``, ``sighup``, ``sigkill``, ``sigstop``: that signal to
  this process (``sigstop``: paused there until a SIGCONT from outside);
  ``(group)``: to its whole process group, as SLURM or a terminal send it; ``(parent)``: to the
  parent process (mp.spawn's launcher, torchrun's agent);
- ``exit(CODE)``: ``os._exit(CODE)`` (1 without a code), no cleanup, as a crash;
- ``error(ERRNO)``: raise ``OSError(ERRNO)`` there (ENOSPC without one), as a failed write;
- ``panic(MSG)``: raise ``RuntimeError`` ("failpoint NAME: MSG");
- ``sleep(MS)``: sleep MS milliseconds (a hang, a slow disk);
- ``print(MSG)``: print "failpoint NAME: MSG" to stderr (where a run passed).

Read once, at import (and by ``configure``); unset, a point is one check of an empty dict. A
spec that does not parse ends the process at import with one line naming the variable (exit 2).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

VARIABLE = "IMAGENET_FAILPOINTS"
SIGNALS = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sigusr1": signal.SIGUSR1,
           "sighup": signal.SIGHUP, "sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}
ACTIONS = {"off", "exit", "error", "panic", "sleep", "print", *SIGNALS}

# name (or name@rank) -> its terms, each [hits left (None: every hit), action, argument]
_points: dict[str, list[list]] = {}
_ranked = False  # a name@rank is armed: the rank is looked up at each hit
_lock = threading.Lock()  # hits come from the training thread and the checkpoint writer


class FailpointSpecError(ValueError):
    """``IMAGENET_FAILPOINTS`` does not parse (the message names the variable and the term)."""


def failpoint(name: str) -> None:
    """The point ``name``: act as ``IMAGENET_FAILPOINTS`` asks; nothing when it is unset."""
    if _points:
        _hit(name)


def parse(spec: str) -> dict[str, list[list]]:
    """``IMAGENET_FAILPOINTS``'s value -> {name: terms}; FailpointSpecError if it does not parse."""
    points: dict[str, list[list]] = {}
    for entry in filter(None, (part.strip() for part in spec.split(";"))):
        name, eq, actions = entry.partition("=")
        name = name.strip()
        if not eq or not name or not actions.strip():
            raise FailpointSpecError(f"{VARIABLE}: '{entry}' is not NAME=ACTIONS")
        base, at, rank = name.partition("@")
        if at and not rank.isdigit():
            raise FailpointSpecError(f"{VARIABLE}: '{name}': the rank after @ is not a number")
        if name in points:
            raise FailpointSpecError(f"{VARIABLE}: '{name}' is given twice")
        points[name] = [_term(term.strip(), name) for term in actions.split("->")]
    return points


def _term(term: str, name: str) -> list:
    count, star, rest = term.partition("*")
    if not star:
        count, rest = "", term
    elif not count.strip().isdigit():
        raise FailpointSpecError(f"{VARIABLE}: '{name}={term}': the count before * is not a "
                                 "number")
    action, paren, arg = rest.strip().partition("(")
    if paren and not arg.endswith(")"):
        raise FailpointSpecError(f"{VARIABLE}: '{name}={term}': no closing parenthesis")
    action, arg = action.strip(), arg[:-1].strip() if paren else None
    if action not in ACTIONS:
        raise FailpointSpecError(f"{VARIABLE}: '{name}={term}': unknown action '{action}' "
                                 f"(one of {', '.join(sorted(ACTIONS))})")
    bad = _bad_argument(action, arg)
    if bad:
        raise FailpointSpecError(f"{VARIABLE}: '{name}={term}': {bad}")
    return [int(count) if star else None, action, arg]


def _bad_argument(action: str, arg: str | None) -> str | None:
    """Why ``arg`` does not suit ``action``; None when it does."""
    import errno

    if arg is None:
        return "sleep needs milliseconds: sleep(MS)" if action == "sleep" else None
    if action in SIGNALS and arg not in ("group", "parent"):
        return f"{action} takes (group) or (parent), not ({arg})"
    if action in ("exit", "sleep") and not arg.isdigit():
        return f"{action} takes a whole number, not ({arg})"
    if action == "error" and not isinstance(getattr(errno, arg, None), int):
        return f"error takes an errno name (ENOSPC, EIO, ...), not ({arg})"
    if action == "off":
        return "off takes no argument"
    return None


def configure(spec: str | None) -> None:
    """Arm the points ``spec`` names (None or "": none); FailpointSpecError if it does not parse."""
    global _ranked
    points = parse(spec or "")
    with _lock:
        _points.clear()
        _points.update(points)
        _ranked = any("@" in name for name in points)


def configure_from_environment() -> None:
    """``configure`` from ``IMAGENET_FAILPOINTS``; a spec that does not parse ends the process
    with its one line (exit 2), before anything ran."""
    try:
        configure(os.environ.get(VARIABLE))
    except FailpointSpecError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def _rank() -> int:
    """This process's rank: the process group's, else the launcher's RANK, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _hit(name: str) -> None:
    with _lock:  # which term acts, and its count, decided for one hit at a time
        names = [name, f"{name}@{_rank()}"] if _ranked else [name]
        chosen = [_take(_points[n]) for n in names if n in _points]
    for action, arg in filter(None, chosen):
        _act(name, action, arg)


def _take(terms: list[list]) -> tuple[str, str | None] | None:
    """The action of this hit (its term's count spent by one); None once all are spent."""
    for term in terms:
        if term[0] is None:
            return term[1], term[2]
        if term[0] > 0:
            term[0] -= 1
            return term[1], term[2]
    return None


def _act(name: str, action: str, arg: str | None) -> None:
    if action in SIGNALS:
        if arg == "group":
            os.killpg(os.getpgrp(), SIGNALS[action])
        else:
            os.kill(os.getppid() if arg == "parent" else os.getpid(), SIGNALS[action])
    elif action == "exit":
        os._exit(int(arg or 1))
    elif action == "error":
        import errno

        code = getattr(errno, arg or "ENOSPC")
        raise OSError(code, os.strerror(code))  # as write(2) fails: no file name
    elif action == "panic":
        raise RuntimeError(f"failpoint {name}: {arg or 'panic'}")
    elif action == "sleep":
        import time

        time.sleep(int(arg or 0) / 1000)
    elif action == "print":
        sys.stderr.write(f"failpoint {name}: {arg or 'reached'}\n")  # one write: one line
        sys.stderr.flush()


configure_from_environment()
