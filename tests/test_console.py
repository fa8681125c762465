"""What main.py prints for a newcomer: --global-batch-size, slow start-up stages, where the
outputs are, and distributed validation progress that says whose numbers it shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import TINY, child_env, load_checkpoint, run_main, save_edited, write_image_folder

from imagenet.errors import UsageError
from imagenet.settings.flags import parse_config
from imagenet.settings.plan import free_port


def without(flags: list[str], *names: str) -> list[str]:
    """``flags`` without the named flags and their values."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in names:
            skip = True
        else:
            out.append(flag)
    return out


FLAGS = without(TINY, "-b", "-j")  # the batch comes from --global-batch-size here


@pytest.fixture(scope="module")
def global_batch_runs(tmp_path_factory) -> tuple[Path, str, str]:
    """One process with --global-batch-size 8 and no --output-dir (outputs in the current
    folder), every start-up stage announced; then a resume of it on 2 processes, same flag."""
    base = tmp_path_factory.mktemp("global_batch")
    data = write_image_folder(base / "data")
    run = base / "run"
    run.mkdir()
    first = run_main(str(data), *FLAGS, "--global-batch-size", "8", "-j", "1", "--epochs", "1",
                     "--seed", "0", env=child_env(IMAGENET_NOTICE_AFTER="0"), cwd=run)
    assert first.returncode == 0, first.stderr
    second = run_main(str(data), *FLAGS, "--global-batch-size", "8", "-j", "0", "--epochs", "2",
                      "--seed", "0", "--resume", "auto", "--multiprocessing-distributed",
                      "--nproc-per-node", "2", "-p", "1", cwd=run)
    assert second.returncode == 0, second.stderr
    return run, first.stdout, second.stdout


@pytest.mark.slow
def test_global_batch_size_splits_over_the_processes_and_is_recorded(global_batch_runs):
    run, first, second = global_batch_runs
    assert "global batch 8 = 1 process(es) x 8 images x 1 accumulation step(s)" in first
    assert "--global-batch-size 8 -> 4 per process" in second
    assert "global batch 8 = 2 process(es) x 4 images x 1 accumulation step(s)" in second
    config = json.loads((run / "config.json").read_text())
    assert config["config"]["global_batch_size"] == 8
    assert config["global_batch"] == 8 and config["batch_per_process"] == 4


@pytest.mark.slow
def test_a_resume_on_more_processes_keeps_the_global_batch_and_the_steps(global_batch_runs):
    run, _, second = global_batch_runs
    assert ("layout changed since the checkpoint: 1 process(es) x 8 images x 1 accumulation "
            "step(s) = global batch 8, 3 steps per epoch -> 2 process(es) x 4 images x 1 "
            "accumulation step(s) = global batch 8, 3 steps per epoch") in second
    changed = [line for line in second.splitlines() if "changed since the checkpoint:" in line]
    assert changed[0] == "=> changed since the checkpoint: --epochs 1 -> 2"  # not -b: unused
    assert len(changed) == 2, changed
    assert "approximated" not in second
    ckpt = load_checkpoint(run / "checkpoint.pth.tar")
    assert ckpt["epoch"] == 2 and ckpt["global_step"] == 6


@pytest.mark.slow
def test_slow_start_up_stages_say_what_they_do(global_batch_runs):
    _, first, _ = global_batch_runs  # IMAGENET_NOTICE_AFTER=0: every stage counts as slow
    lines = first.splitlines()
    # The training loader starts as soon as the data set is listed: its worker fetches while
    # the model is built and the checks run (run.build).
    expected = ["=> reading the data set",
                "=> found 3 classes, 24 training images per epoch and 9 validation images (",
                "=> starting the training loader (1 worker process(es)) ...",
                "=> checking the disk space and every validation image ...",
                "=> disk space and validation images checked (",
                "=> waiting for the first training batch", "=> first training batch ready (",
                "=> first step ", "Epoch: [0]"]
    at = [next(i for i, line in enumerate(lines) if line.startswith(text)) for text in expected]
    assert at == sorted(at), first


