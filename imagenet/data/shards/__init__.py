"""Training and validation from WebDataset tar shards, exactly and resumably.

  sources    the data argument -> shard URLs, their sample counts (``_info.json``), class names
  streams    opening a shard: local file, http(s) with bounded retries, ``pipe:`` commands
  tarreader  the samples of one shard, strict about truncation, skipping without reading
  plan       which samples each batch of a rank holds in an epoch: a pure function
  reader     ``ShardBatches`` (the DataLoader dataset) and ``ShardTrain`` (the trainer's view)
  check      before training: each rank's share of the validation shards is there and whole
  parquet    Hugging Face Parquet files read as shards (``--data-format parquet``)

Our own small reader of the format rather than the ``webdataset`` package, whose iteration model
cannot give what the trainer promises: batches independent of the number of loader workers,
equal steps per rank with each sample once, resume without replaying the epoch, errors for
truncated shards (see README, "Tar shards"). No dependency beyond torch and the standard library.
The training process reads (a thread per stream), the loader workers decode.
"""

from __future__ import annotations

import logging

import torch

from imagenet.data import device
from imagenet.data.folder import Data, StopSafeLoader, build_transforms, loader_options
from imagenet.data.shards.parquet import resolve_parquet
from imagenet.data.shards.plan import STREAMS, train_batches_per_rank
from imagenet.data.shards.reader import ShardBatchSampler, ShardSamples, ShardTrain
from imagenet.data.shards.sources import resolve
from imagenet.errors import DataError, UsageError
from imagenet.settings.images import image_backend
from imagenet.settings.plan import Plan

__all__ = ["build_shard_data"]

log = logging.getLogger(__name__)


def build_shard_data(plan: Plan, data: str, rank: int, aug_seed: int, pin_memory: bool) -> Data:
    """Loaders for this rank from the shards ``data`` names (see ``sources``)."""
    cfg, layout = plan.cfg, plan.layout
    world_size = layout.world_size
    if cfg.ra_reps > 1 and not cfg.evaluate:  # -e reads no training batch
        raise UsageError(f"--ra-reps {cfg.ra_reps} needs an ImageFolder: tar shards give each "
                         "process a contiguous stretch of the epoch, read once, so the copies "
                         "of an image cannot be spread over the processes; drop --ra-reps")
    shards = resolve_parquet(data, cfg.val_data) if plan.data_format == "parquet" else \
        resolve(data, cfg.val_data, cfg.num_classes)
    batch, workers = layout.batch_size, layout.workers
    steps = train_batches_per_rank(shards.train.total, world_size, batch)
    if steps == 0 and not cfg.evaluate:
        raise DataError(f"the training shards hold {shards.train.total} images, fewer than one "
                        f"global batch ({world_size} process(es) x {batch}); lower -b")
    on_device = plan.decode.on_device
    train_tf, val_tf = device.item_transforms(cfg, plan.crops) if on_device else \
        build_transforms(cfg, plan.crops)
    finish = device.device_crops(cfg) if on_device else None
    # encoded bytes: nvJPEG reads them from pageable memory itself
    extra = {"collate_fn": device.collate} if on_device else {}
    pin_memory = pin_memory and not on_device
    where = {"world_size": world_size, "rank": rank, "batch_size": batch}
    splits = ((shards.train, train_tf, True), (shards.val, val_tf, False))
    loaders = [StopSafeLoader(ShardSamples(tf, image_backend(cfg), len(shards.classes), train,
                                           encoded=on_device),
                              # validation needs no mixing: one stream, fewer starts in shards
                              batch_sampler=ShardBatchSampler(
                                  split, shuffle=train, seed=cfg.seed or 0, aug_seed=aug_seed,
                                  **where, streams=STREAMS if train else 1),
                              num_workers=workers, pin_memory=pin_memory,
                              # private: making an iterator must not consume the global RNG
                              generator=torch.Generator().manual_seed(aug_seed),
                              # 2, not 4: an "index" here is a read batch, and a new epoch's
                              # first batch waits until all of them are queued
                              **loader_options(workers, prefetch=2), **extra)
               for split, tf, train in splits]
    for note in shards.notes if rank == 0 and not cfg.evaluate else ():
        log.warning("=> %s", note)
    left_out = shards.train.total - steps * batch * world_size
    kind = "Parquet files" if plan.data_format == "parquet" else "shards"
    log.info("=> %s: %d training images in %d %s, %d batches of %d per process and epoch (%d "
             "left out each epoch, different ones); %d validation images in %d %s",
             "parquet" if plan.data_format == "parquet" else "shards", shards.train.total,
             len(shards.train.urls), kind, steps, batch, left_out, shards.val.total,
             len(shards.val.urls), kind)
    return Data(ShardTrain(loaders[0], finish and finish[0]), loaders[1], len(shards.classes),
                shards.classes, shards.val.total, train_finish=finish and finish[0],
                val_finish=finish and finish[1])
