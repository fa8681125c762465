"""Batches of tar shards: ``ShardBatches`` (the DataLoader dataset) and ``ShardTrain``.

A DataLoader worker yields whole batches (``batch_size=None``) of the plan in ``plan.py``; each
sample is decoded and augmented as in an ImageFolder run (same transforms, augmentation seeded
by (seed, epoch, sample)). The position to start from - epoch, first batch, seeds - lives in a
small shared-memory tensor, so persistent workers see every ``set_position``. A resumed epoch
opens each stream's shard at its position: the samples before it are passed over by their tar
headers (a seek on local files, read and dropped on downloads), never decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import IterableDataset, get_worker_info

from imagenet import transforms as T
from imagenet.data import seeded_call
from imagenet.errors import RunError
from imagenet.shards.plan import BLOCK, GROUPS, EpochPlan, train_batches_per_rank
from imagenet.shards.sources import ShardList
from imagenet.shards.streams import open_shard
from imagenet.shards.tarreader import SampleReader, ShardError

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp")  # first one present is used
WANTED = frozenset((*IMAGE_EXTENSIONS, "cls"))

Raw = dict[str, bytes | str]


@dataclass
class ReadStats:
    """What this process's reader did: shards opened, samples passed over and decoded."""

    opened: int = 0
    skipped: int = 0  # passed over by their headers to reach a stream's start
    decoded: int = 0


