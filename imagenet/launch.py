"""Deciding how this invocation runs: launch mode, ranks, device, backend, per-process layout.

The only reader of RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* / SLURM_* / TORCHELASTIC_*. Every
function here is pure (flags, environment and GPU count in, a decision out) except
``rendezvous``, which fills MASTER_ADDR/PORT where the launcher did not; ``distributed`` acts on
the decisions.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from imagenet.config import Config
from imagenet.errors import UsageError


@dataclass(frozen=True)
class Launch:
    """How this invocation starts its training processes."""

    mode: str  # "single" | "spawn" (mp.spawn here) | "env" (a launcher started us) | "manual"
    nprocs: int = 1  # processes this invocation spawns (mode "spawn")
    nnodes: int = 1
    node_rank: int = 0
    reason: str = ""


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


def plan_launch(cfg: Config, env: Mapping[str, str], cuda_count: int) -> Launch:
    """Decide the launch mode from flags, environment and visible GPUs."""
    gpus = cuda_count if not cfg.no_accel else 0
    if cfg.multiprocessing_distributed:
        return _plan_spawn(cfg, env, gpus)
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch("env", reason="launched by torchrun / torch.distributed.launch")
    if is_slurm_job_step(env):
        return Launch("env", reason="launched by SLURM srun")
    if cfg.world_size > 1:
        if cfg.rank < 0:
            raise UsageError(f"--world-size {cfg.world_size} needs --rank for each process "
                             "(or use torchrun / --multiprocessing-distributed)")
        if cfg.rank >= cfg.world_size:
            raise UsageError(f"--rank {cfg.rank} is outside --world-size {cfg.world_size} "
                             f"(process ranks are 0..{cfg.world_size - 1})")
        return Launch("manual", reason=f"manual process rank {cfg.rank} of {cfg.world_size}")
    if cfg.nproc_per_node and cfg.nproc_per_node > 1:
        _check_gpus(cfg.nproc_per_node, gpus)
        return Launch("spawn", cfg.nproc_per_node,
                      reason=f"--nproc-per-node {cfg.nproc_per_node}: DDP on one node")
    if gpus > 1 and cfg.gpu is None:
        return Launch("spawn", gpus, reason=f"{gpus} GPUs visible and no --gpu: "
                      "one DDP process per GPU (not DataParallel)")
    return Launch("single", reason="one process")


def _plan_spawn(cfg: Config, env: Mapping[str, str], gpus: int) -> Launch:
    """--multiprocessing-distributed: processes per node, nodes and this node's rank."""
    if "LOCAL_RANK" in env or cfg.local_rank is not None:
        raise UsageError("--multiprocessing-distributed starts its own processes: do not also "
                         "start main.py with torchrun / torch.distributed.launch (drop one)")
    nprocs = cfg.nproc_per_node or gpus or 1
    _check_gpus(nprocs, gpus)
    from_env = cfg.dist_url == "env://"  # like the classic: WORLD_SIZE / RANK count nodes then
    slurm_nodes, slurm_node = _srun_nodes(env)
    nnodes = cfg.world_size if cfg.world_size > 0 else (
        env_int(env, "WORLD_SIZE") if from_env else None) or slurm_nodes or 1
    node_rank = cfg.rank if cfg.rank >= 0 else (
        env_int(env, "RANK") if from_env else None)
    if node_rank is None:
        node_rank = slurm_node
    if node_rank is None:
        if nnodes > 1:
            raise UsageError(f"--world-size {nnodes} nodes: give each node its --rank "
                             f"(0..{nnodes - 1})")
        node_rank = 0
    if not 0 <= node_rank < nnodes:
        raise UsageError(f"--rank {node_rank} is not a node of --world-size {nnodes} (with "
                         f"--multiprocessing-distributed they count nodes: 0..{nnodes - 1})")
    return Launch("spawn", nprocs, nnodes, node_rank,
                  f"--multiprocessing-distributed: {nprocs} process(es) on node {node_rank} "
                  f"of {nnodes}")


def _srun_nodes(env: Mapping[str, str]) -> tuple[int | None, int | None]:
    """(nodes, this node's rank) for --multiprocessing-distributed under srun: one task per
    node, each spawning that node's processes. Several tasks per node are refused: each would
    spawn a process per GPU of the same node."""
    if not is_slurm_job_step(env):
        return None, None
    per_node = slurm_tasks_per_node(env)
    if per_node is not None and per_node > 1:
        raise UsageError(f"srun started {slurm_tasks(env)} tasks, {per_node} per node, and "
                         "--multiprocessing-distributed starts one process per GPU in each: "
                         "run one task per node (srun --ntasks-per-node=1) or drop "
                         "--multiprocessing-distributed (srun then starts one process per task)")
    return slurm_tasks(env), int(env["SLURM_PROCID"])


