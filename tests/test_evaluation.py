"""The per-image and per-class results (imagenet.reporting.results, imagenet.evaluation.validate) in
one process, and the bad input of --finetune, --predictions and -e --val-data: one line naming the
flag or file.

The multi-process runs that produce these files are in test_finetune.py.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import torchvision
from helpers import TINY18, write_image_folder
from torch import nn

from imagenet.cli import main
from imagenet.errors import RunError
from imagenet.evaluation.validate import FlipTTA
from imagenet.reporting import results as reports


def test_confusion_matrix_and_per_class_rows():
    target = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    pred = torch.tensor([0, 0, 1, 1, 1, 1, 0, 2])
    confusion = reports.confusion_matrix(target, pred, 4)
    assert confusion.tolist() == [[2, 2, 0, 0], [0, 2, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]]
    rows = reports.per_class(confusion, ["cat", "dog", "fox", "owl"], [40, 30, 20, 10])
    assert [(r["class"], r["train_images"], r["val_images"], r["correct"], r["acc1"],
             r["most_confused_with"]) for r in rows] == [
        ("cat", 40, 4, 2, 50.0, "dog"), ("dog", 30, 2, 2, 100.0, None),
        ("fox", 20, 2, 1, 50.0, "cat"), ("owl", 10, 0, 0, None, None)]
    assert reports.mean_class_acc1(rows) == pytest.approx(200 / 3)
    assert reports.worst_classes(rows) == (
        "cat 50.0% (2/4; 40 training; most often taken for dog), "
        "fox 50.0% (1/2; 20 training; most often taken for cat)")


def test_confusion_image_rows_scale_from_white_to_blue():
    image = reports.confusion_image(torch.tensor([[3, 1], [0, 0]]))
    cell = 32  # the largest cell: few classes
    assert image.shape == (3, 2 * cell, 2 * cell) and image.dtype == torch.uint8
    pixel = image[:, 0, 0].tolist()  # 3 of 4 images: three quarters of the way to blue
    assert pixel == [round(255 + 0.75 * (c - 255)) for c in reports.FULL_RGB]
    assert image[:, cell, 0].tolist() == list(reports.ABSENT_RGB)  # a class without images


def test_merge_puts_ranks_in_dataset_order_and_refuses_a_duplicate():
    def rows(ids):
        n = len(ids)
        return {"ids": torch.tensor(ids), "target": torch.tensor(ids) % 2,
                "top": torch.zeros(n, 2, dtype=torch.long), "prob": torch.ones(n, 2)}

    merged = reports.merge([rows([0, 2, 4]), rows([1, 3])], 5)
    assert merged.ids.tolist() == [0, 1, 2, 3, 4] and merged.target.tolist() == [0, 1, 0, 1, 0]
    with pytest.raises(RunError, match="cover 4 distinct images in 5 rows"):
        reports.merge([rows([0, 2, 4]), rows([1, 2])], 5)


def test_flip_tta_returns_the_log_of_the_mean_probabilities():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 5))
    x = torch.randn(2, 3, 8, 8)
    mean = (model(x).softmax(1) + model(x.flip(3)).softmax(1)) / 2
    out = FlipTTA(model)(x)
    assert torch.allclose(out.exp(), mean, atol=1e-6)
    # Cross-entropy of the output is that of the mean probabilities.
    target = torch.tensor([1, 3])
    assert nn.functional.cross_entropy(out, target).item() == pytest.approx(
        -mean[[0, 1], target].log().mean().item(), rel=1e-5)
    assert math.isclose(out.logsumexp(1)[0].item(), 0.0, abs_tol=1e-6)


# ---------------------------------------------------------------- bad input

def _error(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, lines
    return code, lines[0]


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    path = tmp_path / "best.pth.tar"
    torch.save({"state_dict": torchvision.models.resnet18(num_classes=3).state_dict(),
                "arch": "resnet18", "classes": ["class0", "class1", "class2"]}, path)
    return path


def test_eval_folder_with_a_class_the_checkpoint_does_not_know(capsys, tmp_path, checkpoint):
    data = write_image_folder(tmp_path / "d", classes=3, train_per_class=1, val_per_class=1)
    (data / "val" / "class1").rename(data / "val" / "zebra")
    code, line = _error(capsys, *TINY18, "-e", "--resume", str(checkpoint), "--val-data",
                        str(data / "val"), "--output-dir", str(tmp_path / "o"))
    assert code == 1 and "class folder(s) zebra are not among the model's 3 classes" in line


def test_eval_folder_needs_a_checkpoint_and_a_folder(capsys, tmp_path, checkpoint):
    code, line = _error(capsys, *TINY18, "-e", "--val-data", str(tmp_path),
                        "--output-dir", str(tmp_path / "o"))
    assert code == 2 and "give --resume PATH" in line
    code, line = _error(capsys, *TINY18, "-e", "--resume", str(checkpoint), "--val-data",
                        str(tmp_path / "nope"), "--output-dir", str(tmp_path / "o"))
    assert code == 2 and "--val-data" in line and "no such folder" in line


def test_eval_folder_of_one_image_evaluates_it(capsys, tmp_path, checkpoint):
    """Nothing trains under -e: no training-set size can refuse it."""
    from PIL import Image

    (tmp_path / "one" / "class2").mkdir(parents=True)
    Image.new("RGB", (40, 40), (200, 30, 30)).save(tmp_path / "one" / "class2" / "a.jpg")
    code = main([*TINY18, "-e", "--resume", str(checkpoint), "--val-data", str(tmp_path / "one"),
                 "--output-dir", str(tmp_path / "o"), "--log-to", "none"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "(1 images)" in captured.out
    assert (tmp_path / "o" / "per_class.json").is_file()


@pytest.mark.slow
def test_eval_of_shards_ignores_what_only_training_needs(capsys, tmp_path, checkpoint):
    """-e on tar shards whose training split is smaller than a batch, with a recipe's
    --ra-reps: neither stops an evaluation."""
    from test_shards import prepare_shards

    write_image_folder(tmp_path / "d", classes=3, train_per_class=1, val_per_class=2)
    proc = prepare_shards(tmp_path / "d", tmp_path / "shards")
    assert proc.returncode == 0, proc.stderr
    code = main([str(tmp_path / "shards"), *TINY18, "-b", "16", "--ra-reps", "4", "-e",
                 "--resume", str(checkpoint), "--output-dir", str(tmp_path / "o"),
                 "--log-to", "none"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "(6 images)" in captured.out


def test_predictions_path_is_checked_before_any_work(capsys, tmp_path, checkpoint):
    code, line = _error(capsys, str(tmp_path), *TINY18, "-e", "--resume", str(checkpoint),
                        "--predictions", str(tmp_path))
    assert code == 2 and "--predictions" in line and "is a folder" in line


def test_finetune_errors_name_the_file_and_the_keys(capsys, tmp_path, checkpoint):
    data = write_image_folder(tmp_path / "d", classes=2, train_per_class=2, val_per_class=1)
    args = [str(data), *TINY18, "--output-dir", str(tmp_path / "o"), "--finetune"]
    code, line = _error(capsys, *args, str(tmp_path / "nope.pth"))
    assert code == 2 and "--finetune: no file at" in line
    code, line = _error(capsys, *args, str(checkpoint), "-a", "resnet34")
    assert code == 1 and "was saved for -a resnet18, but this run uses -a resnet34" in line
    plain = tmp_path / "r34.pth"  # a plain state dict of another architecture
    torch.save(torchvision.models.resnet34(num_classes=2).state_dict(), plain)
    code, line = _error(capsys, *args, str(plain))
    assert code == 1 and "missing none; unexpected layer1.2.conv1.weight, " in line
    code, line = _error(capsys, *args, str(checkpoint), "--pretrained")
    assert code == 2 and "--finetune PATH and --pretrained/--weights" in line


@pytest.mark.slow
def test_eval_folder_of_a_checkpoint_without_class_names_takes_sorted_folders(tmp_path,
                                                                             capsys):
    """The classic script's checkpoints name no classes: label i is the i-th folder."""
    torch.manual_seed(0)
    path = tmp_path / "classic.pth.tar"
    model = torchvision.models.resnet18(num_classes=2)
    torch.save({"epoch": 1, "arch": "resnet18", "best_acc1": torch.tensor(1.0),
                "state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}, path)
    data = write_image_folder(tmp_path / "d", classes=2, train_per_class=1, val_per_class=2)
    shutil.rmtree(data / "train")
    code = main([*TINY18, "-e", "--resume", str(path), "--val-data", str(data / "val"),
                 "--output-dir", str(tmp_path / "o"), "--predictions", str(tmp_path / "p.csv")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "names no classes: label i is the i-th class folder" in out
    assert f"on the images of {data / 'val'}: 4 images, 2 classes" in out  # not "imagenet"
    header, *rows = (tmp_path / "p.csv").read_text().splitlines()
    assert header == "path,target,pred,confidence,top5,top5_confidence" and len(rows) == 4


def test_shard_predictions_know_which_sample_each_row_is(tmp_path):
    """Tar shards: the ids ``sample_ids`` gives a rank's rows are the samples its validation
    batches hold, in order, every sample once over the ranks; names are SHARD#N."""
    from torch.utils.data import DataLoader

    from imagenet.data.shards import resolve
    from imagenet.data.shards.reader import ShardBatchSampler, ShardSamples
    from imagenet.evaluation.validate import sample_ids, sample_names
    from imagenet.tools import prepare

    write_image_folder(tmp_path / "folder", classes=3, train_per_class=2, val_per_class=3)
    assert prepare.main(["--from-folder", str(tmp_path / "folder"), "--out",
                         str(tmp_path / "shards"), "--shard-max-images", "4"]) == 0
    val = resolve(str(tmp_path / "shards"), None, None).val
    assert len(val.counts) == 3  # 9 images: 4 + 4 + 1
    every = []
    for rank in range(2):
        sampler = ShardBatchSampler(val, world_size=2, rank=rank, batch_size=2, shuffle=False,
                                    streams=1)
        loader = DataLoader(ShardSamples(lambda x: x, "tensor", 3, False),
                            batch_sampler=sampler)
        read = [(item[2], item[3]["__url__"], item[3]["__key__"]) for batch in sampler
                for item in batch]
        assert [i for i, _, _ in read] == sample_ids(loader)
        names = sample_names(loader)
        assert [names(i).split("#")[0] for i, _, _ in read] == [url for _, url, _ in read]
        every += read
    assert sorted(i for i, _, _ in every) == list(range(9))
    first = {url: min(i for i, u, _ in every if u == url) for _, url, _ in every}
    assert all(names(i) == f"{url}#{i - first[url]}" for i, url, _ in every)


def test_eval_resume_auto_without_a_checkpoint_is_refused(capsys, tmp_path):
    """-e --resume auto in a folder with no checkpoint: one line, not an untrained model's
    numbers."""
    data = write_image_folder(tmp_path / "d", classes=2, train_per_class=2, val_per_class=1)
    code, line = _error(capsys, str(data), *TINY18, "-e", "--resume", "auto", "--output-dir",
                        str(tmp_path / "empty"), "--log-to", "none")
    assert code == 2 and "-e --resume auto: no checkpoint in" in line, line
