"""Parquet as users hand it over: an image folder that happens to hold a .parquet file, a
--val-data folder with several splits, rows without bytes or labels, unlabeled test splits,
class names that are not folder names, a data set at a URL, a missing Hub client.

The files are written here with pyarrow as the ``datasets`` library lays them out (an ``Image``
struct of bytes and path, a ``ClassLabel`` integer, the class names in the ``huggingface``
schema metadata), from real JPEGs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import ROOT, TINY, child_env, run_main, write_image_folder

from imagenet.data.shards.parquet import resolve_parquet
from imagenet.errors import DataError
from imagenet.settings.images import data_format

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
CLASSES = ["cat", "dog", "eel"]
EVAL = ["-a", "shufflenet_v2_x0_5", "--val-resize-size", "36", "--val-crop-size", "32",
        "-b", "8", "-j", "0", "-e"]


def write_split(path: Path, rows: list[tuple[bytes | None, int | None]], classes=CLASSES,
                row_group: int = 4, statistics: bool = True) -> Path:
    """One Parquet file of (image bytes, label) rows, as ``datasets`` writes it."""
    features = {"image": {"_type": "Image"}, "label": {"names": classes, "_type": "ClassLabel"}}
    schema = pa.schema([("image", IMAGE), ("label", pa.int64())],
                       metadata={b"huggingface": json.dumps({"info": {"features": features}})})
    images = pa.array([{"bytes": b, "path": f"{i}.jpg"} for i, (b, _) in enumerate(rows)], IMAGE)
    labels = pa.array([label for _, label in rows], pa.int64())
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table([images, labels], schema=schema), path, row_group_size=row_group,
                   write_statistics=statistics)
    return path


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory) -> list[bytes]:
    folder = write_image_folder(tmp_path_factory.mktemp("jpg"), train_per_class=4,
                                val_per_class=0)
    return [p.read_bytes() for p in sorted((folder / "train").rglob("*.jpg"))]


def rows_of(jpegs: list[bytes], n: int) -> list[tuple[bytes, int]]:
    return [(jpegs[i % len(jpegs)], i % len(CLASSES)) for i in range(n)]


def hub(root: Path, jpegs: list[bytes], train: int = 24, val: int = 9, val_split="validation",
        **kw) -> Path:
    """A Hub-layout set: data/train-*.parquet (two files) and data/<val_split>-*.parquet."""
    rows = rows_of(jpegs, train)
    write_split(root / "data" / "train-00000-of-00002.parquet", rows[:train // 2])
    write_split(root / "data" / "train-00001-of-00002.parquet", rows[train // 2:])
    write_split(root / "data" / f"{val_split}-00000-of-00001.parquet", rows_of(jpegs, val), **kw)
    return root


# ---- 1. which format a folder is


def test_an_image_folder_that_holds_a_parquet_file_is_read_as_the_folder(tmp_path, jpegs):
    """A captions.parquet beside train/ and val/ (a regression: refused as "no training split
    in the Hub's layout"). The Hub's own folder-per-split layout stays Parquet."""
    imf = write_image_folder(tmp_path / "imf", train_per_class=2, val_per_class=2)
    pq.write_table(pa.table({"caption": ["a", "b"]}), imf / "captions.parquet")
    write_split(imf / "extra" / "data" / "train-00000-of-00001.parquet", rows_of(jpegs, 3))
    assert data_format(str(imf), "auto") == "folder"
    converted = tmp_path / "converted"  # the Hub's refs/convert/parquet branch: train/0000.parquet
    write_split(converted / "train" / "0000.parquet", rows_of(jpegs, 6))
    write_split(converted / "val" / "0000.parquet", rows_of(jpegs, 3))
    assert data_format(str(converted), "auto") == "parquet"
    assert resolve_parquet(str(converted), None).val.total == 3

    proc = run_main(str(imf), *EVAL, "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert " * Acc@1" in proc.stdout and "Parquet" not in proc.stdout + proc.stderr


# ---- 2. --val-data on a folder of several splits


def test_val_data_on_a_hub_folder_validates_its_validation_split_only(tmp_path, jpegs):
    """24 training + 9 validation rows gave "33 validation images" before."""
    data = hub(tmp_path / "a", jpegs)
    other = hub(tmp_path / "b", jpegs, train=20, val=7, val_split="test")
    assert resolve_parquet(str(data), str(other)).val.total == 7  # b's test split, not its train
    assert resolve_parquet(str(data), str(data)).val.total == 9
    # a folder of files with no split in their names: all of them
    plain = tmp_path / "plain"
    write_split(plain / "part-0.parquet", rows_of(jpegs, 5))
    write_split(plain / "part-1.parquet", rows_of(jpegs, 4))
    assert resolve_parquet(str(data), str(plain)).val.total == 9
    only_train = tmp_path / "c"
    write_split(only_train / "data" / "train-00000-of-00001.parquet", rows_of(jpegs, 5))
    with pytest.raises(Exception, match=r"--val-data .*c holds only training files"):
        resolve_parquet(str(data), str(only_train))


# ---- 3. every row a run reads, checked before the first step


def test_a_validation_row_without_image_bytes_stops_the_run_before_the_first_step(tmp_path,
                                                                                 jpegs):
    """docs/your-own-data.md's promise: one line naming the file, before training (it came
    after a whole training epoch)."""
    rows = rows_of(jpegs, 9)
    rows[6] = (None, 0)
    data = hub(tmp_path / "d", jpegs, train=48)
    bad = write_split(data / "data" / "validation-00000-of-00001.parquet", rows)
    proc = run_main(str(data), *TINY, "--epochs", "1", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(bad) in errors[0] and "no image bytes" in errors[0], \
        proc.stderr
    assert "Traceback" not in proc.stderr and "Epoch: [0]" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("statistics", [True, False], ids=["footer", "no-statistics"])
@pytest.mark.parametrize("split,label,found", [
    ("train", -1, "label -1 (unlabeled)"),
    ("train", 3, "label 3, but the data set has 3 classes"),
    ("train", None, "no label"),
    ("test", -1, "label -1 (unlabeled)"),  # the Hub's test splits are often unlabeled
])
def test_rows_without_a_usable_label_are_named_before_training(tmp_path, jpegs, statistics,
                                                               split, label, found):
    data = hub(tmp_path / "e", jpegs, val_split="test")
    rows = rows_of(jpegs, 12)
    rows[9] = (rows[9][0], label)
    name = "train-00001-of-00002" if split == "train" else "test-00000-of-00001"
    bad = write_split(data / "data" / f"{name}.parquet", rows, statistics=statistics)
    with pytest.raises(DataError) as caught:
        resolve_parquet(str(data), None)
    message = str(caught.value)
    assert message.startswith(f"Parquet file {bad} (split {split})"), message
    assert found in message and "\n" not in message


def test_rows_without_bytes_in_a_file_without_statistics_are_named(tmp_path, jpegs):
    data = hub(tmp_path / "f", jpegs)
    rows = rows_of(jpegs, 12)
    rows[11] = (None, 1)
    bad = write_split(data / "data" / "train-00000-of-00002.parquet", rows, statistics=False)
    with pytest.raises(DataError, match=f"^Parquet file {bad} \\(split train\\).* no image "
                                        "bytes"):
        resolve_parquet(str(data), None)


# ---- 4, 5. prepare --from-parquet: unlabeled rows, labels past the classes, odd class names


def prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "imagenet.tools.prepare", *args],
                          capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=120)


@pytest.mark.slow
def test_prepare_skips_unlabeled_rows_and_refuses_a_label_past_the_classes(tmp_path, jpegs,
                                                                           capsys):
    from imagenet.tools import prepare as tool

    data = hub(tmp_path / "g", jpegs, val_split="test")
    rows = rows_of(jpegs, 9)
    for i in (1, 4, 5):
        rows[i] = (rows[i][0], -1)
    write_split(data / "data" / "test-00000-of-00001.parquet", rows)
    assert tool.main(["--from-parquet", str(data), "--out", str(tmp_path / "out")]) == 0
    assert "3 unlabeled rows (label -1) of split val not written" in capsys.readouterr().out
    written = sorted((tmp_path / "out" / "val").rglob("*.jpg"))
    assert len(written) == 6 and len(list((tmp_path / "out" / "train").rglob("*.jpg"))) == 24
    labels = {p.name: p.parent.name for p in written}
    assert labels == {f"{i:08d}.jpg": CLASSES[i % 3] for i in (0, 2, 3, 6, 7, 8)}

    rows[4] = (rows[4][0], 7)
    bad = write_split(data / "data" / "test-00000-of-00001.parquet", rows)
    proc = prepare("--from-parquet", str(data), "--out", str(tmp_path / "out2"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: Parquet file {bad} (split test): row 4 has label 7, but the data set has 3 "
        "classes (cat ... eel): fix its labels or the ClassLabel names in its metadata"], \
        proc.stderr


@pytest.mark.parametrize("names", [["..", ".", "ok"], ["a/b", "", "x" * 300], ["..", "..x", "/"]])
def test_prepare_writes_every_image_inside_out_whatever_the_class_names(tmp_path, jpegs, names):
    from imagenet.tools import prepare as tool

    data = tmp_path / "h"
    write_split(data / "data" / "train-00000-of-00001.parquet", rows_of(jpegs, 9), names)
    write_split(data / "data" / "validation-00000-of-00001.parquet", rows_of(jpegs, 6), names)
    out = tmp_path / "sub" / "out"
    assert tool.main(["--from-parquet", str(data), "--out", str(out)]) == 0
    everything = [p for p in tmp_path.rglob("*.jpg")]
    assert all(p.is_relative_to(out) for p in everything), everything
    for split, n in (("train", 9), ("val", 6)):
        files = [p for p in (out / split).rglob("*.jpg")]
        assert len(files) == n  # no image lost, none taken for another split's
        folders = sorted({p.parent for p in files})
        assert len(folders) == 3 and all(f.parent == out / split for f in folders), folders


# ---- 6, 7. a data set at a URL; the Hub's client missing


def test_a_parquet_set_at_a_url_is_found_and_leaves_no_staging_folder(tmp_path, jpegs):
    """``local://`` stands for any fsspec URL (s3://, gs://): it was taken for tar shards and
    asked for an _info.json; the --predictions URL's staging folder stayed in $TMPDIR."""
    data = hub(tmp_path / "i", jpegs)
    temp = tmp_path / "tmp"
    temp.mkdir()
    preds = f"local://{tmp_path}/preds/predictions.csv"
    proc = run_main(f"local://{data}", *EVAL, "--predictions", preds, "--output-dir",
                    str(tmp_path / "run"), env=child_env(TMPDIR=str(temp)))
    assert proc.returncode == 0, proc.stderr
    assert "=> parquet: 24 training images in 2 Parquet files" in proc.stdout, proc.stdout
    assert len((tmp_path / "preds" / "predictions.csv").read_text().splitlines()) == 10
    staging = temp / f"imagenet-trainer-{os.geteuid()}"
    assert [p.name for p in staging.iterdir()] == [], list(staging.iterdir())


