"""Checkpoint files stay loadable through kills, and bad or hostile checkpoints are refused."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import pickle
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import torchvision
from helpers import TINY, TINY18, run_main

from imagenet.checkpoint import files, resume_from
from imagenet.checkpoint.states import resumed_best
from imagenet.errors import CheckpointError, UsageError

# ---- kill-during-save torture


def _writer(folder: Path, epoch: int, best: float) -> None:
    """Save forever like the trainer: accuracy goes up and down, model_best on improvement."""
    torch.set_num_threads(1)  # a forked child must not touch the parent's OpenMP pool
    while True:
        epoch += 1
        acc = float(epoch * 37 % 101)
        is_best = acc > best
        best = max(best, acc)
        payload = {"epoch": epoch, "acc": acc, "best_acc1": best,
                   "state_dict": {"w": torch.full((1 << 19,), acc)}}  # 2 MB: kills land mid-write
        files.atomic_save(payload, folder / files.CHECKPOINT,
                            copies=[folder / files.BEST] if is_best else [])


def _resume_point(folder: Path) -> tuple[int, float]:
    """Where a restarted writer continues: the trainer's resume rule for best_acc1."""
    path = folder / files.CHECKPOINT
    if not path.exists():
        return 0, -1.0
    ckpt = files.load_checkpoint(path)
    return ckpt["epoch"], resumed_best(ckpt, path, folder)


KILLS = 20


@pytest.mark.slow
def test_sigkill_during_saves_never_leaves_an_unloadable_or_inconsistent_file(tmp_path):
    rng = random.Random(0)
    fork = multiprocessing.get_context("fork")
    kills_mid_write = 0
    for _ in range(KILLS):
        # As the trainer does at start: so that a temp file below is this kill's, mid-write.
        files.remove_stale_temp_files(tmp_path)
        epoch, best = _resume_point(tmp_path)
        writer = fork.Process(target=_writer, args=(tmp_path, epoch, best), daemon=True)
        writer.start()
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        assert writer.exitcode == -signal.SIGKILL
        kills_mid_write += bool(list(tmp_path.glob(".*.tmp-*")))
        if not (tmp_path / files.CHECKPOINT).exists():
            continue  # killed before its first save completed
        ckpt = files.load_checkpoint(tmp_path / files.CHECKPOINT)
        best_file = files.load_checkpoint(tmp_path / files.BEST)
        # model_best holds the weights of its own accuracy, and never lags the checkpoint.
        assert best_file["best_acc1"] == best_file["acc"]
        assert torch.all(best_file["state_dict"]["w"] == best_file["acc"])
        assert ckpt["best_acc1"] <= best_file["best_acc1"]
        assert ckpt["best_acc1"] == max(ckpt["acc"], ckpt["best_acc1"])
    assert _resume_point(tmp_path)[0] > KILLS, "the writer hardly ran: the kills tested nothing"
    # About half the kills land in a write (8 to 15 of 20 measured; the others before the
    # writer's first save or between saves). Fewer than 3 would mean the kills tested little.
    assert kills_mid_write >= 3, f"only {kills_mid_write} of {KILLS} kills landed during a write"
    files.remove_stale_temp_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [files.CHECKPOINT, files.BEST]


def test_resume_keeps_the_higher_best_acc1_of_model_best(tmp_path):
    # A kill between writing model_best and replacing checkpoint.pth.tar.
    torch.save({"state_dict": {}, "best_acc1": 70.0}, tmp_path / files.BEST)
    ckpt = {"state_dict": {}, "best_acc1": 50.0}
    assert resumed_best(ckpt, tmp_path / files.CHECKPOINT, tmp_path) == 70.0
    # A checkpoint from elsewhere does not adopt this folder's model_best.
    other = tmp_path / "other" / files.CHECKPOINT
    assert resumed_best(ckpt, other, tmp_path) == 50.0
    (tmp_path / files.BEST).write_bytes(b"garbage")  # unreadable: warn and ignore
    assert resumed_best(ckpt, tmp_path / files.CHECKPOINT, tmp_path) == 50.0


