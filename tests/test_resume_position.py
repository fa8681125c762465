"""Where a resume continues, in any layout: the data order, the step, the schedule, the optimizer.

The end-to-end proof with real processes is tests/test_resume_matrix.py; these pin the pieces.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from helpers import tiny_net

from imagenet.checkpoint.states import restore_optimizer
from imagenet.data.samplers import NoSingleImageBatches, ResumableDistributedSampler, train_batches
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import Layout
from imagenet.training.optim import build_optimizer, build_scheduler, rebuild_schedule, resume_point


def remaining(size: int, world: int, images: int, epoch: int = 3) -> list[list[int]]:
    """Each rank's indices for the rest of ``epoch`` after ``images`` were trained."""
    shares = []
    for rank in range(world):
        sampler = ResumableDistributedSampler(size, rank, world, seed=11)
        sampler.continue_epoch(epoch, images)
        share = [i for _, i in sampler]
        assert len(share) == len(sampler)
        shares.append(share)
    return shares


@pytest.mark.parametrize("size, old_world, per_rank, new_world", [
    (50, 2, 7, 3), (50, 4, 3, 1), (49, 1, 20, 4), (7, 2, 1, 5), (50, 3, 16, 2)])
def test_another_layout_continues_with_the_rest_of_the_epochs_order(size, old_world, per_rank,
                                                                     new_world):
    # W ranks that each trained n samples trained the first n x W items of the epoch's order.
    before = remaining(size, old_world, 0)
    trained = [i for share in before for i in share[:per_rank]]
    images = per_rank * old_world
    order = [i for step in zip(*before) for i in step]  # the global order, rank-strided back
    assert sorted(trained) == sorted(order[:images])
    after = remaining(size, new_world, images)
    rest = [i for step in zip(*after) for i in step]
    assert len({len(s) for s in after}) == 1  # every rank the same number: DDP never waits
    assert rest[:size - images] == order[images:size]  # the untrained items, in their order
    padding = rest[size - images:]
    assert len(padding) < new_world and set(padding) <= set(order[:images] or order)
    assert Counter(trained + rest[:size - images]) == Counter(range(size))


def test_same_layout_continues_exactly_where_each_rank_stopped():
    for rank in range(3):
        whole = ResumableDistributedSampler(50, rank, 3, seed=5)
        whole.set_epoch(2)
        resumed = ResumableDistributedSampler(50, rank, 3, seed=5)
        resumed.continue_epoch(2, 4 * 3)
        assert list(resumed) == list(whole)[4:]
        per_rank = ResumableDistributedSampler(50, rank, 3, seed=5)
        per_rank.set_epoch(2, start=4)
        assert list(per_rank) == list(resumed)


def ckpt(epoch: int, step: int, images: int, steps: int, global_step: int = 1) -> dict:
    return {"epoch": epoch, "step_in_epoch": step, "global_step": global_step,
            "steps_per_epoch": steps, "sampler": {"images": images}}


W1B8, W1B16 = Layout(1, 8, 1, 0), Layout(1, 16, 1, 0)


def test_resume_point_in_the_new_layout():
    # Same layout: the same step, exactly.
    point = resume_point(ckpt(2, 5, 40, 12), 12, W1B8, same_layout=True, order_size=96)
    assert (point.epoch, point.step_in_epoch, point.images, point.approximated) == \
        (2, 5, 40, False)
    # 40 images in steps of 16 are 2.5 steps: the rest (56 images) takes 4 steps of 6.
    point = resume_point(ckpt(2, 5, 40, 12), 6, W1B16, same_layout=False, order_size=96)
    assert (point.step_in_epoch, point.exact_step, point.approximated) == (2, 2.5, True)
    assert abs(point.step_in_epoch - point.exact_step) < 1
    # Tar shards: another layout starts the epoch over.
    shards = resume_point(ckpt(2, 5, 40, 12), 6, W1B16, same_layout=False, order_size=None)
    assert (shards.step_in_epoch, shards.images, shards.approximated) == (0, 0, True)
    # Stopped at the epoch's last step: only the validation is left, in any layout.
    assert resume_point(ckpt(1, 12, 96, 12), 6, W1B16, False, 96).step_in_epoch == 6
    # pytorch/examples' checkpoint: epochs only.
    classic = resume_point({"epoch": 31, "state_dict": {}}, 6, W1B16, False, 96)
    assert (classic.epoch, classic.step_in_epoch, classic.images) == (31, 0, 0)
    # Older checkpoints recorded each rank's samples ("start") and the world size.
    old = {**ckpt(0, 3, 0, 6), "sampler": {"start": 12}, "world_size": 2}
    assert resume_point(old, 12, W1B8, False, 96).images == 24


def steps_the_loader_takes(size: int, layout: Layout, images: int) -> int:
    """Optimizer steps of the real training batches left in an epoch after ``images``."""
    batches = set()
    for rank in range(layout.world_size):
        sampler = ResumableDistributedSampler(size, rank, layout.world_size, seed=3)
        sampler.continue_epoch(0, images)
        batches.add(len(list(NoSingleImageBatches(sampler, layout.batch_size))))
    assert len(batches) == 1  # every rank takes the same steps
    return math.ceil(batches.pop() / layout.grad_accum_steps)


