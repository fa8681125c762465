"""Deciding how this invocation runs: launch mode, ranks, device, backend, per-process layout.

The only reader of RANK / LOCAL_RANK / WORLD_SIZE / SLURM_* / TORCHELASTIC_* and Kubeflow's
PET_* (MASTER_ADDR/PORT: ``settings.plan``). Every function here is pure (flags,
environment and the accelerator in, a decision out); ``launching`` acts on the decisions.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from imagenet.errors import UsageError
from imagenet.settings.choices import (
    env_int,
    is_slurm_job_step,
    slurm_tasks,
    slurm_tasks_per_node,
    unlaunched_slurm_tasks,
)
from imagenet.settings.devices import SYNC_BN, Accelerator, as_accelerator, default_backend
from imagenet.settings.flags import Config


@dataclass(frozen=True)
class Launch:
    """How this invocation starts its training processes."""

    mode: str  # "single" | "spawn" (mp.spawn here) | "env" (a launcher started us) | "manual"
    nprocs: int = 1  # processes this invocation spawns (mode "spawn")
    nnodes: int = 1
    node_rank: int = 0
    reason: str = ""

    def child(self, local_index: int) -> Ranks:
        """Who this node's process ``local_index`` is, as mp.spawn starts them (nprocs a node,
        nodes in --rank order); outside mp.spawn, the only process of one node."""
        return Ranks(self.node_rank * self.nprocs + local_index, local_index,
                     self.nnodes * self.nprocs, self.nprocs)


@dataclass(frozen=True)
class Ranks:
    """Who one process is among the job's processes."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int


def plan_launch(cfg: Config, env: Mapping[str, str], accel: Accelerator | int) -> Launch:
    """Decide the launch mode from flags, environment and the visible accelerator devices."""
    accel = as_accelerator(accel)
    gpus = accel.count if not cfg.no_accel else 0
    check_torchrun_contract(env)
    if cfg.multiprocessing_distributed:
        return _plan_spawn(cfg, env, gpus)
    if "RANK" in env and "WORLD_SIZE" in env:
        check_env_ranks(env)
        per_node = cfg.nproc_per_node or (gpus if cfg.gpu is None else 1)
        if started_once_per_node(cfg, env) and per_node > 1:
            return _plan_spawn(cfg, env, gpus, "RANK/WORLD_SIZE without LOCAL_RANK (one process "
                               "per node, as Kubeflow's PyTorchJob starts them)")
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


def check_env_ranks(env: Mapping[str, str]) -> None:
    """RANK and WORLD_SIZE from the environment: whole numbers, RANK in 0..WORLD_SIZE-1 (a rank
    outside would wait --dist-timeout for peers that never come)."""
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except ValueError:
        raise UsageError(f"RANK={env['RANK']!r} and WORLD_SIZE={env['WORLD_SIZE']!r} from the "
                         "environment must be whole numbers: fix the variables your launcher "
                         "or script sets (or unset both for one process)") from None
    if world < 1:
        raise UsageError(f"WORLD_SIZE={world} from the environment must be at least 1: fix the "
                         "variables your launcher or script sets (or unset RANK and WORLD_SIZE "
                         "for one process)")
    if not 0 <= rank < world:
        raise UsageError(f"RANK={rank} from the environment is outside WORLD_SIZE={world} "
                         f"(ranks 0..{world - 1}): fix the variables your launcher or script "
                         "sets (or unset both for one process)")


def overridden_flags(cfg: Config, launch: Launch, env: Mapping[str, str]) -> str | None:
    """One warning when a launcher that started the processes (torchrun, srun) disagrees with
    --world-size, --rank or --nproc-per-node: the launcher's numbers win (the processes it
    started are the ones that run); None when nothing disagrees."""
    if launch.mode != "env":
        return None
    rank, _, world, local_world = resolve_ranks(launch, 0, cfg, env)
    who = "torchrun" if "RANK" in env else "srun"
    ignored = []
    if cfg.world_size > 0 and cfg.world_size != world:
        ignored.append(f"--world-size {cfg.world_size} is ignored ({who} started {world} "
                       "processes)")
    if cfg.rank >= 0 and (cfg.rank != rank or world > 1):
        ignored.append(f"--rank {cfg.rank} is ignored ({who} gives each process its rank)")
    if cfg.nproc_per_node is not None and cfg.nproc_per_node != local_world:
        ignored.append(f"--nproc-per-node {cfg.nproc_per_node} is ignored ({who} started "
                       f"{local_world} on this node)")
    if not ignored:
        return None
    return f"{who}'s numbers win: {'; '.join(ignored)}; drop them from main.py's command line"


