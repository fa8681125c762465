"""A start, overlapped and timed (issue 31): the training loader's workers start on the resumed
position before the model is built; their batches are exactly those the resume then asks for,
and a wrong guess is thrown away without a trace; each start's time to its first step is
recorded. Real loaders with worker processes, on a JPEG folder the test writes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY, write_image_folder

from imagenet.cli import main
from imagenet.data.folder import build_data, shutdown_workers
from imagenet.reporting.logger import StartClock
from imagenet.run.build import start_early
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import Layout
from imagenet.settings.plan import fixed_plan


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("startup") / "data", train_per_class=6)


def loaders(data: Path, out: Path, *flags: str):
    cfg = parse_config([str(data), *TINY, "-b", "4", "--output-dir", str(out), *flags])
    plan = fixed_plan(cfg, Layout(1, 4, 1, 1))  # one loader worker
    return plan, build_data(plan, data, 0, aug_seed=5, pin_memory=False)


def batches(iterator, count: int) -> list[torch.Tensor]:
    return [next(iterator)[0].clone() for _ in range(count)]


def reference(data: Path, out: Path, epoch: int, images: int, count: int) -> list[torch.Tensor]:
    """The batches of (epoch, images) from a loader started the usual way."""
    _, built = loaders(data, out)
    try:
        built.train.continue_after(epoch, images)
        return batches(iter(built.train_loader), count)
    finally:
        shutdown_workers(built.train_loader, built.val_loader)


def test_batches_started_early_are_the_ones_the_start_asks_for(data, tmp_path):
    plan, built = loaders(data, tmp_path / "out", "--start-epoch", "1", "--epochs", "3")
    try:
        early = start_early(plan, built, None)
        assert early is not None and early.key == (0, 5, 1, 0)
        assert built.train_loader._iterator is not None  # the worker is up, fetching
        got = early.take((0, 5, 1, 0))
        assert got is not None and early.take((0, 5, 1, 0)) is None  # taken once
        assert all(a.equal(b) for a, b in zip(batches(got, 3),
                                              reference(data, tmp_path / "ref", 1, 0, 3)))
    finally:
        shutdown_workers(built.train_loader, built.val_loader)


def test_a_wrong_guess_is_thrown_away(data, tmp_path):
    plan, built = loaders(data, tmp_path / "out")
    try:
        early = start_early(plan, built, None)
        assert early is not None
        # The resume continues elsewhere (another rank's checkpoint, another seed): the workers
        # that hold the guessed seeds are stopped, and the loader starts on the real position.
        built.train.reseed(7, 9)
        built.train.continue_after(0, 8)
        assert early.take((7, 9, 0, 8)) is None
        assert built.train_loader._iterator is None
        got = batches(iter(built.train_loader), 2)
    finally:
        shutdown_workers(built.train_loader, built.val_loader)
    _, fresh = loaders(data, tmp_path / "ref")
    try:
        fresh.train.reseed(7, 9)
        fresh.train.continue_after(0, 8)
        want = batches(iter(fresh.train_loader), 2)
    finally:
        shutdown_workers(fresh.train_loader, fresh.val_loader)
    assert all(a.equal(b) for a, b in zip(got, want))


def test_no_early_start_without_workers(data, tmp_path):
    cfg = parse_config([str(data), *TINY, "--output-dir", str(tmp_path / "out")])
    plan = fixed_plan(cfg, Layout(1, 8, 1, 0))
    built = build_data(plan, data, 0, aug_seed=5, pin_memory=False)
    assert start_early(plan, built, None) is None


def test_the_clock_names_every_stage(monkeypatch):
    clock = StartClock.begin(time.time() - 2.0)
    for stage in ("data", "model", "resume", "checks"):
        clock.mark(stage, "from the folder index" if stage == "data" else "")
    record = clock.first_step()
    assert clock.first_step() is None  # the first step only
    assert list(record["stages_s"]) == ["start", "data", "model", "resume", "checks",
                                        "first_step"]
    assert 2.0 <= record["time_to_first_step_s"] < 10
    assert record["stages_s"]["start"] >= 2.0
    line = StartClock.line(record)
    assert line.startswith("=> first step ") and "data set 0.0 s (from the folder index)" in line


@pytest.mark.slow
def test_config_json_keeps_every_start(data, tmp_path, capsys):
    out = tmp_path / "out"
    flags = [str(data), *TINY, "-j", "1", "--output-dir", str(out)]
    assert main([*flags, "--epochs", "1"]) == 0
    assert main([*flags, "--epochs", "2", "--resume", "auto"]) == 0
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("=> first step")]
    config = json.loads((out / "config.json").read_text())
    assert len(config["starts"]) == 2 == len(printed)
    for start in config["starts"]:
        assert start["time_to_first_step_s"] > 0
        assert start["notes"]["training_batches"] == "loaded during the start"
    assert config["starts"][1]["notes"]["resume"] == "checkpoint.pth.tar"
    # A fresh run in the folder starts a new record (the old one is moved aside).
    assert main([*flags, "--epochs", "1"]) == 0
    assert len(json.loads((out / "config.json").read_text())["starts"]) == 1
    (previous,) = (out / "previous").iterdir()
    assert len(json.loads((previous / "config.json").read_text())["starts"]) == 2


@pytest.mark.slow
def test_a_resume_reads_its_checkpoint_once_and_parses_and_sets_up_logging_once(
        data, tmp_path, monkeypatch):
    """Before the first optimizer step of a resume (-j 1: the loader starts early, on the
    checkpoint's position), checkpoint.pth.tar is opened once for reading, main.py's parser is
    built once and the console's logging is set up once (issue 42: 3, 3 and 2 before)."""
    import argparse
    import builtins
    import logging

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    out = tmp_path / "out"
    flags = [str(data), *TINY, "-j", "1", "--output-dir", str(out)]
    assert main([*flags, "--epochs", "1"]) == 0
    counts = {"checkpoint": 0, "parser": 0, "logging": 0}
    at_first_step: list[dict[str, int]] = []
    real_open = builtins.open
    parser_init, formatter_init = argparse.ArgumentParser.__init__, logging.Formatter.__init__

    def counting_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, Path)) and Path(file).name == "checkpoint.pth.tar" \
                and "r" in mode:
            counts["checkpoint"] += 1
        return real_open(file, mode, *args, **kwargs)

    def counting(name, init):
        def counted(self, *args, **kwargs):
            counts[name] += 1
            init(self, *args, **kwargs)
        return counted

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(argparse.ArgumentParser, "__init__", counting("parser", parser_init))
    monkeypatch.setattr(logging.Formatter, "__init__", counting("logging", formatter_init))
    hook = register_optimizer_step_pre_hook(
        lambda *_: None if at_first_step else at_first_step.append(dict(counts)))
    try:
        assert main([*flags, "--epochs", "2", "--resume", "auto"]) == 0
    finally:
        hook.remove()
    assert at_first_step == [{"checkpoint": 1, "parser": 1, "logging": 1}]
