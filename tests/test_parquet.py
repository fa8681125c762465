"""--data-format parquet: Hugging Face image datasets in the Hub's Parquet layout.

The files are written by the ``datasets`` library itself from a real JPEG folder (its
``imagefolder`` builder names the classes, ``embed_table_storage`` puts the image bytes in the
rows, as ``push_to_hub`` does): the training split in three files of unequal row counts and
small row groups, validation in two. Read through the trainer's own batch sampler and reader.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import (
    TINY,
    device_images_match,
    device_path_trains_the_same,
    run_main,
    write_image_folder,
)
from torch.utils.data import DataLoader

import imagenet.data.transforms as T
from imagenet.data.shards.parquet import resolve_parquet
from imagenet.data.shards.reader import ShardBatchSampler, ShardSamples
from imagenet.data.shards.sources import ShardList
from imagenet.data.shards.tarreader import ShardError
from imagenet.errors import DataError
from imagenet.settings.images import data_format

TRAIN_FILES = (0, 7, 16, 36)  # row ranges of the three training files: 7, 9 and 20 rows
VAL_FILES = (0, 5, 12)


def hub_parquet(images: Path, out: Path, row_group: int = 4) -> Path:
    """``images`` (train/, val/) as the Hub holds a data set: data/<split>-0000i-of-0000n."""
    import datasets
    from datasets.table import embed_table_storage

    loaded = datasets.load_dataset("imagefolder", data_dir=str(images))
    for split, cuts in (("train", TRAIN_FILES), ("validation", VAL_FILES)):
        embedded = loaded[split].with_format("arrow").map(embed_table_storage, batched=True)
        n = len(cuts) - 1
        for i in range(n):
            part = embedded.select(range(cuts[i], cuts[i + 1]))
            part.to_parquet(str(out / "data" / f"{split}-{i:05d}-of-{n:05d}.parquet"),
                            batch_size=row_group)
    return out


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("img"), train_per_class=12,
                              val_per_class=4)


@pytest.fixture(scope="module")
def hub(images, tmp_path_factory) -> Path:
    return hub_parquet(images, tmp_path_factory.mktemp("hub"))


def file_sha(path: str) -> str:
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()


def read_all(shards, *, world: int, rank: int, train: bool, batch: int = 4, epoch: int = 0,
             first: int = 0) -> list[list[tuple[str, int, str]]]:
    """Every batch a rank reads: (key, label, sha1 of the encoded image) per sample."""
    sampler = ShardBatchSampler(shards, world_size=world, rank=rank, batch_size=batch,
                                shuffle=train, seed=3, aug_seed=5)
    sampler.set_position(epoch, first)
    samples = ShardSamples(T.val_transform(18, 16), "tensor", 3, train=False, keys=True)
    out = []
    for items in sampler:
        out.append([(raw["__key__"], samples._label(raw),
                     hashlib.sha1(raw[next(k for k in raw if k in ("jpg", "png"))]).hexdigest())
                    for _, _, _, raw in items])
    # the loader's own path (workers decode what the sampler read)
    loader = DataLoader(samples, batch_sampler=sampler, num_workers=0)
    sampler.set_position(epoch, first)
    assert sum(len(b[1]) for b in loader) == sum(len(b) for b in out)
    return out


def test_the_hubs_layout_is_found_counted_and_named(hub, images):
    assert data_format(str(hub), "auto") == "parquet"
    shards = resolve_parquet(str(hub), None)
    assert shards.classes == ["class0", "class1", "class2"]  # the ClassLabel's names
    assert shards.train.counts == (7, 9, 20) and shards.val.counts == (5, 7)
    assert [Path(u).name for u in shards.val.urls] == ["validation-00000-of-00002.parquet",
                                                        "validation-00001-of-00002.parquet"]
    assert pq.ParquetFile(shards.train.urls[2]).metadata.num_row_groups == 5  # streamed by 4s


@pytest.mark.parametrize("world", [1, 2, 3])
def test_validation_reads_every_image_once_at_any_world_size(hub, images, world):
    shards = resolve_parquet(str(hub), None)
    seen = [s for rank in range(world)
            for b in read_all(shards.val, world=world, rank=rank, train=False) for s in b]
    originals = sorted(file_sha(str(p)) for p in (images / "val").rglob("*.jpg"))
    assert sorted(sha for _, _, sha in seen) == originals  # each image once, its own bytes
    by_sha = {file_sha(str(p)): int(p.parent.name[-1]) for p in (images / "val").rglob("*.jpg")}
    assert all(label == by_sha[sha] for _, label, sha in seen)  # the folder's class


def test_the_epoch_order_is_the_seeds_whatever_the_world_size_and_resumes_mid_epoch(hub):
    shards = resolve_parquet(str(hub), None).train
    # 36 rows, global batches of 8: 4 steps, the same 32 images trained (and 4 left out) by
    # one process or two, each once.
    one = [s for b in read_all(shards, world=1, rank=0, train=True, batch=8) for s in b]
    two = [s for rank in range(2) for b in read_all(shards, world=2, rank=rank, train=True,
                                                    batch=4) for s in b]
    assert len(one) == len(two) == len(set(two)) == 32 and sorted(one) == sorted(two)
    again = [s for b in read_all(shards, world=1, rank=0, train=True, batch=8) for s in b]
    later = [s for b in read_all(shards, world=1, rank=0, train=True, batch=8, epoch=1)
             for s in b]
    assert again == one and later != one  # fixed by (seed, epoch)
    # Resumed at the 5th batch: the same batches as the uninterrupted epoch's rest (each
    # stream starts inside a row group of another file: the rows before are passed over).
    whole = read_all(shards, world=2, rank=1, train=True, batch=2)
    assert read_all(shards, world=2, rank=1, train=True, batch=2, first=5) == whole[5:]


def test_a_cut_file_a_file_without_classes_and_disagreeing_splits_are_named(hub, tmp_path):
    import shutil

    broken = tmp_path / "cut"
    shutil.copytree(hub, broken)
    victim = broken / "data" / "train-00001-of-00003.parquet"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(ShardError, match=f"^Parquet file {victim} cannot be read .*cut short"):
        resolve_parquet(str(broken), None)

    plain = tmp_path / "plain"
    shutil.copytree(hub, plain)
    victim = plain / "data" / "validation-00001-of-00002.parquet"
    table = pq.read_table(victim)
    pq.write_table(table.replace_schema_metadata(None), victim)
    with pytest.raises(DataError, match=f"^Parquet file {victim} has no Hugging Face features"):
        resolve_parquet(str(plain), None)

    other = tmp_path / "other"
    shutil.copytree(hub, other)
    for victim in sorted((other / "data").glob("validation-*.parquet")):
        table = pq.read_table(victim)
        meta = json.loads(table.schema.metadata[b"huggingface"])
        meta["info"]["features"]["label"]["names"] = ["a", "b", "c"]
        pq.write_table(table.replace_schema_metadata(
            {b"huggingface": json.dumps(meta).encode()}), victim)
    first_val = other / "data" / "validation-00000-of-00002.parquet"
    with pytest.raises(DataError, match=f"^Parquet file {first_val} lists other class names"):
        resolve_parquet(str(other), None)


def test_rows_whose_images_are_paths_not_bytes_are_named(hub, tmp_path):
    """``Dataset.to_parquet`` without embedding keeps only the images' paths."""
    out = tmp_path / "paths" / "data"
    out.mkdir(parents=True)
    for src in (hub / "data").glob("*.parquet"):
        table = pq.read_table(src)
        images = table.column("image").combine_chunks()
        no_bytes = pa.StructArray.from_arrays(
            [pa.nulls(len(images), pa.binary()), images.field("path")], ["bytes", "path"])
        pq.write_table(table.set_column(0, "image", no_bytes), out / src.name)
    with pytest.raises(DataError, match=r"train-00000-of-00003.parquet \(split train\): row 0 "
                                        "has no image bytes"):
        resolve_parquet(str(out.parent), None)  # by the footer's null counts, before reading
    files = sorted(str(p) for p in out.glob("validation-*"))  # the reader's own check
    with pytest.raises(ShardError, match="has no image bytes"):
        read_all(ShardList(tuple(files), (5, 7)), world=1, rank=0, train=False)


