"""What the launchers' variables say: typed reads (``env_int``) and SLURM's view of a job step -
whether srun started this process, its tasks, their nodes (an sbatch script is one process)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from imagenet.errors import UsageError


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
