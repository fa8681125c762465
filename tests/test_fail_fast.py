"""Failures end in one line, early: unusable output folders, a full disk, a last batch of one,
a silent master, a bad validation image, signals during validation, impossible flags.

Real processes throughout: a real tmpfs (in a private mount namespace) and RLIMIT_FSIZE for the
full disk, a socket that listens but never accepts for the silent master, real signals.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY,
    child_env,
    main_cmd,
    run_main,
    run_parallel,
    write_image_folder,
)

from imagenet.cli import main


def one_error_line(text: str) -> str:
    """The single ``error:`` line of a failed run (and no traceback)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, text
    assert "Traceback" not in text, text
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """3 classes, 24 training and 9 validation JPEGs."""
    return write_image_folder(tmp_path_factory.mktemp("failfast") / "data")


# ---------------------------------------------------------------- case 11: impossible flags

@pytest.mark.parametrize("argv, words", [
    (["--world-size", "0"], "--world-size must be at least 1 (or left unset), got 0"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--wd", "inf"], "--wd must be a finite number, got inf"),
    (["--dist-url", "garbage", "--world-size", "2", "--rank", "1"],
     "--dist-url 'garbage' is not a rendezvous address"),
    (["--dist-url", "tcp://127.0.0.1", "--world-size", "2", "--rank", "1"],
     "--dist-url 'tcp://127.0.0.1' is not a rendezvous address"),
    pytest.param(["--gpu", "0"], "--gpu 0: no CUDA device is visible",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")),
])
def test_impossible_flags_are_refused_before_anything_starts(capsys, tmp_path, argv, words):
    # A missing data folder: the flag must be refused before the data is even looked at.
    code = main([str(tmp_path / "no-data"), *TINY, *argv, "--output-dir", str(tmp_path / "o")])
    assert code == 2
    assert words in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- case 6: the output folder

def test_output_dir_that_is_a_file_is_refused(capsys, data, tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    code = main([str(data), *TINY, "--epochs", "1", "--output-dir", str(target)])
    assert code == 2
    assert f"--output-dir {target} is a file, not a folder" in \
        one_error_line(capsys.readouterr().err)
    assert target.read_text() == "mine"


def as_unprivileged(cmd: list[str]) -> list[str]:
    """``cmd`` run without the power to write where permissions say no (root has it)."""
    if os.geteuid() != 0:
        return cmd
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a folder unwritable")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", *cmd]


def test_unwritable_output_dir_is_refused_at_start_and_left_alone(data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.pth.tar").write_bytes(b"an earlier run's")
    out.chmod(0o555)
    try:
        proc = subprocess.run(as_unprivileged(main_cmd(str(data), *TINY, "--epochs", "1",
                                                       "--output-dir", str(out))),
                              capture_output=True, text=True, env=child_env(), timeout=300)
    finally:
        out.chmod(0o755)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--output-dir {out} is not writable (Permission denied)" in \
        one_error_line(proc.stderr)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pth.tar"]


# ---------------------------------------------------------------- case 7: a last batch of one

def test_a_last_training_batch_of_one_image_is_dropped_and_validation_is_whole(tmp_path):
    data = write_image_folder(tmp_path / "data", classes=3, train_per_class=25, val_per_class=3)
    for extra in sorted((data / "train").glob("*/img24.jpg"))[:2]:
        extra.unlink()  # 73 training images: 9 batches of 8 and one of 1
    out = tmp_path / "out"
    proc = run_main(str(data), *TINY, "--epochs", "1", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    (record,) = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["train_images"] == 72  # the one-image batch was left out
    assert record["val_count"] == 9  # 8 + 1: the validation set is never cut
    assert "Epoch: [0][9/9]" in proc.stdout


# ---------------------------------------------------------------- case 8: a silent master

def test_a_master_port_that_listens_but_never_answers_ends_after_the_timeout(data, tmp_path):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes connections; nobody ever accepts them
        port = silent.getsockname()[1]
        cmd = main_cmd(str(data), *TINY, "--world-size", "2", "--rank", "1", "--dist-url",
                       f"tcp://127.0.0.1:{port}", "--dist-timeout", "3")
        (result,) = run_parallel([cmd], [child_env()], tmp_path / "logs", timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    line = one_error_line(result.stderr)
    assert f"127.0.0.1:{port} as rank 1 of world size 2" in line
    assert "accepts connections but did not answer" in line and "--dist-timeout 3s" in line
