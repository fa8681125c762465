"""Batches made ahead of the step (imagenet.data.prefetch) and no empty pipeline at an epoch's
start (imagenet.run.trainer): the thread hands batches over in order, its errors reach the
training thread, it stops when the iteration ends early; the next epoch's batches load while an
epoch validates, and they are the batches the epoch would have read anyway."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY, write_image_folder

import imagenet.run.trainer as trainer
from imagenet.checkpoint.resume_from import Decided
from imagenet.data.prefetch import DeviceBatches, device_batches
from imagenet.errors import DataError
from imagenet.launching.process_group import DistInfo
from imagenet.reporting.logger import RunLogger
from imagenet.run.build import build_run
from imagenet.run.checkpointing import resume
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import Layout
from imagenet.settings.plan import fixed_plan

CPU = torch.device("cpu")


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((2, 3, 4, 4), i % 200, dtype=torch.uint8), torch.tensor([i, i]))
            for i in range(n)]


def plus_one(batch, device):
    time.sleep(0.002)  # a decode that takes a while
    images, labels = batch
    return images.to(device) + 1, labels.to(device)


def batch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "imagenet-batches"]


def test_the_thread_hands_every_batch_over_in_order():
    made = list(DeviceBatches(batches(20), CPU, plus_one, threaded=True, ahead=2))
    assert [int(images[0, 0, 0, 0]) for images, _ in made] == [i + 1 for i in range(20)]
    assert [int(labels[0]) for _, labels in made] == list(range(20))
    in_turn = list(DeviceBatches(batches(20), CPU, plus_one))
    assert [int(images[0, 0, 0, 0]) for images, _ in in_turn] == [i + 1 for i in range(20)]
    assert not batch_threads()


class Failing:
    """A loader whose fourth batch cannot be read."""

    def __iter__(self):
        for i, batch in enumerate(batches(10)):
            if i == 3:
                raise DataError("cannot read image /data/train/x/broken.jpg")
            yield batch


def test_an_error_in_the_thread_is_raised_in_the_training_thread():
    seen = []
    with pytest.raises(DataError, match="broken.jpg"):
        for images, _ in DeviceBatches(Failing(), CPU, plus_one, threaded=True):
            seen.append(int(images[0, 0, 0, 0]))
    assert seen == [1, 2, 3]  # every batch before the bad one, then its error
    assert not batch_threads()


def test_an_iteration_ended_early_stops_its_thread():
    it = iter(DeviceBatches(batches(1000), CPU, plus_one, threaded=True, ahead=2))
    next(it)
    assert batch_threads()
    del it  # a stop in the step: nothing asks for the rest
    deadline = time.monotonic() + 10
    while batch_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not batch_threads()
    it = iter(DeviceBatches(batches(1000), CPU, plus_one, threaded=True, ahead=2))
    next(it)
    it.close()  # the trainer's explicit close
    assert not batch_threads()


def test_without_workers_nothing_runs_beside_the_training_thread():
    plain = batches(3)
    assert device_batches(plain, CPU, None) is plain  # the CPU path passes through
    made = iter(device_batches(plain, CPU, plus_one, threaded=False))
    assert not batch_threads()
    assert [int(images[0, 0, 0, 0]) for images, _ in made] == [1, 2, 3]


# ---------------------------------------------------------------- the epoch boundary


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("prefetch") / "data", classes=2,
                              train_per_class=8, val_per_class=4)


def trained_weights(folder: Path, out: Path, monkeypatch, prefetch: bool) -> dict:
    """Two seeded epochs through the trainer (2 loader workers); with ``prefetch`` off the next
    epoch's batches are asked for only when it begins."""
    cfg = parse_config([str(folder), *TINY, "-b", "4", "--epochs", "2", "--seed", "0", "-j",
                        "2", "--output-dir", str(out)])
    out.mkdir(parents=True)
    run = build_run(fixed_plan(cfg, Layout(1, 4, 1, 2)), DistInfo(), Decided(None))
    seen = []
    validate = trainer.validate_epoch

    def watching(run, stop, report=None):
        loader = run.data.train_loader
        # The next epoch's loader is running: its sampler is at that epoch's start and the
        # workers have been sent its first batches' indices.
        iterator = loader._iterator
        seen.append((run.data.train.sampler.epoch, run.data.train.sampler.skip,
                     iterator is not None and iterator._send_idx > 0))
        return validate(run, stop, report)

    monkeypatch.setattr(trainer, "validate_epoch", watching)
    if not prefetch:
        monkeypatch.setattr(trainer, "next_epoch_batches", lambda run, epoch: None)
    resume(run)
    logger = RunLogger(out, True, log_to="none")
    try:
        trainer.train(run, logger)
    finally:
        logger.close()
        trainer.shutdown_workers(run.data.train_loader, run.data.val_loader)
    return {"weights": {k: v.clone() for k, v in run.raw_model.state_dict().items()},
            "seen": seen}


@pytest.mark.slow
def test_the_next_epoch_loads_during_validation_and_trains_the_same(folder, tmp_path,
                                                                   monkeypatch):
    ahead = trained_weights(folder, tmp_path / "ahead", monkeypatch, prefetch=True)
    # Epoch 0's validation ran with epoch 1's batches on their way; the last epoch has no next.
    assert ahead["seen"][0] == (1, 0, True)
    assert ahead["seen"][1][0] == 1
    monkeypatch.undo()
    late = trained_weights(folder, tmp_path / "late", monkeypatch, prefetch=False)
    assert late["seen"][0][:2] == (0, 0)  # nothing asked for epoch 1 before it began
    for name, value in ahead["weights"].items():
        assert torch.equal(value, late["weights"][name]), name


# ---------------------------------------------------------------- the progress line's window


def test_the_progress_line_measures_its_own_window():
    """Time, Data and img/s of each progress line cover its own steps: the last, shorter window
    is divided by its own 2 steps (not by -p 4), and img/s is not counted from the run's start."""
    from helpers import tiny_engine, tiny_net, uint8_batches

    from imagenet.training.engine import Hooks, Step, train_one_epoch

    def slow(batches, seconds):
        for batch in batches:
            time.sleep(seconds)
            yield batch

    records = []
    engine = tiny_engine(tiny_net(), "-p", "4", steps=6)
    time.sleep(0.3)  # a run that started long before this epoch (compiling, validating, ...)
    train_one_epoch(engine, slow(uint8_batches(6, 8), 0.05), Step(),
                    Hooks(on_progress=records.append))
    assert [r["step"] for r in records] == [4, 6]
    last = records[-1]
    assert last["data_time"] >= 0.045  # 0.05 s of waiting per step, 2 steps in the window
    window = last["batch_time"] * 2
    assert last["images_per_sec"] == pytest.approx(last["images"] / window, rel=0.05)
    assert last["images"] == 16 and last["images_per_sec"] <= 16 / 0.1