@pytest.mark.slow
def test_the_output_folder_is_named_at_the_start_and_the_end(global_batch_runs):
    run, first, _ = global_batch_runs
    assert f"=> outputs (checkpoints, metrics.jsonl, config.json, tb/) go to the current " \
           f"folder {run} (--output-dir .)" in first
    best = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["best_acc1"]
    assert f"=> outputs in {run}: model_best.pth.tar (best Acc@1 {best:.3f}), " \
           "checkpoint.pth.tar" in first
    assert first.rstrip().splitlines()[-1] == f"=> curves: tensorboard --logdir {run / 'tb'}"
    assert list((run / "tb").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_distributed_validation_progress_says_it_is_rank_0s(global_batch_runs):
    _, _, second = global_batch_runs
    progress = [line for line in second.splitlines() if line.startswith("Test:")]
    assert progress and all(line.endswith("(rank 0 only, 1 of 2 ranks; the * line is the "
                                          "job's)") for line in progress), second
    summary = re.search(r" \* Acc@1 [\d.]+ Acc@5 [\d.]+  \(9 images\)$", second, flags=re.M)
    assert summary, second


@pytest.mark.slow
def test_an_uneven_global_batch_fails_before_joining_the_other_ranks(tmp_path):
    """Under a launcher (here torchrun's variables for rank 0 of 2): one line, exit 2, at once
    (the peer never comes; joining would wait for --dist-timeout)."""
    data = write_image_folder(tmp_path / "data", train_per_class=2, val_per_class=1)
    env = child_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = run_main(str(data), *FLAGS, "--global-batch-size", "10", "--grad-accum-steps", "2",
                    "--dist-timeout", "120", env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "error: --global-batch-size 10 does not divide into 2 process(es) x 2 accumulation "
        "step(s) = 4 equal micro-batches: give a multiple of 4 (e.g. 8 or 12)")


def test_global_batch_size_and_b_exclude_each_other():
    with pytest.raises(UsageError, match="either -b/--batch-size .* or --global-batch-size"):
        parse_config(["-b", "32", "--global-batch-size", "256"])
    with pytest.raises(UsageError, match="--global-batch-size must be positive"):
        parse_config(["--global-batch-size", "0"])
    cfg = parse_config(["--demo", "--global-batch-size", "48"])
    assert cfg.global_batch_size == 48 and cfg.batch_size == 256  # --demo's -b 64 not applied


@pytest.mark.slow
def test_a_re_logged_epoch_record_names_its_own_epoch(tmp_path, capsys):
    """A kill between an epoch's save and its metrics.jsonl line: the resume writes the
    checkpoint's record, and its line names that epoch (0), not the one it starts (1)."""
    from imagenet.cli import main

    data = write_image_folder(tmp_path / "data", classes=2, train_per_class=4, val_per_class=2)
    out = tmp_path / "out"
    flags = [str(data), *TINY, "--output-dir", str(out), "--log-to", "none", "--resume", "auto"]
    assert main([*flags, "--epochs", "1"]) == 0
    (out / "metrics.jsonl").write_text("")  # as if killed before the line was written
    capsys.readouterr()
    assert main([*flags, "--epochs", "2"]) == 0
    text = capsys.readouterr().out
    assert re.findall(r"=> epoch (\d+) trained", text) == ["0", "1"], text
    epochs = [json.loads(ln)["epoch"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [0, 1]


@pytest.mark.slow
def test_the_last_line_names_no_best_file_that_is_not_there(tmp_path, capsys):
    """A resume from another folder's checkpoint whose epochs never beat its best: the new
    folder has no model_best.pth.tar, and the last lines do not claim one."""
    from imagenet.cli import main

    data = write_image_folder(tmp_path / "data", classes=2, train_per_class=4, val_per_class=2)
    flags = [str(data), *TINY[:-2], "--log-to", "none"]
    assert main([*flags, "--lr", "0.01", "--epochs", "1", "--output-dir", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    # A best no epoch can beat (equal weights could still tie-break one image differently).
    ckpt = load_checkpoint(tmp_path / "a" / "checkpoint.pth.tar")
    ckpt["best_acc1"] = 101.0
    save_edited(ckpt, tmp_path / "unbeaten.pth.tar")
    assert main([*flags, "--lr", "0", "--freeze-backbone", "--epochs", "2", "--output-dir",
                 str(tmp_path / "b"), "--resume", str(tmp_path / "unbeaten.pth.tar")]) == 0
    text = capsys.readouterr().out
    assert not (tmp_path / "b" / "model_best.pth.tar").exists()  # the same weights: not better
    assert "outputs in" in text and "model_best.pth.tar (best Acc@1" not in text, text
    assert "no epoch of this run beat" in text
