"""Which samples each batch of a rank holds in an epoch of tar shards: a pure function.

Training: the shards in an order drawn from (seed, epoch); inside each shard, blocks of ``BLOCK``
samples, each in an order drawn from (seed, epoch, shard, block). That makes the epoch one
sequence of N positions. Every rank runs ``S = N // (W x B)`` batches of B (W ranks): rank r
trains on positions [r S B, (r + 1) S B). The last N - S W B positions (fewer than one global
batch; other samples every epoch) are left out of that epoch; every other sample is seen exactly
once. Validation: shards and samples in stored order; rank r takes [r N // W, (r + 1) N // W)
in batches of B, the last one short: every image exactly once over the ranks.

A rank reads its stretch as ``STREAMS`` contiguous parts at once (each a sequential read of
whole shards, but the first); every batch takes its share of samples from each part, so a batch
mixes several shards. Where a part starts inside a shard, the samples before are passed over.

A batch therefore draws from ``STREAMS`` places of the split, a block each: its class mix is a
folder's shuffled epoch's only if those places hold different classes. With 2 streams of 128, a
split stored in class order (a ``datasets`` set written with pyarrow after ``shuffle()``,
which only records an index mapping; sets sorted by label) gave batches of 2-3 classes and
trained near chance (issue 60: 10.6 % top-1, its folders 19.4 %); 16 streams of 16 give a
10-class set stored so batches of 9-10 classes, as a folder's (18.0 % over 5 seeds, the
folders 18.7 %: docs/your-own-data.md), and read the same 256 samples ahead. The price:
a rank's parts start inside a shard 16 times an epoch, not twice; on downloaded tar shards
(http(s), ``pipe:``, object storage) the samples before each start are downloaded and dropped.
The same layout wherever the shards are: a copy on local disk gives the same epochs.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import accumulate

import numpy as np

# parts of a rank's stretch read at once, each a thread (http: one connection each): the places
# of the split a batch draws from, 64 // 16 = 4 samples each at -b 64
STREAMS = 16
BLOCK = 16  # samples shuffled together inside a shard; a stream holds one block in memory
_MASK = (1 << 63) - 1


def train_batches_per_rank(samples: int, world_size: int, batch_size: int) -> int:
    """Training batches every rank runs per epoch: the incomplete last global batch is dropped."""
    return samples // (world_size * batch_size)


def _rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng([k & _MASK for k in keys])


class EpochPlan:
    """The samples of every batch of one rank in one epoch (see the module docstring)."""

    def __init__(self, counts: Sequence[int], *, world_size: int, rank: int, batch_size: int,
                 seed: int, epoch: int, shuffle: bool, block: int = BLOCK,
                 streams: int = STREAMS) -> None:
        self.counts, self.seed, self.epoch, self.shuffle = list(counts), seed, epoch, shuffle
        self.block, self.streams = block, streams
        n = len(self.counts)
        self.order = _rng(seed, epoch).permutation(n).tolist() if shuffle else list(range(n))
        # Position of each shard (in epoch order) in the sequence; sample ids in stored order.
        self.starts = list(accumulate((self.counts[s] for s in self.order), initial=0))
        self.id_base = list(accumulate(self.counts, initial=0))
        total = self.starts[-1]
        if shuffle:
            steps = train_batches_per_rank(total, world_size, batch_size)
            first, self.sizes = rank * steps * batch_size, [batch_size] * steps
        else:
            first = rank * total // world_size
            length = (rank + 1) * total // world_size - first
            self.sizes = [min(batch_size, length - i) for i in range(0, length, batch_size)]
        # Stream s's stretch starts after the shares of streams 0..s-1 in every batch.
        totals = [sum(self.share(size)[s] for size in self.sizes) for s in range(streams)]
        self.stream_start = list(accumulate(totals, initial=first))

    @property
    def batches(self) -> int:
        return len(self.sizes)

    def share(self, size: int) -> list[int]:
        """How many of a batch's ``size`` samples each stream gives."""
        return [size // self.streams + (s < size % self.streams) for s in range(self.streams)]

    def position(self, stream: int, batch: int) -> int:
        """Sequence position of stream ``stream``'s first sample for batch ``batch``."""
        return self.stream_start[stream] + sum(self.share(size)[stream]
                                               for size in self.sizes[:batch])

    def locate(self, position: int) -> tuple[int, int]:
        """(shard, position inside the shard's epoch order) of a sequence position."""
        i = bisect.bisect_right(self.starts, position) - 1
        return self.order[i], position - self.starts[i]

    def block_order(self, shard: int, block: int, length: int) -> list[int]:
        """Offsets of a block's samples in the order this epoch reads them."""
        if not self.shuffle:
            return list(range(length))
        return _rng(self.seed, self.epoch, shard, block).permutation(length).tolist()

    def sample_id(self, shard: int, index: int) -> int:
        """A sample's number in the whole split (stored order): the same every epoch."""
        return self.id_base[shard] + index
