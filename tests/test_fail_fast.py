"""Failures end in one line, early: unusable output folders, a full disk, a last batch of one,
a silent master, a bad validation image, signals during validation, impossible flags.

Real processes throughout: a real tmpfs (in a private mount namespace) and RLIMIT_FSIZE for the
full disk, a socket that listens but never accepts for the silent master, real signals.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    MAIN,
    ROOT,
    TINY18,
    child_env,
    fault_at,
    load_checkpoint,
    main_cmd,
    prestarted_cmd,
    private_mount_prefix,
    run_main,
    run_parallel,
    write_image_folder,
)
from test_fault_tolerance import Live, fault_run

from imagenet.cli import main
from imagenet.launching.failures import is_stopped


def one_error_line(text: str, rank: int = 0) -> str:
    """The single ``error:`` line of a failed run (of a process of ``rank``: its tag first), and
    no traceback."""
    tag = f"[rank {rank}] " if rank else ""
    lines = [ln.removeprefix(tag) for ln in text.splitlines() if ln.startswith(f"{tag}error:")]
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
    pytest.param(["--gpu", "0"], "--gpu 0: no accelerator device is visible",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")),
])
def test_impossible_flags_are_refused_before_anything_starts(capsys, tmp_path, argv, words):
    # A missing data folder: the flag must be refused before the data is even looked at.
    code = main([str(tmp_path / "no-data"), *TINY18, *argv, "--output-dir", str(tmp_path / "o")])
    assert code == 2
    assert words in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- case 6: the output folder

def test_output_dir_that_is_a_file_is_refused(capsys, data, tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    code = main([str(data), *TINY18, "--epochs", "1", "--output-dir", str(target)])
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


@pytest.mark.slow
def test_unwritable_output_dir_is_refused_at_start_and_left_alone(data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.pth.tar").write_bytes(b"an earlier run's")
    out.chmod(0o555)
    try:
        proc = subprocess.run(as_unprivileged(main_cmd(str(data), *TINY18, "--epochs", "1",
                                                       "--output-dir", str(out))),
                              capture_output=True, text=True, env=child_env(), timeout=300)
    finally:
        out.chmod(0o755)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--output-dir {out} is not writable (Permission denied)" in \
        one_error_line(proc.stderr)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pth.tar"]


def limit_file_size(limit: int):
    """preexec_fn: this process may not write files larger than ``limit`` bytes (ulimit -f)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


@pytest.mark.slow
def test_a_file_size_limit_too_small_for_a_checkpoint_fails_at_start(data, tmp_path):
    proc = subprocess.run(main_cmd(str(data), *TINY18, "--epochs", "1", "--output-dir",
                                   str(tmp_path / "out")),
                          capture_output=True, text=True, env=child_env(), timeout=300,
                          preexec_fn=limit_file_size(20_000_000))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = one_error_line(proc.stderr)
    assert "a checkpoint of this run takes about 89.5 MB, more than the file size limit " \
        "(ulimit -f = 20.0 MB)" in line
    assert "Epoch: [" not in proc.stdout  # not an epoch spent first


@pytest.mark.slow
def test_a_checkpoint_that_meets_the_file_size_limit_fails_in_one_line_and_keeps_the_old(
        tmp_path):
    # CPython ignores SIGXFSZ: the write past the limit fails with EFBIG (the classic trainer
    # showed torch's zip writer error, "unexpected pos ...", and left the old file in place).
    script = """
import resource, sys, torch
from pathlib import Path
from imagenet.checkpoint import files
from imagenet.errors import CheckpointError
path = Path(sys.argv[1])
files.atomic_save({"state_dict": {"w": torch.ones(10)}}, path)
resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, resource.RLIM_INFINITY))
try:
    files.atomic_save({"state_dict": {"w": torch.zeros(1_000_000)}}, path)
except CheckpointError as exc:
    print(f"error: {exc}")
"""
    path = tmp_path / "checkpoint.pth.tar"
    proc = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                          text=True, env=child_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert one_error_line(proc.stdout) == (
        f"error: cannot write {path}: larger than the file size limit (ulimit -f = 1.0 MB); "
        "free some space or give another --output-dir; the previous file is kept")
    assert torch.equal(load_checkpoint(path)["state_dict"]["w"], torch.ones(10))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left


