"""--fsdp checkpoints stay classic: main.py runs that hand checkpoints between FSDP, DDP and one
process, SIGKILL + resume, and the sharded directory (--sharded-checkpoint) with its conversion.

Two processes (--multiprocessing-distributed) train shufflenet_v2_x0_5 at 32 px with every flag
that carries state across a resume (test_fault_tolerance's FLAGS: EMA, MixUp/CutMix, random
erasing, warm-up + cosine). FSDP computes what DDP computes (the same reductions, bitwise on
gloo), so a run that changes between them must end exactly where an all-DDP run ends.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torchvision
from helpers import SMALL_ARCH, child_env, fault_at, load_checkpoint, run_main, write_image_folder
from test_fault_tolerance import (
    FLAGS,
    RUN_STATE,
    SINGLE,
    SPAWN,
    assert_equal,
    assert_same_run,
    fault_run,
    run_cmd,
    run_to_end,
)

from imagenet.checkpoint import files, rundir
from imagenet.tools import unshard

pytestmark = pytest.mark.slow
FSDP = [*SPAWN, "--fsdp"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("fsdp-ckpt") / "data", train_per_class=16)


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> Path:
    """Epoch 1 under DDP; the same under FSDP, SIGKILLed mid-epoch and resumed; epoch 2 under
    DDP from the FSDP checkpoint and under FSDP from the DDP checkpoint."""
    base = tmp_path_factory.mktemp("runs")
    run_to_end(run_cmd(data, base / "ddp1", *SPAWN, "-j", "0", "--epochs", "1"))
    cmd = run_cmd(data, base / "fsdp1", *FSDP, "-j", "0", "--epochs", "1", "--save-every", "2")
    # The whole job killed once step 2's checkpoint is on disk.
    code, output = fault_run(cmd, fault_at("save.done", 1, "sigkill(group)"))
    assert code == -signal.SIGKILL, output
    assert load_checkpoint(base / "fsdp1" / "checkpoint.pth.tar")["step_in_epoch"] == 2
    output = run_to_end([*cmd, "--resume", "auto"])
    assert "=> FSDP over 2 processes (ZeRO-3): InvertedResidual x16 + root" in output, output
    for mode, source in (("ddp2", "fsdp1"), ("fsdp2", "ddp1")):
        flags = FSDP if mode.startswith("fsdp") else SPAWN
        output = run_to_end(run_cmd(data, base / mode, *flags, "-j", "0", "--epochs", "2",
                                    "--resume", str(base / source / "checkpoint.pth.tar")))
        assert "(epoch 1, step 0," in output, output
    return base


def test_fsdp_killed_and_resumed_ends_bitwise_equal_to_ddp(runs):
    assert_same_run(runs / "fsdp1", runs / "ddp1")


def test_fsdp_to_ddp_and_ddp_to_fsdp_continue_bitwise_equal(runs):
    got = load_checkpoint(runs / "fsdp2" / "checkpoint.pth.tar")
    want = load_checkpoint(runs / "ddp2" / "checkpoint.pth.tar")
    assert got["epoch"] == 2
    for key in RUN_STATE:
        assert_equal(got[key], want[key], key)


def test_fsdp_checkpoint_loads_into_a_plain_model_and_evaluates_in_one_process(runs, data,
                                                                              tmp_path):
    best = load_checkpoint(runs / "fsdp1" / "model_best.pth.tar")
    model = torchvision.models.get_model(SMALL_ARCH, num_classes=3)
    model.load_state_dict(best["state_dict"])  # strict: plain keys, full tensors
    assert list(best["optimizer"]["state"])[:2] == [0, 1]  # optimizer.state_dict()'s format
    # -e in one process (world size 2 -> 1) reproduces the best top-1 of the FSDP run.
    proc = run_main(str(data), *FLAGS, *SINGLE, "-j", "0", "-e", "--resume",
                    str(runs / "fsdp1" / "model_best.pth.tar"), "--output-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert f" * Acc@1 {best['best_acc1']:.3f} " in proc.stdout, proc.stdout


def test_fsdp_checkpoint_resumes_training_in_one_process(runs, data, tmp_path):
    out = tmp_path / "single"
    output = run_to_end(run_cmd(data, out, *SINGLE, "--fsdp", "-j", "0", "--epochs", "3",
                                "--resume", str(runs / "fsdp2" / "checkpoint.pth.tar")))
    assert "one process: --fsdp has nothing to shard" in output, output
    assert "(epoch 2, step 0," in output, output
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["world_size"]) == (3, 1)


def test_sharded_checkpoint_directory_resumes_and_converts_to_the_classic_file(runs, data,
                                                                               tmp_path):
    out = tmp_path / "sharded"
    cmd = run_cmd(data, out, *FSDP, "-j", "0", "--epochs", "1", "--save-every", "2",
                  "--sharded-checkpoint")
    # Rank 0 kills the whole job after step 3: the directory of step 2 is whole (every rank
    # writes its shards before training on).
    code, output = fault_run(cmd, fault_at("train.step@0", 3, "sigkill(group)"))
    assert code == -signal.SIGKILL, output
    assert not (out / "checkpoint.pth.tar").exists()
    run_to_end([*cmd, "--resume", "auto"])
    assert not list(out.glob(".*.tmp*")) and not list(out.glob(".*.old")), list(out.iterdir())
    # The one documented command; the result is what a file checkpoint would have been.
    converted = subprocess.run(
        [sys.executable, "-m", "imagenet.tools.unshard", str(out / "checkpoint.dcp")],
        capture_output=True, text=True, env=child_env(), timeout=300)
    assert converted.returncode == 0, converted.stderr
    assert f"wrote {out / 'checkpoint.pth.tar'} (epoch 1, step 0," in converted.stdout
    for name in ("model_best", "model_best_ema"):  # the same, without starting Python again
        assert unshard.main([str(out / f"{name}.dcp")]) == 0
    assert_same_run(out, runs / "ddp1")
    ema = load_checkpoint(out / "model_best_ema.pth.tar")
    assert_equal(ema["state_dict"], load_checkpoint(
        runs / "ddp1" / "model_best_ema.pth.tar")["state_dict"], "model_best_ema")
    # A sharded directory also resumes in one process (torch reshards 2 -> 1 on load), with
    # the optimizer settings of its command line (--wd changed), not the saved ones.
    single = tmp_path / "single"
    shutil.copytree(out / "checkpoint.dcp", single / "checkpoint.dcp")
    output = run_to_end(run_cmd(data, single, *SINGLE, "--fsdp", "--sharded-checkpoint", "-j",
                                "0", "--epochs", "2", "--wd", "0.002", "--resume", "auto",
                                "--keep-checkpoints", "1"))
    assert "(epoch 1, step 0," in output, output
    # --keep-checkpoints keeps directories too: the epoch's, whole, named in the index.
    assert files.is_checkpoint_dir(single / "checkpoint_epoch002.dcp")
    assert [e.file for e in rundir.read_index(single)] == ["checkpoint_epoch002.dcp"]
    assert unshard.main([str(single / "checkpoint.dcp")]) == 0
    resumed = load_checkpoint(single / "checkpoint.pth.tar")
    assert resumed["epoch"] == 2
    assert {g["weight_decay"] for g in resumed["optimizer"]["param_groups"]} == {0.002}


def test_refused_combination_is_one_line_at_start_up(tmp_path):
    proc = run_main("--dummy", "--fsdp", "--ddp-comm-hook", "powersgd", "--output-dir",
                    str(tmp_path), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --ddp-comm-hook powersgd compresses DDP's gradient all-reduce; --fsdp "
        "reduce-scatters gradient shards instead and has no DDP hooks: drop one "
        "(--fsdp-reduce-dtype bf16 halves FSDP's gradient bytes)"]
