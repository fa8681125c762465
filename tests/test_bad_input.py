"""Bad input: one clear message naming the flag or file, exit code 2 (usage) or 1 (runtime)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import TINY18, run_main, write_image_folder

from imagenet.cli import main


def _main(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    return code, err


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("argv, code, words", [
    (["-b", "0"], 2, "-b/--batch-size must be positive"),
    (["--lr", "-1"], 2, "--lr must not be negative"),
    (["--epochs", "2", "--start-epoch", "4"], 2, "--epochs (2) is smaller than --start-epoch"),
    (["-a", "resnet1"], 2, "unknown architecture 'resnet1'"),
])
def test_usage_errors(capsys, tmp_path, argv, code, words):
    rc, err = _main(capsys, str(tmp_path), *argv)
    assert rc == code
    assert words in _one_error_line(err)


def test_missing_data_folder(capsys, tmp_path):
    rc, err = _main(capsys, str(tmp_path / "nope"), *TINY18, "--output-dir", str(tmp_path))
    assert rc == 2 and "nope' does not exist" in _one_error_line(err)
    assert "--demo" in err


@pytest.mark.parametrize("missing", ["train", "val"])
def test_missing_split(capsys, image_folder, tmp_path, missing):
    shutil.rmtree(image_folder / missing)
    rc, err = _main(capsys, str(image_folder), *TINY18, "--output-dir", str(tmp_path / "o"))
    assert rc == 2 and f"{missing}' is missing" in _one_error_line(err)


def test_class_folder_without_images(capsys, image_folder, tmp_path):
    (image_folder / "train" / "empty").mkdir()
    rc, err = _main(capsys, str(image_folder), *TINY18, "--output-dir", str(tmp_path / "o"))
    assert rc == 1 and "empty" in _one_error_line(err)


def test_val_classes_differ(capsys, image_folder, tmp_path):
    (image_folder / "val" / "class2").rename(image_folder / "val" / "other")
    rc, err = _main(capsys, str(image_folder), *TINY18, "--output-dir", str(tmp_path / "o"))
    line = _one_error_line(err)
    assert rc == 1 and "val/ classes differ" in line and "other" in line


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["0", "2"])
def test_truncated_image_is_named_without_a_worker_traceback(tmp_path, workers):
    data = write_image_folder(tmp_path / "data", classes=2, train_per_class=4, val_per_class=2)
    bad = data / "train" / "class1" / "img2.jpg"
    bad.write_bytes(bad.read_bytes()[:200])
    proc = run_main(str(data), *TINY18, "-j", workers, "--epochs", "1",
                    "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 1
    line = _one_error_line(proc.stderr)
    assert str(bad) in line
    assert not (tmp_path / "o" / "checkpoint.pth.tar").exists()


def test_resume_file_missing_is_an_error_not_a_fresh_start(capsys, image_folder, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "checkpoint.pth.tar").write_bytes(b"precious")
    rc, err = _main(capsys, str(image_folder), *TINY18, "--resume", str(tmp_path / "typo.pth"),
                    "--output-dir", str(out))
    assert rc == 2 and "--resume: no checkpoint at" in _one_error_line(err)
    assert (out / "checkpoint.pth.tar").read_bytes() == b"precious"
    # Decided once, before anything is built: the data set was not even listed.
    assert not (out / "cache").exists()


def _resume_error(capsys, data: Path, tmp_path: Path, ckpt: Path, *extra: str) -> str:
    rc, err = _main(capsys, str(data), *TINY18, *extra, "--resume", str(ckpt),
                    "--output-dir", str(tmp_path / "o"))
    assert rc == 1
    return _one_error_line(err)


@pytest.mark.slow
def test_resume_refuses_bad_checkpoints(capsys, image_folder, tmp_path):
    import torchvision

    good = tmp_path / "good.pth.tar"
    torch.save({"epoch": 1, "arch": "resnet18",
                "state_dict": torchvision.models.resnet18(num_classes=3).state_dict()}, good)
    truncated = tmp_path / "truncated.pth.tar"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert "truncated" in _resume_error(capsys, image_folder, tmp_path, truncated)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert "not a checkpoint" in _resume_error(capsys, image_folder, tmp_path, text)
    line = _resume_error(capsys, image_folder, tmp_path, good, "-a", "resnet34")
    assert "saved for -a resnet18" in line and "resnet34" in line
    other = tmp_path / "noarch.pth.tar"
    torch.save({"state_dict": torchvision.models.resnet34(num_classes=3).state_dict()}, other)
    line = _resume_error(capsys, image_folder, tmp_path, other)
    assert "missing keys" in line or "unexpected keys" in line
    classes = tmp_path / "classes.pth.tar"
    torch.save({"arch": "resnet18",
                "state_dict": torchvision.models.resnet18(num_classes=5).state_dict()}, classes)
    line = _resume_error(capsys, image_folder, tmp_path, classes)
    assert "fc.weight" in line and "5 classes" in line and "has 3" in line


@pytest.mark.slow
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(image_folder, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "checkpoint.pth.tar").write_bytes(b"last good")
    proc = run_main(str(image_folder), *TINY18, "--lr", "1e30", "--epochs", "1",
                    "--output-dir", str(out))
    assert proc.returncode == 1
    line = _one_error_line(proc.stderr)
    assert "NaN/infinite at epoch 0, step" in line
    assert line.endswith("no checkpoint had been saved yet")
    # A fresh run: the earlier run's file was moved aside first, untouched.
    (kept,) = (out / "previous").glob("*/checkpoint.pth.tar")
    assert kept.read_bytes() == b"last good"


@pytest.mark.slow
def test_debug_shows_the_traceback(image_folder, tmp_path):
    proc = run_main(str(tmp_path / "missing"), *TINY18, "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


# ---------------------------------------------------------------- crops too small for -a

CROPS_32 = ["--train-crop-size", "32", "--val-resize-size", "36", "--val-crop-size", "32"]


@pytest.mark.slow
def test_crops_too_small_for_the_architecture_name_its_size(capsys, tmp_path):
    """Found from the model on the meta device before the data folder is even looked at (it
    does not exist here) and before --multiprocessing-distributed starts any process."""
    spawn = ["--multiprocessing-distributed", "--nproc-per-node", "2"]
    rc, err = _main(capsys, str(tmp_path / "no-data"), "-a", "alexnet", *CROPS_32, *spawn)
    assert rc == 2 and _one_error_line(err) == (
        "error: --train-crop-size 32 and --val-crop-size 32: too small for -a alexnet, which "
        "needs crops of at least 63 px; give --train-crop-size 63 and --val-crop-size 63 or "
        "more")
    rc, err = _main(capsys, str(tmp_path / "no-data"), "-a", "inception_v3", "-e", *CROPS_32)
    assert rc == 2 and "--val-crop-size 32: too small for -a inception_v3, which needs crops " \
        "of at least 75 px" in _one_error_line(err)
    for size in ("32", "256"):
        rc, err = _main(capsys, str(tmp_path / "no-data"), "-a", "vit_b_16",
                        "--train-crop-size", size, "--val-crop-size", "224")
        assert rc == 2 and _one_error_line(err) == (
            f"error: --train-crop-size {size}: -a vit_b_16 takes crops of exactly 224 px (the "
            "size it is built for); give --train-crop-size 224 and --val-crop-size 224")


def test_the_minimum_found_on_the_meta_device_is_the_real_one():
    import torchvision

    from imagenet.training.models import check_crop_sizes

    model = torchvision.models.alexnet(num_classes=3).eval()
    with torch.no_grad():
        model(torch.zeros(1, 3, 63, 63))  # the minimum named above runs for real
        with pytest.raises(RuntimeError, match="too small"):
            model(torch.zeros(1, 3, 62, 62))
    for arch, size in (("alexnet", "63"), ("resnet18", "32"), ("vit_b_16", "224")):
        check_crop_sizes(arch, {"--train-crop-size": int(size),
                                "--val-crop-size": int(size)})  # accepted: no error
