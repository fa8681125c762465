"""Training controls (docs/training-controls.md): --ra-reps, progressive resizing, --time-limit,
--keep-checkpoints. The pieces in process here (real JPEG folders and shards, real squeue
processes, real files); whole runs of main.py in test_training_controls_runs.py."""

from __future__ import annotations

import json
import os
import stat
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import tiny_engine, tiny_net, uint8_batches, write_image_folder

from imagenet.checkpoint import files, rundir
from imagenet.checkpoint.rundir import move_previous_run
from imagenet.data.folder import build_data, shutdown_workers
from imagenet.data.samplers import ResumableDistributedSampler
from imagenet.errors import RunError, UsageError
from imagenet.launching.timelimit import Deadline
from imagenet.settings.choices import end_time, parse_duration, slurm_end_time
from imagenet.settings.flags import parse_config
from imagenet.settings.images import CropSchedule
from imagenet.settings.launch import Layout
from imagenet.settings.plan import fixed_plan
from imagenet.training.models import RECOMPILE_LIMIT, compile_model

# ---------------------------------------------------------------- --ra-reps


def shares(size: int, world: int, reps: int, images: int = 0, epoch: int = 4) -> list[list]:
    """Each rank's keys for the rest of ``epoch`` after ``images`` items of its order."""
    out = []
    for rank in range(world):
        sampler = ResumableDistributedSampler(size, rank, world, seed=3, reps=reps)
        sampler.continue_epoch(epoch, images)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("size, world, reps", [(48, 1, 2), (48, 2, 2), (50, 4, 4), (31, 3, 4)])
