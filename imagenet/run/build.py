"""Everything one training process holds (``Run``), built from the flags; no resume yet.

This rank's data, as the plan says: the data argument (or the demo's data), where the folder
indexes are kept, and the data set with its loaders (an ImageFolder, --dummy data, tar shards, or
-e --val-data's own).

The training batches that load while the model is built (what each start-up stage costs is
timed by ``reporting.logger.StartClock``).

``EarlyBatches``: once the data set is listed, the training loader's workers start and fetch the
first batches of the position the resume will continue (read from the checkpoint's small
entries, without its tensors), while the model is built, the checkpoint loaded and the output
folder checked. The batches are only used when the resume then puts the data exactly there
(same order seed, augmentation seed, epoch and images already trained); otherwise the workers
are stopped and the loader starts again, as it would have without them: a guess never changes
what is trained.
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

import imagenet.data.prefetch as prefetch
from imagenet.checkpoint import files, rundir
from imagenet.checkpoint.resume_from import Decided
from imagenet.checkpoint.rundir import Writer
from imagenet.checkpoint.states import data_resume_point
from imagenet.data.folder import Data, FolderTrain, build_data, stop_workers
from imagenet.data.index import ImageCheck, IndexFiles
from imagenet.errors import TrainerError, UsageError
from imagenet.launching.process_group import DistInfo, from_rank0, raise_agreed
from imagenet.reporting.logger import FirstBatch, StartClock, slow_stage
from imagenet.run.outputs import Outputs
from imagenet.settings.flags import DEMO_DATA, Config
from imagenet.settings.launch import Layout
from imagenet.settings.plan import Plan
from imagenet.training.engine import Engine, EpochTotals, Step
from imagenet.training.models import build_model, wrap
from imagenet.training.optim import EpochStart, build_ema, build_engine, images_trained

if TYPE_CHECKING:
    from imagenet.training.compile_cache import CompileCache


@dataclass
class Best:
    """The best top-1 so far and the file that holds those weights."""

    path: Path
    acc1: float = 0.0

    def update(self, acc1: float) -> bool:
        """Record an epoch's top-1; True when its weights become the best file.

        A first epoch at 0% still gets a file: nothing has scored yet and there is none.
        """
        improved = acc1 > self.acc1 or (self.acc1 == 0.0 and not self.path.exists())
        self.acc1 = max(self.acc1, acc1)
        return improved


@dataclass
class Run:
    """Everything one training process holds."""

    plan: Plan  # the flags and every setting resolved from them (``cfg``, ``layout``)
    dist: DistInfo
    output_dir: Path
    data: Data
    raw_model: nn.Module  # unwrapped: what checkpoints hold
    engine: Engine
    step: Step
    best: Best
    best_ema: Best | None  # --model-ema: the EMA weights' best top-1
    aug_seed: int  # augmentation randomness is a function of (aug_seed, epoch, sample)
    continues: Decided = field(default_factory=Decided)  # the checkpoint it resumes, read once
    # Which run OUTPUT_DIR's record and checkpoints are (config.json and every checkpoint say):
    # new for a fresh run, the checkpoint's when the run continues one of OUTPUT_DIR
    # (``checkpointing.resume``); rank 0's is the one written.
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    epoch_start: EpochStart = field(default_factory=EpochStart)  # a resume inside an epoch
    outputs: Outputs = field(default_factory=Outputs)  # object storage, imagenet.train's caller
    # What the epoch's metrics.jsonl record needs, checkpointed: its training so far, and (once
    # done) the whole record, written again if a kill came between the save and the log line.
    train_totals: EpochTotals | None = None
    last_record: dict[str, Any] | None = None
    writer: Writer = field(default_factory=Writer)  # rank 0's checkpoint writes, in background
    # A run's start (run_training's): its clock, the training batches started before the
    # resume, the compiled graphs kept for restarts (--compile).
    clock: StartClock | None = None
    early: EarlyBatches | None = None
    compile_cache: CompileCache | None = None
    val_check: ImageCheck | None = None  # the validation images' check, begun early

    @property
    def cfg(self) -> Config:
        """The flags (``plan.cfg``)."""
        return self.plan.cfg

    @property
    def layout(self) -> Layout:
        """How each optimizer step's images are spread (``plan.layout``)."""
        return self.plan.layout

    def images_trained(self) -> int:
        """Images of the current epoch's order trained so far, whatever layout trained them."""
        return images_trained(self.step, self.epoch_start, self.layout.global_batch,
                              self.data.train.images)


