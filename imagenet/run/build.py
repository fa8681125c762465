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
from imagenet.checkpoint.source import Decided
from imagenet.checkpoint.weights import read_agreed
from imagenet.checkpoint.writer import Writer
from imagenet.data.folder import Data
from imagenet.data.valcheck import ImageCheck, image_check
from imagenet.errors import UsageError
from imagenet.launching.collectives import DistInfo, from_rank0
from imagenet.reporting.stages import StartClock, slow_stage
from imagenet.run.loading import data_root, load_data
from imagenet.run.outputs import Outputs
from imagenet.run.startup import EarlyBatches, start_early
from imagenet.settings.decoders import image_backend
from imagenet.settings.flags import Config
from imagenet.settings.launch import Layout
from imagenet.settings.plan import Plan
from imagenet.training.assembly import build_engine
from imagenet.training.compile_cache import CompileCache, graph_signature, open_cache
from imagenet.training.engine import Engine, EpochTotals, Step
from imagenet.training.finetune import prepare_model
from imagenet.training.models import build_model, wrap
from imagenet.training.optim import build_ema
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
    continues: Path | None = None  # the checkpoint the run resumes, decided once (None: fresh)
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


def build_run(plan: Plan, dist: DistInfo, continues: Decided,
              clock: StartClock | None = None) -> Run:
    """Data, model and engine for this process (no resume yet).

    ``clock``: a run's start (``run.trainer``), timed by it: the training loader also starts
    at once, before the model is built (``start_early``), and --compile reuses the compiled
    graphs a previous start kept (``training.compile_cache``). ``continues``: the checkpoint
    the run resumes, decided once (``checkpoint.source.decide``; ``Decided(None)``: a fresh
    run).
    """
    cfg, layout = plan.cfg, plan.layout
    output_dir = Path(cfg.output_dir)  # made, checked and locked by checkpoint.rundir.claim_folder
    # Model init uses the same seed on every rank; augmentation gets its own per-sample seeds.
    seed_process(cfg.seed)
    eval_data.check_outputs(cfg, dist)  # -e's report folder, --predictions
    # Rank 0's seed (unseeded: its draw) is the job's augmentation seed: a sample's
    # augmentation does not depend on the rank that loads it, and the checkpoint's seed is
    # every rank's. Every rank broadcasts, seeded or not, so that flags differing across ranks
    # are reported (checkpoint.changes), not stuck in a collective only some ranks call.
    aug_seed = from_rank0(cfg.seed if cfg.seed is not None else
                          random.SystemRandom().randrange(2**31))
    root = data_root(cfg, output_dir)
    with slow_stage(f"reading the data set {root} (listing every image)") as stage:
        data = load_data(plan, dist, root, aug_seed, continues.path)
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
    early, val_check = None, None
    if clock is not None:
        clock.mark("data", data.listed)
        early = start_early(plan, data, continues.path)
        if not cfg.evaluate:  # checked before training (preflight), meanwhile in the background
            val_check = image_check(data.val_loader.dataset, dist.rank, dist.world_size,
                                    image_backend(cfg))
            val_check = val_check.start() if val_check is not None else None
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
    compiled = None
    if clock is not None and cfg.compile:  # before anything compiles
        compiled = open_cache(plan.cache_dir, graph_signature(cfg, layout, data.num_classes,
                                                                dist.device), dist.is_main)
    model = wrap(raw, cfg, dist, ema, sizes=plan.train_sizes)
    if cfg.seed is not None:  # per-rank stream for dropout / MixUp in the training step
        torch.manual_seed(cfg.seed + dist.rank)
    steps = -(-data.train.batches // layout.grad_accum_steps)
    engine = build_engine(cfg, raw, model, dist.device, layout, steps, data.num_classes, ema,
                          data.train_counts)
    name = files.dcp_name if cfg.sharded_checkpoint else str  # best: a file or a directory
    best_ema = Best(output_dir / name(files.BEST_EMA)) if cfg.model_ema else None
    run = Run(plan, dist, output_dir, data, raw, engine, Step(epoch=cfg.start_epoch),
              Best(output_dir / name(files.BEST)), best_ema, aug_seed, continues.path, clock=clock,
              early=early, compile_cache=compiled, val_check=val_check)
    if clock is not None:
        clock.mark("model", "compiled graphs from the cache" if compiled and compiled.reused
                   else "")
    return run