def in_tmpfs(size_mb: int, out: Path, cmd: list[str], then: str = "") -> \
        subprocess.CompletedProcess:
    """Run ``cmd`` with ``out`` a fresh ``size_mb`` MB tmpfs (a real full disk), in a private
    mount namespace; ``then`` is shell run meanwhile (``$pid`` is the command's)."""
    prefix = private_mount_prefix()
    if prefix is None:
        pytest.skip("cannot mount a tmpfs here (needs root or user namespaces)")
    out.mkdir()
    script = (f'mount -t tmpfs -o size={size_mb}m tmpfs "$OUT" || exit 97\n'
              f'"$@" & pid=$!\n{then}\nwait $pid')
    return subprocess.run([*prefix, "sh", "-c", script, "sh", *cmd], capture_output=True,
                          text=True, env=child_env(OUT=str(out)), timeout=300)


@pytest.mark.slow
def test_a_disk_too_small_for_the_checkpoints_fails_at_start(data, tmp_path):
    proc = in_tmpfs(120, tmp_path / "out", main_cmd(str(data), *TINY18, "--epochs", "2",
                                                    "--output-dir", str(tmp_path / "out")))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = one_error_line(proc.stderr)
    assert re.search(rf"error: {tmp_path}/out has 12\d\.\d MB free, but this run needs about "
                     r"178\.9 MB for its checkpoints \(one is about 89\.5 MB", line), line
    assert "Epoch: [" not in proc.stdout


@pytest.mark.slow
def test_a_disk_that_fills_during_the_run_fails_the_next_save_in_one_line(data, tmp_path):
    out, keep = tmp_path / "out", tmp_path / "keep"
    keep.mkdir()
    # After the first checkpoint: pause the run, fill the disk but 2 MB, go on.
    fill = f'''
while [ ! -e "$OUT/checkpoint.pth.tar" ] && kill -0 $pid 2>/dev/null; do sleep 0.02; done
kill -STOP $pid
avail=$(df --output=avail -B1 "$OUT" | tail -n 1)
dd if=/dev/zero of="$OUT/filler" bs=65536 count=$(( (avail - 2097152) / 65536 )) 2>/dev/null
kill -CONT $pid
wait $pid; code=$?
ls -A "$OUT" > {keep}/listing; cp "$OUT/checkpoint.pth.tar" {keep}/
exit $code'''
    proc = in_tmpfs(250, out, main_cmd(str(data), *TINY18, "--epochs", "2", "--save-every", "1",
                                       "--output-dir", str(out)), then=fill)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = one_error_line(proc.stderr)
    assert line.startswith(f"error: cannot write {out}/checkpoint.pth.tar: No space left on "
                           "device (") and line.endswith("the previous file is kept"), line
    left = (keep / "listing").read_text().split()
    assert not [name for name in left if ".tmp" in name], left  # no partial file in place
    assert load_checkpoint(keep / "checkpoint.pth.tar")["step_in_epoch"] >= 1


