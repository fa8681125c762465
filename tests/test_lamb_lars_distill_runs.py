"""Whole main.py runs of the new recipes' parts: a mid-epoch resume ends bitwise equal to the
uninterrupted run for --opt lamb with --bce-loss, and for --opt lars with --distill-teacher;
the checkpoint records the teacher (path, architecture, digest) but never its weights, and a
resume with another teacher is refused in one line.

Each chain is stopped after its first step by --time-limit (a SLURM end time already passed:
the run saves and exits 143 at that step, no signal to time), then resumed with --resume auto.
One epoch of 3 steps on 24 JPEGs: the resume continues inside the epoch, validates and ends.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import SMALL_ARCH, child_env, load_checkpoint, run_main, write_image_folder
from test_distill import saved_model
from test_fault_tolerance import assert_same_run

from imagenet.checkpoint.files import state_digest

pytestmark = pytest.mark.slow

FLAGS = ["-a", SMALL_ARCH, "--train-crop-size", "32", "--val-resize-size", "36",
         "--val-crop-size", "32", "-b", "8", "-j", "0", "-p", "1", "--epochs", "1",
         "--seed", "0", "--lr-scheduler", "cosine", "--mixup-alpha", "0.2",
         "--cutmix-alpha", "1.0", "--log-to", "none"]
LAMB = ["--opt", "lamb", "--lr", "0.002", "--wd", "0.02", "--bce-loss", "--bce-target-thresh",
        "0.2", "--label-smoothing", "0.1", "--model-ema", "--model-ema-steps", "1"]
LARS = ["--opt", "lars", "--lr", "0.5", "--wd", "5e-5", "--lars-trust-coef", "0.002",
        "--distill-temperature", "2"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("trust")
    return {"data": write_image_folder(base / "data"),
            "teacher": saved_model(base / "teacher.pth", seed=1),
            "other": saved_model(base / "other.pth", seed=2)}


def chain(data: Path, out: Path, *flags: str) -> None:
    """A run stopped by --time-limit after its first step, then resumed to its end."""
    cmd = [str(data), *FLAGS, *flags, "--output-dir", str(out)]
    ended = child_env(SLURM_JOB_ID="4242", SLURM_JOB_END_TIME=str(int(time.time())))
    stopped = run_main(*cmd, "--time-limit", "slurm", env=ended)
    assert stopped.returncode == 143, stopped.stdout + stopped.stderr
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (0, 1)  # mid-epoch
    resumed = run_main(*cmd, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr


@pytest.mark.parametrize("opt", ["lamb", "lars"])
def test_a_mid_epoch_resume_ends_bitwise_as_the_uninterrupted_run(folders, tmp_path, opt):
    flags = LAMB if opt == "lamb" else [*LARS, "--distill-teacher", str(folders["teacher"])]
    reference = run_main(str(folders["data"]), *FLAGS, *flags, "--output-dir",
                         str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stdout + reference.stderr
    chain(folders["data"], tmp_path / "chain", *flags)
    assert_same_run(tmp_path / "chain", tmp_path / "reference")
    ckpt = load_checkpoint(tmp_path / "chain" / "checkpoint.pth.tar")
    assert set(ckpt["optimizer"]["state"][0]) == (
        {"step", "exp_avg", "exp_avg_sq"} if opt == "lamb" else {"momentum_buffer"})
    if opt == "lamb":
        return
    # the teacher: recorded, not saved; another one is refused on resume
    teacher = folders["teacher"]
    assert ckpt["distill_teacher"] == {
        "source": str(teacher), "arch": SMALL_ARCH,
        "digest": state_digest(torch.load(teacher, weights_only=True))}
    student_keys = set(torchvision_state_keys())
    assert set(ckpt["state_dict"]) == student_keys  # the student's weights alone
    other = run_main(str(folders["data"]), *FLAGS, *LARS, "--epochs", "2", "--distill-teacher",
                     str(folders["other"]), "--output-dir", str(tmp_path / "chain"),
                     "--resume", "auto")
    assert other.returncode == 2, other.stdout + other.stderr
    errors = [line for line in other.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --distill-teacher {folders['other']} (sha256:"
                      f"{errors[0].split('(sha256:')[1][:12]}) is not the teacher the checkpoint "
                      f"was trained with ({teacher}, {ckpt['distill_teacher']['digest'][:19]}); "
                      "give that teacher to resume it, or start a new run"], other.stderr


def torchvision_state_keys() -> list[str]:
    import torchvision

    return list(torchvision.models.get_model(SMALL_ARCH, num_classes=3).state_dict())
