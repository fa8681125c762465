"""The folder index (issue 31): a restart reads the data set's listing from a file instead of
listing every folder again; any change to the folders is noticed and listed again; a damaged or
foreign index is never used; the validation check, -e and every rank use it; a run resumed
through it is bitwise the uninterrupted run.

The oracle is torchvision's own ImageFolder scan of the same folder, as it is at that moment.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from chaos import Leg
from helpers import (
    SMALL_ARCH,
    TINY,
    child_env,
    fault_at,
    load_checkpoint,
    prestarted_cmd,
    run_main,
    settled_folder,
    write_image_folder,
)
from torchvision import datasets

import imagenet.data.index as index
from imagenet.cli import main
from imagenet.data.folder import IndexedFolder, build_data
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import Layout
from imagenet.settings.plan import cache_dir, fixed_plan


@pytest.fixture
def settled(monkeypatch):
    """Folder times trusted at once: the folders a test has just written are not 'too recent
    to trust' (a file system with nanosecond times, as the tests' own is)."""
    monkeypatch.setattr(index, "SETTLE_NS", 0)


def tricky_folder(root: Path) -> Path:
    """Classes with nested folders, upper-case and non-image extensions, a file at the root,
    an empty sub-folder and a class that is a symbolic link to another."""
    for name in ("b", "a", "c c", "Z"):
        for sub in ("", "sub", "sub/deeper", "empty"):
            (root / name / sub).mkdir(parents=True, exist_ok=True)
        for f in ("x.jpg", "Y.JPEG", "notes.txt", "p.png", "w.webp"):
            (root / name / f).write_bytes(b"x")
        (root / name / "sub" / "q.jpg").write_bytes(b"x")
        (root / name / "sub" / "deeper" / "r.jpeg").write_bytes(b"x")
    (root / "link").symlink_to(root / "a")
    (root / "readme.jpg").write_bytes(b"x")
    return root


def read(folder: Path, cache: Path) -> tuple[IndexedFolder, index.Listing]:
    """The dataset the trainer builds from ``folder`` with its index kept in ``cache``."""
    listing = index.folder_listing(folder, index.IndexFiles(cache))
    return IndexedFolder(str(folder), listing), listing


def same_as_torchvision(dataset: IndexedFolder, folder: Path) -> None:
    fresh = datasets.ImageFolder(str(folder))
    assert dataset.classes == fresh.classes
    assert dataset.class_to_idx == fresh.class_to_idx
    assert dataset.samples == fresh.samples
    assert dataset.targets == fresh.targets


def index_file(cache: Path) -> Path:
    (found,) = (cache / index.SUBFOLDER).glob("*.json.gz")
    return found


def test_the_listing_is_torchvisions_and_a_second_start_reads_it(tmp_path, settled):
    folder = tricky_folder(tmp_path / "data")
    first, listing = read(folder, tmp_path / "cache")
    assert listing.how == "listed"
    same_as_torchvision(first, folder)
    again, listing = read(folder, tmp_path / "cache")
    assert (listing.how, listing.changed, listing.new) == ("index", [], [])
    same_as_torchvision(again, folder)
    assert index.describe(listing) is None  # nothing to say when it is used as it is


def touch_all(folder: Path) -> None:
    """Change nothing but the times (a data set copied again, rsync -a)."""
    for path in [folder, *folder.rglob("*")]:
        os.utime(path, ns=(1_000_000_000, 1_000_000_000), follow_symlinks=False)


def add_file(folder: Path) -> None:
    (folder / "b" / "new.jpg").write_bytes(b"x")


def remove_file(folder: Path) -> None:
    (folder / "a" / "x.jpg").unlink()


def rename_file(folder: Path) -> None:
    (folder / "a" / "x.jpg").rename(folder / "a" / "x2.jpg")


def add_nested_file(folder: Path) -> None:
    (folder / "Z" / "sub" / "deeper" / "new.png").write_bytes(b"x")


def add_class(folder: Path) -> None:
    (folder / "d").mkdir()
    (folder / "d" / "only.jpg").write_bytes(b"x")


def remove_class(folder: Path) -> None:
    shutil.rmtree(folder / "c c")


def add_file_and_restore_the_time(folder: Path) -> None:
    """rsync -t / cp -p / tar x: the folder's modification time set back as it was."""
    st = (folder / "b").stat()
    (folder / "b" / "new.jpg").write_bytes(b"x")
    os.utime(folder / "b", ns=(st.st_atime_ns, st.st_mtime_ns))


