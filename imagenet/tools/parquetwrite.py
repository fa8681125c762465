"""``prepare`` and Hugging Face Parquet, both ways.

- ``--from-folder DIR --format parquet``: an ImageFolder as the Hub holds a data set
  (``OUT/data/train-00000-of-0000N.parquet``, ``OUT/data/validation-...``), the columns and the
  ``huggingface`` schema metadata the ``datasets`` library writes (an ``Image`` struct of
  ``bytes`` and ``path``, a ``ClassLabel`` with the class names), so ``datasets.load_dataset``,
  ``push_to_hub``-style uploads and this trainer all read it. The training images in a seeded
  random order (as the shards'), cut at ``--shard-size`` / ``--shard-max-images``; row groups of
  ``ROW_GROUP`` rows (the ``datasets`` default for images).
- ``--from-parquet DIR``: a Parquet data set (the Hub's layout, local or any fsspec URL) as an
  ImageFolder, ``OUT/train/<class>/`` and ``OUT/val/<class>/``: for tools that read class
  folders. (This trainer reads the Parquet files themselves: ``--data-format parquet``.)

Every file goes through a temporary name; a rerun rewrites what is missing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from pathlib import Path

from imagenet.data.shards.parquet import ParquetReader, pyarrow_parquet, resolve_parquet
from imagenet.errors import UsageError
from imagenet.tools.prepfiles import PART_SUFFIX, Progress, claim_folder
from imagenet.tools.shardwrite import (
    ImageBytes,
    Item,
    folder_items,
    limits_of,
    plan_shards,
)

log = logging.getLogger(__name__)

ROW_GROUP = 100  # rows per row group (datasets' writer batch size for image features)
MAX_NAME = 200  # bytes of a class folder's name (file systems allow 255)


def hub_metadata(classes: list[str]) -> dict[bytes, bytes]:
    """The schema metadata ``datasets`` writes for an Image column and a ClassLabel."""
    features = {"image": {"_type": "Image"}, "label": {"names": classes, "_type": "ClassLabel"}}
    return {b"huggingface": json.dumps({"info": {"features": features}}).encode()}


def write_parquet(path: Path, items: list[Item], classes: list[str], read: ImageBytes) -> None:
    """One Parquet file of ``items`` (through a temporary name)."""
    import pyarrow as pa

    pq = pyarrow_parquet()
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("image", image), ("label", pa.int64())], metadata=hub_metadata(classes))
    tmp = path.with_name(path.name + PART_SUFFIX)
    with pq.ParquetWriter(tmp, schema) as writer:
        for start in range(0, len(items), ROW_GROUP):
            rows = items[start:start + ROW_GROUP]
            images = pa.array([{"bytes": read(i), "path": Path(i.path).name} for i in rows],
                              type=image)
            writer.write_table(pa.table([images, pa.array([i.label for i in rows], pa.int64())],
                                        schema=schema), row_group_size=ROW_GROUP)
    os.replace(tmp, path)


def parquet_from_folder(args: argparse.Namespace) -> int:
    """``prepare --from-folder DIR --format parquet``."""
    root, out = args.from_folder, args.out
    train, classes = folder_items(root / "train")
    val, val_classes = folder_items(root / "val")
    if val_classes != classes:
        raise UsageError(f"{root}: val/ classes differ from train/ classes; labels would be "
                         "wrong")
    claim_folder(out)
    (out / "data").mkdir(exist_ok=True)
    read = ImageBytes()
    for split, items in (("train", train), ("validation", val)):
        parts = plan_shards(items, limits_of(args))  # the shards' files: a file mixes classes
        names = [f"{split}-{i:05d}-of-{len(parts):05d}.parquet" for i in range(len(parts))]
        for stale in (out / "data").glob(f"{split}-*"):
            if stale.name not in names:
                stale.unlink()
        progress = Progress(split, args.log_every)
        for name, part in zip(names, parts):
            path = out / "data" / name
            if not path.is_file():
                write_parquet(path, part, classes, read)
            progress.add(len(part), len(part), sum(i.size for i in part), note=f" ({name})")
        progress.log(note=f" in {len(parts)} Parquet files")
    read.close()
    return 0


def folder_names(classes: list[str]) -> list[str]:
    """A folder name for each class that stays inside its split's folder: unsafe characters
    become ``_``, a name of dots alone (``..``), an empty one or a hidden one (``.x``) is
    prefixed ``class<i>_``, a long one cut to fit a file name (with its index)."""
    names = []
    for i, name in enumerate(classes):
        safe = re.sub(r"[^\w.-]+", "_", name)
        if not safe.strip(".") or safe.startswith("."):
            safe = f"class{i}_{safe}".rstrip("_")
        if len(safe.encode()) > MAX_NAME:
            safe = f"{safe.encode()[:MAX_NAME - 12].decode(errors='ignore')}-class{i}"
        names.append(safe)
    return names


def folder_from_parquet(args: argparse.Namespace) -> int:
    """``prepare --from-parquet DIR``: OUT/train/<class>/ and OUT/val/<class>/. Rows labeled -1
    (the Hub's unlabeled rows) are not written, and counted."""
    shards = resolve_parquet(str(args.from_parquet), None, unlabeled=True)
    safe = folder_names(shards.classes)
    if len(set(safe)) != len(safe):
        raise UsageError(f"{args.from_parquet}: two class names give one folder name; the "
                         "folders would mix them")
    for split, files in (("train", shards.train), ("val", shards.val)):
        out = args.out / split
        claim_folder(out)
        progress, row, unlabeled = Progress(split, args.log_every), 0, 0
        for url in files.urls:
            reader = ParquetReader(url)
            while (sample := reader.next()) is not None:
                row += 1
                if sample["cls"] == -1:  # resolve_parquet let no other label outside 0..N-1
                    unlabeled += 1
                    continue
                ext = next(k for k in sample if not k.startswith("_") and k != "cls")
                folder = out / safe[sample["cls"]]
                folder.mkdir(exist_ok=True)
                path = folder / f"{row - 1:08d}.{ext}"  # row numbers: file names may repeat
                if not path.is_file():
                    tmp = path.with_name(path.name + PART_SUFFIX)
                    tmp.write_bytes(sample[ext])
                    os.replace(tmp, path)
                progress.add(1, 1, len(sample[ext]))
        progress.log(note=f" from {len(files.urls)} Parquet files")
        if unlabeled:
            log.warning("%d unlabeled rows (label -1) of split %s not written: an ImageFolder "
                        "has no class for them", unlabeled, split)
    return 0
