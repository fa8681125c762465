"""Checkpoints written in the background (imagenet/checkpoint/rundir.py): the state is copied off
the model at the save point, rank 0 writes it in a thread while training goes on, one write at a
time; a stop and the end of the run wait for the write under way; a kill during a write leaves
the previous checkpoint whole; the resume is bitwise.

Slow storage is real time in a real process: a ``sitecustomize`` on the children's PYTHONPATH
throttles every write of a checkpoint's file to a few MB/s (fault injection: this machine has no
device-mapper or cgroup-v2 I/O throttling).
"""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, load_checkpoint, write_image_folder
from test_fault_tolerance import (
    SINGLE,
    SPAWN,
    Live,
    assert_same_run,
    run_cmd,
    run_to_end,
    step_line,
)

from imagenet.checkpoint.rundir import Writer, to_host

THROTTLE = '''
import os, time
from imagenet.checkpoint import files

_write, _rate = files._WriteErrors.write, float(os.environ["SLOW_WRITE_MB_PER_S"]) * 2**20


def _slow(self, data):
    written = _write(self, data)
    time.sleep(len(data) / _rate)
    return written


files._WriteErrors.write = _slow
'''


def slow_env(tmp_path: Path, mb_per_s: float) -> dict[str, str]:
    """Children whose checkpoint writes run at ``mb_per_s`` (:func:`rate`)."""
    site = tmp_path / "slow-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(THROTTLE)
    return {"PYTHONPATH": f"{site}:{ROOT}", "SLOW_WRITE_MB_PER_S": str(mb_per_s)}


def rate(reference: Path, seconds: float) -> float:
    """The MB/s at which one checkpoint of the reference run takes ``seconds`` to write: each
    test makes a write as slow as its assertion needs, whatever the model's size."""
    return (reference / "checkpoint.pth.tar").stat().st_size / 2**20 / seconds


# ---------------------------------------------------------------- the pieces

def test_the_copy_off_the_model_does_not_change_with_training():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"state_dict": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1,
             "groups": [{"lr": 0.1}], "pair": (torch.ones(2), 3)}
    snapshot = to_host(state)
    before = {k: v.clone() for k, v in snapshot["state_dict"].items()}
    momentum = snapshot["optimizer"]["state"][0]["momentum_buffer"].clone()
    for _ in range(3):  # training goes on
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    state["groups"][0]["lr"] = 0.01
    state["pair"][0].add_(1)
    for key, value in before.items():
        assert torch.equal(snapshot["state_dict"][key], value), key
    assert torch.equal(snapshot["optimizer"]["state"][0]["momentum_buffer"], momentum)
    assert snapshot["groups"][0]["lr"] == 0.1 and torch.equal(snapshot["pair"][0], torch.ones(2))
    assert snapshot["epoch"] == 1


def test_one_write_at_a_time_in_order_and_an_error_reaches_the_training_thread():
    writer, done, order = Writer(), threading.Event(), []

    def slow(name: str) -> None:
        done.wait(5)
        order.append(name)

    writer.submit(lambda: slow("first"))
    assert writer.busy
    done.set()
    writer.submit(lambda: order.append("second"))  # waits for the first
    assert order[0] == "first"
    assert writer.wait() is not None and order == ["first", "second"]
    assert writer.wait() is None  # nothing under way

    def fails() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(fails)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    writer.submit(fails)
    with pytest.raises(OSError):
        writer.submit(lambda: order.append("after"))  # the next save raises it
    assert order == ["first", "second"]


# ---------------------------------------------------------------- real runs, slow storage

@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("async") / "data", train_per_class=16)


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> Path:
    """The uninterrupted run, at full speed."""
    out = tmp_path_factory.mktemp("async-ref") / "single"
    run_to_end(run_cmd(data, out, *SINGLE, "-j", "0"))
    return out


def temp_files(out: Path) -> list[Path]:
    return [p for p in out.glob(".checkpoint.pth.tar.tmp-*")] if out.is_dir() else []


def wait_for_temp(out: Path, live: Live, within: float = 120) -> None:
    deadline = time.monotonic() + within
    while not temp_files(out):
        assert time.monotonic() < deadline and live.proc.poll() is None, live.output
        time.sleep(0.01)


