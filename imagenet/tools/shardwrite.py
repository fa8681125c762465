"""Write WebDataset tar shards and their ``_info.json`` (``prepare --format shards``).

``OUT/train-000000.tar ...`` and ``OUT/val-000000.tar ...``: each sample is ``CLASS/NAME.jpg``
(the original bytes; other formats keep their extension) and ``CLASS/NAME.cls`` (the label as
text), in an order drawn from ``--seed`` over the whole split, so every shard holds many
classes. ``_info.json`` has the layout of the published ImageNet shards (``splits.train`` and
``splits.validation`` with ``filenames``, ``shard_lengths``, ``num_samples``) plus ``classes``
(the class names, label order) and ``num_classes``.

The samples come from an ImageFolder or straight from the ILSVRC2012 archives (indexed once,
then read at their offsets: the archives must be the uncompressed .tar files, and the reads
follow the shuffled order, fast on SSDs, slow on spinning disks). Both give the same shards.
Idempotent and resumable like the rest of ``prepare``: the shards are a pure function of the
samples, the seed and the size limits, each is written to a ``.part`` name and renamed, and a
rerun keeps every shard already on disk with its planned size (a changed plan rewrites them).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from imagenet.errors import UsageError
from imagenet.tools.prepfiles import (
    PART_SUFFIX,
    Progress,
    atomic_write,
    claim_folder,
    is_image,
    read_own_json,
    train_archive_as_val,
    val_label,
)

log = logging.getLogger(__name__)

INFO = "_info.json"
PLAN_MARKER = ".imagenet-prepare-shards"  # the plan digest of each split written here
SPLIT_FILES = {"train": "train", "validation": "val"}  # split name -> shard file prefix


@dataclass(frozen=True, slots=True)  # ImageNet: 1.28 M of them
class Item:
    """One image to write: where its bytes are and what it becomes in a shard."""

    key: str  # CLASS/NAME: the member names without extension
    ext: str  # jpg, png, ...
    label: int
    size: int  # bytes
    path: str  # the image file, or the archive holding it
    offset: int = -1  # byte offset in the archive; -1 for a file of its own


@dataclass(frozen=True)
class Limits:
    """How the shards are cut and ordered."""

    seed: int
    max_bytes: int
    max_images: int | None


def item_key(class_name: str, file_name: str) -> tuple[str, str]:
    """(key, extension) of an image file: dots in the name would split the key (WebDataset)."""
    stem, _, ext = file_name.rpartition(".")
    ext = ext.lower()
    return f"{class_name}/{stem.replace('.', '_')}", "jpg" if ext == "jpeg" else ext


# ---- samples from an ImageFolder or the archives


def folder_items(root: Path) -> tuple[list[Item], list[str]]:
    """The images of an ImageFolder split in torchvision's order, and its class names."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    try:
        classes, class_to_idx = find_classes(str(root))
        samples = make_dataset(str(root), class_to_idx, extensions=IMG_EXTENSIONS)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise UsageError(f"{root}: {exc}") from None
    items = []
    for path, label in samples:
        key, ext = item_key(classes[label], Path(path).name)
        items.append(Item(key, ext, label, os.path.getsize(path), path))
    return items, classes


def open_indexable(path: Path, what: str) -> tarfile.TarFile:
    """An archive opened for random access (uncompressed tar only)."""
    try:
        return tarfile.open(path, mode="r:")
    except tarfile.TarError as exc:
        raise UsageError(f"{path}: not an uncompressed tar archive ({exc}); shards need "
                         f"{what} as downloaded (random access)") from None


def train_archive_items(path: Path) -> tuple[list[Item], list[str]]:
    """Index ILSVRC2012_img_train.tar (a tar of per-class tars): offsets of every image."""
    found: list[tuple[str, str, int, int]] = []  # wnid, file name, offset, size
    with open_indexable(path, "ILSVRC2012_img_train.tar") as outer:
        for member in outer:
            wnid = Path(member.name).name.removesuffix(".tar")
            if not (member.isfile() and member.name.endswith(".tar")):
                raise UsageError(f"{path}: member {member.name!r} is not a per-class tar; is "
                                 "this ILSVRC2012_img_train.tar?")
            with tarfile.open(fileobj=outer.extractfile(member), mode="r:") as inner:
                found += [(wnid, Path(m.name).name, member.offset_data + m.offset_data, m.size)
                          for m in inner if m.isfile() and is_image(m.name)]
    classes = sorted({wnid for wnid, *_ in found})
    return archive_items(path, found, classes), classes