def replace_class_by_a_copy(folder: Path) -> None:
    """The same names in a folder copied with its times (another inode)."""
    shutil.copytree(folder / "a", folder / "a.new", symlinks=True)
    (folder / "a.new" / "extra.jpg").write_bytes(b"x")
    shutil.copystat(folder / "a", folder / "a.new")
    shutil.rmtree(folder / "a")
    (folder / "a.new").rename(folder / "a")


@pytest.mark.parametrize("change", [add_file, remove_file, rename_file, add_nested_file,
                                    add_class, remove_class, add_file_and_restore_the_time,
                                    replace_class_by_a_copy])
def test_a_changed_folder_is_listed_again_and_said_so(tmp_path, settled, change, caplog):
    folder = tricky_folder(tmp_path / "data")
    read(folder, tmp_path / "cache")
    change(folder)
    dataset, listing = read(folder, tmp_path / "cache")
    same_as_torchvision(dataset, folder)
    assert listing.how == "updated"
    line = index.describe(listing)
    assert line is not None and "out of date" in line and str(folder) in line
    # The index was rewritten: the next start reads it whole again.
    dataset, listing = read(folder, tmp_path / "cache")
    assert listing.how == "index"
    same_as_torchvision(dataset, folder)


def test_only_the_changed_folders_are_listed_again(tmp_path, settled):
    folder = write_image_folder(tmp_path / "data", classes=4) / "train"
    read(folder, tmp_path / "cache")
    (folder / "class2" / "more.jpg").write_bytes((folder / "class2" / "img0.jpg").read_bytes())
    _, listing = read(folder, tmp_path / "cache")
    assert listing.changed == ["class2"] and listing.new == []


def test_a_touched_but_unchanged_data_set_is_listed_again(tmp_path, settled):
    """Times that changed are a change: the index does not judge contents."""
    folder = tricky_folder(tmp_path / "data")
    read(folder, tmp_path / "cache")
    touch_all(folder)
    dataset, listing = read(folder, tmp_path / "cache")
    assert listing.how == "updated"
    same_as_torchvision(dataset, folder)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:40])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def not_gzip(path: Path) -> None:
    path.write_text("hello")


def other_json(path: Path) -> None:
    with gzip.open(path, "wt") as f:
        json.dump({"format": "something else"}, f)


def other_version(path: Path) -> None:
    with gzip.open(path, "rt") as f:
        payload = json.load(f)
    payload["version"] = 999
    with gzip.open(path, "wt") as f:
        json.dump(payload, f)


def malformed_records(path: Path) -> None:
    with gzip.open(path, "rt") as f:
        payload = json.load(f)
    payload["folders"]["a"] = ["not", "a", "record"]
    with gzip.open(path, "wt") as f:
        json.dump(payload, f)


def another_folders_index(path: Path) -> None:
    with gzip.open(path, "rt") as f:
        payload = json.load(f)
    payload["root"] = "/somewhere/else"
    with gzip.open(path, "wt") as f:
        json.dump(payload, f)


@pytest.mark.parametrize("damage", [truncate, flip_a_byte, not_gzip, other_json, other_version,
                                    malformed_records, another_folders_index])
