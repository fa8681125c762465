"""--class-balanced-loss: the loss an epoch reports is the weighted mean over all its images,
whatever -b and the world size; --backbone-lr-scale: every group's schedule is its learning rate's
scaled copy, the --lr-min floor included (the backbone's learning rate never rises)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import StripedImages, gloo_rank_saving, start_ranks, tiny_net

from imagenet.evaluation.validate import evaluate
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import Layout
from imagenet.training.engine import Step, train_one_epoch
from imagenet.training.optim import (
    build_engine,
    build_optimizer,
    build_scheduler,
    class_weights,
    rebuild_schedule,
)

COUNTS = [12, 3, 1]  # training images per class: weights far apart
FLAGS = {"plain": ["--class-balanced-loss", "0.9"],
         "smoothed": ["--class-balanced-loss", "0.9", "--label-smoothing", "0.1"]}


def engine_for(model, flags, batch: int, world: int = 1, lr: str = "0.01"):
    cfg = parse_config(["data", "--lr", lr, *flags])
    return build_engine(cfg, model, model, torch.device("cpu"), Layout(world, batch, 1, 0), 1, 3,
                        class_counts=COUNTS)


def batches(data: StripedImages, batch: int, start: int = 0, step: int = 1):
    ids = list(range(start, len(data), step))
    return [(data.images[ids[i:i + batch]], data.labels[ids[i:i + batch]])
            for i in range(0, len(ids), batch)]


def expected_loss(model, data: StripedImages, flags) -> float:
    """The weighted mean over every image at once (one batch of all of them)."""
    from imagenet.data.transforms import normalize

    smoothing = 0.1 if "--label-smoothing" in flags else 0.0
    with torch.no_grad():
        out = model(normalize(data.images))
    return float(F.cross_entropy(out, data.labels, weight=class_weights(COUNTS, 0.9),
                                 label_smoothing=smoothing))


@pytest.mark.parametrize("kind", FLAGS)
def test_class_balanced_validation_loss_does_not_depend_on_the_batch_size(kind):
    data, model = StripedImages(20, classes=3, seed=3), tiny_net(classes=3)
    want = expected_loss(model, data, FLAGS[kind])
    for b in (1, 4, 7, 20):
        got = evaluate(engine_for(model, FLAGS[kind], b), model, batches(data, b), len(data))
        assert got["loss"] == pytest.approx(want, rel=1e-6), b


@pytest.mark.parametrize("kind", FLAGS)
def test_class_balanced_training_loss_does_not_depend_on_the_batch_size(kind):
    data = StripedImages(20, classes=3, seed=3)
    want = expected_loss(tiny_net(classes=3), data, FLAGS[kind])
    for b in (1, 4, 20):
        model = tiny_net(classes=3)  # lr 0: the weights stay those ``want`` was computed with
        engine = engine_for(model, [*FLAGS[kind], "--momentum", "0"], b, lr="0")
        got = train_one_epoch(engine, batches(data, b), Step())
        assert got["loss"] == pytest.approx(want, rel=1e-6), b


def _rank_loss(info, batch: int = 3):
    data, model = StripedImages(20, classes=3, seed=3), tiny_net(classes=3)
    engine = engine_for(model, FLAGS["smoothed"], batch, world=info.world_size)
    mine = batches(data, batch, start=info.rank, step=info.world_size)  # 10 images each, uneven
    return evaluate(engine, model, mine, len(data))["loss"]


@pytest.mark.slow
def test_class_balanced_validation_loss_at_world_size_2(tmp_path):
    from test_shards import free_port

    start_ranks(gloo_rank_saving, args=(2, free_port(), tmp_path, _rank_loss))
    want = expected_loss(tiny_net(classes=3), StripedImages(20, classes=3, seed=3),
                         FLAGS["smoothed"])
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
@pytest.mark.parametrize("warmup", ["0", "1"])
def test_backbone_lr_floor_is_scaled_like_its_lr(schedule, warmup):
    cfg = parse_config(["d", "--lr", "0.01", "--backbone-lr-scale", "0.1", "--lr-min", "0.005",
                        "--lr-scheduler", schedule, "--epochs", "3", "--lr-warmup-epochs",
                        warmup])
    model = tiny_net(classes=3)
    optimizer = build_optimizer(model, cfg, head=("4",))
    assert [g["lr_scale"] for g in optimizer.param_groups] == [1.0, 0.1]
    scheduler = build_scheduler(optimizer, cfg, 4)
    seen = [[g["lr"] for g in optimizer.param_groups]]
    for _ in range(12):
        optimizer.step()
        scheduler.step()
        seen.append([g["lr"] for g in optimizer.param_groups])
    head, body = zip(*seen)
    assert all(b == pytest.approx(0.1 * h, rel=1e-9) for h, b in zip(head, body)), seen
    after_warmup = body[4 * int(warmup):]
    assert all(later <= earlier + 1e-15 for earlier, later in zip(after_warmup,
                                                                   after_warmup[1:])), seen
    assert (head[-1], body[-1]) == pytest.approx((0.005, 0.0005), rel=1e-9)
    resumed = build_optimizer(model, cfg, head=("4",))  # a resume replays the same schedule
    rebuild_schedule(resumed, cfg, 4, 7)
    assert [g["lr"] for g in resumed.param_groups] == pytest.approx(seen[7], rel=1e-12)
