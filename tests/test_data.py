"""Samplers and the seeded dataset: order, sharding, resumption, worker independence."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from imagenet.data.samplers import ResumableDistributedSampler, SeededDataset, ShardSampler


@pytest.mark.parametrize("size, world", [(10, 1), (10, 3), (31, 2), (7, 4)])
def test_training_order_is_distributed_samplers(size, world):
    for rank in range(world):
        ours = ResumableDistributedSampler(size, rank, world, seed=5)
        theirs = DistributedSampler(list(range(size)), num_replicas=world, rank=rank, seed=5)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert [i for _, i in ours] == list(theirs)
            assert all(e == epoch for e, _ in ours)


def test_mid_epoch_start_skips_exactly_the_consumed_samples():
    sampler = ResumableDistributedSampler(20, rank=1, world_size=2, seed=1)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(2, start=4)
    assert list(sampler) == full[4:] and len(sampler) == len(full) - 4
    sampler.set_epoch(3)
    assert len(sampler) == 10


@pytest.mark.parametrize("size, world", [(31, 2), (31, 3), (5, 8), (50, 7)])
def test_validation_shards_cover_every_image_once(size, world):
    seen = [i for r in range(world) for i in ShardSampler(size, r, world)]
    assert sorted(seen) == list(range(size))
    assert sum(len(ShardSampler(size, r, world)) for r in range(world)) == size


class _Noise(Dataset):
    """Returns random numbers drawn from the global generators: shows what the seeding fixes."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int):
        import random

        return torch.rand(2), random.random(), index


def _epoch(workers: int, start: int = 0) -> list:
    sampler = ResumableDistributedSampler(12, seed=3)
    sampler.set_epoch(1, start=start)
    loader = DataLoader(SeededDataset(_Noise(), seed=9), batch_size=4, sampler=sampler,
                        num_workers=workers)
    return [(b[0], b[1], b[2]) for b in loader]


def test_augmentation_randomness_ignores_workers_and_interruption():
    plain, with_workers, resumed = _epoch(0), _epoch(2), _epoch(0, start=4)
    for a, b in zip(plain, with_workers, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for a, b in zip(plain[1:], resumed, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    other_epoch = SeededDataset(_Noise(), seed=9)[(2, 0)][0]
    assert not torch.equal(plain[0][0][0], other_epoch)


def test_fetching_in_the_training_process_leaves_its_random_streams_alone():
    import random

    torch.manual_seed(123)
    random.seed(123)
    expected = (torch.rand(1), random.random())
    torch.manual_seed(123)
    random.seed(123)
    SeededDataset(_Noise(), seed=9)[(0, 5)]
    assert (torch.rand(1), random.random()) == expected