def seed_process(seed: int | None) -> None:
    """Seed python, numpy and torch in this process, with deterministic kernels; or let cuDNN
    pick the fastest ones when unseeded."""
    if seed is None:
        torch.backends.cudnn.benchmark = True
        return
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


@dataclass
class Inputs:
    """What a run trains on: this rank's data and the job's augmentation seed."""

    data: Data
    aug_seed: int  # rank 0's (unseeded: its draw): a sample's augmentation is the same anywhere


def build_inputs(plan: Plan, dist: DistInfo, continues: Decided) -> Inputs:
    """This process's data (listed, its loaders made; no worker started), seeded first.
    ``continues``: the checkpoint the run resumes (-e --val-data reads its classes)."""
    cfg, layout = plan.cfg, plan.layout
    # Model init uses the same seed on every rank; augmentation gets its own per-sample seeds.
    seed_process(cfg.seed)
    check_outputs(cfg, dist)  # -e's report folder, --predictions
    # Rank 0's seed (unseeded: its draw) is the job's augmentation seed: a sample's
    # augmentation does not depend on the rank that loads it, and the checkpoint's seed is
    # every rank's. Every rank broadcasts, seeded or not, so that flags differing across ranks
    # are reported (checkpoint.resume_from), not stuck in a collective only some ranks call.
    aug_seed = from_rank0(cfg.seed if cfg.seed is not None else
                          random.SystemRandom().randrange(2**31))
    root = data_root(cfg, Path(cfg.output_dir))
    with slow_stage(f"reading the data set {root} (listing every image)") as stage:
        data = load_data(plan, dist, root, aug_seed, continues)
        stage.done = (f"found {data.num_classes} classes, {data.train.images} training images "
                      f"per epoch and {data.val_size} validation images")
    if cfg.fsdp and data.val_size < dist.world_size:  # every rank joins every sharded forward
        raise UsageError(f"--fsdp: the validation set has {data.val_size} image(s), fewer than "
                         f"the {dist.world_size} processes; it needs at least one per process")
    no_room = prefetch.check_room([(data.train_loader, max(plan.train_sizes)),
                              (data.val_loader, cfg.val_crop_size)], layout.batch_size,
                             dist.local_world_size)
    if no_room:
        raise UsageError(no_room)
    return Inputs(data, aug_seed)


def check_outputs(cfg: Config, info: DistInfo) -> None:
    """-e's OUTPUT_DIR (the reports go there) and --predictions can be written; rank 0
    checks, every rank raises its error. Collective."""
    error = None
    if info.is_main:
        try:
            if cfg.predictions:  # the report's files: imported when a run writes one
                from imagenet.reporting.results import check_predictions_path

                check_predictions_path(Path(cfg.predictions))
            if cfg.evaluate:
                rundir.prepare_folder(Path(cfg.output_dir))
        except TrainerError as exc:
            error = exc
    raise_agreed(error)


