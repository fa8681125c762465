"""Flag values checked against this machine and its job, when the flags are parsed.

Which values of -a and --log-to exist on this machine: torchvision's architectures and timm's
(``timm/NAME``, with timm installed), and the experiment trackers whose packages are installed.
Checked when the flags are parsed, before anything starts; nothing heavy is imported for a
value that does not need it.

--time-limit's DURATION: seconds (``5400``), ``HH:MM:SS`` or ``D-HH:MM:SS``, or ``slurm``
(parsed here, checked with the other flags), and the end time it gives a run (resolved once, by
the plan; ``launching.timelimit`` keeps the clock).

What the launchers' variables say: typed reads (``env_int``) and SLURM's view of a job step -
whether srun started this process, its tasks, their nodes (an sbatch script is one process).
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import importlib.util
import math
import re
import subprocess
import time
from collections.abc import Mapping
from types import ModuleType

from imagenet.errors import RunError, UsageError

TIMM_PREFIX = "timm/"  # -a timm/NAME: a timm model
INSTALL = "pip install 'imagenet-trainer[timm]' (or pip install timm)"
TRACKERS = ("tensorboard", "mlflow", "wandb")


def available_archs() -> list[str]:
    """Real classification architectures (not helpers like get_model)."""
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def check_arch(arch: str, weights: str | None = None, pretrained: bool = False) -> None:
    """Raise UsageError for an unknown architecture, suggesting close names."""
    if arch.startswith(TIMM_PREFIX):
        check_timm_arch(arch, weights, pretrained)
        return
    names = available_archs()
    if arch not in names:
        close = difflib.get_close_matches(arch, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UsageError(f"-a/--arch: unknown architecture '{arch}'{hint} "
                         f"(choose from torchvision.models.list_models(), e.g. resnet18, "
                         f"resnet50, vit_b_16)")


def import_timm(arch: str) -> ModuleType:
    """timm, or the one line that says how to install it."""
    try:
        import timm
    except ImportError:
        raise UsageError(f"-a {arch} needs timm, which is not installed: {INSTALL}") from None
    return timm


def timm_name(arch: str) -> str:
    """'timm/resnet50.a1_in1k' -> 'resnet50.a1_in1k'."""
    return arch[len(TIMM_PREFIX):]


def check_timm_arch(arch: str, weights: str | None, pretrained: bool = False) -> None:
    """A timm model name (and weight tag) that exists; close names when it does not."""
    timm = import_timm(arch)
    name = timm_name(arch)
    base, _, tag = name.partition(".")
    if weights:
        raise UsageError(f"--weights names torchvision weights; for timm's, put the tag in the "
                         f"name and add --pretrained: -a timm/{base}.TAG --pretrained (tags: "
                         f"timm.list_pretrained('{base}.*'))")
    if not timm.is_model(base):
        close = difflib.get_close_matches(base, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(f'timm/{c}' for c in close)}?" if close else ""
        raise UsageError(f"-a/--arch: timm has no model '{base}'{hint} (choose from "
                         "timm.list_models())")
    tags = timm.list_pretrained(f"{base}.*")
    if pretrained and not tags:
        raise UsageError(f"-a {arch} --pretrained: timm has no pretrained weights for {base} "
                         "(drop --pretrained to train it from scratch)")
    if tag and name not in tags:
        known = f"; it has {', '.join(tags[:6])}" if tags else " (it has no pretrained weights)"
        raise UsageError(f"-a {arch}: timm has no weights tagged '{tag}' for {base}{known}")


def parse_log_to(text: str) -> str:
    """--log-to's value: known tracker names, comma-separated, without repeats; or 'none'."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if names == ["none"]:
        return "none"
    unknown = [n for n in names if n not in TRACKERS] or ([] if names else [text])
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown tracker '{unknown[0]}': give a comma-separated list of "
            f"{', '.join(TRACKERS)}, or none")
    return ",".join(dict.fromkeys(names))


def tracker_names(log_to: str) -> list[str]:
    """The trackers of a --log-to value."""
    return [] if log_to == "none" else log_to.split(",")


def install_hint(name: str) -> str:
    """The one line for a tracker whose package is missing."""
    return (f"--log-to {name}: the {name} package is not installed; pip install "
            f"'imagenet-trainer[{name}]' (or pip install {name})")


def check_trackers_installed(log_to: str) -> None:
    """Refuse, before anything starts, a tracker whose package is missing (nothing imported)."""
    for name in tracker_names(log_to):
        if importlib.util.find_spec(name) is None:
            raise UsageError(install_hint(name))


# ---------------------------------------- --time-limit: its duration and the end it gives a run

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


# ------------------------------- what the launchers' variables say (SLURM's view of a job step)

def env_int(env: Mapping[str, str], name: str) -> int | None:
    """An integer environment variable; None when unset or empty."""
    value = env.get(name)
    return int(value) if value not in (None, "") else None


def in_srun_step(env: Mapping[str, str]) -> bool:
    """True in a process that ``srun`` started. An sbatch script (SLURM's batch step) also has
    SLURM_PROCID and the allocation's SLURM_NTASKS, but no SLURM_STEP_ID: it is one process."""
    return "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)


def slurm_tasks(env: Mapping[str, str]) -> int:
    """Tasks of this SLURM job step (srun -n), else of the allocation; 1 outside SLURM."""
    return env_int(env, "SLURM_STEP_NUM_TASKS") or env_int(env, "SLURM_NTASKS") or 1


def slurm_tasks_per_node(env: Mapping[str, str]) -> int | None:
    """Tasks of this job step on each node ('2(x3)' counts 2), if SLURM says."""
    return (env_int(env, "SLURM_NTASKS_PER_NODE")
            or _first_int(env.get("SLURM_STEP_TASKS_PER_NODE"))
            or _first_int(env.get("SLURM_TASKS_PER_NODE")))


def is_slurm_job_step(env: Mapping[str, str]) -> bool:
    """True inside ``srun`` with several tasks (one process per task is the convention)."""
    return in_srun_step(env) and slurm_tasks(env) > 1


def unlaunched_slurm_tasks(env: Mapping[str, str]) -> str | None:
    """A warning when this runs in an sbatch script whose tasks no srun started, else None.

    Taking the allocation's task count as the world size would make this process rank 0 of N
    and wait --dist-timeout for peers that never start; it runs as on a plain machine instead.
    """
    tasks = env_int(env, "SLURM_NTASKS") or 1
    if "SLURM_JOB_ID" not in env or in_srun_step(env) or tasks <= 1:
        return None
    return (f"SLURM allocated {tasks} tasks, but srun did not start this process (no "
            "SLURM_STEP_ID: an sbatch script runs once): it runs as one launch on this node. "
            "For one process per task, start it with `srun python main.py ...`")


def _first_int(text: str | None) -> int | None:
    match = re.match(r"\d+", text or "")
    return int(match.group()) if match else None


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[03-05,7],cpu1' -> 'gpu03'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise UsageError(f"cannot parse the SLURM node list '{nodelist}'; set MASTER_ADDR")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first
