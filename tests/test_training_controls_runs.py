"""Training controls in whole runs of main.py: --ra-reps and progressive resizing survive a
--time-limit stop, a SIGKILL mid-epoch and a world-size change; --keep-checkpoints' history
with them; a chain of jobs ends with "nothing left to train".

Every run trains the same recipe (repeated augmentation x2, a 24 -> 28 -> 32 px crop ramp, the
2 best epochs kept, a cosine schedule) on 48 JPEGs; an interrupted chain must end bitwise equal
to the uninterrupted run of its layout, its checkpoint history included.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from helpers import fault_at, load_checkpoint, prestarted_cmd, write_image_folder
from test_fault_tolerance import RUN_STATE, Live, assert_equal
from test_training_controls import fake_squeue

pytestmark = pytest.mark.slow

FLAGS = ["-a", "squeezenet1_1", "--opt", "adamw", "--lr", "0.002", "--lr-scheduler", "cosine",
         "--train-crop-size", "32", "--val-resize-size", "36", "--val-crop-size", "32",
         "-p", "1", "--epochs", "3", "--seed", "0", "--ra-reps", "2", "--train-crop-start", "24",
         "--train-crop-ramp", "0", "2", "--train-crop-multiple", "4", "--keep-checkpoints", "2"]
SINGLE = ["-b", "8"]  # 48 images: 6 steps per epoch
SPAWN = ["-b", "8", "--multiprocessing-distributed", "--nproc-per-node", "2"]  # 4 per process
SIZES = [24, 28, 32]


def cmd(data: Path, out: Path, *extra: str) -> list[str]:
    return prestarted_cmd(str(data), *FLAGS, "--output-dir", str(out), *extra)


def run(command: list[str], **env: str) -> tuple[int, str]:
    """Run to the end; the exit code and the output (stdout and stderr)."""
    live = Live(command, **env)
    return live.finish(), live.output


def kill_after(command: list[str], saves: int, **env: str) -> str:
    """SIGKILL the run (its whole process group, from its checkpoint writer: a failpoint) once
    its ``saves``-th checkpoint is on disk."""
    live = Live(command, IMAGENET_FAILPOINTS=fault_at("save.done", saves, "sigkill(group)"),
                **env)
    assert live.finish() == -signal.SIGKILL, live.output
    return live.output


def history_of(out: Path) -> tuple[list[dict], dict[str, dict]]:
    """checkpoints.json's entries and the weights of the files it keeps."""
    index = json.loads((out / "checkpoints.json").read_text())["checkpoints"]
    return index, {e["file"]: load_checkpoint(out / e["file"])["state_dict"] for e in index}


def assert_same_run(out: Path, reference: Path) -> None:
    """The final checkpoint and the checkpoint history equal the uninterrupted run's."""
    got, want = load_checkpoint(out / "checkpoint.pth.tar"), load_checkpoint(
        reference / "checkpoint.pth.tar")
    for key in RUN_STATE:
        assert_equal(got[key], want[key], key)
    assert_equal(history_of(out), history_of(reference), "history")
    kept = sorted(p.name for p in out.glob("checkpoint_epoch*"))
    assert kept == sorted(e["file"] for e in history_of(out)[0])