class _Stream:
    """One group's stretch of the epoch sequence, read front to back as raw samples."""

    def __init__(self, shards: ShardList, plan: EpochPlan, position: int,
                 stats: ReadStats) -> None:
        self.shards, self.plan, self.position, self.stats = shards, plan, position, stats
        self.reader: SampleReader | None = None
        self.reader_shard = -1
        self.block: list[tuple[int, Raw]] = []
        self.block_at: tuple[int, int] = (-1, -1)  # (shard, block index) held in self.block

    def take(self, n: int) -> list[tuple[int, Raw]]:
        """The next ``n`` samples as (sample id, raw sample)."""
        out = []
        for _ in range(n):
            shard, q = self.plan.locate(self.position)
            if self.block_at != (shard, q // self.plan.block):
                self._load_block(shard, q // self.plan.block)
            out.append(self.block[q % self.plan.block])
            self.position += 1
        return out

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def _load_block(self, shard: int, block: int) -> None:
        url, count = self.shards.urls[shard], self.shards.counts[shard]
        lo, hi = block * self.plan.block, min((block + 1) * self.plan.block, count)
        if self.reader is None or self.reader_shard != shard or self.reader.index != lo:
            self.close()
            self.reader, self.reader_shard = SampleReader(open_shard(url), url, WANTED), shard
            self.stats.opened += 1
            self.stats.skipped += self.reader.skip(lo)
        raw = [self._next(url, count) for _ in range(hi - lo)]
        if hi == count:  # the shard must end here, as _info.json says
            extra = self.reader.next()
            if extra is not None:
                raise ShardError(f"shard {url} holds more than the {count} samples its "
                                 f"_info.json lists (next: {extra['__key__']})")
            self.close()
        order = self.plan.block_order(shard, block, hi - lo)
        self.block = [(self.plan.sample_id(shard, lo + j), raw[j]) for j in order]
        self.block_at = (shard, block)

    def _next(self, url: str, count: int) -> Raw:
        assert self.reader is not None
        sample = self.reader.next()
        if sample is None:
            raise ShardError(f"shard {url} ends after {self.reader.index} samples but its "
                             f"_info.json lists {count}: copy it again or fix _info.json")
        sample["__url__"] = url  # for error messages
        return sample


class ShardBatches(IterableDataset):
    """One rank's batches of a split: (uint8 images N x 3 x H x W, int64 labels[, keys])."""

    def __init__(self, shards: ShardList, *, transform: Callable, backend: str, num_classes: int,
                 world_size: int, rank: int, batch_size: int, train: bool, seed: int = 0,
                 aug_seed: int = 0, keys: bool = False, block: int = BLOCK) -> None:
        super().__init__()
        self.shards, self.transform, self.backend = shards, transform, backend
        self.num_classes, self.train, self.keys = num_classes, train, keys
        self.layout = {"world_size": world_size, "rank": rank, "batch_size": batch_size,
                       "block": block}
        # epoch, first batch, order seed, augmentation seed: shared with persistent workers
        self.state = torch.tensor([0, 0, seed, aug_seed], dtype=torch.int64).share_memory_()
        self.stats = ReadStats()

    def set_position(self, epoch: int, first_batch: int = 0) -> None:
        self.state[0], self.state[1] = epoch, first_batch

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The plan of ``epoch`` (default: the current one)."""
        epoch = int(self.state[0]) if epoch is None else epoch
        return EpochPlan(self.shards.counts, seed=int(self.state[2]), epoch=epoch,
                         shuffle=self.train, **self.layout)

    def __len__(self) -> int:
        return max(self.plan().batches - int(self.state[1]), 0)

    def __iter__(self) -> Iterator[tuple]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        if GROUPS % workers:
            raise RunError(f"{workers} loader workers do not divide {GROUPS} (use "
                           "plan.usable_workers)")
        plan, first = self.plan(), int(self.state[1])
        streams: dict[int, _Stream] = {}
        try:
            for b in range(first + worker, plan.batches, workers):
                group = b % GROUPS
                if group not in streams:
                    streams[group] = _Stream(self.shards, plan, plan.batch_start(b), self.stats)
                yield self._batch(streams[group].take(plan.sizes[b]), plan.epoch)
        finally:
            for stream in streams.values():
                stream.close()

    def first_images(self, epoch: int, count: int) -> torch.Tensor:
        """Up to ``count`` images of this rank's first batch of ``epoch``, augmented."""
        plan = self.plan(epoch)
        stream = _Stream(self.shards, plan, plan.batch_start(0), self.stats)
        try:
            items = stream.take(min(count, plan.sizes[0] if plan.sizes else 0))
        finally:
            stream.close()
        return torch.stack([self._image(raw, epoch, i) for i, raw in items])

    def _batch(self, items: list[tuple[int, Raw]], epoch: int) -> tuple:
        labels = torch.tensor([self._label(raw) for _, raw in items], dtype=torch.int64)
        images = torch.stack([self._image(raw, epoch, i) for i, raw in items])
        if self.keys:
            return images, labels, [raw["__key__"] for _, raw in items]
        return images, labels

    def _image(self, raw: Raw, epoch: int, sample_id: int) -> torch.Tensor:
        ext = next((e for e in IMAGE_EXTENSIONS if e in raw), None)
        if ext is None:
            raise ShardError(f"shard {raw['__url__']}: sample {raw['__key__']} has no image "
                             f"member (.{', .'.join(IMAGE_EXTENSIONS)})")
        self.stats.decoded += 1

        def load() -> torch.Tensor:
            image = T.decode_image(raw[ext], f"{raw['__key__']}.{ext} in shard {raw['__url__']}",
                                   self.backend)
            return self.transform(image)

        if not self.train:
            return load()
        return seeded_call(int(self.state[3]), epoch, sample_id, load)

    def _label(self, raw: Raw) -> int:
        try:
            label = int(raw["cls"])
        except (KeyError, ValueError):
            raise ShardError(f"shard {raw['__url__']}: sample {raw['__key__']} has no integer "
                             ".cls member (its label)") from None
        if not 0 <= label < self.num_classes:
            raise ShardError(f"shard {raw['__url__']}: sample {raw['__key__']} has label "
                             f"{label}, outside the {self.num_classes} classes (check "
                             "--num-classes)")
        return label


class ShardTrain:
    """``TrainData`` (see ``imagenet.data``) of tar shards."""

    def __init__(self, dataset: ShardBatches, loader) -> None:
        self.dataset, self.loader = dataset, loader

    @property
    def order_seed(self) -> int:
        return int(self.dataset.state[2])

    @property
    def aug_seed(self) -> int:
        return int(self.dataset.state[3])

    @property
    def batches(self) -> int:
        layout = self.dataset.layout
        return train_batches_per_rank(self.dataset.shards.total, layout["world_size"],
                                      layout["batch_size"])

    @property
    def images(self) -> int:
        return self.batches * self.dataset.layout["batch_size"] * self.dataset.layout["world_size"]

    def set_position(self, epoch: int, samples_done: int) -> None:
        batch = self.dataset.layout["batch_size"]
        if samples_done % batch:
            raise RunError(f"cannot continue shards after {samples_done} samples: not a "
                           f"multiple of the batch ({batch})")
        self.dataset.set_position(epoch, samples_done // batch)

    def reseed(self, order_seed: int, aug_seed: int) -> None:
        self.dataset.state[2], self.dataset.state[3] = order_seed, aug_seed

    def preview(self, epoch: int, count: int) -> torch.Tensor:
        return self.dataset.first_images(epoch, count)