def test_repeated_augmentation_is_rasamplers_order_at_any_world_size(size, world, reps):
    # torchvision's RASampler: every index of the epoch's permutation reps times in a row,
    # strided over the ranks; the epoch stays one pass (size items, not size x reps).
    ranks = shares(size, world, reps)
    assert len({len(r) for r in ranks}) == 1 and len(ranks[0]) == -(-size // world)
    order = [key for step in zip(*ranks) for key in step][:size]  # padding is past size
    perm = torch.randperm(size, generator=torch.Generator().manual_seed(3 + 4)).tolist()
    assert order == [(4, perm[i // reps], i % reps) for i in range(size)]
    # Copies of one image go to consecutive ranks; with world >= reps, to different ones.
    holders = [i % world for i, key in enumerate(order) if key[1] == perm[0]]
    assert holders == [i % world for i in range(reps)]
    # One pass: size / reps distinct images, each reps times (the last maybe fewer).
    counts = Counter(key[1] for key in order)
    assert len(counts) == -(-size // reps) and max(counts.values()) == reps


@pytest.mark.parametrize("old_world, per_rank, new_world", [(2, 5, 1), (2, 5, 3), (1, 9, 2)])
def test_repeated_augmentation_continues_in_another_layout(old_world, per_rank, new_world):
    # W ranks that each trained n items trained the first n x W items of the order; another
    # layout trains the rest: every (image, copy) of the epoch exactly once.
    size, reps = 48, 4
    whole = [key for step in zip(*shares(size, 1, reps)) for key in step]
    trained = [key for keys in shares(size, old_world, reps) for key in keys[:per_rank]]
    images = per_rank * old_world
    rest = [key for step in zip(*shares(size, new_world, reps, images)) for key in step]
    assert Counter(trained + rest[:size - images]) == Counter(whole)
    assert len(set(whole)) == size  # no (image, copy) twice in an epoch


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("controls") / "data", train_per_class=6)


def test_the_copies_of_an_image_are_augmented_differently(folder):
    cfg = parse_config([str(folder), "--ra-reps", "3", "--train-crop-size", "32"])
    data = build_data(fixed_plan(cfg, Layout(1, 6, 1, 0)), folder, 0, aug_seed=7, pin_memory=False)
    dataset = data.train.loader.dataset
    copies = [dataset[(2, 5, c)][0] for c in range(3)]
    assert not torch.equal(copies[0], copies[1]) and not torch.equal(copies[1], copies[2])
    assert torch.equal(dataset[(2, 5, 1)][0], copies[1])  # still a function of the key
    assert torch.equal(dataset[(2, 5)][0], copies[0])  # copy 0: the run without --ra-reps
    keys = next(iter(data.train.loader.batch_sampler))
    assert [k[2] for k in keys] == [0, 1, 2, 0, 1, 2] and keys[0][1] == keys[2][1]


def test_repeated_augmentation_refuses_tar_shards_in_one_line():
    from imagenet.data.shards import build_shard_data

    cfg = parse_config(["/data/wds", "--ra-reps", "4"])
    with pytest.raises(UsageError, match=r"^--ra-reps 4 needs an ImageFolder: tar shards"):
        build_shard_data(fixed_plan(cfg, Layout(1, 8, 1, 0)), "/data/wds", 0, 0, False)


# ---------------------------------------------------------------- progressive resizing


def test_crop_schedule_is_ffcvs_ramp():
    # FFCV's ResNet-50 (88 epochs): 160 px up to epoch 65, 192 px from 76, multiples of 32.
    ffcv = CropSchedule(160, 192, 65, 76, 32)
    assert [ffcv.size(e) for e in (0, 65, 66, 70, 71, 76, 87)] == [160, 160, 160, 160, 192,
                                                                      192, 192]
    assert ffcv.sizes(88) == [160, 192]
    fine = CropSchedule(128, 176, 2, 8, 8)  # linear, on multiples of 8
    assert [fine.size(e) for e in range(10)] == [128, 128, 128, 136, 144, 152, 160, 168, 176,
                                                  176]
    assert CropSchedule(176, 176, 0, 0, 32).sizes(5) == [176]
    assert CropSchedule(64, 32, 1, 3, 8).sizes(5) == [64, 48, 32]  # shrinking works too
    assert CropSchedule(24, 32, 0, 2, 32).sizes(3) == [24, 32]  # rounded, kept within the ends


@pytest.mark.parametrize("argv, message", [
    (["--train-crop-start", "160"], "--train-crop-start needs the other flag"),
    (["--train-crop-ramp", "1", "5"], "--train-crop-ramp needs the other flag"),
    (["--train-crop-start", "160", "--train-crop-ramp", "5", "1"], "0 <= START <= END"),
    (["--train-crop-start", "0", "--train-crop-ramp", "1", "5"], "--train-crop-start must be"),
    (["--train-crop-multiple", "0"], "--train-crop-multiple must be positive"),
    (["--ra-reps", "0"], "--ra-reps must be positive"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints must not be negative"),
    (["--time-limit", "1:5"], "--time-limit '1:5' is not a duration"),
])
def test_bad_training_control_flags_are_one_line_each(argv, message):
    with pytest.raises(UsageError, match=message):
        parse_config(["data", *argv])


PROGRESSIVE = ["--train-crop-size", "32", "--train-crop-start", "24", "--train-crop-ramp", "0",
               "2", "--train-crop-multiple", "4"]  # 24, 28, 32 px
VAL = ["--val-crop-size", "36", "--val-resize-size", "40"]


def first_batch_sizes(train, epochs=range(3)) -> list[int]:
    sizes = []
    for epoch in epochs:
        train.set_position(epoch, 0)
        sizes.append(next(iter(train.loader))[0].shape[-1])
    return sizes


def test_each_epoch_trains_its_crop_in_loader_workers_and_from_tar_shards(folder, tmp_path):
    from imagenet.data.shards import build_shard_data
    from imagenet.tools.prepare import get_args_parser
    from imagenet.tools.shardwrite import shards_from_folder

    cfg = parse_config([str(folder), "--seed", "0", *PROGRESSIVE, *VAL])
    layout = Layout(1, 4, 1, 1)  # a loader worker: it builds each epoch's transform itself
    data = build_data(fixed_plan(cfg, layout), folder, 0, aug_seed=1, pin_memory=False)
    shards_from_folder(get_args_parser().parse_args(
        ["--from-folder", str(folder), "--out", str(tmp_path / "wds"), "--shard-max-images",
         "8"]))
    shards = build_shard_data(fixed_plan(cfg, layout), str(tmp_path / "wds"), 0, 1, False)
    try:
        assert first_batch_sizes(data.train) == [24, 28, 32]
        assert next(iter(data.val_loader))[0].shape[-1] == 36  # validation keeps its own size
        assert first_batch_sizes(shards.train) == [24, 28, 32]
    finally:
        shutdown_workers(data.train.loader, data.val_loader, shards.train.loader,
                         shards.val_loader)
    dummy = build_data(fixed_plan(parse_config(["--dummy", "--dummy-size", "8", *PROGRESSIVE]),
                                  Layout(1, 4, 1, 0)), "", 0, 1, False)
    assert first_batch_sizes(dummy.train) == [24, 28, 32]


@pytest.mark.slow
def test_compile_makes_one_static_graph_per_size_not_one_per_batch(monkeypatch):
    # torch's own counters, on the CPU; the "eager" backend captures the same graphs as
    # inductor (benchmarks/bench.py progressive measures inductor's compile times).
    from torch._dynamo.utils import counters

    from imagenet.training.engine import Step, train_one_epoch

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)  # put back afterwards
    torch._dynamo.reset()
    counters.clear()
    cfg = parse_config(["data", "--compile", "--epochs", "3", *PROGRESSIVE])
    sizes = fixed_plan(cfg, Layout(1, 8, 1, 0)).train_sizes
    model = compile_model(tiny_net(bn=True), "eager", len(sizes))
    engine = tiny_engine(model, "--lr", "0.01", steps=4)
    graphs = []
    for epoch, size in enumerate((24, 28, 32)):
        batches = uint8_batches(3, 8, size=size) + uint8_batches(1, 3, size=size)  # short last
        train_one_epoch(engine, batches, Step(epoch))
        graphs.append(counters["stats"]["unique_graphs"])
    # Static shapes: every size compiles a graph for its batch and one for the short batch, in
    # the first epoch of that size; nothing is ever compiled twice or dynamic.
    assert graphs == [2, 4, 6], graphs
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT * 3
    torch._dynamo.reset()


# ---------------------------------------------------------------- --time-limit


@pytest.mark.parametrize("text, seconds", [("5400", 5400), ("90.5", 90.5), ("01:30:00", 5400),
                                           ("48:00:00", 172800), ("1-12:00:05", 129605)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5", "1:30", "01:60:00", "1h", "nan", "inf"])
def test_bad_durations_name_the_flag_and_the_formats(text):
    with pytest.raises(UsageError, match=r"--time-limit .* HH:MM:SS .* or 'slurm'"):
        parse_duration(text)


def fake_squeue(folder: Path, body: str) -> dict[str, str]:
    """An environment whose PATH starts with a real ``squeue`` script running ``body``."""
    folder.mkdir(exist_ok=True)
    script = folder / "squeue"
    script.write_text(f"#!/bin/sh\necho \"$@\" > {folder}/args\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{folder}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}


def test_slurm_end_time_from_squeue_or_the_jobs_variable(tmp_path):
    env = fake_squeue(tmp_path / "bin", "echo 2031-05-01T12:34:56")
    assert slurm_end_time(env) == time.mktime((2031, 5, 1, 12, 34, 56, 0, 0, -1))
    assert (tmp_path / "bin" / "args").read_text().split() == ["-h", "-j", "4242", "-o", "%e"]
    assert slurm_end_time({**env, "SLURM_JOB_END_TIME": "1900000000"}) == 1900000000
    cfg = parse_config(["data", "--time-limit", "slurm"])
    end, name = end_time(cfg.time_limit, env)
    assert name.startswith("the end of SLURM job 4242 at 2031-05-01 12:34:56")
    unlimited = fake_squeue(tmp_path / "unlimited", "echo Unknown")
    assert end_time(cfg.time_limit, unlimited) is None  # a job without an end: no limit (warned)


def test_slurm_end_time_errors_are_one_line(tmp_path):
    with pytest.raises(UsageError, match="not run in a SLURM job .*give a duration"):
        slurm_end_time({"PATH": os.environ["PATH"]})
    env = fake_squeue(tmp_path / "bin", "echo 'slurm_load_jobs error: Invalid job id' >&2\nexit 1")
    with pytest.raises(RunError, match=r"`squeue -h -j 4242 -o %e` failed \(slurm_load_jobs "
                                       r"error: Invalid job id\)"):
        slurm_end_time(env)
    with pytest.raises(RunError, match="squeue is not on PATH"):
        slurm_end_time({"PATH": str(tmp_path / "nothing"), "SLURM_JOB_ID": "1"})


def test_the_deadline_keeps_room_for_the_stop():
    clock = [1000.0]
    deadline = Deadline(end=1050.0, name="the end", save_seconds=5.0, now=lambda: clock[0])
    steps = []
    while True:  # steps of 2 s, one of 6 s: room for two of the longest, two saves and 10 s
        clock[0] += 6.0 if len(steps) == 3 else 2.0
        steps.append(clock[0])
        if deadline.due():
            break
    assert deadline.margin() == 2 * 6 + 2 * 5 + 10
    assert clock[0] + deadline.margin() >= 1050 > clock[0] - 2 + deadline.margin()
    deadline.saved(20.0)  # a measured save replaces the estimate, and is not a step
    assert deadline.save_seconds == 20 and deadline.step_seconds == 6
    assert "before the end (a step takes up to 6.0 s, a save 20.0 s)" in deadline.describe()


def test_the_time_limit_keeps_room_for_compiling_a_new_crop_size():
    """Suspicion settled (it held): at an epoch's end the margin covers ordinary steps, but
    under --compile the next epoch's first step at a new crop size compiles graphs, as long as
    the run's first step took; the stop before such an epoch keeps room for it."""
    from imagenet.launching.preemption import StopFlag

    def epoch_then_end(compiles: bool) -> tuple[bool, float]:
        clock = [0.0]
        stop = StopFlag(Deadline(end=300.0, name="the end", save_seconds=5.0,
                                 now=lambda: clock[0]))
        for seconds in [60.0] + [1.0] * 25:  # the first step compiled the first size's graphs
            clock[0] += seconds
            assert not stop.should_stop()
        clock[0] += 170.0  # validation; the save measured
        stop.saved(5.0)
        return stop.settle(compiles=compiles), 300.0 - clock[0]

    going_on, left = epoch_then_end(compiles=False)
    assert not going_on and left == 45.0  # an ordinary step, saves and the exit fit in 45 s ...
    assert left - 60.0 < 0  # ... a compiling step does not: the save would come after the end
    stopping, _ = epoch_then_end(compiles=True)
    assert stopping


# ---------------------------------------------------------------- --keep-checkpoints


def keep(folder: Path, n: int, epoch: int, acc1: float) -> None:
    """An epoch end as run.checkpointing.save does it: index, file, prune."""
    path = rundir.plan(folder, n, rundir.epoch_entry(epoch, acc1, epoch * 10, False))
    if path is not None:
        files.atomic_save({"epoch": epoch, "state_dict": {}}, path)
    rundir.prune(folder, sharded=False)


def test_the_history_keeps_the_best_by_top1_later_epochs_first_at_a_tie(tmp_path):
    for epoch, acc1 in enumerate([10.0, 30.0, 20.0, 30.0, 5.0], start=1):
        keep(tmp_path, 2, epoch, acc1)
    kept = sorted(p.name for p in tmp_path.glob("checkpoint_epoch*"))
    assert kept == ["checkpoint_epoch002.pth.tar", "checkpoint_epoch004.pth.tar"]
    index = json.loads((tmp_path / "checkpoints.json").read_text())
    assert [(e["epoch"], e["acc1"]) for e in index["checkpoints"]] == [(4, 30.0), (2, 30.0)]
    assert index["keep"] == 2 and index["ranked_by"] == "val_acc1"
    keep(tmp_path, 2, 4, 1.0)  # epoch 4 trained again (a resume from an older checkpoint)
    assert [e.epoch for e in rundir.read_index(tmp_path)] == [2, 4]


def test_a_kill_between_the_steps_of_an_epoch_end_leaves_a_consistent_history(tmp_path):
    keep(tmp_path, 1, 1, 50.0)
    # Killed after the index named epoch 2 but before its file was written: the entry is
    # dropped when read, the one it evicted is still kept, and the next epoch end deletes what
    # no entry names.
    rundir.plan(tmp_path, 1, rundir.epoch_entry(2, 60.0, 20, False))
    assert [e.epoch for e in rundir.read_index(tmp_path)] == [1]
    assert (tmp_path / "checkpoint_epoch001.pth.tar").is_file()
    keep(tmp_path, 1, 2, 60.0)
    assert sorted(p.name for p in tmp_path.glob("checkpoint_epoch*")) == [
        "checkpoint_epoch002.pth.tar"]
    (tmp_path / "checkpoints.json").write_text("{not json")
    assert rundir.read_index(tmp_path) == []  # a damaged index: a warning, a new start


def test_a_kill_between_the_index_and_the_link_loses_no_evicted_checkpoint(tmp_path):
    """Suspicion settled: epoch 3 evicts epoch 2 from the index, then the kill comes before its
    file is linked; the resume trains epoch 3 again, worse this time: epoch 2 is still among
    the two best and must still be kept."""
    keep(tmp_path, 2, 1, 50.0)
    keep(tmp_path, 2, 2, 40.0)
    rundir.plan(tmp_path, 2, rundir.epoch_entry(3, 60.0, 30, False))  # killed after this
    assert [e.epoch for e in rundir.read_index(tmp_path)] == [1, 2]  # as before epoch 3
    keep(tmp_path, 2, 3, 30.0)  # epoch 3 again, from the resumed checkpoint of epoch 2
    assert sorted(p.name for p in tmp_path.glob("checkpoint_epoch*")) == [
        "checkpoint_epoch001.pth.tar", "checkpoint_epoch002.pth.tar"]
    assert [e.epoch for e in rundir.read_index(tmp_path)] == [1, 2]
    # Killed after the link, before the prune: the eviction stands.
    path = rundir.plan(tmp_path, 2, rundir.epoch_entry(4, 45.0, 40, False))
    files.atomic_save({"epoch": 4, "state_dict": {}}, path)
    assert [e.epoch for e in rundir.read_index(tmp_path)] == [1, 4]
    keep(tmp_path, 2, 5, 1.0)
    assert sorted(p.name for p in tmp_path.glob("checkpoint_epoch*")) == [
        "checkpoint_epoch001.pth.tar", "checkpoint_epoch004.pth.tar"]
    assert "evicting" not in json.loads((tmp_path / "checkpoints.json").read_text())


def test_a_fresh_run_moves_the_history_to_previous(tmp_path):
    keep(tmp_path, 2, 1, 50.0)
    (tmp_path / "checkpoint_epoch003.dcp").mkdir()  # --sharded-checkpoint's directories too
    (tmp_path / "checkpoint.pth.tar").write_bytes(b"x")
    moved = move_previous_run(tmp_path)
    assert sorted(p.name for p in moved.iterdir()) == [
        "checkpoint.pth.tar", "checkpoint_epoch001.pth.tar", "checkpoint_epoch003.dcp",
        "checkpoints.json"]
    assert not list(tmp_path.glob("checkpoint*"))