def val_archive_items(path: Path, labels: dict[str, str], classes: Sequence[str]) -> list[Item]:
    """Index ILSVRC2012_img_val.tar with ``labels`` (image stem -> wnid)."""
    found = []
    with open_indexable(path, "ILSVRC2012_img_val.tar") as archive:
        for member in archive:
            name = Path(member.name).name
            if member.isfile() and name.endswith(".tar"):
                raise train_archive_as_val(path, name)
            if not (member.isfile() and is_image(name)):
                continue
            found.append((val_label(labels, name, path), name, member.offset_data,
                          member.size))
    if not found:
        raise UsageError(f"{path} holds no images; is this ILSVRC2012_img_val.tar?")
    return archive_items(path, found, classes)


def archive_items(path: Path, found: list[tuple[str, str, int, int]],
                  classes: Sequence[str]) -> list[Item]:
    """Items in ImageFolder order (class, then file name): as if the archive were extracted."""
    index = {c: i for i, c in enumerate(classes)}
    unknown = sorted({wnid for wnid, *_ in found} - set(index))
    if unknown:
        raise UsageError(f"{path}: class {unknown[0]} is not among the training classes")
    found = sorted(found, key=lambda f: (index[f[0]], f[1]))
    return [Item(*item_key(wnid, name), index[wnid], size, str(path), offset)
            for wnid, name, offset, size in found]


# ---- planning and writing


def plan_shards(items: Sequence[Item], limits: Limits) -> list[list[Item]]:
    """The shards of a split: items in seeded random order, cut at the size limits."""
    shards: list[list[Item]] = [[]]
    size = 0
    for i in np.random.default_rng(limits.seed).permutation(len(items)).tolist():
        cost = 2048 + items[i].size  # two headers and the label, roughly
        full = size + cost > limits.max_bytes or len(shards[-1]) == limits.max_images
        if shards[-1] and full:
            shards.append([])
            size = 0
        shards[-1].append(items[i])
        size += cost
    return shards if shards[0] else []


def members(item: Item, data: bytes) -> list[tuple[tarfile.TarInfo, bytes]]:
    """The tar members of one sample, with deterministic headers."""
    out = []
    for ext, payload in ((item.ext, data), ("cls", str(item.label).encode())):
        info = tarfile.TarInfo(f"{item.key}.{ext}")
        info.size, info.mode, info.mtime = len(payload), 0o444, 0
        out.append((info, payload))
    return out