def test_a_damaged_index_is_never_used(tmp_path, settled, damage):
    folder = tricky_folder(tmp_path / "data")
    read(folder, tmp_path / "cache")
    damage(index_file(tmp_path / "cache"))
    remove_file(folder)  # a changed folder that a damaged index must not hide
    dataset, listing = read(folder, tmp_path / "cache")
    same_as_torchvision(dataset, folder)
    line = index.describe(listing)
    assert line is not None and "damaged or foreign" in line and "listed" in line
    _, listing = read(folder, tmp_path / "cache")  # written again, whole
    assert listing.how == "index"


def plant(path: Path, record: str, where: int, name: str) -> None:
    """Add ``name`` to a folder record's sub-folders (``where`` 1) or image files (2)."""
    with gzip.open(path, "rt") as f:
        payload = json.load(f)
    payload["folders"][record][where].append(name)
    with gzip.open(path, "wt") as f:
        json.dump(payload, f)


@pytest.mark.parametrize("where, name", [
    (2, "../../../outside.jpg"),  # an image outside the data folder
    (2, "../class1/img0.jpg"),  # another class's image, mislabelled
    (2, ""), (2, "img0.jpg\0.png"),
    (1, "../../../elsewhere"),  # a folder outside it, listed as a new one
    (1, ".."), (1, "."),  # the data folder or the class again: every image twice
])
def test_an_index_entry_that_is_no_name_in_its_folder_is_refused(tmp_path, settled, where,
                                                                   name):
    """No entry a folder lists holds a '/' or is '.', '..', empty or has a NUL: an index
    (it sits in the cache folder, anyone may have written it) that says so is not used."""
    folder = write_image_folder(tmp_path / "data", classes=2, train_per_class=2,
                                val_per_class=1) / "train"
    image = (folder / "class0" / "img0.jpg").read_bytes()
    (tmp_path / "outside.jpg").write_bytes(image)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "outside.jpg").write_bytes(image)
    read(folder, tmp_path / "cache")
    plant(index_file(tmp_path / "cache"), "class0", where, name)
    dataset, listing = read(folder, tmp_path / "cache")
    inside = [p for p, _ in dataset.samples
              if Path(os.path.realpath(p)).is_relative_to(folder.resolve())]
    assert [p for p, _ in dataset.samples] == inside, "the index led outside the data folder"
    same_as_torchvision(dataset, folder)
    line = index.describe(listing)
    assert line is not None and "damaged or foreign" in line and repr(name) in line, line
    _, listing = read(folder, tmp_path / "cache")  # written again from the folder's listing
    assert listing.how == "index"


def test_folders_written_just_before_the_listing_are_listed_again(tmp_path):
    """A file system with one- or two-second times could hide a file added in the same
    second as the listing: such folders are not taken from the index (and no line says so)."""
    folder = tricky_folder(tmp_path / "data")  # written this instant
    read(folder, tmp_path / "cache")
    dataset, listing = read(folder, tmp_path / "cache")
    assert listing.how == "updated" and listing.changed == [] and listing.new == []
    assert index.describe(listing) is None
    same_as_torchvision(dataset, folder)


def test_an_unwritable_cache_folder_warns_and_lists(tmp_path, settled, caplog):
    folder = tricky_folder(tmp_path / "data")
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder would be")
    with caplog.at_level(logging.WARNING):
        dataset, listing = read(folder, blocker)
    same_as_torchvision(dataset, folder)
    assert any("cannot write the folder index" in r.message for r in caplog.records)