def test_a_damaged_model_best_does_not_set_the_resumed_best_acc1(tmp_path, caplog):
    """A model_best whose bits changed after it was written (its checksum no longer matches)
    is named and ignored: trusting its best_acc1 (here flipped to 99) would keep every later,
    better epoch from replacing the damaged file."""
    best = tmp_path / files.BEST
    files.atomic_save({"state_dict": {"w": torch.ones(4)}, "best_acc1": 70.0},
                      tmp_path / files.CHECKPOINT, copies=[best])
    ckpt = {"state_dict": {}, "best_acc1": 50.0}
    assert resumed_best(ckpt, tmp_path / files.CHECKPOINT, tmp_path) == 70.0  # intact: kept
    flipped = torch.load(best, weights_only=True)
    flipped["best_acc1"] = 99.0  # the checksum written with 70.0 stays
    torch.save(flipped, best)
    with caplog.at_level(logging.WARNING):
        assert resumed_best(ckpt, tmp_path / files.CHECKPOINT, tmp_path) == 50.0
    assert f"{best} is damaged" in caplog.text and "ignoring" in caplog.text
    flipped["best_acc1"], flipped["state_dict"]["w"][0] = 70.0, 2.0  # a weight changed instead
    torch.save(flipped, best)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert resumed_best(ckpt, tmp_path / files.CHECKPOINT, tmp_path) == 50.0
    assert f"{best} is damaged" in caplog.text