def metrics_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def crops(output: str) -> list[int]:
    return [int(s) for s in re.findall(r"=> epoch \d+: training crop (\d+) px", output)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("controls") / "data", train_per_class=16)


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted runs: one process, and two (mp.spawn), without loader workers."""
    base = tmp_path_factory.mktemp("reference")
    for name, layout in (("single", SINGLE), ("spawn", SPAWN)):
        code, output = run(cmd(data, base / name, *layout, "-j", "0"))
        assert code == 0, output
        assert crops(output) == SIZES, output
    assert [m["train_crop_px"] for m in metrics_of(base / "single")] == SIZES
    return {"single": base / "single", "spawn": base / "spawn"}


def test_a_chain_of_time_limited_jobs_ends_as_the_uninterrupted_run(data, reference, tmp_path):
    # Each job of the chain runs the same command; SLURM gives each its own end time. The
    # first one's has passed: it stops after its first step, saves, and exits 143.
    out = tmp_path / "out"
    job = cmd(data, out, *SINGLE, "--time-limit", "slurm", "--resume", "auto")
    slurm = {"SLURM_JOB_ID": "4242"}
    code, output = run([*job, "-j", "0"], SLURM_JOB_END_TIME=str(int(time.time())), **slurm)
    assert code == 143, output
    assert re.search(r"^time limit: stopped at epoch 0 step 1, .* after the end of SLURM job "
                     rf"4242 at .*; checkpoint saved in {out}; --resume auto continues$",
                     output, flags=re.M), output
    assert (load_checkpoint(out / "checkpoint.pth.tar")["step_in_epoch"]) == 1
    # The next job's end time comes from squeue (a real process on PATH), an hour ahead. It is
    # killed mid-epoch (after a --save-every checkpoint) in the middle of the ramp...
    squeue = fake_squeue(tmp_path / "bin", "date -d '+1 hour' +%Y-%m-%dT%H:%M:%S")
    # From step 1: saves at steps 2 and 4, before epoch 0's validation, at its end, then at
    # epoch 1's step 2, the fifth.
    output = kill_after([*job, "-j", "0", "--save-every", "2"], 5, **squeue)
    assert re.search(r"=> time limit: stopping in time to save before the end of SLURM job 4242 "
                     r"at .* \(59 min \d\d s from now\)", output), output
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (1, 2), output
    # ... and the one after it finishes (with loader workers: each builds the epoch's crop).
    later = {**slurm, "SLURM_JOB_END_TIME": str(int(time.time()) + 3600)}
    code, output = run([*job, "-j", "2"], **later)
    assert code == 0 and crops(output) == SIZES[1:], output
    assert_same_run(out, reference["single"])
    # Every job after the end leaves at once.
    start = time.monotonic()
    code, output = run([*job, "-j", "2"], **later)
    assert code == 0, output
    assert re.search(r"^=> nothing left to train: .*checkpoint.pth.tar has finished 3 of "
                     r"--epochs 3 \(best Acc@1 [\d.]+\)", output, flags=re.M), output
    assert "Epoch:" not in output and "squeezenet1_1 on" not in output  # nothing was built
    assert time.monotonic() - start < 60


def test_two_ranks_stop_at_the_same_step_and_resume_bitwise(data, reference, tmp_path):
    out = tmp_path / "out"
    job = cmd(data, out, *SPAWN, "-j", "0", "--resume", "auto")
    # Rank 0 keeps the clock: its stop after step 1 is agreed one step later, by both ranks.
    code, output = run([*job, "--time-limit", "1"])
    assert code == 143, output
    # "S s after" where the start took longer than the limit, "S s before" where it did not.
    assert re.search(r"^time limit: stopped at epoch 0 step 2, .* (before|after) --time-limit 1 "
                     r"at ", output, flags=re.M), output
    assert "[rank 1] time limit: stopped at epoch 0 step 2;" in output, output
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["step_in_epoch"], ckpt["world_size"]) == (2, 2)
    # From step 2: saves at step 4, before epoch 0's validation, at its end, at epoch 1's step 2.
    kill_after([*job, "--save-every", "2"], 4)
    assert load_checkpoint(out / "checkpoint.pth.tar")["step_in_epoch"] == 2
    shutil.copytree(out, tmp_path / "killed")  # for the world-size change below
    code, output = run(job)
    assert code == 0 and crops(output) == SIZES[1:], output
    assert_same_run(out, reference["spawn"])
    # The same checkpoint resumed by one process (same global batch, 8): the rest of epoch 1's
    # order, the fresh one-process run's learning rates from there, the same crops.
    resumed = tmp_path / "killed"
    killed = load_checkpoint(resumed / "checkpoint.pth.tar")
    step = killed["step_in_epoch"]
    code, output = run(cmd(data, resumed, *SINGLE, "-j", "0", "--resume", "auto"))
    assert code == 0 and crops(output) == SIZES[1:], output
    assert "=> layout changed since the checkpoint: 2 process(es) x 4 images" in output, output
    assert f"(epoch 1, step {step}," in output and "approximated" not in output, output
    # the resumed epoch's record counts its whole training: the checkpoint's part and the rest
    assert step > 0 and [m["train_images"] for m in metrics_of(resumed)[1:]] == [48, 48]
    assert lrs(resumed, killed["global_step"]) == lrs(reference["single"],
                                                      killed["global_step"])


def lrs(out: Path, after: int) -> list[float]:
    """TensorBoard's step/lr from step ``after`` + 1 on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    return [e.value for e in acc.Scalars("step/lr") if e.step > after]
