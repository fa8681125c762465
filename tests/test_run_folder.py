"""One output folder, one run: the lock, the history of earlier runs, and only good state kept.

Real main.py processes on real folders: a run that holds OUTPUT_DIR pauses itself (SIGSTOP at a
failpoint) in the middle of a save while other invocations try the same folder; files are
compared by sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY,
    TINY18,
    child_env,
    fault_at,
    load_checkpoint,
    main_cmd,
    run_main,
    save_edited,
    settled_folder,
    write_image_folder,
)

from imagenet.cli import main
from imagenet.errors import CheckpointError, RunError
from imagenet.launching.failures import is_stopped

pytestmark = pytest.mark.slow


def one_error_line(text: str) -> str:
    """The single ``error:`` line of a failed run (and no traceback)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, text
    assert "Traceback" not in text, text
    return lines[0]


def non_finite_tensors(ckpt: dict) -> list[str]:
    """Keys of the floating-point tensors (any depth) that hold a NaN or an infinity."""
    def walk(obj, name):
        if isinstance(obj, torch.Tensor) and obj.is_floating_point():
            yield from [] if torch.isfinite(obj).all() else [name]
        elif isinstance(obj, dict):
            for key, value in obj.items():
                yield from walk(value, f"{name}/{key}")
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                yield from walk(value, f"{name}[{i}]")
    return list(walk(ckpt, ""))


def digests(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``folder`` (hidden lock file excluded)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".run.lock"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path]:
    """48 training images (6 steps of 8) and the output folder of a finished 1-epoch run."""
    base = tmp_path_factory.mktemp("finished")
    data = settled_folder(write_image_folder(base / "data", train_per_class=16))  # index kept
    out = base / "out"
    proc = run_main(str(data), *TINY, "--epochs", "1", "--seed", "0", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    return data, out


def test_a_fresh_run_that_fails_in_a_used_folder_keeps_the_whole_earlier_record(finished,
                                                                               tmp_path):
    data, done = finished
    out = tmp_path / "out"
    shutil.copytree(done, out)
    before = digests(out)
    assert {"metrics.jsonl", "config.json", "checkpoint.pth.tar", "model_best.pth.tar"} \
        <= set(before) and any(name.startswith("tb/") for name in before)
    proc = run_main(str(data), *TINY, "--epochs", "1", "--lr", "1e6", "--output-dir", str(out))
    assert proc.returncode == 1
    assert "NaN/infinite" in one_error_line(proc.stderr)
    # Every file of the earlier run, byte for byte, in one folder named after its start time.
    (moved,) = (out / "previous").iterdir()
    started = json.loads((done / "config.json").read_text())["started"]
    assert moved.name == started.replace("T", "_").replace(":", "-")
    # The cache folder (the folder index, compiled graphs) is no record of a run: it stays, for
    # the new run to use.
    cached = {name: digest for name, digest in before.items() if name.startswith("cache/")}
    assert cached and digests(moved) == {k: v for k, v in before.items() if k not in cached}
    assert all(digests(out)[name] == digest for name, digest in cached.items())
    assert f"moved its checkpoints, metrics.jsonl, config.json and tb/ to {moved}" in proc.stdout


def test_the_holder_of_a_folder_is_never_disturbed_and_a_second_run_is_refused(finished,
                                                                              tmp_path):
    data, _ = finished
    out = tmp_path / "out"
    # Run A: a save every step; it pauses itself (SIGSTOP, a failpoint) as it writes its second
    # checkpoint's temp file, the first one in place.
    run_a = subprocess.Popen(main_cmd(str(data), *TINY, "--epochs", "1", "--save-every", "1",
                                      "--seed", "1", "--output-dir", str(out)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=child_env(IMAGENET_FAILPOINTS=fault_at("save.write", 2,
                                                                        "sigstop")),
                             start_new_session=True)
    try:
        temp = pause_during_a_save(run_a, out)
        # -e reads without a lock and deletes nothing: A's temp file stays.
        evaluated = run_main(str(data), *TINY, "-e", "--resume", "auto", "--output-dir",
                             str(out))
        assert evaluated.returncode == 0, evaluated.stderr
        assert temp.exists()
        # A second training run, fresh or resuming, is refused, naming A.
        for extra in (["--seed", "2"], ["--resume", "auto"]):
            proc = run_main(str(data), *TINY, "--epochs", "1", *extra, "--output-dir", str(out))
            assert proc.returncode == 1, proc.stdout + proc.stderr
            line = one_error_line(proc.stderr)
            assert f"--output-dir {out} is in use by another run (host " in line
            assert f", pid {run_a.pid}, started " in line
            assert temp.exists() and "Epoch: [" not in proc.stdout
        os.killpg(run_a.pid, signal.SIGCONT)
        output = run_a.communicate(timeout=300)[0]
    finally:
        if run_a.poll() is None:
            os.killpg(run_a.pid, signal.SIGKILL)
            run_a.wait()
    assert run_a.returncode == 0, output
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0]  # A's own, once
    assert json.loads((out / "config.json").read_text())["config"]["seed"] == 1
    assert not list(out.glob(".*.tmp-*"))


def pause_during_a_save(proc: subprocess.Popen, out: Path) -> Path:
    """The temp file of the checkpoint ``proc`` is writing, once it has stopped itself there."""
    deadline = time.monotonic() + 240
    while not is_stopped(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, \
            f"never stopped in a save: {proc.communicate()[0] if proc.poll() else ''}"
        time.sleep(0.05)
    (temp,) = out.glob(".checkpoint.pth.tar.tmp-*")
    assert (out / "checkpoint.pth.tar").exists()
    return temp


def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    from imagenet.checkpoint.rundir import lock_folder

    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from imagenet.checkpoint.rundir import lock_folder; lock_folder(Path(sys.argv[1])); "
         "print('locked', flush=True); time.sleep(600)", str(out)],
        stdout=subprocess.PIPE, text=True, env=child_env())
    try:
        assert holder.stdout.readline().strip() == "locked"  # type: ignore[union-attr]
        with pytest.raises(RunError, match=f"in use by another run .*pid {holder.pid}, "):
            lock_folder(out)
    finally:
        holder.kill()  # SIGKILL: no handler, no cleanup
        holder.wait()
    lock_folder(out).release()  # free at once