def started_once_per_node(cfg: Config, env: Mapping[str, str]) -> bool:
    """True when a launcher started this process once per node with RANK / WORLD_SIZE counting
    nodes: Kubeflow's PyTorchJob (original contract: RANK = pod index, WORLD_SIZE = pods) and
    the classic ``--dist-url env://`` scripts. Launchers that start one process per device
    (torchrun, torch.distributed.launch, Ray Train) always set LOCAL_RANK (or --local-rank)."""
    return ("RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" not in env
            and cfg.local_rank is None and cfg.dist_url == "env://")


def check_torchrun_contract(env: Mapping[str, str]) -> None:
    """Refuse a process that a job meant torchrun to start: Kubeflow's PyTorchJob with
    nprocPerNode and Trainer's TrainJob pass the layout as PET_* variables, which only torchrun
    reads. Started directly, WORLD_SIZE would count processes that never start (or each pod
    would train alone), and the run would wait for them until --dist-timeout."""
    if "LOCAL_RANK" in env or "TORCHELASTIC_RUN_ID" in env:
        return
    nproc = _int_or_none(env.get("PET_NPROC_PER_NODE"))
    nnodes = _int_or_none(env.get("PET_NNODES"))
    if (nproc or 0) > 1 or ((nnodes or 0) > 1 and "RANK" not in env):
        raise UsageError(
            f"this job asks torchrun for the processes (PET_NNODES={env.get('PET_NNODES')}, "
            f"PET_NPROC_PER_NODE={env.get('PET_NPROC_PER_NODE')}: PyTorchJob nprocPerNode or "
            "a TrainJob), but main.py was started directly: make the container command "
            "`torchrun main.py ...` (torchrun reads the PET_* variables)")


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text and text.strip().isdigit() else None


def _plan_spawn(cfg: Config, env: Mapping[str, str], gpus: int,
                why: str = "--multiprocessing-distributed") -> Launch:
    """--multiprocessing-distributed (or ``why``): processes per node, nodes and this node's
    rank."""
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
                  f"{why}: {nprocs} process(es) on node {node_rank} of {nnodes}")


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
        ranks = launch.child(local_index)
        return ranks.rank, ranks.local_rank, ranks.world_size, ranks.local_world_size
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


def local_ranks(cfg: Config, env: Mapping[str, str], world: int) -> tuple[int, int]:
    """(local_rank, local_world_size) in a process group that the caller created (Ray Train
    sets LOCAL_RANK and LOCAL_WORLD_SIZE)."""
    local = env_int(env, "LOCAL_RANK")
    return (cfg.local_rank or 0) if local is None else local, \
        env_int(env, "LOCAL_WORLD_SIZE") or world


def choose_backend(requested: str | None, device_type: str) -> str:
    """The backend torch registers for the device type (nccl for CUDA, xccl for XPU, gloo for
    the CPU, ...); an impossible request, or a device type without one, is a clear error."""
    if requested is None:
        backend = default_backend(device_type)
        if backend is None:
            raise UsageError(f"torch has no process-group backend for {device_type} devices, so "
                             f"several processes cannot train together on them: train in one "
                             f"process (no --nproc-per-node/--world-size), or add --no-accel to "
                             f"train the processes on the CPU with gloo")
        return backend
    if requested == "nccl" and device_type != "cuda":
        where = "the CPU (no accelerator or --no-accel)" if device_type == "cpu" \
            else f"{device_type} devices"
        raise UsageError(f"--dist-backend nccl needs CUDA GPUs, and this process runs on {where}; "
                         f"use --dist-backend {default_backend(device_type) or 'gloo'} or leave "
                         f"it unset")
    if requested == "nccl" and not dist.is_nccl_available():
        raise UsageError("--dist-backend nccl: this torch build has no NCCL; use gloo")
    return requested


def check_sync_bn(sync_bn: bool, device_type: str) -> None:
    """--sync-bn: torch's SyncBatchNorm has kernels for some devices only (CUDA, XPU, HPU); say
    so before starting."""
    if sync_bn and device_type == "cpu":
        raise UsageError("--sync-bn needs CUDA GPUs: torch's SyncBatchNorm cannot train on the "
                         "CPU; drop --sync-bn for CPU runs (each rank then normalises its own "
                         "batch)")
    if sync_bn and device_type not in SYNC_BN:
        raise UsageError(f"--sync-bn: torch's SyncBatchNorm has no kernels for {device_type} "
                         f"devices (only {', '.join(SYNC_BN[:3])}); drop --sync-bn (each rank "
                         f"then normalises its own batch)")