def build_run(plan: Plan, dist: DistInfo, continues: Decided, inputs: Inputs | None = None,
              compile_cache: CompileCache | None = None) -> Run:
    """Data (``inputs``; None: built now), model and engine for this process (no resume yet).

    ``continues``: the checkpoint the run resumes, decided and read once
    (``checkpoint.resume_from.decide``; ``Decided()``: a fresh run). ``compile_cache``: opened by
    the start (``run.trainer.start_run``) before anything compiles.
    """
    cfg, layout = plan.cfg, plan.layout
    output_dir = Path(cfg.output_dir)  # made, checked and locked by checkpoint.rundir.claim_folder
    if inputs is None:
        inputs = build_inputs(plan, dist, continues)
    data = inputs.data
    raw = build_model(cfg.arch, data.num_classes, cfg.pretrained, cfg.weights).to(dist.device)
    if cfg.finetune or cfg.freeze_backbone:  # on the plain model, before anything wraps it
        from imagenet.checkpoint.weights import read_agreed
        from imagenet.training.finetune import prepare_model

        weights = read_agreed(Path(cfg.finetune)) if cfg.finetune else None
        prepare_model(raw, cfg, data.classes, weights)
    if cfg.channels_last and not (cfg.fsdp and dist.distributed):
        # Not under --fsdp: torch 2.14's fully_shard refuses non-contiguous parameters
        # (NotImplementedError in FSDPParam), and gathers every weight into a view with
        # contiguous strides anyway. The activations still run channels_last (the input is),
        # where most of the speed comes from; cuDNN converts the small weights per conv.
        raw = raw.to(memory_format=torch.channels_last)
    ema = build_ema(raw, cfg, layout)  # a copy of the whole model: before --fsdp shards it
    model = wrap(raw, cfg, dist, ema, sizes=plan.train_sizes)
    if cfg.seed is not None:  # per-rank stream for dropout / MixUp in the training step
        torch.manual_seed(cfg.seed + dist.rank)
    steps = layout.optimizer_steps(data.train.batches)
    teacher = None
    if cfg.distill_teacher and not cfg.evaluate:  # built like the student, never wrapped
        from imagenet.checkpoint.teacher import build_teacher

        teacher = build_teacher(cfg, data.classes, dist.device)
    engine = build_engine(cfg, raw, model, dist.device, layout, steps, data.num_classes, ema,
                          data.train_counts, teacher)
    name = files.dcp_name if cfg.sharded_checkpoint else str  # best: a file or a directory
    best_ema = Best(output_dir / name(files.BEST_EMA)) if cfg.model_ema else None
    return Run(plan, dist, output_dir, data, raw, engine, Step(epoch=cfg.start_epoch),
               Best(output_dir / name(files.BEST)), best_ema, inputs.aug_seed, continues,
               compile_cache=compile_cache)


# ----------------------------------------------------------- this rank's data, as the plan says

log = logging.getLogger(__name__)
STREAMED = ("shards", "parquet")  # read by the shard machinery (imagenet.data.shards)


def data_root(cfg: Config, output_dir: Path) -> str:
    """The data argument: DIR (a folder, URL or shard pattern), or the built-in demo data
    generated under OUTPUT_DIR."""
    if not cfg.demo:
        return cfg.data
    from imagenet.tools.demo import make_demo_dataset

    return str(make_demo_dataset(output_dir / DEMO_DATA))


def index_files(plan: Plan, dist: DistInfo) -> IndexFiles:
    """Where the folder indexes are kept (--cache-dir); every process reads them. Rank 0 writes
    the ones it builds; so does each other node's first process when --cache-dir names a folder
    (node-local data copies then get one each): in the default OUTPUT_DIR/cache, the run folder
    is rank 0's alone, and a node without it writes nothing there."""
    writes = dist.is_main or (dist.local_rank == 0 and plan.cfg.cache_dir is not None)
    return IndexFiles(plan.cache_dir, write=writes)


def load_data(plan: Plan, dist: DistInfo, root: str, aug_seed: int,
              continues: Decided | None = None) -> Data:
    """This rank's data: an ImageFolder (or --dummy data) or tar shards, as the plan says;
    ``continues``: the checkpoint of the run (-e --val-data labels its folder with its
    classes)."""
    cfg = plan.cfg
    pin_memory = dist.device.type not in ("cpu", "mps")  # MPS shares the CPU's memory
    indexes = index_files(plan, dist)
    if dist.is_main and plan.data_format != "dummy":
        log.info("=> images decoded by %s (%s)", plan.decoding.name, plan.decoding.why)
    if plan.data_format not in STREAMED and cfg.evaluate and cfg.val_data:  # DIR not read
        from imagenet.evaluation.validate import build_eval_data

        return build_eval_data(plan, dist.rank, aug_seed, pin_memory, indexes, continues)
    if dist.is_main and plan.decode.on_device:
        log.info("=> JPEGs decoded and cropped on %s (--decode-on-device %s); loader workers "
                 "read files", dist.device, plan.decode.why)
    elif dist.is_main and plan.data_format == "folder" and dist.device.type == "cuda":
        log.info("=> JPEGs decoded and cropped by the loader workers (--decode-on-device %s)",
                 plan.decode.why)
    if plan.data_format in STREAMED:
        from imagenet.data.shards import build_shard_data  # imported only for shards

        return build_shard_data(plan, root, dist.rank, aug_seed, pin_memory=pin_memory)
    return build_data(plan, root, dist.rank, aug_seed, pin_memory=pin_memory, files=indexes)