def test_a_shard_url_without_info_names_the_parquet_format(tmp_path):
    from imagenet.data.shards.sources import resolve

    (tmp_path / "empty").mkdir()
    with pytest.raises(Exception, match="--data-format parquet"):
        resolve(f"local://{tmp_path}/empty", None, None)


HF_MISSING = """
import sys
sys.modules["huggingface_hub"] = None  # as if not installed
from imagenet.cli import main
sys.exit(main(["hf://datasets/owner/name", "-e", "--output-dir", sys.argv[1]]))
"""


@pytest.mark.slow
def test_hf_urls_without_the_hub_client_name_the_parquet_extra(tmp_path):
    proc = subprocess.run([sys.executable, "-c", HF_MISSING, str(tmp_path / "run")],
                          capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "imagenet-trainer[parquet]" in errors[0], proc.stderr
    assert "[cloud]" not in errors[0]


def test_val_data_help_names_parquet():
    from imagenet.settings.flags import get_args_parser

    action = next(a for a in get_args_parser()._actions if "--val-data" in a.option_strings)
    assert "Parquet" in action.help and "validation split" in action.help, action.help


def test_a_resume_download_from_a_url_leaves_no_staging_folder(tmp_path, monkeypatch):
    """The --resume file of another URL than --output-dir is downloaded into a folder of its
    own under $TMPDIR; release() took the file and left the folder, one per run."""
    from imagenet.checkpoint.storage import Remote
    from imagenet.settings.plan import Staging, staging_dir, staging_root

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    (tmp_path / "tmp").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "checkpoint.pth.tar").write_bytes(b"weights")
    url = f"local://{tmp_path}/other/checkpoint.pth.tar"
    staging_root().mkdir(mode=0o700)
    local = staging_dir(url, True) / "checkpoint.pth.tar"
    remote = Remote.of(Staging(None, None, url, local))
    remote.attach(continuing=False, training=False)
    assert local.read_bytes() == b"weights"
    remote.push()
    remote.release()
    assert list(staging_root().iterdir()) == []
    assert (tmp_path / "other" / "checkpoint.pth.tar").read_bytes() == b"weights"


def test_rows_stored_in_class_order_are_named_from_the_footer(tmp_path, jpegs):
    """The reader mixes a batch from 16 places of the split: rows sorted by class still give
    batches of few classes where a set has many. The footer's label statistics tell it (a row
    group of one class), and rank 0 says so before training; shuffled rows say nothing."""
    shuffled = resolve_parquet(str(hub(tmp_path / "s", jpegs)), None)
    assert shuffled.notes == ()
    data = hub(tmp_path / "o", jpegs)
    for i in range(2):
        rows = sorted(rows_of(jpegs, 12), key=lambda r: r[1])
        write_split(data / "data" / f"train-0000{i}-of-00002.parquet", rows)
    (note,) = resolve_parquet(str(data), None).notes
    assert note.startswith(f"100% of the training row groups in {data} hold one class alone")
    assert "shuffle the rows once before writing them" in note