def _check_gpus(nprocs: int, gpus: int) -> None:
    """DDP on GPUs needs one GPU per process on the node."""
    if gpus and nprocs > gpus:
        raise UsageError(f"--nproc-per-node {nprocs} is more than the {gpus} visible GPU(s); "
                         f"DDP needs one GPU per process: give at most {gpus}, or --no-accel")


def resolve_ranks(launch: Launch, local_index: int, cfg: Config,
                  env: Mapping[str, str]) -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) of this process."""
    if launch.mode == "spawn":
        rank = launch.node_rank * launch.nprocs + local_index
        return rank, local_index, launch.nnodes * launch.nprocs, launch.nprocs
    if launch.mode == "env" and "RANK" in env:
        world = int(env["WORLD_SIZE"])
        local = env_int(env, "LOCAL_RANK")
        local = cfg.local_rank if local is None else local
        return (int(env["RANK"]), local or 0, world,
                env_int(env, "LOCAL_WORLD_SIZE") or world)
    if launch.mode == "env":  # SLURM
        ntasks = slurm_tasks(env)
        return (int(env["SLURM_PROCID"]), env_int(env, "SLURM_LOCALID") or 0, ntasks,
                slurm_tasks_per_node(env) or ntasks)
    if launch.mode == "manual":
        local = cfg.gpu if cfg.gpu is not None else (env_int(env, "LOCAL_RANK") or 0)
        return cfg.rank, local, cfg.world_size, 1
    return 0, 0, 1, 1


def _first_int(text: str | None) -> int | None:
    match = re.match(r"\d+", text or "")
    return int(match.group()) if match else None


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[03-05,7],cpu1' -> 'gpu03'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise UsageError(f"cannot parse SLURM_JOB_NODELIST '{nodelist}'; set MASTER_ADDR")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def choose_backend(requested: str | None, device_type: str) -> str:
    """nccl for CUDA, gloo for CPU; an impossible request is a clear error."""
    if requested is None:
        return "nccl" if device_type == "cuda" else "gloo"
    if requested == "nccl" and device_type != "cuda":
        raise UsageError("--dist-backend nccl needs CUDA GPUs, and this process runs on the CPU "
                         "(no CUDA or --no-accel); use --dist-backend gloo or leave it unset")
    if requested == "nccl" and not dist.is_nccl_available():
        raise UsageError("--dist-backend nccl: this torch build has no NCCL; use gloo")
    return requested


def check_sync_bn(sync_bn: bool, device_type: str) -> None:
    """--sync-bn: torch's SyncBatchNorm has kernels for GPUs only; say so before starting."""
    if sync_bn and device_type == "cpu":
        raise UsageError("--sync-bn needs CUDA GPUs: torch's SyncBatchNorm cannot train on the "
                         "CPU; drop --sync-bn for CPU runs (each rank then normalises its own "
                         "batch)")


def check_gpu_flag(gpu: int | None, no_accel: bool, cuda_count: int) -> None:
    """--gpu asks for a CUDA device: without one it is an error, not a silent CPU run."""
    if gpu is not None and not no_accel and cuda_count == 0:
        raise UsageError(f"--gpu {gpu}: no CUDA device is visible (torch.cuda.is_available() is "
                         "False); drop --gpu to train on the CPU, or check the driver and "
                         "CUDA_VISIBLE_DEVICES")