@pytest.mark.slow
def test_a_full_disk_on_rank_0_ends_every_rank_with_its_line_and_nothing_more(data, tmp_path):
    """Two processes; the disk fills after the first checkpoint, rank 0's next save fails. Rank 1
    learns it from its mailbox and waits for rank 0 to exit (so that mp.spawn names rank 0):
    meanwhile its hang watch must not talk to rank 0's store, which left with rank 0 (torch's
    C++ 'Broken pipe' warnings with their stack frames, found by the chaos matrix)."""
    out = tmp_path / "out"
    fill = '''
while [ ! -e "$OUT/checkpoint.pth.tar" ] && kill -0 $pid 2>/dev/null; do sleep 0.02; done
avail=$(df --output=avail -B1 "$OUT" | tail -n 1)
dd if=/dev/zero of="$OUT/filler" bs=65536 count=$(( (avail - 2097152) / 65536 )) 2>/dev/null'''
    proc = in_tmpfs(250, out, main_cmd(str(data), *TINY18, "--epochs", "2", "--save-every", "1",
                                       "--multiprocessing-distributed", "--nproc-per-node", "2",
                                       "--output-dir", str(out)), then=fill)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [x for x in proc.stderr.splitlines() if re.match(r"(\[rank \d\] )?error:", x)]
    assert len(lines) == 2, proc.stderr
    assert lines[0 if lines[0].startswith("error:") else 1].startswith(
        f"error: cannot write {out}/checkpoint.pth.tar: No space left on device")
    assert any(x.startswith("[rank 1] error: rank 0 failed: cannot write") for x in lines)
    assert not re.search(r"^frame #\d+: ", proc.stderr, flags=re.M), proc.stderr
    assert "Broken pipe" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def pause_at_first_checkpoint(out: Path, fault: str, keep: Path, after: str = "") -> str:
    """Shell for ``in_tmpfs``: once ``out`` has a checkpoint, stop the run, apply ``fault``,
    let it go on; at the end list what is left into ``keep`` and run ``after``."""
    return f'''
while [ ! -e "{out}/checkpoint.pth.tar" ] && kill -0 $pid 2>/dev/null; do sleep 0.02; done
kill -STOP $pid
{fault}
kill -CONT $pid
wait $pid; code=$?
ls -A "{out}" > {keep}/listing 2>&1
{after}
exit $code'''


@pytest.mark.slow
def test_an_output_folder_deleted_during_the_run_ends_it_in_one_line(data, tmp_path):
    disk, keep = tmp_path / "disk", tmp_path / "keep"
    out = disk / "out"
    keep.mkdir()
    proc = in_tmpfs(250, disk, main_cmd(str(data), *TINY18, "--epochs", "2", "--save-every", "1",
                                        "--output-dir", str(out)),
                    then=pause_at_first_checkpoint(out, f'rm -rf "{out}"', keep))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = one_error_line(proc.stderr)  # also: no thread's traceback (TensorBoard's writer)
    assert re.fullmatch(rf"error: cannot write {out}/\S+: {out} is gone \(deleted or unmounted "
                        r"while the run was writing to it\); the run stopped with nothing "
                        r"more to save there", line), line
    assert "No such file" in (keep / "listing").read_text()


@pytest.mark.slow
def test_an_output_folder_turned_read_only_during_the_run_ends_it_in_one_line(data, tmp_path):
    """The folder's file system turns read-only under the run (what ext4 does after an I/O
    error): a read-only copy of its folders is mounted over it, the checkpoint stays below."""
    out, keep = tmp_path / "out", tmp_path / "keep"
    keep.mkdir()
    turn_read_only = f'''
ro={tmp_path}/ro; mkdir -p $ro && mount -t tmpfs -o size=1m tmpfs $ro
(cd "{out}" && find . -type d -exec mkdir -p "$ro/{{}}" \\;)
mount -o remount,ro $ro && mount --bind $ro "{out}"'''
    after = f'umount "{out}"; cp "{out}/checkpoint.pth.tar" {keep}/'
    proc = in_tmpfs(250, out, main_cmd(str(data), *TINY18, "--epochs", "2", "--save-every", "1",
                                       "--output-dir", str(out)),
                    then=pause_at_first_checkpoint(out, turn_read_only, keep, after))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = one_error_line(proc.stderr)
    assert re.fullmatch(rf"error: cannot write {out}/\S+: the file system is read-only now "
                        rf"\(remounted read-only after an error\?\); the run stopped; fix {out} "
                        r"or give another --output-dir, then --resume auto", line), line
    assert load_checkpoint(keep / "checkpoint.pth.tar")["step_in_epoch"] >= 1  # still whole