# -------------------------------------- the training batches that load while the model is built

Key = tuple[int, int, int, int]  # order seed, augmentation seed, epoch, images already trained


class EarlyBatches:
    """Training batches started before the resume (see the module docstring)."""

    def __init__(self, loader: DataLoader, key: Key, batches: Iterator) -> None:
        self.loader, self.key, self.batches = loader, key, batches
        self.outcome = "started early"

    def take(self, key: Key) -> Iterator | None:
        """The started batches when the data continues at ``key``; None (and the workers
        stopped) otherwise, or once taken."""
        batches, self.batches = self.batches, None
        if batches is None:
            return None
        if key == self.key:
            self.outcome = "loaded during the start"
            return batches
        log.debug("the training batches started early were for %s, the resume continues at "
                  "%s: started again", self.key, key)
        self.outcome = "started early for another position: started again"
        stop_workers(self.loader)
        return None


def start_early(plan: Plan, data: Data, ckpt: dict[str, Any] | None) -> EarlyBatches | None:
    """Start the training loader's workers on the batches the resume of ``ckpt`` (the
    checkpoint decided and read once; None: a fresh start) is expected to continue with
    (``expected_start``); None without loader workers, or when it cannot tell. The data's
    seeds are left as they were: the resume sets them."""
    train = data.train
    if plan.layout.workers == 0 or not isinstance(train, FolderTrain):
        return None
    try:
        key = expected_start(plan, train, ckpt)
    except Exception as exc:  # the resume itself reports what is wrong with the checkpoint
        log.debug("no early start of the training loader: %s", exc)
        return None
    if key is None:
        return None
    seeds = train.order_seed, train.aug_seed
    order_seed, aug_seed, epoch, images = key
    train.reseed(order_seed, aug_seed)
    train.continue_after(epoch, images)
    batches = iter(FirstBatch(train.loader, plan.layout.workers, "training"))
    train.reseed(*seeds)  # the workers hold their copy; the resume decides the run's
    return EarlyBatches(train.loader, key, batches)


def expected_start(plan: Plan, train: FolderTrain, ckpt: dict[str, Any] | None) -> Key | None:
    """Where ``resume`` will put the training data - (order seed, augmentation seed, epoch,
    images already trained) - by the same rule (``data_resume_point``) from the checkpoint it
    resumes, ``ckpt``, before the model exists; None when there is nothing to train first or it
    cannot tell. A guess to start the loader early (``start_early``): the trainer uses those
    batches only if the resume agrees."""
    cfg, layout = plan.cfg, plan.layout
    if cfg.evaluate:
        return None
    if ckpt is None:
        return train.order_seed, train.aug_seed, cfg.start_epoch, 0
    steps = layout.optimizer_steps(train.batches)
    point = data_resume_point(ckpt, cfg, layout, steps, train)
    order_seed = int(ckpt["sampler"]["seed"]) if ckpt.get("sampler") else train.order_seed
    aug_seed = int(ckpt.get("aug_seed", train.aug_seed))
    if point.step_in_epoch < steps:
        return order_seed, aug_seed, point.epoch, min(point.images, train.images)
    if point.epoch + 1 < cfg.epochs:  # only the validation is left: then the next epoch
        return order_seed, aug_seed, point.epoch + 1, 0
    return None