@pytest.mark.parametrize("size, images, layout", [
    (600, 140, Layout(1, 17, 1, 0)),  # 460 left: 27 batches of 17 and one of 1 (dropped)
    (600, 150, Layout(2, 8, 1, 0)),  # 225 per rank: 28 batches of 8 and one of 1
    (600, 134, Layout(1, 5, 3, 0)),  # 466 left: 93 batches of 5 (31 steps) and one of 1
    (97, 46, Layout(3, 2, 2, 0)),  # 17 per rank: 8 batches of 2 (4 steps) and one of 1
    (600, 140, Layout(2, 9, 1, 0)),  # 230 per rank: 25 batches of 9 and one of 5, all kept
])
def test_a_resumed_epoch_ends_on_the_last_step_of_the_new_layouts_epoch(size, images, layout):
    # A last batch of one image is dropped: planning the rest as ceil(images / global batch)
    # steps would leave every later learning rate one step behind the fresh run's.
    per_rank = math.ceil(size / layout.world_size)
    steps = math.ceil(train_batches(per_rank, layout.batch_size) / layout.grad_accum_steps)
    point = resume_point(ckpt(0, 7, images, 30), steps, layout, False, size)
    assert point.step_in_epoch + steps_the_loader_takes(size, layout, images) == steps
    assert abs(point.step_in_epoch - point.exact_step) < 1


def lrs_of(scheduler, optimizer, steps: int) -> list[float]:
    values = []
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        values.append(optimizer.param_groups[0]["lr"])
    return values


@pytest.mark.parametrize("argv", [
    ["--lr-scheduler", "cosine", "--lr-warmup-epochs", "3", "--epochs", "9"],
    ["--lr-scheduler", "cosine", "--lr-warmup-epochs", "2", "--lr-warmup-method", "constant",
     "--epochs", "7", "--lr-min", "0.001"],
    ["--lr-scheduler", "multistep", "--lr-milestones", "3", "5", "--lr-warmup-epochs", "2"],
    ["--lr-step-size", "2", "--epochs", "8"],
])
def test_rebuilt_schedule_equals_a_fresh_run_exactly(argv):
    cfg = parse_config(["--lr", "0.4", *argv])
    steps_per_epoch = 7
    fresh_opt = build_optimizer(tiny_net(), cfg)
    fresh = lrs_of(build_scheduler(fresh_opt, cfg, steps_per_epoch), fresh_opt, 60)
    for done in (0, 1, 13, 14, 20, 35):
        # An optimizer left anywhere by another schedule (other --lr, other steps per epoch).
        other = parse_config(["--lr", "3.0", "--lr-warmup-epochs", "1"])
        optimizer = build_optimizer(tiny_net(), cfg)
        stale = build_scheduler(optimizer, other, 5)
        lrs_of(stale, optimizer, 17)
        optimizer.param_groups[0]["initial_lr"] = 3.0
        scheduler = rebuild_schedule(optimizer, cfg, steps_per_epoch, done)
        assert lrs_of(scheduler, optimizer, 60 - done) == fresh[done:], done


def test_the_optimizer_keeps_its_state_but_takes_the_flags_hyperparameters():
    model = tiny_net()
    old = parse_config(["--lr", "0.1", "--wd", "0.01", "--momentum", "0.9"])
    saved_opt = build_optimizer(model, old)
    build_scheduler(saved_opt, old, 4)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    saved_opt.step()
    saved = {"optimizer": saved_opt.state_dict(), "config": old.to_dict()}
    new = parse_config(["--lr", "0.03", "--wd", "0.002", "--momentum", "0.8"])
    optimizer = build_optimizer(model, new)
    restore_optimizer(model, optimizer, saved, new)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["momentum"]) == (0.03, 0.002, 0.8)
    assert "initial_lr" not in group
    for p in model.parameters():
        assert torch.equal(optimizer.state[p]["momentum_buffer"],
                           saved_opt.state[p]["momentum_buffer"])


@pytest.mark.parametrize("flags", [["--opt", "adamw"], ["--norm-weight-decay", "0"]])
def test_an_optimizer_state_that_cannot_fit_starts_afresh_with_a_warning(flags, caplog):
    model = tiny_net((4,), bn=True)
    old = parse_config([])
    saved_opt = build_optimizer(model, old)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    saved_opt.step()
    new = parse_config(flags)
    optimizer = build_optimizer(model, new)
    restore_optimizer(model, optimizer, {"optimizer": saved_opt.state_dict(),
                                         "config": old.to_dict()}, new)
    assert not optimizer.state and "starts afresh" in caplog.text
    assert optimizer.param_groups[0]["lr"] == new.lr


def test_steps_per_epoch_is_the_images_over_the_global_batch():
    # The resume arithmetic relies on ceil(ceil(ceil(N / W) / b) / k) == ceil(N / (W b k)).
    for n in range(1, 80):
        for w, b, k in ((1, 8, 1), (2, 3, 2), (3, 5, 1), (4, 2, 3)):
            assert math.ceil(math.ceil(math.ceil(n / w) / b) / k) == math.ceil(n / (w * b * k))
