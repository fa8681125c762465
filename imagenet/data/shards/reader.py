"""Batches of tar shards: ``ShardBatchSampler`` reads, ``ShardSamples`` decodes, ``ShardTrain``.

The training process reads (a thread per stream of ``plan.EpochPlan``, a few batches ahead);
its DataLoader's workers decode: the batch sampler hands them each batch's encoded samples as
its "indices". So the batches are the plan's for any number of workers, and reading is the same
few sequential streams whatever ``-j`` is. Each sample is decoded and augmented as in an
ImageFolder run (same transforms, augmentation seeded by (seed, epoch, sample)). A resumed epoch
opens each stream's shard at its position: the samples before it are passed over by their tar
headers (a seek on local files, read and dropped on downloads), never decoded.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

import imagenet.data.transforms as T
from imagenet.data import device
from imagenet.data.samplers import seeded_call
from imagenet.data.shards.parquet import ParquetReader, open_reader
from imagenet.data.shards.plan import BLOCK, STREAMS, EpochPlan, train_batches_per_rank
from imagenet.data.shards.sources import ShardList
from imagenet.data.shards.tarreader import IMAGE_EXTENSIONS, SampleReader, ShardError
from imagenet.data.transforms import follow_epoch
from imagenet.errors import RunError

WANTED = frozenset((*IMAGE_EXTENSIONS, "cls"))
AHEAD = 4  # batches each stream reads ahead

Raw = dict[str, bytes | str]
Item = tuple[int, int, int, Raw]  # augmentation seed, epoch, sample id, encoded sample


@dataclass
class ReadStats:
    """What a reader did: shards opened, samples passed over and decoded (this process)."""

    opened: int = 0
    skipped: int = 0  # passed over by their headers to reach a stream's start
    read: int = 0  # encoded samples read (whole blocks)
    decoded: int = 0

    def add(self, **counts: int) -> None:
        """Add to the counters; the streams' threads share one ReadStats."""
        with _STATS_LOCK:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


_STATS_LOCK = threading.Lock()  # module-level: a ReadStats travels to loader workers (pickled)


class _Stream:
    """One stretch of the epoch sequence, read front to back as encoded samples."""

    def __init__(self, shards: ShardList, plan: EpochPlan, position: int,
                 stats: ReadStats) -> None:
        self.shards, self.plan, self.position, self.stats = shards, plan, position, stats
        self.reader: SampleReader | ParquetReader | None = None
        self.reader_shard = -1
        self.block: list[tuple[int, Raw]] = []
        self.block_at: tuple[int, int] = (-1, -1)  # (shard, block index) held in self.block

    def take(self, n: int) -> list[tuple[int, Raw]]:
        """The next ``n`` samples as (sample id, encoded sample)."""
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
            self.reader, self.reader_shard = open_reader(url, WANTED), shard
            self.stats.add(opened=1, skipped=self.reader.skip(lo))
        raw = [self._next(url, count) for _ in range(hi - lo)]
        self.stats.add(read=hi - lo)
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


class _Ahead:
    """A thread reading one stream's share of the coming batches, ``AHEAD`` batches ahead."""

    def __init__(self, stream: _Stream, shares: list[int]) -> None:
        self.queue: queue.Queue = queue.Queue(AHEAD)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(stream, shares), daemon=True,
                                       name="shard-reader")
        self.thread.start()

    def get(self) -> list[tuple[int, Raw]]:
        """The next batch's share; re-raises what went wrong in the thread."""
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)  # a read in progress ends within streams.TIMEOUT anyway

    def _run(self, stream: _Stream, shares: list[int]) -> None:
        try:
            for n in shares:
                if not self._put(stream.take(n)):
                    return
        except BaseException as exc:  # handed to the training thread
            self._put(exc)
        finally:
            stream.close()

    def _put(self, item: object) -> bool:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False