@pytest.mark.slow
def test_training_goes_on_during_a_slow_write_and_a_sigterm_waits_for_it(data, reference,
                                                                         tmp_path):
    """--save-every 2 into a folder where a checkpoint takes 6 s to write:
    steps are trained while the step-2 checkpoint is written; a SIGTERM meanwhile stops the
    run at the next step, which saves once the write under way is done (exit 143, the stop's
    step on disk); the resume, still on slow storage, ends bitwise as the uninterrupted run."""
    out = tmp_path / "out"
    cmd = run_cmd(data, out, *SINGLE, "-j", "0", "--save-every", "2")
    live = Live(cmd, timeout=600, **slow_env(tmp_path, rate(reference, 6)))
    live.wait_for(step_line(0, 2))
    wait_for_temp(out, live)
    live.wait_for(step_line(0, 3))  # a step trained while the write goes on
    assert temp_files(out), "the write ended before the next step: not in the background"
    live.signal_group(signal.SIGTERM)
    code = live.finish()
    assert code == 143, live.output
    assert "Traceback" not in live.output
    stopped = re.search(r"stopped by SIGTERM at epoch 0 step (\d+)", live.output)
    assert stopped, live.output
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (0, int(stopped.group(1)))
    assert ckpt["step_in_epoch"] >= 3 and not temp_files(out)
    resumed = Live([*cmd, "--resume", "auto"], timeout=600,
                   **slow_env(tmp_path, rate(reference, 1)))
    assert resumed.finish() == 0, resumed.output  # the end waits for the last write
    assert_same_run(out, reference)


@pytest.mark.slow
def test_a_rank_that_stops_first_does_not_end_rank_0s_last_write(data, reference, tmp_path):
    """Two ranks stop together (--time-limit 1) while rank 0's last checkpoint takes 4 s to
    write. Rank 1 has nothing to write: it exited at once with the requeue code, and mp.spawn's
    parent then terminated rank 0 during its write (the stop's checkpoint lost, no line from
    rank 0, "training process 1 of this node exited with code 143; stopped the others"). Now
    the parent waits for every rank and exits with the requeue code once they have ended."""
    out = tmp_path / "out"
    live = Live(run_cmd(data, out, *SPAWN, "-j", "0", "--time-limit", "1"), timeout=600,
                **slow_env(tmp_path, rate(reference, 4)))
    code = live.finish()
    assert code == 143, live.output
    assert "stopped the others" not in live.output and "Traceback" not in live.output
    stop = re.search(r"^time limit: stopped at epoch 0 step (\d+)", live.output, flags=re.M)
    assert stop and "[rank 1] time limit: stopped at epoch 0 step" in live.output, live.output
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (0, int(stop.group(1)))
    assert not temp_files(out)


@pytest.mark.slow
def test_a_sigkill_during_a_slow_write_keeps_the_previous_checkpoint(data, reference,
                                                                       tmp_path):
    """Killed while the step-4 checkpoint is half written: the step-2 one is whole, the
    resume starts there and ends bitwise as the uninterrupted run."""
    out = tmp_path / "out"
    cmd = run_cmd(data, out, *SINGLE, "-j", "0", "--save-every", "2")
    live = Live(cmd, timeout=600, **slow_env(tmp_path, rate(reference, 4)))
    live.wait_for(step_line(0, 4))
    deadline = time.monotonic() + 120
    while True:  # the step-2 file in place, the step-4 one being written
        if temp_files(out) and (out / "checkpoint.pth.tar").is_file():
            try:
                if load_checkpoint(out / "checkpoint.pth.tar")["step_in_epoch"] == 2:
                    break
            except Exception:  # replaced meanwhile: look again
                pass
        assert time.monotonic() < deadline and live.proc.poll() is None, live.output
        time.sleep(0.01)
    live.signal_group(signal.SIGKILL)
    assert live.finish() == -signal.SIGKILL
    assert load_checkpoint(out / "checkpoint.pth.tar")["step_in_epoch"] == 2
    output = run_to_end([*cmd, "--resume", "auto"])
    assert "(epoch 0, step 2," in output, output
    assert_same_run(out, reference)