def check_gpu_flag(gpu: int | None, no_accel: bool, accel: Accelerator | int) -> None:
    """--gpu asks for an accelerator device: without one it is an error, not a silent CPU run."""
    if gpu is not None and not no_accel and not as_accelerator(accel):
        raise UsageError(f"--gpu {gpu}: no accelerator device is visible "
                         "(torch.accelerator.is_available() is "
                         "False); drop --gpu to train on the CPU, or check the driver and "
                         "CUDA_VISIBLE_DEVICES")


def device_type_of(cfg: Config, accel: Accelerator) -> str:
    """Where this invocation's processes train: the accelerator's device type, or "cpu"."""
    return accel.type if accel and not cfg.no_accel else "cpu"


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

    def optimizer_steps(self, batches: int) -> int:
        """Optimizer steps in an epoch of ``batches`` batches a process (the last step takes
        what is left when they do not divide by the accumulation)."""
        return -(-batches // self.grad_accum_steps)

    def samples_before(self, step_in_epoch: int) -> int:
        """Samples of this process's share of the epoch used by ``step_in_epoch`` steps."""
        return step_in_epoch * self.grad_accum_steps * self.batch_size


def process_ranks(cfg: Config, launch: Launch, env: Mapping[str, str],
                  group: tuple[int, int] | None) -> Ranks | None:
    """This process's ranks where they do not depend on a spawned child's index; ``group``:
    (rank, world size) in a process group the caller created."""
    if group is not None:
        rank, world = group
        local, local_world = local_ranks(cfg, env, world)
        return Ranks(rank, local, world, local_world)
    if launch.mode == "spawn":
        return None
    return Ranks(*resolve_ranks(launch, 0, cfg, env))


def plan_layout(cfg: Config, launch: Launch, world_size: int, local_world_size: int,
                env: Mapping[str, str] = os.environ,
                cpus: tuple[int, int] | None = None) -> Layout:
    """Per-process batch and loader workers from -b and -j.

    With --multiprocessing-distributed (mode "spawn") -b and -j count per node, as in the classic,
    and are split across the node's processes; under every other launcher -b is per process.
    Without -j, each process gets the cores it may use (``process_cores``), less one for itself.
    ``cpus``: (cores this process may run on, cores of the machine); None reads them.
    --global-batch-size replaces -b under every launcher.
    """
    if cfg.global_batch_size is not None:
        batch = batch_from_global(cfg.global_batch_size, world_size, cfg.grad_accum_steps)
    elif launch.mode == "spawn":
        batch = per_process_batch(cfg.batch_size, launch.nprocs)
    else:
        batch = cfg.batch_size
    if cfg.workers is not None:
        workers = per_process_workers(cfg.workers, launch.nprocs if launch.mode == "spawn" else 1)
    else:
        local = launch.nprocs if launch.mode == "spawn" else local_world_size
        workers = auto_workers(process_cores(env, launch.mode, local,
                                             *(cpus or cpu_counts())))
    return Layout(world_size, batch, cfg.grad_accum_steps, workers)


def batch_from_global(global_batch: int, world_size: int, grad_accum_steps: int) -> int:
    """Images per process and micro-batch for --global-batch-size: an exact split or an error."""
    parts = world_size * grad_accum_steps
    if global_batch % parts:
        lower = global_batch - global_batch % parts
        near = f"{lower} or {lower + parts}" if lower else f"{parts}"
        raise UsageError(f"--global-batch-size {global_batch} does not divide into {world_size} "
                         f"process(es) x {grad_accum_steps} accumulation step(s) = {parts} "
                         f"equal micro-batches: give a multiple of {parts} (e.g. {near})")
    return global_batch // parts


def per_process_batch(batch_per_node: int, nprocs: int) -> int:
    """The classic split of -b across a node's spawned processes."""
    if batch_per_node < nprocs:
        raise UsageError(f"-b/--batch-size {batch_per_node} is smaller than the {nprocs} "
                         f"processes on this node; give at least {nprocs}")
    return batch_per_node // nprocs


def per_process_workers(workers_per_node: int, nprocs: int) -> int:
    """Loader workers of each of a node's ``nprocs`` processes: the classic split of -j
    (rounded up)."""
    return (workers_per_node + nprocs - 1) // nprocs


def cpu_counts() -> tuple[int, int]:
    """(cores this process may run on, cores of the machine)."""
    machine = os.cpu_count() or 1
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    return affinity, machine


def process_cores(env: Mapping[str, str], mode: str, local_procs: int, affinity: int,
                  machine: int) -> int:
    """Cores of this process's own: its share of the CPU set it inherited from its launcher.

    A task that srun started holds its own CPU set already (--cpus-per-task, bound by srun's
    task/affinity plugin): it is not divided again. Without binding (--cpu-bind=none, or no
    affinity plugin) a task sees the whole node: SLURM_CPUS_PER_TASK says its share, else the
    node's cores are divided among its tasks. mp.spawn's, torchrun's (also when one srun task
    per node runs torchrun) and manual ranks' processes all inherit one set: divided.
    """
    if mode == "env" and "RANK" not in env and is_slurm_job_step(env):  # an srun task
        per_task = env_int(env, "SLURM_CPUS_PER_TASK")
        if per_task:
            return max(1, min(affinity, per_task))
        if affinity < machine:
            return affinity
    return max(1, affinity // max(local_procs, 1))


MAX_AUTO_WORKERS = 16  # see auto_workers


def auto_workers(cores: int) -> int:
    """Default loader workers of a process that owns ``cores`` cores: one core is left to the
    training process itself (it launches the device's work and pins memory), at most 16.

    Measured per core (benchmarks/bench.py data, 465x375 px JPEGs, CPU seconds; a loader
    worker reaches ~75% of it): decode + crop + flip ~1,100 img/s, + TrivialAugment + random
    erasing ~720, + RandAugment ~570. The classic's cap of 8 then gives ~3,400 img/s with
    RandAugment, short of an H100 (and of an A100 at ~3,000 with anything heavier); 16 give
    ~6,800-13,000. More per process cost memory (every worker holds the file list) for little:
    give -j, or decode on the GPU (--decode-on-device), whose workers only read files.
    """
    return max(1, min(MAX_AUTO_WORKERS, cores - 1))


@dataclass(frozen=True)
class Job:
    """The launcher's part of the plan (``settings.plan``): everything read from the flags and
    the launchers' variables about the processes."""

    launch: Launch
    layout: Layout
    process: Ranks | None  # this process's ranks (None under mp.spawn: each child's own)
    first_rank: int  # the lowest rank this invocation runs (0: it keeps rank 0's duties)
    restarts: int  # torchrun's restarts of the worker group
    agent_store: bool  # torchrun's agent hosts the rendezvous store
    launcher: int | None  # the pid that must outlive the training processes
    notes: tuple[str, ...]  # warnings about the launch, said once
    device_type: str  # where the processes train: the accelerator's device type, or "cpu"
    backend: str | None  # the process group's (None: one process, or a caller's group)


def plan_job(cfg: Config, env: Mapping[str, str], accel: Accelerator | int,
             launch: Launch | None = None,
             group: tuple[int, int] | None = None, cpus: tuple[int, int] | None = None) -> Job:
    """How this invocation's processes start, who they are and how each step's images are
    spread. ``launch``: decided by the caller (``imagenet.train``), else from the flags and
    ``env``; ``group``: (rank, world size) of the caller's process group."""
    accel = as_accelerator(accel)
    check_gpu_flag(cfg.gpu, cfg.no_accel, accel)
    launch = launch or plan_launch(cfg, env, accel)
    device_type, backend = device_type_of(cfg, accel), None
    if launch.mode != "single":  # impossible requests fail here, once
        if group is None:  # a caller's group (Ray) has its backend
            backend = choose_backend(cfg.dist_backend, device_type)
        check_sync_bn(cfg.sync_bn, device_type)
    process = process_ranks(cfg, launch, env, group)
    ranks = process or launch.child(0)
    layout = plan_layout(cfg, launch, ranks.world_size, ranks.local_world_size, env, cpus)
    notes = [note for note in (unlaunched_slurm_tasks(env),) if note]
    overridden = overridden_flags(cfg, launch, env)
    if overridden and ranks.rank == 0:
        notes.append(overridden)
    launcher = None if group is not None else os.getpid() if launch.mode == "spawn" \
        else launcher_pid(launch, env, os.getppid())
    return Job(launch, layout, process, ranks.rank, elastic_restart_count(env),
               agent_hosts_store(env), launcher, tuple(notes), device_type, backend)