def test_the_device_path_gives_the_cpu_path_s_images_from_parquet(hub):
    """--decode-on-device on Parquet rows: every training image of two epochs and every
    validation image equals the CPU path's (helpers.device_images_match)."""
    assert device_images_match(resolve_parquet(str(hub), None)) == (64, 12)


@pytest.mark.slow
def test_main_trains_the_same_weights_with_the_device_path_on_parquet(hub, tmp_path):
    """Seeded runs on Parquet rows through the CPU path and the device path end with the same
    weights (helpers.device_path_trains_the_same)."""
    device_path_trains_the_same(hub, tmp_path, *TINY)


@pytest.mark.slow
def test_main_trains_and_evaluates_on_hub_parquet(hub, tmp_path):
    proc = run_main(str(hub), *TINY, "--epochs", "1", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert ("=> parquet: 36 training images in 3 Parquet files, 4 batches of 8 per process "
            "and epoch (4 left out each epoch, different ones); 12 validation images in 2 "
            "Parquet files") in proc.stdout, proc.stdout
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["epoch"] == 0 and "val_acc1" in record
    evaluated = run_main(str(hub), *TINY, "-e", "--resume", str(tmp_path / "run" /
                                                                  "checkpoint.pth.tar"),
                         "--output-dir", str(tmp_path / "eval"))
    assert evaluated.returncode == 0, evaluated.stderr
    assert f"Acc@1 {record['val_acc1']:.3f}" in evaluated.stdout, evaluated.stdout


def test_prepare_writes_hub_parquet_of_a_folder_and_a_folder_of_hub_parquet(images, hub,
                                                                           tmp_path):
    """Folder -> Parquet that ``datasets`` itself reads with the class names; Hub Parquet ->
    a folder holding each image's own bytes under its class."""
    import datasets

    from imagenet.tools import prepare

    out = tmp_path / "published"
    assert prepare.main(["--from-folder", str(images), "--format", "parquet", "--out", str(out),
                         "--shard-max-images", "15"]) == 0
    assert sorted(p.name for p in (out / "data").iterdir()) == [
        "train-00000-of-00003.parquet", "train-00001-of-00003.parquet",
        "train-00002-of-00003.parquet", "validation-00000-of-00001.parquet"]
    loaded = datasets.load_dataset("parquet", data_dir=str(out / "data"))
    assert loaded["train"].features["label"].names == ["class0", "class1", "class2"]
    assert len(loaded["train"]) == 36 and len(loaded["validation"]) == 12
    row = loaded["validation"][0]
    assert row["image"].size[1] == 40 and row["label"] in (0, 1, 2)  # decoded by datasets (PIL)
    first = sorted((images / "train").rglob("*.jpg"))
    trained = resolve_parquet(str(out), None)
    assert trained.train.counts == (15, 15, 6) and trained.classes == ["class0", "class1",
                                                                        "class2"]
    by_sha = {file_sha(str(p)): p.parent.name for p in first}
    rows = [s for b in read_all(trained.train, world=1, rank=0, train=True, batch=4) for s in b]
    assert sorted(sha for _, _, sha in rows) == sorted(by_sha)  # every image, its own bytes
    assert [r[1] for r in rows] != sorted(r[1] for r in rows)  # the files mix the classes

    folder = tmp_path / "folder"
    assert prepare.main(["--from-parquet", str(hub), "--out", str(folder)]) == 0
    for split, src in (("train", "train"), ("val", "val")):
        got = {file_sha(str(p)): p.parent.name for p in (folder / split).rglob("*.jpg")}
        want = {file_sha(str(p)): p.parent.name for p in (images / src).rglob("*.jpg")}
        assert got == want
    assert prepare.main(["--from-parquet", str(hub), "--out", str(folder)]) == 0  # a rerun
