"""The job's plan: the command line (with a recipe file's values), the launcher's environment and
the machine, resolved once into every setting the later stages read.

``make_plan`` runs before any process, model or loader is built: in main.py's process (under
--multiprocessing-distributed the parent, which hands the plan to its children), in each process
a launcher started, and in ``imagenet.train``. Every stage after it reads ``Plan`` fields: none
reads the launchers' variables (RANK, MASTER_*, SLURM_*, TORCHELASTIC_*), and none derives a
setting from the flags again (the per-process batch and workers, the crop of each epoch, where
JPEGs are decoded, whether this is a restart, where the processes meet).

Where an object-storage --output-dir, --resume or --predictions is on this node: the plan
replaces each URL by a local path once (``stage``), and every later stage reads those paths;
``checkpoint.storage.Remote`` mirrors them to the URLs.

Every process computes the same paths. They lie in a folder of this user's own,
``$TMPDIR/imagenet-trainer-<uid>`` (0700): ``stage`` makes it, or refuses one that another user
owns or could write into (a shared folder let one user's run fail every other user's and
take files another user had left, its folder index included, for its own).

Where a job's processes meet: torch's init_method and rank 0's store, decided once by the plan
(``settings.plan``) from --dist-url or the launcher's MASTER_ADDR/PORT; ``launching.process_group``
joins there. Pure: the environment is read, never written.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import socket
import stat
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlparse

import torch

from imagenet.errors import UsageError
from imagenet.settings.choices import end_time, first_slurm_host, is_slurm_job_step, no_end_note
from imagenet.settings.devices import Accelerator, as_accelerator
from imagenet.settings.flags import CACHE, Config, cpu_per_image_flags
from imagenet.settings.images import (
    CropSchedule,
    Decoding,
    choose_decoding,
    crop_schedule,
    data_format,
    is_url,
)
from imagenet.settings.launch import Launch, Layout, Ranks, plan_job


@dataclass(frozen=True)
class Decode:
    """Where training JPEGs are decoded and cropped: by the loader workers or on the device."""

    on_device: bool
    why: str  # for the start-up line


@dataclass(frozen=True)
class Plan:
    """Everything resolved before the first process is built (see the module docstring)."""

    cfg: Config  # the flags, a recipe file's values and --demo's, validated
    launch: Launch  # how the processes start, and why
    layout: Layout  # world size, images per process and micro-batch, accumulation, workers
    crops: CropSchedule  # the training crop of every epoch
    data_format: str  # how DIR is read: "folder", "shards", "parquet" or "dummy"
    device_type: str  # where the processes train: "cuda", "xpu", "mps", ... or "cpu"
    decode: Decode
    restarts: int  # torchrun's restarts of the worker group (TORCHELASTIC_RESTART_COUNT)
    agent_store: bool  # torchrun's agent hosts the rendezvous store the workers share
    started: float  # unix time main.py started: --time-limit counts from it
    time_limit: tuple[float, str] | None  # --time-limit's end (unix time) and its name; rank 0
    slurm_job: str | None  # SLURM_JOB_ID (the run folder's lock names it)
    hang_timeout: float  # seconds without progress that make a hang (0: not watched)
    process: Ranks | None = None  # this process's ranks (None under mp.spawn: each child's own)
    launcher: int | None = None  # the pid that must outlive the training processes
    # (mp.spawn's parent, torchrun's agent): killed, it cannot stop them; they stop on their own
    notes: tuple[str, ...] = field(default=())  # warnings about the launch, said once
    lr_rule: str | None = None  # how --lr-base became cfg.lr (None: --lr as given)
    # The object-storage URLs that cfg's output_dir, resume and predictions stand for locally
    staged: Staging | None = None
    cache_dir: Path | None = None  # the folder index and compiled graphs (--cache-dir; None: off)
    # Where the processes meet (--dist-url, MASTER_ADDR/PORT); none: no group of its own
    meet: Rendezvous = field(default_factory=lambda: Rendezvous("env://"))
    # Which library decodes the images (--decoder, --image-backend)
    decoding: Decoding = field(default_factory=lambda: Decoding("tensor", "default"))
    accel: Accelerator = field(default_factory=Accelerator)  # what the plan was made for
    backend: str | None = None  # the process group's (None: one process, or a caller's group)

    def device(self, local_index: int = 0) -> torch.device:
        """The device of this node's process ``local_index`` (0 outside mp.spawn): its local
        rank's accelerator device, --gpu, or the CPU (``choose_device``)."""
        return choose_device(self.cfg, self.launch, self.ranks(local_index).local_rank,
                             self.accel)

    def ranks(self, local_index: int = 0) -> Ranks:
        """The ranks of this node's process ``local_index`` (0 outside mp.spawn)."""
        return self.process if self.process is not None else self.launch.child(local_index)

    @property
    def restarted(self) -> bool:
        """torchrun restarted the worker group: it continues OUTPUT_DIR's checkpoint."""
        return self.restarts > 0

    @property
    def train_sizes(self) -> list[int]:
        """Every training crop size of the run, in order."""
        return self.crops.sizes(self.cfg.epochs) if self.crops.progressive else [self.crops.end]

    @property
    def crop_flags(self) -> dict[str, int]:
        """The crop sizes the run feeds the model, by flag (-e validates only); with
        --train-crop-start, its smallest (rounded) training size."""
        cfg = self.cfg
        crops = {"--val-crop-size": cfg.val_crop_size}
        if not cfg.evaluate:
            crops = {"--train-crop-size": cfg.train_crop_size, **crops}
            if cfg.train_crop_start is not None:  # progressive resizing: its smallest size
                crops = {"--train-crop-start": min(self.train_sizes), **crops}
        return crops