class ShardBatchSampler(Sampler):
    """One rank's batches of a split, as lists of ``Item`` for ``ShardSamples``."""

    def __init__(self, shards: ShardList, *, world_size: int, rank: int, batch_size: int,
                 shuffle: bool, seed: int = 0, aug_seed: int = 0, block: int = BLOCK,
                 streams: int = STREAMS) -> None:
        self.shards, self.shuffle = shards, shuffle
        self.layout = {"world_size": world_size, "rank": rank, "batch_size": batch_size,
                       "block": block, "streams": streams}
        self.seed, self.aug_seed = seed, aug_seed
        self.epoch = self.first = 0
        self.stats = ReadStats()

    def set_position(self, epoch: int, first_batch: int = 0) -> None:
        self.epoch, self.first = epoch, first_batch

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The plan of ``epoch`` (default: the current one)."""
        return EpochPlan(self.shards.counts, seed=self.seed, shuffle=self.shuffle,
                         epoch=self.epoch if epoch is None else epoch, **self.layout)

    def __len__(self) -> int:
        return max(self.plan().batches - self.first, 0)

    def __iter__(self) -> Iterator[list[Item]]:
        plan, first = self.plan(), self.first
        readers = [_Ahead(_Stream(self.shards, plan, plan.position(s, first), self.stats),
                          [plan.share(size)[s] for size in plan.sizes[first:]])
                   for s in range(plan.streams)]
        try:
            for _ in range(first, plan.batches):
                yield [(self.aug_seed, plan.epoch, sample_id, raw)
                       for reader in readers for sample_id, raw in reader.get()]
        finally:
            for reader in readers:
                reader.stop()

    def first_items(self, epoch: int, count: int) -> list[Item]:
        """Up to ``count`` samples of this rank's first batch of ``epoch`` (read here), in the
        batch's order: each stream's share in turn."""
        plan, items = self.plan(epoch), []
        for s, share in enumerate(plan.share(plan.sizes[0]) if plan.sizes else []):
            if len(items) >= count:
                break
            stream = _Stream(self.shards, plan, plan.position(s, 0), self.stats)
            try:
                items += [(self.aug_seed, epoch, i, raw)
                          for i, raw in stream.take(min(count - len(items), share))]
            finally:
                stream.close()
        return items


class ShardSamples(Dataset):
    """Decodes and transforms the items ``ShardBatchSampler`` yields: (image, label[, key]).
    ``encoded`` (--decode-on-device): the transform gets (JPEG bytes or decoded image, name), as
    ``device.read_encoded`` gives it for a file, and the device decodes the JPEGs."""

    def __init__(self, transform: Callable, backend: str, num_classes: int, train: bool,
                 keys: bool = False, encoded: bool = False) -> None:
        self.transform, self.backend, self.num_classes = transform, backend, num_classes
        self.train, self.keys, self.encoded = train, keys, encoded
        self.stats = ReadStats()

    def __getitem__(self, item: Item) -> tuple:
        aug_seed, epoch, sample_id, raw = item
        label = self._label(raw)
        if self.train:
            follow_epoch(self, epoch)  # progressive resizing: the epoch's crop size
            image = seeded_call(aug_seed, epoch, sample_id, lambda: self._image(raw))
        else:
            image = self._image(raw)
        return (image, label, raw["__key__"]) if self.keys else (image, label)

    def _image(self, raw: Raw) -> torch.Tensor:
        ext = next((e for e in IMAGE_EXTENSIONS if e in raw), None)
        if ext is None:
            raise ShardError(f"shard {raw['__url__']}: sample {raw['__key__']} has no image "
                             f"member (.{', .'.join(IMAGE_EXTENSIONS)})")
        self.stats.decoded += 1
        name = f"{raw['__key__']}.{ext} in shard {raw['__url__']}"
        if self.encoded:
            return self.transform(device.encoded(raw[ext], name, self.backend))
        return self.transform(T.decode_image(raw[ext], name, self.backend))  # type: ignore

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
    """``TrainData`` (see ``imagenet.data.folder``) of tar shards."""

    def __init__(self, loader: DataLoader, finish: Callable | None = None) -> None:
        self.loader = loader
        self.finish = finish  # a loader batch -> device tensors (--decode-on-device)
        self.sampler: ShardBatchSampler = loader.batch_sampler  # type: ignore[assignment]
        self.dataset: ShardSamples = loader.dataset  # type: ignore[assignment]

    @property
    def order_seed(self) -> int:
        return self.sampler.seed

    @property
    def aug_seed(self) -> int:
        return self.sampler.aug_seed

    @property
    def batches(self) -> int:
        layout = self.sampler.layout
        return train_batches_per_rank(self.sampler.shards.total, layout["world_size"],
                                      layout["batch_size"])

    @property
    def images(self) -> int:
        layout = self.sampler.layout
        return self.batches * layout["batch_size"] * layout["world_size"]

    def set_position(self, epoch: int, samples_done: int) -> None:
        batch = self.sampler.layout["batch_size"]
        if samples_done % batch:
            raise RunError(f"cannot continue shards after {samples_done} samples: not a "
                           f"multiple of the batch ({batch})")
        self.sampler.set_position(epoch, samples_done // batch)

    # Each rank reads a contiguous stretch of the epoch: only the layout that trained part of
    # an epoch can go on with the rest of it.
    continues_any_layout = False

    def continue_after(self, epoch: int, images: int) -> None:
        self.set_position(epoch, images // self.sampler.layout["world_size"])

    def reseed(self, order_seed: int, aug_seed: int) -> None:
        self.sampler.seed, self.sampler.aug_seed = order_seed, aug_seed

    def preview(self, epoch: int, count: int) -> torch.Tensor:
        items = [self.dataset[item] for item in self.sampler.first_items(epoch, count)]
        if self.finish is None:
            return torch.stack([image for image, *_ in items])
        return self.finish(self.loader.collate_fn(items), torch.device("cpu"))[0]
