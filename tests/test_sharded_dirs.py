"""--sharded-checkpoint directories on disk: a kill between the two renames of a save, a fresh
run in a folder that such a kill left, damaged copies (a shard file missing, no .metadata, a
truncated shard) on resume and in ``python -m imagenet.tools.unshard``. Real directories written
by torch.distributed.checkpoint; the end-to-end resume at world size 2 runs main.py. Hostile
directories (a .metadata or a value that runs code when unpickled) are refused, not run."""

from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from helpers import TINY18, child_env, main_cmd, run_main, run_parallel, write_image_folder
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from imagenet.checkpoint import files, rundir, sharded
from imagenet.checkpoint.weights import read_weights
from imagenet.errors import CheckpointError
from imagenet.tools import unshard

SHARD = "__0_0.distcp"  # the one shard file a single writer makes


def tiny_dcp(path: Path, mark: str = "") -> Path:
    """A whole checkpoint directory as ``sharded.write`` makes it (one writer), marked."""
    tensors = {"state_dict": {"w": torch.arange(4000.0), "b": torch.ones(3)}}
    with sharded.single_process_is_meant():
        import torch.distributed.checkpoint as dcp

        dcp.save(tensors, checkpoint_id=path)
    files.atomic_save({"state_dict": None, "epoch": 1, "mark": mark}, path / files.SHARDED_META)
    return path


def damaged(root: Path, how: str) -> Path:
    """A copy of a whole directory with a shard file missing, no .metadata or a cut shard."""
    path = tiny_dcp(root / f"{how.replace(' ', '-')}.dcp")
    if how == "no shard":
        (path / SHARD).unlink()
    elif how == "no .metadata":
        (path / ".metadata").unlink()
    else:
        (path / SHARD).write_bytes((path / SHARD).read_bytes()[:1000])
    return path


WHAT_IS_MISSING = {"no shard": f"its shard file {SHARD} is missing",
                   "no .metadata": "its .metadata is missing",
                   "truncated": f"its shard file {SHARD} is truncated (1000 of at least "}


# ---------------------------------------------------------------- hostile directories


class RunsCode:
    """Unpickled, ``os.system`` creates ``marker``: proof that a load ran the folder's code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def hostile_metadata(path: Path, marker: Path) -> Path:
    """A whole directory whose .metadata is DCP's own plus a call that creates ``marker``."""
    tiny_dcp(path)
    metadata = pickle.loads((path / ".metadata").read_bytes())  # written just now: ours
    metadata.storage_meta.modules = [RunsCode(marker)]
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    return path