@pytest.mark.slow
def test_predictions_that_meet_a_full_disk_end_in_one_line(data, tmp_path):
    trained = run_main(str(data), *TINY18, "--epochs", "1", "--output-dir", str(tmp_path / "run"))
    assert trained.returncode == 0, trained.stderr
    disk = tmp_path / "disk"
    # The disk is filled as the evaluation starts (its imports alone take seconds).
    fill = f'dd if=/dev/zero of="{disk}/filler" bs=65536 2>/dev/null'
    proc = in_tmpfs(1, disk, main_cmd(str(data), *TINY18, "-e", "--resume",
                                      str(tmp_path / "run" / "checkpoint.pth.tar"),
                                      "--output-dir", str(tmp_path / "eval"),
                                      "--predictions", str(disk / "predictions.csv")),
                    then=fill)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = one_error_line(proc.stderr)
    assert line.startswith(f"error: cannot write {disk}/predictions.csv: No space left on "
                           "device"), line


# ---------------------------------------------------------------- case 7: a last batch of one

@pytest.mark.slow
def test_a_last_training_batch_of_one_image_is_dropped_and_validation_is_whole(tmp_path):
    data = write_image_folder(tmp_path / "data", classes=3, train_per_class=25, val_per_class=3)
    for extra in sorted((data / "train").glob("*/img24.jpg"))[:2]:
        extra.unlink()  # 73 training images: 9 batches of 8 and one of 1
    out = tmp_path / "out"
    proc = run_main(str(data), *TINY18, "--epochs", "1", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    (record,) = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["train_images"] == 72  # the one-image batch was left out
    assert record["val_count"] == 9  # 8 + 1: the validation set is never cut
    assert "Epoch: [0][9/9]" in proc.stdout


# ---------------------------------------------------------------- case 8: a silent master

@pytest.mark.slow
def test_a_master_port_that_listens_but_never_answers_ends_after_the_timeout(data, tmp_path):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes connections; nobody ever accepts them
        port = silent.getsockname()[1]
        cmd = prestarted_cmd(str(data), *TINY18, "--world-size", "2", "--rank", "1",
                             "--dist-url", f"tcp://127.0.0.1:{port}", "--dist-timeout", "3")
        (result,) = run_parallel([cmd], [child_env()], tmp_path / "logs", timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    line = one_error_line(result.stderr, rank=1)  # the line says which process it is
    assert f"127.0.0.1:{port} as rank 1 of world size 2" in line
    assert "accepts connections but did not answer" in line and "--dist-timeout 3s" in line


@pytest.mark.parametrize("variables, words", [
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29x"},
     "MASTER_PORT=29x is not a port: give a number from 1 to 65535"),
    ({"MASTER_ADDR": "127.0.0.1"}, "--dist-url env:// needs MASTER_ADDR and MASTER_PORT"),
])
@pytest.mark.slow
def test_a_launchers_unusable_master_is_one_line_before_any_data_is_read(data, tmp_path,
                                                                          variables, words):
    # A manual env:// launch (RANK/WORLD_SIZE given): the plan reads where the ranks meet once,
    # before the data, the model or the process group; nothing is written to OUTPUT_DIR.
    env = {**child_env(), "RANK": "1", "WORLD_SIZE": "2", **variables}
    result = run_main(str(data), *TINY18, "--output-dir", str(tmp_path / "out"), env=env,
                      timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert words in one_error_line(result.stderr)  # the plan's error: before any rank joins
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- case 9: bad validation images

@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_a_bad_validation_image_is_found_before_training_on_every_rank(data, tmp_path, launcher):
    """Every rank stops with the finding, each line tagged with its rank (under torchrun too,
    where the line is printed after the process left the training: it used to say rank 0's)."""
    broken = tmp_path / "data"
    shutil.copytree(data, broken)
    bad = broken / "val" / "class0" / "img1.jpg"  # validation image 1: rank 1's shard
    bad.write_bytes(b"<html>404</html>")
    out = tmp_path / "out"
    args = [str(broken), *TINY18, "--epochs", "1", "--output-dir", str(out)]
    cmd = main_cmd(*args, "--multiprocessing-distributed", "--nproc-per-node", "2") \
        if launcher == "spawn" else [sys.executable, "-m", "torch.distributed.run",
                                     "--standalone", "--nproc-per-node", "2", *main_cmd(*args)[1:]]
    (result,) = run_parallel([cmd], [child_env()], tmp_path / "logs", timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    reason = f"cannot read image {bad}: no image format recognises its first bytes (16 bytes: " \
        "empty, damaged or not an image); found by the check of the validation images"
    own = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert len(own) == 1 and own[0].startswith(f"error: {reason}"), result.stderr  # rank 0's
    assert f"[rank 1] error: {reason}" in result.stderr
    assert "object at 0x" not in result.stderr
    assert "Epoch: [" not in result.stdout and not (out / "checkpoint.pth.tar").exists()


def test_the_image_check_reads_ends_and_leaves_the_rest_to_the_decoder(tmp_path):
    from PIL import Image

    from imagenet.data.transforms import check_image_file
    from imagenet.errors import DataError

    good = tmp_path / "good.jpg"
    Image.new("RGB", (40, 30), (200, 10, 10)).save(good, quality=90)
    Image.new("RGB", (40, 30)).save(tmp_path / "good.png")
    (tmp_path / "trailing.jpg").write_bytes(good.read_bytes() + b"\0" * 100)  # decodes fine
    (tmp_path / "cut.jpg").write_bytes(good.read_bytes()[:-200])
    (tmp_path / "empty.jpg").write_bytes(b"")
    for name in ("good.jpg", "good.png", "trailing.jpg"):
        check_image_file(tmp_path / name, "tensor")
    with pytest.raises(DataError, match=r"cut\.jpg: (image file is truncated|Truncated File Read)"):
        check_image_file(tmp_path / "cut.jpg", "tensor")
    with pytest.raises(DataError, match=r"empty\.jpg: no image format .* \(0 bytes"):
        check_image_file(tmp_path / "empty.jpg", "pil")


# ---------------------------------------------------------------- case 10: signals

# The runs are signalled once they train, never while they start: forked from the pre-imported
# trainer (prestarted_cmd), each in a process group of its own. A run placed a fault by a
# failpoint (``fault_run``) sends the signal itself, to its whole group as a terminal does.

def ctrl_c_at(args: list[str], point: str, hit: int) -> tuple[int, str]:
    """main.py with ``args``, Ctrl-C (SIGINT to its whole group) at the ``hit``-th pass of
    the failpoint ``point``."""
    return fault_run(prestarted_cmd(*args), fault_at(point, hit, "sigint(group)"))


@pytest.mark.slow
def test_a_signal_during_validation_stops_within_a_batch_and_keeps_the_trained_epoch(tmp_path):
    # 60 validation images, 8 batches: Ctrl-C after the first.
    data = write_image_folder(tmp_path / "data", val_per_class=20)
    out = tmp_path / "out"
    args = [str(data), *TINY18, "-p", "1", "--epochs", "1", "--output-dir", str(out)]
    code, output = ctrl_c_at(args, "validate.batch", 1)
    assert code == 143, output
    assert one_error_line(output) == (f"error: stopped by SIGINT during the validation of epoch "
                                      f"0; checkpoint saved in {out}; resume with --resume auto")
    batches = [int(b) for b in re.findall(r"^Test: \[(\d)/8\]", output, flags=re.M)]
    assert batches == [1], output  # it did not wait for the end of the validation
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step_in_epoch"], ckpt["steps_per_epoch"]) == (0, 3, 3)
    # The resumed run validates the trained epoch, and that is all that was left.
    proc = run_main(*args, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert "Epoch: [" not in proc.stdout
    (record,) = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert (record["epoch"], record["val_count"]) == (0, 60)


@pytest.mark.slow
def test_ranks_with_unequal_validation_shards_stop_validation_together(tmp_path):
    # 33 validation images on 2 ranks, 4 per batch: 5 batches on rank 0, 4 on rank 1, which
    # must still take part in the stop agreement of rank 0's fifth batch: SIGINT to rank 1 alone
    # once it has validated its third (its vote goes out with its fourth ask and is agreed one
    # ask later, StopFlag.should_stop: before rank 0's fifth batch, which rank 1 asks for after
    # its last). Only rank 1 is signalled: a Ctrl-C to the group would reach rank 0 at a batch
    # that depends on how far it is ahead, and the batch it stops at with it.
    data = write_image_folder(tmp_path / "data", val_per_class=11)
    out = tmp_path / "out"
    code, output = fault_run(prestarted_cmd(
        str(data), *TINY18, "-p", "1", "--epochs", "1", "--multiprocessing-distributed",
        "--nproc-per-node", "2", "--output-dir", str(out)),
        fault_at("validate.batch@1", 3, "sigint"))
    assert code == 143, output
    assert re.search(r"\nerror: stopped by a signal on another rank during the validation of "
                     rf"epoch 0; checkpoint saved in {re.escape(str(out))}", output), output
    assert max(int(b) for b in re.findall(r"^Test: \[(\d)/5\]", output, flags=re.M)) == 4
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step_in_epoch"], ckpt["world_size"]) == (0, 3, 2)


@pytest.mark.slow
def test_a_signal_after_the_stopped_line_still_exits_143(data, tmp_path):
    live = Live(prestarted_cmd(str(data), *TINY18, "-j", "2", "-p", "1", "--epochs", "1",
                               "--output-dir", str(tmp_path / "out")), timeout=300)
    live.wait_for("Epoch: [0][1/3]")
    live.signal_group(signal.SIGINT)
    live.wait_for("error: stopped by SIGINT")
    # Frozen while it shuts down, then a second Ctrl-C more than a second after the first.
    live.signal_group(signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while not is_stopped(live.group):  # the run's main process: the leader of its group
        assert time.monotonic() < deadline, "exited before the second signal: nothing was tested"
        time.sleep(0.01)
    time.sleep(1.2)
    live.signal_group(signal.SIGINT)
    live.signal_group(signal.SIGCONT)
    code = live.finish()
    assert code == 143, live.output
    assert "KeyboardInterrupt" not in live.output and "Traceback" not in live.output, live.output


@pytest.mark.slow
def test_a_second_signal_once_the_stop_is_over_exits_143(tmp_path):
    # The trainer's order: stop flag installed, signal, stop agreed, saved, uninstalled; then
    # a second Ctrl-C before the process has exited.
    script = """
import os, signal, time
from imagenet.launching.preemption import StopFlag
flag = StopFlag()
flag.install()
os.kill(os.getpid(), signal.SIGINT)
assert flag.should_stop()
flag.uninstall()
time.sleep(1.2)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(5)
print("still alive", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=child_env(), timeout=60)
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert "still alive" not in proc.stdout and "KeyboardInterrupt" not in proc.stderr
    assert "second signal (SIGINT): exiting now (the checkpoint is saved)" in proc.stderr


CRASHING = """
import ctypes, runpy, sys
import imagenet.run.trainer as trainer
trainer.train = lambda *args, **kwargs: ctypes.string_at(0)  # a crash in C code, in training
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_crash_in_c_code_prints_where_each_thread_was(tmp_path):
    """A segfault (found once in a chaos run under torchrun: only "exitcode -11") now prints the
    Python stack of every thread of the process, so the crash says where it was."""
    proc = subprocess.run(
        [sys.executable, "-c", CRASHING, MAIN, "--dummy", *TINY18, "--epochs", "1",
         "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGSEGV, proc.stderr[-3000:]
    assert "Fatal Python error: Segmentation fault" in proc.stderr, proc.stderr[-3000:]
    assert re.search(r'File ".*imagenet/run/trainer\.py", line \d+ in resume_and_train',
                     proc.stderr), proc.stderr[-3000:]
