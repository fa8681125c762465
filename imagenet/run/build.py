"""Everything one training process holds (``Run``), built from the flags; no resume yet."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import imagenet.data.shm as shm
import imagenet.evaluation.eval_data as eval_data
from imagenet.checkpoint import files
from imagenet.checkpoint.resume_from import Decided
from imagenet.checkpoint.weights import read_agreed
from imagenet.checkpoint.writer import Writer
from imagenet.data.folder import Data
from imagenet.data.valcheck import ImageCheck
from imagenet.errors import UsageError
from imagenet.launching.collectives import DistInfo, from_rank0
from imagenet.reporting.stages import StartClock, slow_stage
from imagenet.run.loading import data_root, load_data
from imagenet.run.outputs import Outputs
from imagenet.run.startup import EarlyBatches
from imagenet.settings.flags import Config
from imagenet.settings.launch import Layout
from imagenet.settings.plan import Plan
from imagenet.training.compile_cache import CompileCache
from imagenet.training.engine import Engine, EpochTotals, Step
from imagenet.training.finetune import prepare_model
from imagenet.training.models import build_model, wrap
from imagenet.training.optim import build_ema
from imagenet.training.parts import build_engine
from imagenet.training.position import EpochStart, images_trained


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
    eval_data.check_outputs(cfg, dist)  # -e's report folder, --predictions
    # Rank 0's seed (unseeded: its draw) is the job's augmentation seed: a sample's
    # augmentation does not depend on the rank that loads it, and the checkpoint's seed is
    # every rank's. Every rank broadcasts, seeded or not, so that flags differing across ranks
    # are reported (checkpoint.flag_changes), not stuck in a collective only some ranks call.
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
    no_room = shm.check_room([(data.train_loader, max(plan.train_sizes)),
                              (data.val_loader, cfg.val_crop_size)], layout.batch_size,
                             dist.local_world_size)
    if no_room:
        raise UsageError(no_room)
    return Inputs(data, aug_seed)


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
    weights = read_agreed(Path(cfg.finetune)) if cfg.finetune else None
    prepare_model(raw, cfg, data.classes, weights)  # --finetune, --freeze-backbone: unwrapped
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
    engine = build_engine(cfg, raw, model, dist.device, layout, steps, data.num_classes, ema,
                          data.train_counts)
    name = files.dcp_name if cfg.sharded_checkpoint else str  # best: a file or a directory
    best_ema = Best(output_dir / name(files.BEST_EMA)) if cfg.model_ema else None
    return Run(plan, dist, output_dir, data, raw, engine, Step(epoch=cfg.start_epoch),
               Best(output_dir / name(files.BEST)), best_ema, inputs.aug_seed, continues,
               compile_cache=compile_cache)