def hostile_value(path: Path, marker: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A directory the trainer's writer made, its optimizer's lr a call that creates
    ``marker`` (DCP keeps non-tensor values as pickles); the model and optimizer it fits."""
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = sharded.sharded_state(model, optimizer, None)
    state["optimizer"]["param_groups"][0]["lr"] = RunsCode(marker)
    with sharded.single_process_is_meant():
        sharded.write(state, {"state_dict": None, "epoch": 1, "arch": "linear"}, path, True)
    return model, optimizer


def refusal(read, path: Path) -> str:
    """The CheckpointError that ``read(path)`` raises ("" when it raises none)."""
    try:
        read(path)
    except CheckpointError as exc:
        return str(exc)
    return ""


READS_METADATA = {  # how each entry point reads a directory's .metadata
    "-e/--resume DIR": lambda path: files.resolve_resume(str(path), path.parent, False, True),
    "--resume auto": lambda path: files.resolve_resume("auto", path.parent, False, False),
    "--finetune DIR": read_weights,
    "unshard (DCP's own reader)": lambda path: sharded.to_single_file(path, path.parent / "x"),
}


@pytest.mark.parametrize("entry", list(READS_METADATA))
def test_a_metadata_that_runs_code_is_refused_not_run(tmp_path, entry):
    marker = tmp_path / "ran"
    path = hostile_metadata(tmp_path / "checkpoint.dcp", marker)
    error = refusal(READS_METADATA[entry], path)
    assert not marker.exists(), "the directory's .metadata ran code"
    assert error.startswith(f"refusing {path}: its .metadata "), error
    assert f"{os.system.__module__}.system" in error and "\n" not in error
    FileSystemReader(path).read_metadata()  # the payload is live: torch's own reader runs it
    assert marker.exists()


def test_a_value_that_runs_code_is_refused_on_resume_and_in_unshard(tmp_path, capsys):
    marker = tmp_path / "ran"
    path = tmp_path / "checkpoint.dcp"
    model, optimizer = hostile_value(path, marker)
    assert files.incomplete(path) is None  # a whole directory: only its contents are wrong
    error = refusal(lambda p: sharded.load(model, optimizer, None, p, "linear", []), path)
    assert not marker.exists(), "the directory's optimizer state ran code on resume"
    assert error.startswith(f"refusing {path}: its value optimizer.param_groups.0.lr "), error
    assert unshard.main([str(path)]) == 1
    assert not marker.exists(), "the directory's optimizer state ran code in unshard"
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: refusing {path}: its value optimizer.param_groups.0.lr ")


@pytest.mark.slow
def test_evaluating_a_directory_that_runs_code_is_one_line(tmp_path):
    marker = tmp_path / "ran"
    path = hostile_metadata(tmp_path / "checkpoint.dcp", marker)
    proc = run_main("--dummy", *TINY18, "-e", "--resume", str(path), "--output-dir",
                    str(tmp_path / "out"), timeout=120)
    assert not marker.exists(), "main.py -e ran the directory's code"
    assert proc.returncode == 1, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: refusing {path}: its .metadata "), proc.stderr


# ---------------------------------------------------------------- a kill between the renames


def test_a_fresh_run_keeps_the_checkpoint_a_kill_left_aside(tmp_path):
    """Killed between a save's two renames: only .checkpoint.dcp.old is whole. A fresh run in
    the folder moves it to previous/ as checkpoint.dcp (its first save used to delete it)."""
    out = tmp_path / "out"
    tiny_dcp(out / ".checkpoint.dcp.old", mark="the only one")
    (out / "config.json").write_text(json.dumps({"started": "2024-05-01T10:00:00"}))
    moved = rundir.move_previous_run(out)
    files.replace_dir(tiny_dcp(out / ".checkpoint.dcp.tmp", "new run"), out / "checkpoint.dcp")
    assert moved == out / "previous" / "2024-05-01_10-00-00"
    assert sorted(p.name for p in moved.iterdir()) == ["checkpoint.dcp", "config.json"]
    assert files.resolve_resume(str(moved / "checkpoint.dcp"), out, False, sharded=True) == \
        moved / "checkpoint.dcp"
    assert sharded.load_meta(moved / "checkpoint.dcp")["mark"] == "the only one"
    # Killed after the second rename, before the old one was deleted: both move, as they are.
    tiny_dcp(out / ".checkpoint.dcp.old", mark="stale")
    (out / "config.json").write_text(json.dumps({"started": "2024-05-02T10:00:00"}))
    moved = rundir.move_previous_run(out)
    assert sorted(p.name for p in moved.iterdir()) == [".checkpoint.dcp.old", "checkpoint.dcp",
                                                       "config.json"]
    assert sharded.load_meta(moved / "checkpoint.dcp")["mark"] == "new run"


def test_a_resume_uses_the_aside_when_the_directory_is_missing_or_incomplete(tmp_path, caplog):
    out = tmp_path / "out"
    tiny_dcp(out / ".checkpoint.dcp.old", mark="old")
    aside = out / ".checkpoint.dcp.old"
    for resume in ("auto", str(out / "checkpoint.dcp")):  # missing
        assert files.resolve_resume(resume, out, False, sharded=True) == aside
    damaged(out, "no shard").rename(out / "checkpoint.dcp")  # incomplete
    caplog.set_level("WARNING")
    assert files.resolve_resume("auto", out, False, sharded=True) == aside
    assert f"=> {out / 'checkpoint.dcp'}: its shard file {SHARD} is missing; using {aside}, " \
           "the checkpoint it was replacing when a save was interrupted" in caplog.text
    shutil.rmtree(aside)
    with pytest.raises(CheckpointError) as error:  # nothing whole: no silent fresh start
        files.resolve_resume("auto", out, False, sharded=True)
    assert str(error.value) == (
        f"{out / 'checkpoint.dcp'} is incomplete: its shard file {SHARD} is missing; use another "
        "checkpoint (an earlier run's are in previous/), or move it away and start without "
        "--resume")
    assert files.resolve_resume(None, out, False, sharded=True) is None  # a fresh run: moved


# ---------------------------------------------------------------- damaged copies


@pytest.mark.parametrize("how", list(WHAT_IS_MISSING))
def test_a_damaged_directory_is_one_line_on_resume_and_in_unshard(tmp_path, capsys, how):
    path = damaged(tmp_path, how)
    with pytest.raises(CheckpointError, match=f"^{path} is incomplete: "
                                              f"{WHAT_IS_MISSING[how].replace('(', '.')}"):
        files.resolve_resume(str(path), tmp_path, False, sharded=True)
    assert unshard.main([str(path)]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {path} is incomplete: {WHAT_IS_MISSING[how]}")
    assert line.endswith("; it cannot be converted; give another checkpoint directory (an "
                         "earlier run's are in previous/)")


def test_unshard_names_a_bad_output_and_damage_inside_a_shard(tmp_path, capsys):
    path = tiny_dcp(tmp_path / "checkpoint.dcp")
    (tmp_path / "a-folder").mkdir()
    assert unshard.main([str(path), str(tmp_path / "nope" / "x.pth.tar")]) == 2
    assert unshard.main([str(path), str(tmp_path / "a-folder")]) == 2
    assert unshard.main([str(tmp_path / "gone.dcp")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: the output's folder {tmp_path / 'nope'} does not exist: create it or give "
        "another FILE",
        f"error: the output {tmp_path / 'a-folder'} is a folder: give a file name, e.g. "
        f"{tmp_path / 'a-folder' / 'checkpoint.pth.tar'}",
        f"error: {tmp_path / 'gone.dcp'} does not exist: give a checkpoint directory written "
        "with --sharded-checkpoint, e.g. OUTPUT_DIR/checkpoint.dcp"]
    shard = path / SHARD
    shard.write_bytes(b"\0" * shard.stat().st_size)  # whole length, nothing readable
    assert unshard.main([str(path)]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {path} is damaged (rank 0: ") and line.endswith(
        "); give another checkpoint directory")
    assert not list(tmp_path.glob(".*tmp*")) and not (tmp_path / "checkpoint.pth.tar").exists()
    assert unshard.main([str(tiny_dcp(tmp_path / "good.dcp"))]) == 0
    assert torch.load(tmp_path / "good.pth.tar", weights_only=True)["state_dict"]["b"].sum() == 3


def test_a_flipped_byte_inside_a_shard_is_named_before_any_weight_is_used(tmp_path, capsys):
    """A single file carries a checksum; a directory's shard files carried none, so a flipped
    bit inside a tensor loaded as a silently different weight on resume, --finetune and
    unshard. Each file's checksum is written with the directory and checked before reading."""
    model = nn.Linear(64, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    path = tmp_path / "checkpoint.dcp"
    with sharded.single_process_is_meant():
        sharded.write(sharded.sharded_state(model, optimizer, None),
                      {"state_dict": None, "epoch": 1, "arch": "linear"}, path, True)
    whole = (path / SHARD).read_bytes()
    middle = len(whole) // 2
    (path / SHARD).write_bytes(whole[:middle] + bytes([whole[middle] ^ 0x10]) +
                               whole[middle + 1:])
    assert files.incomplete(path) is None  # every part there, at its length
    expected = (f"{path} is damaged: its shard file {SHARD} does not match the checksum "
                "written with it")
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    reads = {"resume": lambda p: sharded.load(model, optimizer, None, p, "linear", []),
             "--finetune": read_weights,
             "unshard": lambda p: sharded.to_single_file(p, tmp_path / "x.pth.tar")}
    for name, read in reads.items():
        assert refusal(read, path).startswith(expected), name
    assert unshard.main([str(path)]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {expected}")
    (path / SHARD).write_bytes(whole)  # the same bytes again: it loads
    assert model.weight.abs().sum() == 0  # nothing of the damaged directory was used
    sharded.load(model, optimizer, None, path, "linear", [])
    assert torch.equal(model.weight, saved)


@pytest.mark.slow
def test_resuming_a_damaged_directory_stops_every_rank_with_one_line(tmp_path):
    data = write_image_folder(tmp_path / "data", train_per_class=4, val_per_class=1)
    path = damaged(tmp_path, "no shard")
    cmd = main_cmd(str(data), *TINY18, "--fsdp", "--sharded-checkpoint",
                   "--multiprocessing-distributed", "--nproc-per-node", "2", "--resume",
                   str(path), "--output-dir", str(tmp_path / "out"))
    (result,) = run_parallel([cmd], [child_env()], tmp_path / "logs", timeout=300)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and "CheckpointException" not in result.stderr
    reason = (f"{path} is incomplete: its shard file {SHARD} is missing; use another checkpoint "
              "(an earlier run's are in previous/), or move it away and start without --resume")
    assert f"\nerror: {reason}\n" in "\n" + result.stderr, result.stderr
    assert f"\n[rank 1] error: {reason}\n" in "\n" + result.stderr, result.stderr


@pytest.mark.slow
def test_turning_sharded_checkpoints_on_or_off_resumes_the_newest_kind(tmp_path, capsys):
    """--resume auto after --sharded-checkpoint was turned off (or on): the folder's newest
    checkpoint, of either kind, continues; not a fresh start that moves the run aside."""
    from imagenet.cli import main

    data = write_image_folder(tmp_path / "data", classes=2, train_per_class=4, val_per_class=2)
    out = tmp_path / "out"
    flags = [str(data), *TINY18, "--fsdp", "--output-dir", str(out), "--resume", "auto",
             "--log-to", "none"]
    assert main([*flags, "--epochs", "1", "--sharded-checkpoint"]) == 0
    capsys.readouterr()
    assert main([*flags, "--epochs", "2"]) == 0  # off: checkpoint.dcp/ is all there is
    text = capsys.readouterr().out
    assert "checkpoint.dcp is the newest checkpoint" in text and "starting fresh" not in text
    assert main([*flags, "--epochs", "3", "--sharded-checkpoint"]) == 0  # on: the file is newer
    text = capsys.readouterr().out
    assert "checkpoint.pth.tar is the newest checkpoint" in text, text
    epochs = [json.loads(ln)["epoch"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [0, 1, 2] and not (out / "previous").exists()