def shard_bytes(items: Sequence[Item]) -> int:
    """The exact size of the shard ``write_shard`` makes of ``items``."""
    total = 2 * tarfile.BLOCKSIZE  # end-of-archive blocks
    for item in items:
        for info, payload in members(item, b"\0" * item.size):
            header = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
            total += len(header) + -(-len(payload) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    return -(-total // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


class ImageBytes:
    """Reads items' bytes; keeps archives open between reads."""

    def __init__(self) -> None:
        self.files: dict[str, int] = {}

    def __call__(self, item: Item) -> bytes:
        if item.offset < 0:
            data = Path(item.path).read_bytes()
        else:
            if item.path not in self.files:
                self.files[item.path] = os.open(item.path, os.O_RDONLY)
            data = os.pread(self.files[item.path], item.size, item.offset)
        if len(data) != item.size:
            raise OSError(f"{item.path}: read {len(data)} of {item.size} bytes of {item.key}; "
                          "is the file truncated?")
        return data

    def close(self) -> None:
        for fd in self.files.values():
            os.close(fd)


def write_shard(path: Path, items: Sequence[Item], read: ImageBytes) -> None:
    """One shard, through a temporary name."""
    tmp = path.with_name(path.name + PART_SUFFIX)
    with open(tmp, "wb") as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for item in items:
                for info, payload in members(item, read(item)):
                    tar.addfile(info, io.BytesIO(payload))
    os.replace(tmp, path)


def plan_digest(shards: Sequence[Sequence[Item]]) -> str:
    """A fingerprint of what every shard of a split holds."""
    h = hashlib.sha256()
    for shard in shards:
        h.update(repr([(i.key, i.ext, i.label, i.size) for i in shard]).encode())
        h.update(b"|")
    return h.hexdigest()


def write_split(out: Path, split: str, items: list[Item], limits: Limits,
                log_every: int) -> dict:
    """Write (or finish) the shards of one split; returns its ``_info.json`` entry."""
    prefix = SPLIT_FILES[split]
    shards = plan_shards(items, limits)
    names = [f"{prefix}-{i:06d}.tar" for i in range(len(shards))]
    keep = adopt_plan(out, split, plan_digest(shards))
    for stale in out.glob(f"{prefix}-*.tar*"):  # a .part, another plan, or past the new end
        if not keep or stale.name not in names:
            stale.unlink()
    progress, read = Progress(split, log_every), ImageBytes()
    try:
        for name, shard in zip(names, shards):
            path, nbytes = out / name, sum(item.size for item in shard)
            done = path.is_file() and path.stat().st_size == shard_bytes(shard)
            if not done:
                write_shard(path, shard, read)
            progress.add(len(shard), 0 if done else len(shard), nbytes, note=f" ({name})")
    finally:
        read.close()
    progress.log(note=f" in {len(shards)} shards")
    return {"name": split, "filenames": names, "shard_lengths": [len(s) for s in shards],
            "num_samples": len(items)}


def adopt_plan(out: Path, split: str, digest: str) -> bool:
    """Record the plan of ``split``; False if shards of another plan must be rewritten."""
    marker = out / PLAN_MARKER
    try:
        plans = json.loads(marker.read_text()) if marker.is_file() else {}
    except (ValueError, UnicodeDecodeError):
        plans = None
    if not isinstance(plans, dict):  # a record of our own: rewriting the shards is safe
        log.warning("%s is damaged: writing the %s shards again", marker, split)
        plans = {}
    if plans.get(split) == digest:
        return True
    if split in plans:
        log.warning("%s: the images, --seed or shard size changed since the shards in %s were "
                    "written: writing them again", split, out)
    plans[split] = digest
    atomic_write(marker, json.dumps(plans, indent=1) + "\n")
    return False


def read_info(out: Path) -> dict:
    """OUT/_info.json as an earlier run wrote it (a new one if there is none); a damaged one is
    refused before any shard is written."""
    path = out / INFO
    if not path.is_file():
        return {"name": out.name, "splits": {}}
    fix = ("delete it and run this command again with every split it should list (finished "
           "shards are kept, not written again)")
    info = read_own_json(path, fix)
    if not isinstance(info, dict) or not isinstance(info.get("splits"), dict):
        raise UsageError(f"{path} is damaged (it holds no 'splits'); {fix}")
    return info


def update_info(out: Path, split: str, entry: dict, classes: list[str]) -> None:
    """Add or replace ``split`` in ``_info.json`` (untouched when nothing changed)."""
    path, info = out / INFO, read_info(out)
    if info.get("classes", classes) != classes:
        raise UsageError(f"{path} lists other classes than this {split} split has; use another "
                         "--out for a different data set")
    info["splits"][split] = entry
    info["num_classes"], info["classes"] = len(classes), classes
    text = json.dumps(info, indent=1) + "\n"
    if not path.is_file() or path.read_text() != text:
        atomic_write(path, text)


# ---- the two ways in from the command line


def limits_of(args: argparse.Namespace) -> Limits:
    """The shard limits from prepare's flags."""
    return Limits(args.seed, int(args.shard_size * 1e6), args.shard_max_images)


def shards_from_folder(args: argparse.Namespace) -> int:
    """``prepare --from-folder DIR``: shards of DIR/train and DIR/val."""
    root = args.from_folder
    if args.out.resolve().is_relative_to(root.resolve()):
        raise UsageError(f"--out {args.out} is inside --from-folder {root}: the shards would "
                         f"become part of the data set they are made of; give an --out outside "
                         f"{root}")
    train, classes = folder_items(root / "train")
    val, val_classes = folder_items(root / "val")
    if val_classes != classes:
        raise UsageError(f"{root}: val/ classes differ from train/ classes; labels would be "
                         "wrong")
    claim_folder(args.out)
    read_info(args.out)
    for split, items in (("train", train), ("validation", val)):
        entry = write_split(args.out, split, items, limits_of(args), args.log_every)
        update_info(args.out, split, entry, classes)
    return 0


def shards_from_archives(args: argparse.Namespace, labels: dict[str, str] | None) -> int:
    """``prepare --format shards`` with the ILSVRC2012 archives."""
    classes, splits = None, []
    if args.train_tar is not None:
        train, classes = train_archive_items(args.train_tar)
        splits.append(("train", train, args.expect_train))
    if args.val_tar is not None and labels is not None:
        classes = classes or sorted(set(labels.values()))
        splits.append(("validation", val_archive_items(args.val_tar, labels, classes),
                       args.expect_val))
    assert classes is not None
    claim_folder(args.out)
    read_info(args.out)
    ok = True
    for split, items, expected in splits:
        entry = write_split(args.out, split, items, limits_of(args), args.log_every)
        update_info(args.out, split, entry, classes)
        if len(items) != expected:
            log.warning("WARNING: %s: %d images, expected %d (difference %+d)", split,
                        len(items), expected, len(items) - expected)
            ok = False
    return 1 if args.strict and not ok else 0