def test_errors_are_torchvisions(tmp_path, settled):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="Couldn't find any class folder"):
        read(empty, tmp_path / "cache")
    folder = tricky_folder(tmp_path / "data")
    (folder / "nothing").mkdir()
    (folder / "nothing" / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes nothing"):
        read(folder, tmp_path / "cache")


def test_the_trainers_data_follows_a_data_set_changed_between_starts(tmp_path, settled):
    data = write_image_folder(tmp_path / "data")
    cfg = parse_config([str(data), *TINY, "--output-dir", str(tmp_path / "out")])
    files = index.IndexFiles(cache_dir(cfg))
    assert files.folder == tmp_path / "out" / "cache"

    def images() -> tuple[int, int]:
        built = build_data(fixed_plan(cfg, Layout(1, 8, 1, 0)), data, 0, 0, False, files)
        return built.train.images, built.val_size

    assert images() == (24, 9)
    for i in range(3):
        shutil.copy(data / "train" / "class1" / "img0.jpg", data / "train" / "class1" / f"{i}.jpg")
    (data / "val" / "class0" / "img0.jpg").unlink()
    assert images() == (27, 8)


def test_cache_dir_none_keeps_nothing(tmp_path):
    data = write_image_folder(tmp_path / "data")
    cfg = parse_config([str(data), "--cache-dir", "none", "--output-dir", str(tmp_path / "o")])
    assert cache_dir(cfg) is None
    build_data(fixed_plan(cfg, Layout(1, 8, 1, 0)), data, 0, 0, False,
               index.IndexFiles(cache_dir(cfg)))
    assert not (tmp_path / "o").exists()


def test_a_cache_dir_url_is_refused(capsys, tmp_path):
    assert main([str(tmp_path), "--cache-dir", "s3://bucket/cache"]) == 2
    assert "--cache-dir s3://bucket/cache: give a folder" in capsys.readouterr().err


@pytest.mark.slow
def test_an_image_damaged_in_place_is_still_caught_by_the_check(capsys, tmp_path, settled):
    """The index lists names; the validation check before training reads the files it lists:
    a file truncated under the same name (no folder changes) is still caught."""
    data = write_image_folder(tmp_path / "data")
    out = tmp_path / "out"
    flags = [str(data), *TINY, "--epochs", "1", "--output-dir", str(out)]
    assert main(flags) == 0
    capsys.readouterr()
    written = {p: p.stat().st_mtime_ns for p in (out / "cache" / index.SUBFOLDER).iterdir()}
    bad = data / "val" / "class1" / "img2.jpg"
    with open(bad, "r+b") as f:  # in place: the folder's entries and times stay
        f.truncate(100)
    assert main([*flags, "--epochs", "2", "--resume", "auto"]) == 1
    err = capsys.readouterr().err
    assert f"cannot read image {bad}" in err and "check of the validation images" in err
    # The listing came from the index (a listing would have rewritten it).
    assert {p: p.stat().st_mtime_ns for p in written} == written


# ---------------------------------------------------------------- main.py, requeued


def starts(out: Path) -> list[dict]:
    return json.loads((out / "config.json").read_text())["starts"]


@pytest.mark.slow
def test_a_requeued_run_reads_the_index_starts_loading_early_and_ends_bitwise(tmp_path):
    """An uninterrupted run, and the same run stopped by SIGTERM mid-epoch and requeued: the
    requeue reads the folder index, its loader workers fetch while the model is built and the
    checkpoint loads, and it ends with the uninterrupted run's weights, bit for bit."""
    # Settled, as a user's data set is: the first run's index must hold (6 steps of 8 an epoch).
    data = settled_folder(write_image_folder(tmp_path / "data", train_per_class=16))
    flags = [str(data), *TINY, "-j", "1", "-p", "1", "--seed", "0", "--epochs", "2",
             "--save-every", "2"]
    whole = tmp_path / "whole"
    proc = run_main(*flags, "--output-dir", str(whole))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    # SIGTERM to the whole group (as SLURM sends it) after step 3 of epoch 1: the run
    # finishes that step, saves it and exits.
    leg = Leg(prestarted_cmd(*flags, "--output-dir", str(out)), tmp_path / "leg1.txt",
              {"IMAGENET_FAILPOINTS": fault_at("train.step", 9, "sigterm(group)")})
    assert leg.wait() == 143, leg.output
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (1, 3), leg.output
    proc = run_main(*flags, "--output-dir", str(out), "--resume", "auto")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, requeued = starts(out)
    assert first["notes"]["data"] == "listed every folder"
    assert requeued["notes"]["data"] == "from the folder index"
    assert requeued["notes"]["training_batches"] == "loaded during the start"
    assert requeued["time_to_first_step_s"] > 0
    assert set(requeued["stages_s"]) == {"start", "data", "model", "resume", "checks",
                                         "first_step"}
    assert "=> first step " in proc.stdout and "(from the folder index)" in proc.stdout
    got, want = (load_checkpoint(o / "checkpoint.pth.tar") for o in (out, whole))
    for key, value in want["state_dict"].items():
        assert value.equal(got["state_dict"][key]), key
    assert got["optimizer"]["state"][0]["momentum_buffer"].equal(
        want["optimizer"]["state"][0]["momentum_buffer"])


@pytest.mark.slow
def test_every_rank_shares_the_index_and_another_rank_count_reads_it(tmp_path):
    """Two processes list the data set once per node (one index per folder), and a requeue
    with one process reads it; the validation check and every rank's loader agree."""
    data = settled_folder(write_image_folder(tmp_path / "data", train_per_class=8))
    out = tmp_path / "out"
    flags = [str(data), *TINY, "--epochs", "1", "--output-dir", str(out)]
    proc = run_main(*flags, "--multiprocessing-distributed", "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = sorted(p.name.split("-")[0] for p in (out / "cache" / index.SUBFOLDER).iterdir())
    assert written == ["train", "val"]
    proc = run_main(*flags, "--epochs", "2", "--resume", "auto", "-j", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [s["notes"]["data"] for s in starts(out)] == ["listed every folder",
                                                         "from the folder index"]


@pytest.mark.slow
def test_evaluate_reads_the_index_of_its_val_data(tmp_path):
    """-e --val-data: the folder index of that folder is written, read, and a damaged one is
    listed again with one line; the accuracy is the same each time."""
    data = write_image_folder(tmp_path / "data")
    train = tmp_path / "train"
    proc = run_main(str(data), *TINY, "--epochs", "1", "--output-dir", str(train))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "eval"
    evaluate = ["-a", SMALL_ARCH, "--val-resize-size", "36", "--val-crop-size", "32", "-b", "8",
                "-j", "0", "-e", "--resume", str(train / "checkpoint.pth.tar"),
                "--val-data", str(data / "val"), "--output-dir", str(out)]
    accuracies = []
    for damage in (False, False, True):
        if damage:
            (found,) = (out / "cache" / index.SUBFOLDER).glob("val-*.json.gz")
            truncate(found)
        proc = run_main(*evaluate)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        accuracies.append([ln for ln in proc.stdout.splitlines() if ln.startswith(" * Acc@1")])
        assert ("is damaged or foreign" in proc.stdout) == damage
    assert accuracies[0] == accuracies[1] == accuracies[2] and accuracies[0]
    assert len(list((out / "cache" / index.SUBFOLDER).glob("val-*.json.gz"))) == 1


@pytest.mark.slow
def test_a_requeue_after_images_were_added_says_so_and_trains_on_them(tmp_path):
    data = settled_folder(write_image_folder(tmp_path / "data"))  # else re-listed silently
    out = tmp_path / "out"
    flags = [str(data), *TINY, "--epochs", "1", "--output-dir", str(out)]
    proc = run_main(*flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for i in range(8):
        shutil.copy(data / "train" / "class0" / "img0.jpg", data / "train" / "class0" / f"{i}.jpg")
    env = child_env(IMAGENET_NOTICE_AFTER="0")  # the data stage's line with its counts
    proc = run_main(*flags, "--epochs", "2", "--resume", "auto", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the folder index of" in proc.stdout and "out of date" in proc.stdout
    assert "32 training images per epoch" in proc.stdout
    assert torch.load(out / "checkpoint.pth.tar", weights_only=True)["epoch"] == 2
