"""The order and the randomness of the data: which samples each rank takes in an epoch, and the
seed each one is augmented with.

Augmentation randomness is a pure function of (seed, epoch, sample index), and of the copy with
repeated augmentation (--ra-reps): each sample re-seeds the worker's generators before its
transform runs. The data a step sees therefore does not depend on the number of workers, on which
worker ran it, or on whether the run was interrupted - the basis of bitwise-exact mid-epoch
resume. Tar shards (``imagenet.data.shards``) follow the same rules.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeVar

import torch
from torch.utils.data import BatchSampler, Dataset, Sampler, get_worker_info

from imagenet.data.transforms import follow_epoch

R = TypeVar("R")


def seeded_call(seed: int, epoch: int, index: int, fn: Callable[[], R], copy: int = 0) -> R:
    """``fn()`` with torch's and python's global generators seeded from (seed, epoch, index)
    and, for the further copies of repeated augmentation, ``copy``."""
    key = (seed, epoch, index) if copy == 0 else (seed, epoch, index, copy)
    if get_worker_info() is not None:
        return _seeded(key, fn)
    # In the training process (-j 0) the global streams belong to the training step
    # (dropout, MixUp): borrow them and put them back.
    python_state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        result = _seeded(key, fn)
    random.setstate(python_state)
    return result


def _seeded(key: tuple[int, ...], fn: Callable[[], R]) -> R:
    sample_seed = hash(key) & 0x7FFF_FFFF_FFFF_FFFF
    torch.default_generator.manual_seed(sample_seed)
    random.seed(sample_seed)
    return fn()


class SeededDataset(Dataset):
    """Wraps a dataset so that item ``(epoch, index)`` (or ``(epoch, index, copy)``) is augmented
    with its own seed, at the epoch's training crop size (progressive resizing)."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, ...]):
        epoch, index, *copy = key
        follow_epoch(self.dataset, epoch)
        return seeded_call(self.seed, epoch, index, partial(self.dataset.__getitem__, index),
                           *copy)


class ResumableDistributedSampler(Sampler):
    """DistributedSampler's order (seed + epoch, padded, strided) that can start mid-epoch.

    Yields ``(epoch, index)`` keys for ``SeededDataset``. Every rank gets the same number of
    samples (the permutation is padded by repeating its start, as DistributedSampler does) so DDP
    ranks never wait for a rank that ran out of data. A resumed epoch continues with the items
    of its permutation after the first ``skip`` (trained before, in any layout: W ranks that
    each trained n samples trained exactly the first n x W items).

    With ``reps`` > 1 (repeated augmentation) the order is torchvision's RASampler's: each index
    of the permutation ``reps`` times in a row, cut to ``size`` items so that an epoch is still
    one pass; strided over the ranks, the copies of an image go to ``reps`` consecutive ranks.
    Its keys are ``(epoch, index, copy)``: every copy is augmented with its own seed. The order
    is still one sequence of ``size`` items, so any layout continues it.
    """

    def __init__(self, size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, reps: int = 1) -> None:
        self.size, self.rank, self.world_size = size, rank, world_size
        self.seed, self.shuffle, self.reps = seed, shuffle, reps
        self.num_samples = math.ceil(size / world_size)
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch, skipping the first ``start`` samples of this rank's share."""
        self.continue_epoch(epoch, start * self.world_size)

    def continue_epoch(self, epoch: int, images: int) -> None:
        """Select the epoch, continuing after the first ``images`` items of its global order."""
        self.epoch, self.skip = epoch, min(images, self.size)

    def _order(self) -> list[int]:
        """The epoch's global order of items (item = index x reps + copy)."""
        if not self.shuffle:
            order = torch.arange(self.size)
        else:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=g)
        if self.reps > 1:  # one pass: the first size / reps images of the permutation, repeated
            copies = torch.arange(self.size) % self.reps
            order = order.repeat_interleave(self.reps)[:self.size] * self.reps + copies
        return order.tolist()

    def _keys(self, items: list[int]) -> list[tuple[int, ...]]:
        if self.reps == 1:
            return [(self.epoch, i) for i in items]
        return [(self.epoch, *divmod(i, self.reps)) for i in items]

    def keys(self) -> list[tuple[int, ...]]:
        """This rank's full list of keys for the current epoch."""
        return self._keys(_padded_share(self._order(), 0, self.rank, self.world_size))

    def indices(self) -> list[int]:
        """This rank's full index list for the current epoch."""
        return [key[1] for key in self.keys()]

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        share = _padded_share(self._order(), self.skip, self.rank, self.world_size)
        return iter(self._keys(share))

    def __len__(self) -> int:
        return math.ceil((self.size - self.skip) / self.world_size)


def _padded_share(order: list[int], skip: int, rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s stride of ``order[skip:]``, padded to a multiple of ``world_size`` with
    the order's first items (DistributedSampler's padding)."""
    rest = order[skip:]
    total = math.ceil(len(rest) / world_size) * world_size
    while len(rest) < total:
        rest += order[: total - len(rest)]
    return rest[rank:total:world_size]


class NoSingleImageBatches(BatchSampler):
    """The training batches, without a last batch that would hold a single image.

    BatchNorm cannot train on one image where a layer is 1x1 (one value per channel: the classic
    script crashes there), and elsewhere its statistics of one image are noise. Every other
    batch, the last incomplete one included, is kept, as in the classic script: the step count
    stays the classic's. The validation loader never drops anything.
    """

    def __init__(self, sampler: Sampler, batch_size: int) -> None:
        super().__init__(sampler, batch_size, drop_last=False)

    def __iter__(self) -> Iterator[list]:
        for batch in super().__iter__():
            if len(batch) > 1 or self.batch_size == 1:
                yield batch

    def __len__(self) -> int:
        return train_batches(len(self.sampler), self.batch_size)  # type: ignore[arg-type]


def train_batches(samples: int, batch_size: int) -> int:
    """Training batches in ``samples`` images: a last batch of one image does not count.

    The one place that counts an ImageFolder epoch's batches (``FolderTrain.batches``, from
    which ``build_run`` derives the steps per epoch, and the loader's length).
    """
    full, rest = divmod(samples, batch_size)
    return full + (rest > 1)


class ShardSampler(Sampler):
    """Validation shard of one rank: every image exactly once across ranks, no padding."""

    def __init__(self, size: int, rank: int = 0, world_size: int = 1) -> None:
        self.size, self.rank, self.world_size = size, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.size, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world_size))


def shard_batches(loader: Any) -> Any:
    """``loader``'s ShardBatchSampler (tar shards, Parquet rows); None for any other loader.
    Looked up, not imported: a run that reads no shards never imports imagenet.data.shards
    (and no ShardBatchSampler can exist then)."""
    reader = sys.modules.get("imagenet.data.shards.reader")
    batches = getattr(loader, "batch_sampler", None)
    return batches if reader is not None and isinstance(batches, reader.ShardBatchSampler) \
        else None