def test_atomic_save_replaces_and_leaves_no_temp_files(tmp_path):
    path, best = tmp_path / files.CHECKPOINT, tmp_path / files.BEST
    files.atomic_save({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, path, copies=[best])
    files.atomic_save({"state_dict": {"w": torch.zeros(2)}, "epoch": 2}, path)
    assert files.load_checkpoint(path)["epoch"] == 2
    assert files.load_checkpoint(best)["epoch"] == 1  # replaced by a new file, not edited
    assert sorted(p.name for p in tmp_path.iterdir()) == [files.CHECKPOINT, files.BEST]


# ---- which checkpoint a restart resumes


def test_resolve_resume_prefers_the_output_dir_checkpoint_after_a_restart(tmp_path):
    given = tmp_path / "pretrained.pth.tar"
    given.write_bytes(b"x")
    out = tmp_path / "out"
    out.mkdir()
    assert files.resolve_resume(str(given), out, restarted=True) == given  # nothing newer yet
    assert files.resolve_resume(None, out, restarted=True) is None
    assert files.resolve_resume("auto", out, restarted=False) is None
    (out / files.CHECKPOINT).write_bytes(b"x")
    assert files.resolve_resume(str(given), out, restarted=True) == out / files.CHECKPOINT
    assert files.resolve_resume(None, out, restarted=True) == out / files.CHECKPOINT
    assert files.resolve_resume("auto", out, restarted=False) == out / files.CHECKPOINT
    assert files.resolve_resume(str(given), out, restarted=False) == given
    assert files.resolve_resume(None, out, restarted=False) is None
    with pytest.raises(UsageError, match="--resume: no checkpoint at"):
        files.resolve_resume(str(tmp_path / "missing"), out, restarted=False)


# ---- refusals, end to end through main.py


class Evil:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _resnet_state(arch: str = "resnet18", num_classes: int = 3) -> dict:
    return torchvision.models.get_model(arch, num_classes=num_classes).state_dict()


def _write_bad(kind: str, path: Path, marker: Path) -> str:
    """Write a bad checkpoint of ``kind``; the words the error message must contain."""
    if kind == "truncated":
        torch.save({"epoch": 1, "arch": "resnet18", "state_dict": _resnet_state()}, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return "is truncated or damaged"
    if kind == "not a checkpoint":
        path.write_text("these are not the weights you are looking for\n")
        return "is not a checkpoint"
    if kind == "other architecture":
        torch.save({"epoch": 1, "arch": "resnet34", "state_dict": _resnet_state("resnet34")}, path)
        return "was saved for -a resnet34, but this run uses -a resnet18"
    if kind == "other class count":
        torch.save({"epoch": 1, "arch": "resnet18", "state_dict": _resnet_state(num_classes=5)},
                   path)
        return "saved with 5 classes, this data set has 3"
    if kind == "malicious (torch.save)":
        torch.save({"epoch": 1, "state_dict": _resnet_state(), "x": Evil(marker)}, path)
        return "refusing"
    assert kind == "malicious (plain pickle)"
    path.write_bytes(pickle.dumps({"state_dict": {}, "x": Evil(marker)}, protocol=2))
    return "refusing"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["truncated", "not a checkpoint", "other architecture",
                                  "other class count", "malicious (torch.save)",
                                  "malicious (plain pickle)"])
def test_bad_checkpoints_are_refused_with_one_clear_error(image_folder, tmp_path, kind):
    path, marker = tmp_path / "bad.pth.tar", tmp_path / "pwned"
    expected = _write_bad(kind, path, marker)
    proc = run_main(str(image_folder), *TINY18, "--epochs", "1", "--output-dir",
                    str(tmp_path / "out"), "--resume", str(path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0] and str(path) in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not marker.exists(), "the checkpoint ran code while being loaded"
    assert not (tmp_path / "out" / files.CHECKPOINT).exists()


def test_the_malicious_file_would_run_code_if_loaded_unsafely(tmp_path):
    """The refusal test above is only meaningful if its payload is live."""
    marker = tmp_path / "pwned"
    for kind in ("malicious (torch.save)", "malicious (plain pickle)"):
        path = tmp_path / "bad.pth.tar"
        _write_bad(kind, path, marker)
        if kind == "malicious (torch.save)":
            torch.load(path, weights_only=False)
        else:
            pickle.loads(path.read_bytes())
        assert marker.exists()
        marker.unlink()
    with pytest.raises(CheckpointError, match="refusing"):
        files.load_checkpoint(path)
    assert not marker.exists()


def test_a_best_file_is_written_for_the_first_epoch_even_at_zero_accuracy(tmp_path):
    from imagenet.run.build import Best

    best = Best(tmp_path / files.BEST)
    assert best.update(0.0)  # nothing scored yet, no file: write one
    best.path.write_bytes(b"x")
    assert not best.update(0.0)
    assert best.update(10.0) and best.update(12.5)
    assert not best.update(10.0) and not best.update(12.5) and best.acc1 == 12.5


# ---- checksums: a damaged checkpoint is never loaded silently


def flip_a_bit_in_the_weights(path: Path) -> None:
    """Flip one bit inside the largest tensor's bytes, leaving torch.save's zip structure whole
    (torch does not check the zip's own CRCs: the file still loads)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        entry = max(archive.infolist(), key=lambda e: e.file_size)
        with open(path, "rb") as f:  # the local header: 30 bytes + name + extra
            f.seek(entry.header_offset + 26)
            name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(
                f.read(2), "little")
    offset = entry.header_offset + 30 + name_len + extra_len + entry.file_size // 2
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_flipped_bit_or_a_cut_is_named_not_loaded(tmp_path):
    path = tmp_path / files.CHECKPOINT
    payload = {"epoch": 3, "state_dict": {"w": torch.arange(100_000, dtype=torch.float32)},
               "config": {"lr": 0.1}}
    files.atomic_save(payload, path)
    loaded = files.load_checkpoint(path)
    assert loaded["checksum"].startswith("sha256:") and loaded["epoch"] == 3
    flip_a_bit_in_the_weights(path)
    raw = torch.load(path, map_location="cpu", weights_only=True)  # torch itself says nothing
    assert not torch.equal(raw["state_dict"]["w"], payload["state_dict"]["w"])
    with pytest.raises(CheckpointError, match="is damaged: its contents do not match the "
                                              "checksum"):
        files.load_checkpoint(path)
    files.atomic_save(payload, path)
    path.write_bytes(path.read_bytes()[:-5000])  # a copy cut short
    with pytest.raises(CheckpointError, match="truncated or damaged"):
        files.load_checkpoint(path)
    # A file written without a checksum (the classic script's) loads as before.
    torch.save({"epoch": 1, "state_dict": {"w": torch.ones(3)}}, path)
    assert files.load_checkpoint(path)["epoch"] == 1


def test_the_checksum_covers_every_value_not_only_the_tensors(tmp_path):
    path = tmp_path / "c.pth.tar"
    files.atomic_save({"epoch": 3, "state_dict": {"w": torch.ones(2)}}, path)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    saved["epoch"] = 4  # as if a bit of the pickled position had flipped
    torch.save(saved, path)
    with pytest.raises(CheckpointError, match="damaged"):
        files.load_checkpoint(path)


@pytest.mark.slow
def test_resume_auto_falls_back_to_the_newest_intact_checkpoint(image_folder, tmp_path):
    """A bit flipped in checkpoint.pth.tar: --resume auto names it, says which checkpoint it
    uses instead (the history's), and the run ends as an uninterrupted one does, and as the
    same run: config.json's run id, which its checkpoints carry (a later fall-back checks it)."""
    flags = [str(image_folder), *TINY, "--seed", "0", "-j", "0", "--keep-checkpoints", "3"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert run_main(*flags, "--epochs", "3", "--output-dir", str(whole)).returncode == 0
    assert run_main(*flags, "--epochs", "2", "--output-dir", str(cut)).returncode == 0
    flip_a_bit_in_the_weights(cut / files.CHECKPOINT)
    run_id = json.loads((cut / "config.json").read_text())["run_id"]
    proc = run_main(*flags, "--epochs", "3", "--output-dir", str(cut), "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "checkpoint.pth.tar is damaged" in out, out[-3000:]
    # The history's epoch-1 file (or model_best, when it is that same file), not the damaged
    # one under its other names (hard links).
    used = re.search(r"resuming from (\S+) instead, the newest intact checkpoint \(epoch 1,", out)
    assert used and Path(used[1]).name in ("checkpoint_epoch001.pth.tar",
                                           "model_best.pth.tar"), out[-3000:]
    assert "Traceback" not in out
    a = torch.load(whole / files.CHECKPOINT, map_location="cpu", weights_only=True)
    b = torch.load(cut / files.CHECKPOINT, map_location="cpu", weights_only=True)
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    assert b["run_id"] == json.loads((cut / "config.json").read_text())["run_id"] == run_id
    # Asked for by name, the damaged file is an error: one line, no fall-back.
    damaged = tmp_path / "damaged.pth.tar"
    damaged.write_bytes((whole / files.CHECKPOINT).read_bytes())
    flip_a_bit_in_the_weights(damaged)
    proc = run_main(*flags, "--epochs", "4", "--output-dir", str(tmp_path / "named"),
                    "--resume", str(damaged))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {damaged} is damaged")


@pytest.mark.slow
def test_a_finished_runs_damaged_checkpoint_is_named_not_taken_for_the_end(image_folder,
                                                                            tmp_path):
    """Found by the chaos matrix (seed 29002, scenario 59): the check that ends a chained job
    whose checkpoint has trained every epoch read the position of a damaged checkpoint.pth.tar
    and said "nothing left to train", the damage unnamed. It is named, and --resume auto goes on
    from the newest intact checkpoint (the epoch-2 file is the damaged one under another name,
    a hard link): the last epoch is trained again and the run ends with an intact checkpoint."""
    out = tmp_path / "out"
    flags = [str(image_folder), *TINY, "--seed", "0", "-j", "0", "--keep-checkpoints", "2",
             "--epochs", "2", "--output-dir", str(out)]
    assert run_main(*flags).returncode == 0
    flip_a_bit_in_the_weights(out / files.CHECKPOINT)
    proc = run_main(*flags, "--resume", "auto")
    out_text = proc.stdout + proc.stderr
    assert proc.returncode == 0, out_text[-3000:]
    damaged = out_text.find("checkpoint.pth.tar is damaged")
    assert damaged >= 0, out_text[-3000:]
    used = re.search(r"resuming from (\S+) instead, the newest intact checkpoint \(epoch 1,",
                     out_text)
    assert used and Path(used[1]).name in ("checkpoint_epoch001.pth.tar",
                                           "model_best.pth.tar"), out_text[-3000:]
    assert "nothing left to train" not in out_text, out_text[-3000:]
    assert "Traceback" not in out_text
    assert files.load_checkpoint(out / files.CHECKPOINT)["epoch"] == 2  # whole again


@pytest.mark.slow
def test_a_damaged_checkpoint_is_replaced_by_the_intact_one_the_resume_used(image_folder,
                                                                             tmp_path):
    """Found by the chaos matrix (seed 29005, scenario 54): a finished run's checkpoint.pth.tar
    truncated (a new file: its history copy is whole), then --resume auto: it named the damage,
    went on from the history's copy of the last epoch, had nothing left to train and ended,
    leaving the damaged file in place while its last line called it "the last epoch; --resume
    auto continues it". The resume now puts a copy of the intact checkpoint in its place and
    says so; -e reads the folder without changing it."""
    out = tmp_path / "out"
    flags = [str(image_folder), *TINY, "--seed", "0", "-j", "0", "--keep-checkpoints", "2",
             "--epochs", "2", "--output-dir", str(out)]
    assert run_main(*flags).returncode == 0
    path = out / files.CHECKPOINT
    whole = path.read_bytes()
    path.unlink()  # the history's hard link keeps the whole file
    path.write_bytes(whole[: len(whole) // 2])
    evaluated = run_main(*flags, "-e", "--resume", "auto")
    assert path.stat().st_size == len(whole) // 2, evaluated.stdout[-2000:]  # -e: untouched
    proc = run_main(*flags, "--resume", "auto")
    out_text = proc.stdout + proc.stderr
    assert proc.returncode == 0, out_text[-3000:]
    assert "checkpoint.pth.tar is truncated or damaged" in out_text, out_text[-3000:]
    assert re.search(r"resuming from \S+checkpoint_epoch002.pth.tar instead", out_text), \
        out_text[-3000:]
    assert re.search(r"replaced the damaged \S+checkpoint.pth.tar with a copy of "
                     r"\S+checkpoint_epoch002.pth.tar", out_text), out_text[-3000:]
    assert files.load_checkpoint(path)["epoch"] == 2  # whole again
    assert path.read_bytes() == whole
    again = run_main(*flags, "--resume", "auto")  # the folder's own checkpoint: finished
    said = again.stdout + again.stderr
    assert again.returncode == 0 and "has finished 2 of --epochs 2" in said, said[-3000:]
    assert "is truncated or damaged" not in said and "instead" not in said, said[-3000:]


def _record(folder: Path) -> dict[str, bytes]:
    """Every file of a run folder and its bytes (the lock's holder line and the index cache
    aside: each start rewrites them)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".run.lock" and "cache" not in p.parts}


@pytest.mark.slow
def test_resume_auto_never_continues_an_earlier_runs_checkpoint(image_folder, tmp_path):
    """Run A finished in OUTPUT_DIR; run B started fresh there (A went to previous/) and its
    checkpoint.pth.tar got a flipped bit - with model_best.pth.tar, the same file under a second
    name (a hard link). B has no intact checkpoint of its own (as after a mid-epoch save, before
    any epoch end), so the requeue stops: one line names the file and what to do, and the
    folder is left as it was. It used to resume A's checkpoint from previous/, copy it over B's,
    move B's record aside as an earlier run's and train on A's weights with A's epoch."""
    out = tmp_path / "out"
    flags = [str(image_folder), *TINY, "--seed", "0", "--output-dir", str(out)]
    for _ in ("A", "B"):
        assert run_main(*flags, "--epochs", "1").returncode == 0
    assert (out / files.CHECKPOINT).samefile(out / files.BEST)
    flip_a_bit_in_the_weights(out / files.CHECKPOINT)
    before = _record(out)
    proc = run_main(*flags, "--epochs", "2", "--resume", "auto")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 1, said[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, said[-3000:]
    assert errors[0].startswith(f"error: {out / files.CHECKPOINT} is damaged"), errors
    assert "--resume" in errors[0] and "previous" in errors[0], errors
    assert "resuming from" not in said and "Traceback" not in said, said[-3000:]
    assert _record(out) == before  # nothing moved aside, nothing replaced


def test_a_fallback_is_one_of_this_runs_own_checkpoints(tmp_path):
    """--resume auto's fall-back takes a checkpoint of OUTPUT_DIR itself that belongs to the run
    recorded there (config.json's run id): never previous/ (earlier runs), never a file in the
    folder that says it is another run's (a copy put back by hand), however new."""
    (tmp_path / "config.json").write_text(json.dumps({"run_id": "b"}))
    weights = {"w": torch.arange(100_000, dtype=torch.float32)}
    saved = [("checkpoint_epoch001.pth.tar", 1, "b"), (files.CHECKPOINT, 2, "b"),
             (files.BEST, 5, "a"), (f"previous/x/{files.CHECKPOINT}", 5, "a")]
    for age, (name, epoch, run) in enumerate(reversed(saved)):  # the earlier in the list, older
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        files.atomic_save({"epoch": epoch, "state_dict": weights, "run_id": run}, path)
        os.utime(path, (time.time() - 60 * age,) * 2)
    damaged = tmp_path / files.CHECKPOINT
    flip_a_bit_in_the_weights(damaged)
    used, ckpt = resume_from.load_decided(damaged, "auto", tmp_path)
    assert used == tmp_path / "checkpoint_epoch001.pth.tar" and ckpt["epoch"] == 1
    (tmp_path / "checkpoint_epoch001.pth.tar").unlink()
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(damaged))} is damaged.*no "
                                              "intact checkpoint to fall back to.*this run's"):
        resume_from.load_decided(damaged, "auto", tmp_path)
