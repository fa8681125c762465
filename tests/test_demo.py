"""The built-in demo data set: layout, real JPEGs, determinism, idempotence, safety, concurrency."""

from __future__ import annotations

import json
import multiprocessing as mp
import re
from pathlib import Path

import pytest
from PIL import Image
from torchvision import datasets

from imagenet.tools.demo import DEMO_CLASSES, MARKER, make_demo_dataset

SMALL = {"train_per_class": 3, "val_per_class": 2, "image_size": 32}


def _files(root: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every image under ROOT."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.jpg"))}


def _mtimes(root: Path) -> dict[str, int]:
    """Relative path -> mtime (ns) of everything under ROOT, including ROOT itself."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in [root, *root.rglob("*")]}


def _generate(root: str, queue) -> None:
    """Child process: generate the small set and report how it went."""
    try:
        make_demo_dataset(Path(root), **SMALL)
        queue.put("ok")
    except Exception as exc:  # reported to the parent, which fails the test with it
        queue.put(repr(exc))


def test_layout_counts_and_marker(tmp_path: Path):
    root = make_demo_dataset(tmp_path / "demo", **SMALL)
    assert root == tmp_path / "demo"
    for split, n in (("train", 3), ("val", 2)):
        assert sorted(p.name for p in (root / split).iterdir()) == sorted(DEMO_CLASSES)
        for name in DEMO_CLASSES:
            assert len(list((root / split / name).glob("*.jpg"))) == n
    params = json.loads((root / MARKER).read_text())
    assert {k: params[k] for k in SMALL} == SMALL
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".demo-")]  # no temp left


def test_images_are_real_jpegs_for_pil_and_image_folder(tmp_path: Path):
    root = make_demo_dataset(tmp_path / "demo", **SMALL)
    for path in root.rglob("*.jpg"):
        with Image.open(path) as img:
            assert (img.format, img.mode, img.size) == ("JPEG", "RGB", (32, 32))
    train = datasets.ImageFolder(str(root / "train"))
    val = datasets.ImageFolder(str(root / "val"))
    assert train.classes == val.classes == sorted(DEMO_CLASSES)
    assert (len(train), len(val)) == (30, 20)
    img, label = val[5]
    assert img.size == (32, 32) and val.classes[label] == val.classes[5 // 2]


def test_deterministic_and_seed_dependent(tmp_path: Path):
    a = _files(make_demo_dataset(tmp_path / "a", **SMALL))
    b = _files(make_demo_dataset(tmp_path / "b", **SMALL))
    c = _files(make_demo_dataset(tmp_path / "c", **SMALL, seed=1))
    assert a == b
    assert a.keys() == c.keys() and a != c


def test_second_call_is_a_no_op(tmp_path: Path):
    root = make_demo_dataset(tmp_path / "demo", **SMALL)
    before = _mtimes(root)
    assert make_demo_dataset(root, **SMALL) == root
    assert _mtimes(root) == before


def test_different_parameters_regenerate(tmp_path: Path):
    root = make_demo_dataset(tmp_path / "demo", **SMALL)
    make_demo_dataset(root, **{**SMALL, "train_per_class": 4})
    assert len(list((root / "train" / DEMO_CLASSES[0]).glob("*.jpg"))) == 4
    assert json.loads((root / MARKER).read_text())["train_per_class"] == 4
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == ["demo"]


def test_damaged_marker_counts_as_stale(tmp_path: Path):
    root = make_demo_dataset(tmp_path / "demo", **SMALL)
    (root / MARKER).write_text("{not json")
    make_demo_dataset(root, **SMALL)
    assert json.loads((root / MARKER).read_text())["image_size"] == 32


def test_refuses_a_foreign_folder(tmp_path: Path):
    root = tmp_path / "mine"
    (root / "train").mkdir(parents=True)
    (root / "notes.txt").write_text("precious")
    with pytest.raises(ValueError, match=re.escape(str(root))):
        make_demo_dataset(root, **SMALL)
    assert (root / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt", "train"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mine-")]


def test_refuses_a_file_and_fills_an_empty_folder(tmp_path: Path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "file"))):
        make_demo_dataset(tmp_path / "file", **SMALL)
    (tmp_path / "empty").mkdir()
    make_demo_dataset(tmp_path / "empty", **SMALL)
    assert (tmp_path / "empty" / MARKER).is_file()


@pytest.mark.slow
def test_concurrent_calls_make_one_complete_set(tmp_path: Path):
    root = tmp_path / "demo"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_generate, args=(str(root), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert results == ["ok", "ok"]
    assert [p.exitcode for p in procs] == [0, 0]
    assert _files(root) == _files(make_demo_dataset(tmp_path / "reference", **SMALL))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".demo-")]
    assert leftovers == []


@pytest.mark.slow
def test_the_demo_run_learns(tmp_path: Path):
    """main.py --demo with its own defaults, shortened to 3 epochs: far above chance (10%)."""
    from helpers import run_main

    out = tmp_path / "out"
    proc = run_main("--demo", "--epochs", "3", "--seed", "0", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["val_count"] for r in records] == [200] * 3  # 10 classes x 20 val images
    assert records[-1]["val_acc1"] > 25, records  # 43% measured; chance is 10%
    assert records[-1]["train_loss"] < records[0]["train_loss"]
    assert (out / "demo-data" / MARKER).is_file()
    # Its first lines say what the demo changes (only flags not given: --epochs 3 was).
    first = proc.stdout.splitlines()[:2]
    assert first[0] == (f"=> --demo: training on the built-in demo data in {out / 'demo-data'} "
                        "(drawn once, no download)")
    assert "--opt adamw --lr 0.002 --wd 0.01 --lr-scheduler cosine" in first[1]
    assert "--train-crop-size 40" in first[1] and "--epochs" not in first[1]
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["data"] == str(out / "demo-data") and config["demo"]