def choose_device(cfg: Config, launch: Launch, local_rank: int, cuda_count: int) -> torch.device:
    """The device of this process: its local rank's GPU, --gpu, or the CPU."""
    if cfg.no_accel or cuda_count == 0:
        return torch.device("cpu")
    if launch.mode == "single":
        if (cfg.gpu or 0) >= cuda_count:
            raise UsageError(f"--gpu {cfg.gpu}: only {cuda_count} GPU(s) visible "
                             f"(0..{cuda_count - 1})")
        return torch.device("cuda", cfg.gpu or 0)
    if launch.mode == "env" and cuda_count == 1:
        # The launcher gave each process its own GPU (srun --gpus-per-task, CUDA_VISIBLE_DEVICES
        # per rank): local rank 3 then sees one device, cuda:0.
        return torch.device("cuda", 0)
    if local_rank >= cuda_count:
        raise UsageError(f"local rank {local_rank} has no GPU: only {cuda_count} visible; "
                         "start at most one process per GPU on each node")
    return torch.device("cuda", local_rank)


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous(cfg: Config, launch: Launch, env: dict[str, str]) -> str:
    """The init_method URL; fills MASTER_ADDR/PORT in ``env`` where the launcher did not."""
    if cfg.dist_url != "env://":
        return cfg.dist_url
    if launch.mode in ("env", "spawn") and is_slurm_job_step(env) and "RANK" not in env:
        env.setdefault("MASTER_ADDR", first_slurm_host(env.get("SLURM_JOB_NODELIST", "")))
        # Every task must agree on the port without talking: derive it from the job id.
        env.setdefault("MASTER_PORT", str(15000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        if launch.mode == "spawn" and launch.nnodes == 1:
            # Single-node fallback: rank 0 is this machine; pick a free loopback port.
            env.setdefault("MASTER_ADDR", "127.0.0.1")
            env.setdefault("MASTER_PORT", str(free_port()))
        else:
            raise UsageError("--dist-url env:// needs MASTER_ADDR and MASTER_PORT for a "
                             "multi-node or manual run; give --dist-url tcp://HOST:PORT of "
                             "rank 0 or export both variables")
    return "env://"


def launcher_pid(launch: Launch, env: Mapping[str, str], parent: int) -> int | None:
    """``parent`` when it launched this training process and must outlive it (mp.spawn's
    parent, torchrun's agent), else None (a shell, srun's step daemon)."""
    if launch.mode == "spawn" or (launch.mode == "env" and "TORCHELASTIC_RUN_ID" in env):
        return parent
    return None


def agent_hosts_store(env: Mapping[str, str]) -> bool:
    """True when torchrun's agent hosts the rendezvous store the workers share."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def elastic_restart_count(env: Mapping[str, str] = os.environ) -> int:
    """How often torchrun has restarted this worker group (0 outside torchrun)."""
    return env_int(env, "TORCHELASTIC_RESTART_COUNT") or 0


@dataclass(frozen=True)
class Layout:
    """How the images of one optimizer step are spread: computed once per process."""

    world_size: int
    batch_size: int  # images per process and micro-batch
    grad_accum_steps: int
    workers: int  # loader workers per process

    @property
    def global_batch(self) -> int:
        """Images per optimizer step over all processes."""
        return self.world_size * self.batch_size * self.grad_accum_steps

    def samples_before(self, step_in_epoch: int) -> int:
        """Samples of this process's share of the epoch used by ``step_in_epoch`` steps."""
        return step_in_epoch * self.grad_accum_steps * self.batch_size


def plan_layout(cfg: Config, launch: Launch, world_size: int, local_world_size: int) -> Layout:
    """Per-process batch and loader workers from -b and -j.

    With --multiprocessing-distributed (mode "spawn") -b and -j count per node, as in the classic,
    and are split across the node's processes; under every other launcher -b is per process.
    Without -j, the usable cores are shared among the node's processes.
    """
    if launch.mode == "spawn":
        batch = per_process_batch(cfg.batch_size, launch.nprocs)
        workers = per_process_workers(cfg.workers, launch.nprocs)
    else:
        batch = cfg.batch_size
        workers = per_process_workers(cfg.workers, 1) if cfg.workers is not None \
            else auto_workers(local_world_size)
    return Layout(world_size, batch, cfg.grad_accum_steps, workers)


def per_process_batch(batch_per_node: int, nprocs: int) -> int:
    """The classic split of -b across a node's spawned processes."""
    if batch_per_node < nprocs:
        raise UsageError(f"-b/--batch-size {batch_per_node} is smaller than the {nprocs} "
                         f"processes on this node; give at least {nprocs}")
    return batch_per_node // nprocs


def per_process_workers(workers_per_node: int | None, nprocs: int) -> int:
    """Loader workers of each of a node's ``nprocs`` processes: the classic split of -j
    (rounded up), or ``auto_workers`` when -j was not given."""
    if workers_per_node is None:
        return auto_workers(nprocs)
    return (workers_per_node + nprocs - 1) // nprocs


def auto_workers(nprocs: int, cores: int | None = None) -> int:
    """Default loader workers per process: the usable cores shared among the node's processes,
    1 to 8 each (the classic's fixed 4 per node leaves 1 per GPU on an 8-GPU node: starved)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1
    return max(1, min(8, cores // max(nprocs, 1)))