def test_lock_files_on_filesystems_that_keep_locks_local_are_reported(tmp_path):
    from imagenet.checkpoint.rundir import host_local_locks

    info = ("36 25 0:45 / {mnt} rw,relatime shared:1 - {fs} server:/export {opts}\n"
            "22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n")
    mnt = str(tmp_path)
    assert host_local_locks(tmp_path / "x", info.format(
        mnt=mnt, fs="nfs4", opts="rw,vers=4.2,local_lock=all")) == "nfs4 mounted with " \
        "local_lock=all"
    assert host_local_locks(tmp_path, info.format(mnt=mnt, fs="nfs", opts="rw,nolock")) == \
        "nfs mounted with nolock"
    assert host_local_locks(tmp_path, info.format(mnt=mnt, fs="lustre",
                                                  opts="rw,localflock")) == \
        "lustre mounted with localflock"
    assert host_local_locks(tmp_path, info.format(mnt=mnt, fs="nfs4",
                                                  opts="rw,local_lock=none")) is None
    assert host_local_locks(tmp_path, info.format(mnt="/elsewhere", fs="nfs4",
                                                  opts="local_lock=all")) is None


def test_only_finite_state_is_saved_and_the_nan_stop_names_the_file_it_kept(finished, tmp_path):
    data, _ = finished
    out = tmp_path / "out"
    # At lr 1e4 the loss stays finite for a few steps after BatchNorm's running_var has gone
    # to inf (measured: the classic check kept such a checkpoint at step 4).
    proc = run_main(str(data), *TINY18, "--epochs", "1", "--lr", "1e4", "--save-every", "1",
                    "--seed", "0", "-p", "1", "--output-dir", str(out))
    assert proc.returncode == 1, proc.stdout
    line = one_error_line(proc.stderr)
    kept = load_checkpoint(out / "checkpoint.pth.tar")
    assert non_finite_tensors(kept) == []  # weights, buffers, optimizer state: all finite
    assert "NaN/infinite" in line and f"the last good checkpoint, {out}/checkpoint.pth.tar " \
        f"(it resumes at epoch 0, step {kept['step_in_epoch']}), is kept" in line
    # A checkpoint that does hold inf (as the old guard kept) is refused, also by -e.
    kept["state_dict"]["layer1.0.bn1.running_var"][0] = float("inf")
    save_edited(kept, tmp_path / "diverged.pth.tar")
    proc = run_main(str(data), *TINY18, "-e", "--resume", str(tmp_path / "diverged.pth.tar"),
                    "--output-dir", str(out))
    assert proc.returncode == 1
    assert "holds NaN/infinite values in 1 tensor(s) (first state_dict/layer1.0.bn1." \
        "running_var)" in one_error_line(proc.stderr)


def test_resume_checks_the_class_names(finished, tmp_path, capsys):
    data, done = finished
    renamed = tmp_path / "data"
    shutil.copytree(data, renamed)
    for split in ("train", "val"):
        (renamed / split / "class1").rename(renamed / split / "zebra")
    for extra in (["--epochs", "2"], ["-e"]):
        code = main([str(renamed), *TINY, *extra, "--resume", str(done / "checkpoint.pth.tar"),
                     "--output-dir", str(tmp_path / "out")])
        line = one_error_line(capsys.readouterr().err)
        assert code == 1
        assert "was trained on other class names than the data's train/ folders (only in the " \
            "checkpoint: 'class1'; only in the data: 'zebra'); its labels would be permuted" \
            in line


def test_class_names_in_another_order_are_named():
    from imagenet.checkpoint.states import check_resumable

    ckpt = {"state_dict": {"w": torch.ones(1)}, "classes": ["cat", "dog", "fox"]}
    check_resumable(ckpt, Path("c.pth"), ["cat", "dog", "fox"])
    check_resumable({"state_dict": {}}, Path("classic.pth"), ["a"])  # no names saved: fine
    with pytest.raises(CheckpointError, match="label 1 is 'dog' in the checkpoint but 'fox'"):
        check_resumable(ckpt, Path("c.pth"), ["cat", "fox", "dog"])