def choose_device(cfg: Config, launch: Launch, local_rank: int,
                  accel: Accelerator | int) -> torch.device:
    """The device of this process: its local rank's accelerator device, --gpu, or the CPU."""
    accel = as_accelerator(accel)
    kind, count = accel.type, accel.count
    if cfg.no_accel or count == 0:
        return torch.device("cpu")
    if launch.mode == "single":
        if (cfg.gpu or 0) >= count:
            raise UsageError(f"--gpu {cfg.gpu}: only {count} {kind} device(s) visible "
                             f"(0..{count - 1})")
        return torch.device(kind, cfg.gpu or 0)
    if launch.mode == "env" and count == 1:
        # The launcher gave each process its own GPU (srun --gpus-per-task, CUDA_VISIBLE_DEVICES
        # per rank): local rank 3 then sees one device, cuda:0.
        return torch.device(kind, 0)
    if local_rank >= count:
        raise UsageError(f"local rank {local_rank} has no {kind} device: only {count} visible; "
                         "start at most one process per GPU on each node")
    return torch.device(kind, local_rank)


def process_start() -> float:
    """When this process started (unix time), from /proc; the time of this call where there is
    no /proc. A spawned child gets its parent's in the plan."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def source_format(cfg: Config) -> str:
    """How DIR is read: "dummy", "folder" (also the demo's data, written later), "shards" or
    "parquet"."""
    if cfg.dummy:
        if cfg.val_data:
            raise UsageError("--val-data gives real validation images; --dummy has none: drop "
                             "one")
        return "dummy"
    if cfg.demo:
        return "folder"
    found = data_format(cfg.data, cfg.data_format)
    if found != "shards" and cfg.num_classes:
        what = "Parquet (its metadata names the classes)" if found == "parquet" else \
            "an ImageFolder"
        raise UsageError(f"--num-classes applies to tar shards only; '{cfg.data}' is read as "
                         f"{what}")
    return found


def device_conflict(cfg: Config, fmt: str) -> str | None:
    """What rules out decoding on the device, or None."""
    if fmt == "dummy":
        return "--dummy data is not decoded"
    if cfg.image_backend == "pil":
        return "--image-backend pil decodes with PIL"
    for flag in cpu_per_image_flags(cfg):  # marked where each augmentation's flag is defined
        return f"{flag} runs per image on the CPU"
    return None


# --decode-on-device auto: the loader workers decode when there are enough of them to feed the
# GPU. Measured per worker (benchmarks/bench.py data, 465x375 px JPEGs, 224 px crops): ~840
# img/s (1,118 img/s on one core, a worker reaching ~75% of it), so 8 workers give ~6,700 img/s,
# the rate of ResNet-50 with bf16 + channels_last + compile on an H200 (issue #27: 15 workers
# trained 4,013 img/s there, the device path 3,384 img/s). With fewer, the GPU decodes.
AUTO_WORKERS = 8
WORKER_RATE = 840  # img/s per loader worker, measured (see above)


def decode_path(cfg: Config, fmt: str, device_type: str, workers: int = 0) -> Decode:
    """--decode-on-device: where training JPEGs are decoded. ``auto``: on a CUDA device when the
    ``workers`` loader workers of a process could not keep up (``AUTO_WORKERS``), and nothing
    needs per-image CPU work."""
    if cfg.decode_on_device == "off":
        return Decode(False, "off")
    conflict = device_conflict(cfg, fmt)
    if cfg.decode_on_device == "on":
        if conflict:
            raise UsageError(f"--decode-on-device on: {conflict}; drop one")
        return Decode(True, "on")
    if conflict:
        return Decode(False, f"auto: {conflict}")
    if device_type != "cuda":
        return Decode(False, "auto: no CUDA device")
    supply = f"{workers} loader worker(s) per process decode ~{workers * WORKER_RATE:,} img/s"
    if workers >= AUTO_WORKERS:
        return Decode(False, f"auto: {supply}, enough for a GPU (the device path is for fewer "
                             f"than {AUTO_WORKERS}; --decode-on-device on forces it)")
    return Decode(True, f"auto: {supply}, too few for a GPU: the GPU decodes (nvJPEG)")


HANG_TIMEOUT = 300.0  # seconds: a step or a save of ResNet-50 takes well under a second on a GPU
# (compiles, the checkpoint's load and uploads pause the clock: launching.watchdog.paused); half
# of --dist-timeout at most, so that a hang is noticed, and its stacks written, before a
# collective times out


def hang_timeout(cfg: Config) -> float:
    """--hang-timeout, or its default (``HANG_TIMEOUT``, at most half of --dist-timeout)."""
    if cfg.hang_timeout is not None:
        return cfg.hang_timeout
    return min(HANG_TIMEOUT, cfg.dist_timeout / 2)


def learning_rate(cfg: Config, global_batch: int) -> tuple[float, str | None]:
    """The learning rate of a run of ``global_batch`` images per optimizer step, and how it
    follows from --lr-base (None: --lr as given, the classic's meaning)."""
    if cfg.lr_base is None:
        return cfg.lr, None
    ratio = global_batch / cfg.lr_base_size
    factor = ratio if cfg.lr_base_scale == "linear" else math.sqrt(ratio)
    rule = (f"--lr-base {cfg.lr_base:g} x global batch {global_batch} / --lr-base-size "
            f"{cfg.lr_base_size}" if cfg.lr_base_scale == "linear" else
            f"--lr-base {cfg.lr_base:g} x sqrt(global batch {global_batch} / --lr-base-size "
            f"{cfg.lr_base_size})")
    return cfg.lr_base * factor, f"{rule} ({cfg.lr_base_scale})"


def with_learning_rate(cfg: Config, global_batch: int) -> tuple[Config, str | None]:
    """``cfg`` whose ``lr`` is the run's learning rate (--lr-base scaled to ``global_batch``:
    resolved here once, every later stage reads ``cfg.lr``), and the rule that gave it."""
    lr, rule = learning_rate(cfg, global_batch)
    # --lr's own --lr-min is checked with the flags (``flags.validate``); --lr-base's here
    if rule is not None and cfg.lr_scheduler == "linear" and cfg.lr_min > lr:
        raise UsageError(f"--lr-scheduler linear falls from the learning rate to --lr-min: "
                         f"--lr-min ({cfg.lr_min:g}) must not exceed the learning rate "
                         f"({lr:g}{', ' + rule if rule else ''})")
    return (cfg if rule is None else replace(cfg, lr=lr)), rule


def cache_dir(cfg: Config) -> Path | None:
    """Where restarts find the folder index and compiled graphs (--cache-dir); None: off."""
    if cfg.cache_dir is None:
        return Path(cfg.output_dir) / CACHE
    return None if cfg.cache_dir.lower() == "none" else Path(cfg.cache_dir)


def make_plan(cfg: Config, env: Mapping[str, str], accel: Accelerator | int,
              launch: Launch | None = None, group: tuple[int, int] | None = None,
              cpus: tuple[int, int] | None = None, started: float | None = None) -> Plan:
    """The plan of this invocation; UsageError for what cannot work, before anything starts.

    ``launch``: decided by the caller (``imagenet.train``), else from the flags and ``env``;
    ``group``: (rank, world size) of the caller's process group; ``cpus``: (cores this process
    may use, cores of the machine), None reads them; ``started``: when --time-limit starts
    counting (unix time; None: when this process started, as main.py's).
    """
    cfg, staged = stage(cfg)  # URLs: local paths from here on
    accel = as_accelerator(accel)
    job = plan_job(cfg, env, accel, launch, group, cpus)
    cfg, lr_rule = with_learning_rate(cfg, job.layout.global_batch)
    fmt = source_format(cfg)
    device_type = job.device_type
    started = process_start() if started is None else started
    # Rank 0 keeps the clock: only its plan asks SLURM for the job's end (squeue)
    limit = end_time(cfg.time_limit, env, started) if job.first_rank == 0 else None
    no_end = no_end_note(cfg.time_limit, env) if job.first_rank == 0 and limit is None else None
    notes = job.notes + ((no_end,) if no_end else ())
    return Plan(cfg, job.launch, job.layout, crop_schedule(cfg), fmt, device_type,
                decode_path(cfg, fmt, device_type, job.layout.workers), job.restarts,
                job.agent_store, started, limit, env.get("SLURM_JOB_ID"),
                hang_timeout(cfg), job.process, job.launcher, notes, lr_rule, staged,
                cache_dir(cfg), rendezvous(cfg, job.launch, env, creates_group=group is None
                                           and job.launch.mode != "single"),
                choose_decoding(cfg), accel, job.backend)


def fixed_plan(cfg: Config, layout: Layout, device_type: str = "cpu") -> Plan:
    """The plan of a process whose layout is given (benchmarks and tests that build a run's
    parts directly): one launch of its own, nothing read from the environment."""
    cfg, staged = stage(cfg)
    fmt = source_format(cfg)
    cfg, lr_rule = with_learning_rate(cfg, layout.global_batch)
    return Plan(cfg, Launch("single", reason="given layout"), layout, crop_schedule(cfg), fmt,
                device_type, decode_path(cfg, fmt, device_type, layout.workers), 0, False,
                time.time(), None, None, hang_timeout(cfg), Ranks(0, 0, layout.world_size, 1),
                lr_rule=lr_rule, staged=staged, cache_dir=cache_dir(cfg),
                decoding=choose_decoding(cfg),
                accel=Accelerator(device_type, 1) if device_type != "cpu" else Accelerator())


# ------------------------------------------- the local paths that stand for object-storage URLs

@dataclass(frozen=True)
class Staging:
    """The URLs of a run and their local stand-ins."""

    output_url: str | None
    staging: Path | None  # the local folder that stands for output_url
    resume_url: str | None = None
    resume_local: Path | None = None
    uploads: dict[str, Path] = field(default_factory=dict)  # URL -> local file, outside staging


def staging_root() -> Path:
    """This user's folder of staging folders on this node."""
    return Path(tempfile.gettempdir()) / f"imagenet-trainer-{os.geteuid()}"


def staging_dir(url: str, evaluate: bool = False) -> Path:
    """The local folder that stands for ``url`` on this node (the same on every rank);
    ``evaluate``: -e's own, apart from a training run's."""
    digest = hashlib.sha1(url.encode()).hexdigest()[:12]
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", url.rstrip("/").rsplit("/", 1)[-1])[:40]
    return staging_root() / f"{tail}-{digest}{'-eval' if evaluate else ''}"


def make_private(root: Path, flag: str) -> None:
    """Make ``root`` (0700), or check that the one there is this user's and that no one else can
    write into it; UsageError naming ``flag`` (the URL that needs it) otherwise."""
    try:
        root.mkdir(mode=0o700)
        root.chmod(0o700)  # whatever the umask
        return
    except FileExistsError:
        pass
    except OSError as exc:
        raise UsageError(f"{flag}: cannot create the staging folder {root} ({exc.strerror}); "
                         "set TMPDIR to a folder you can write") from None
    st = root.lstat()
    if not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder (a link or a file)"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to user {st.st_uid}"
    elif st.st_mode & 0o022:
        problem = "is writable by others"
    else:
        root.chmod(0o700)  # this user's own: readable by this user alone, too
        return
    raise UsageError(f"{flag}: the staging folder {root} {problem}, so files someone else put "
                     f"there could be taken for this run's; set TMPDIR to a folder of your "
                     f"own, or have {root} removed")


def stage(cfg: Config) -> tuple[Config, Staging | None]:
    """``cfg`` with a URL --output-dir / --resume / --predictions replaced by local paths, and
    the URLs they stand for (None: no URL)."""
    output_url = cfg.output_dir.rstrip("/") if is_url(cfg.output_dir) else None
    resume_url = cfg.resume if is_url(cfg.resume) else None
    predictions_url = cfg.predictions if is_url(cfg.predictions) else None
    if output_url is None and resume_url is None and predictions_url is None:
        return cfg, None
    if output_url and cfg.sharded_checkpoint:
        raise UsageError(f"--sharded-checkpoint: every rank writes its shards into "
                         f"--output-dir, which {output_url} cannot collect; give a shared "
                         "filesystem path, or drop --sharded-checkpoint")
    make_private(staging_root(), f"--output-dir {output_url}" if output_url else
                 f"--resume {resume_url}" if resume_url else f"--predictions {predictions_url}")
    staging = staging_dir(output_url, cfg.evaluate) if output_url else None
    changes: dict[str, str] = {}
    if staging is not None:
        changes["output_dir"] = str(staging)
    resume_local = None
    if resume_url:
        resume_local = local_path(resume_url, output_url, staging, cfg.evaluate)
        changes["resume"] = str(resume_local)
    uploads = {}
    if predictions_url:
        local = local_path(predictions_url, output_url, staging, cfg.evaluate)
        changes["predictions"] = str(local)
        if staging is None or not local.is_relative_to(staging):
            uploads[predictions_url] = local  # not part of OUTPUT_DIR's folder: on its own
    return replace(cfg, **changes), Staging(output_url, staging, resume_url, resume_local,
                                            uploads)


def local_path(url: str, output_url: str | None, staging: Path | None, evaluate: bool) -> Path:
    """Where the file at ``url`` is on this node: in the staging folder when it is inside the
    --output-dir URL, else in a folder of its own."""
    if staging is not None and output_url is not None and url.startswith(output_url + "/"):
        return staging / url[len(output_url) + 1:]
    return staging_dir(url, evaluate) / url.rstrip("/").rsplit("/", 1)[-1]


# ------------------------------------- where the processes meet: init_method and rank 0's store

def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Rendezvous:
    """Where a job's processes meet: torch's init_method, and rank 0's store."""

    init_method: str  # --dist-url as given, or env:// (MASTER_ADDR/PORT)
    host: str = ""  # rank 0's store ("" and None: none known, as with a file:// --dist-url)
    port: int | None = None

    def variables(self) -> dict[str, str]:
        """MASTER_ADDR/PORT as torch's env:// reads them: what mp.spawn's children are given."""
        if self.init_method != "env://" or self.port is None:
            return {}
        return {"MASTER_ADDR": self.host, "MASTER_PORT": str(self.port)}


def rendezvous(cfg: Config, launch: Launch, env: Mapping[str, str],
               creates_group: bool = True) -> Rendezvous:
    """Where the processes meet: --dist-url, or (env://) the launcher's MASTER_ADDR/PORT, rank 0's
    node and a port from the job id under srun, a free loopback port for a one-node mp.spawn.

    ``creates_group``: False where no process group is created here (one process, or the
    caller's group): then only what the launcher said, nothing derived, and no error.
    """
    if cfg.dist_url != "env://":
        url = urlparse(cfg.dist_url)  # checked by the flags (settings.flags.check_dist_url)
        if url.scheme == "tcp":
            return Rendezvous(cfg.dist_url, url.hostname or "", url.port)
        return Rendezvous(cfg.dist_url)
    given = {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT") if k in env}
    if creates_group and launch.mode in ("env", "spawn") and is_slurm_job_step(env) \
            and "RANK" not in env:
        # The step's nodes: an srun inside a larger allocation may not start on its first node.
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        given.setdefault("MASTER_ADDR", first_slurm_host(nodes))
        # Every task must agree on the port without talking: derive it from the job id.
        given.setdefault("MASTER_PORT", str(15000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    if creates_group and len(given) < 2:
        if launch.mode == "spawn" and launch.nnodes == 1:
            # Single-node fallback: rank 0 is this machine; pick a free loopback port.
            given.setdefault("MASTER_ADDR", "127.0.0.1")
            given.setdefault("MASTER_PORT", str(free_port()))
        else:
            raise UsageError("--dist-url env:// needs MASTER_ADDR and MASTER_PORT for a "
                             "multi-node or manual run; give --dist-url tcp://HOST:PORT of "
                             "rank 0 or export both variables")
    port = given.get("MASTER_PORT", "")
    valid = port.isdigit() and 0 < int(port) < 65536
    if creates_group and not valid:
        raise UsageError(f"MASTER_PORT={port} is not a port: give a number from 1 to 65535")
    return Rendezvous("env://", given.get("MASTER_ADDR", ""), int(port) if valid else None)
