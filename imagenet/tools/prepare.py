"""Turn the ILSVRC2012 archives into the ImageFolder layout ``OUT/{train,val}/<wnid>/*.JPEG``,
or into WebDataset tar shards (``--format shards``, from the archives or ``--from-folder``);
an ImageFolder to Hugging Face Parquet and back (``imagenet.tools.parquetwrite``).

Offline, streaming (each archive is read once, nothing is extracted twice), resumable and
idempotent: every image is written to a temporary name and ``os.replace``d into place; an image
already on disk with the archive's size is skipped; a class (or the whole val split) gets a marker
file once it is complete so a rerun skips it without touching its files. Shards: see
``imagenet.tools.shardwrite``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from imagenet.errors import INTERRUPTED_EXIT_CODE, RunError, TrainerError, UsageError, report
from imagenet.tools.prepfiles import (
    PART_SUFFIX,
    Progress,
    claim_folder,
    is_image,
    train_archive_as_val,
    val_label,
)
from imagenet.tools.shardwrite import shards_from_archives, shards_from_folder
from imagenet.tools.vallabels import WNID, read_val_labels

log = logging.getLogger(__name__)

DONE_MARKER = ".imagenet-prepare-done"  # in a class folder / in val: complete, holds the count


def get_args_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m imagenet.tools.prepare``."""
    p = argparse.ArgumentParser(
        prog="python -m imagenet.tools.prepare", description=" ".join(__doc__.split("\n\n")[0]
                                                                      .split()),
        epilog="Rerun the same command to resume an interrupted run; finished classes (and "
               "shards) are kept.")
    p.add_argument("--train-tar", type=Path, metavar="PATH",
                   help="ILSVRC2012_img_train.tar (about 138 GB; needs as much free in --out)")
    p.add_argument("--val-tar", type=Path, metavar="PATH",
                   help="ILSVRC2012_img_val.tar (about 6.3 GB); needs one of the label options")
    labels = p.add_mutually_exclusive_group()
    labels.add_argument("--devkit", type=Path, metavar="PATH",
                        help="ILSVRC2012_devkit_t12.tar.gz (val labels; scipy not needed)")
    labels.add_argument("--val-csv", type=Path, metavar="PATH",
                        help="Kaggle LOC_val_solution.csv (val labels; first wnid of each row)")
    labels.add_argument("--val-labels", type=Path, metavar="PATH",
                        help="text file of '<filename> <wnid>' lines (val labels)")
    p.add_argument("--from-folder", type=Path, metavar="DIR",
                   help="write shards (or, with --format parquet, Hugging Face Parquet) of an "
                        "ImageFolder (DIR/train, DIR/val) instead of archives")
    p.add_argument("--from-parquet", metavar="DIR",
                   help="write an ImageFolder (OUT/train, OUT/val) of a Hugging Face Parquet "
                        "data set (a folder or URL in the Hub's layout)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="output folder; train/ and val/ are created inside it (shards: "
                        "train-*.tar, val-*.tar and _info.json)")
    p.add_argument("--format", choices=("folder", "shards", "parquet"), default=None,
                   help="ImageFolder, WebDataset tar shards or Hugging Face Parquet "
                        "(OUT/data/<split>-*.parquet; with --from-folder) (default: folder; "
                        "shards with --from-folder)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="shards: seed of the random order of the images (default: 0)")
    p.add_argument("--shard-size", type=float, default=1000.0, metavar="MB",
                   help="shards: largest shard, megabytes (default: 1000)")
    p.add_argument("--shard-max-images", type=int, default=None, metavar="N",
                   help="shards: most images per shard (default: no limit)")
    p.add_argument("--expect-train", type=int, default=1_281_167, metavar="N",
                   help="expected number of train images (default: 1281167)")
    p.add_argument("--expect-val", type=int, default=50_000, metavar="N",
                   help="expected number of val images (default: 50000)")
    p.add_argument("--strict", action="store_true",
                   help="exit with code 1 if an image count differs from --expect-*")
    p.add_argument("--log-every", type=int, default=10_000, metavar="N",
                   help="log progress every N images (default: 10000; train logs at class ends)")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def open_tar(path: Path, what: str) -> tarfile.TarFile:
    """Open an archive for one streaming pass, or explain what is wrong with it."""
    try:
        return tarfile.open(path, mode="r|*")
    except tarfile.TarError as exc:
        raise UsageError(f"{path}: not a tar archive ({exc}); expected {what}") from None


def read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes]:
    """The data of a regular-file member."""
    src = tar.extractfile(member)
    assert src is not None  # only called for regular files
    return src


def write_image(src: IO[bytes], size: int, dest: Path) -> bool:
    """Copy one image to ``dest`` through a temporary name; False if it was already there."""
    if dest.is_file() and dest.stat().st_size == size:
        return False
    tmp = dest.with_name(dest.name + PART_SUFFIX)
    with open(tmp, "wb") as f:
        while chunk := src.read(1 << 20):
            f.write(chunk)
    os.replace(tmp, dest)
    return True


def finished_count(folder: Path) -> int | None:
    """The image count recorded by a done marker, if the folder still holds that many images."""
    try:
        recorded = int((folder / DONE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return recorded if count_images(folder)[0] == recorded else None


def mark_done(folder: Path, count: int) -> None:
    """Record that ``folder`` is complete with ``count`` images."""
    tmp = folder / (DONE_MARKER + PART_SUFFIX)
    tmp.write_text(f"{count}\n")
    os.replace(tmp, folder / DONE_MARKER)


def drop_partials(folder: Path) -> None:
    """Delete temporary files an interrupted run left behind."""
    for stale in folder.glob(f"**/*{PART_SUFFIX}"):
        stale.unlink()


def extract_class(inner: tarfile.TarFile, class_dir: Path, progress: Progress) -> int:
    """Write one per-class tar's images into ``class_dir``; returns the image count."""
    class_dir.mkdir(parents=True, exist_ok=True)
    drop_partials(class_dir)
    count = written = nbytes = 0
    for member in inner:
        name = Path(member.name).name  # never trust paths inside an archive
        if member.isfile() and is_image(name):
            written += write_image(read_member(inner, member), member.size, class_dir / name)
            count += 1
            nbytes += member.size
    progress.add(count, written, nbytes, note=f" after class {class_dir.name}")
    return count


def prepare_train(tar_path: Path, out: Path, log_every: int) -> None:
    """Stream the train archive (a tar of per-class tars) into ``out/<wnid>/``."""
    what = "ILSVRC2012_img_train.tar"
    progress, classes, skipped = Progress("train", log_every), 0, 0
    with open_tar(tar_path, what) as outer:
        for member in outer:
            wnid = Path(member.name).name.removesuffix(".tar")
            if not (member.isfile() and member.name.endswith(".tar") and WNID.fullmatch(wnid)):
                raise UsageError(f"{tar_path}: member {member.name!r} is not a per-class tar "
                                 f"'nXXXXXXXX.tar'; is this {what}?")
            classes += 1
            class_dir = out / wnid
            done = finished_count(class_dir)
            if done is not None:  # skipping still reads past the member: the stream has no seek
                skipped += 1
                progress.add(done, 0, 0)
                continue
            with tarfile.open(fileobj=read_member(outer, member), mode="r|") as inner:
                mark_done(class_dir, extract_class(inner, class_dir, progress))
    progress.log(note=f" in {classes} classes ({skipped} complete before this run)")


def prepare_val(tar_path: Path, labels: dict[str, str], out: Path, log_every: int) -> None:
    """Stream the flat val archive into ``out/<wnid>/`` using ``labels`` (image stem -> wnid)."""
    what = "ILSVRC2012_img_val.tar"
    done = finished_count(out)
    if done is not None:
        log.info("val: %d images already complete in %s; skipped", done, out)
        return
    out.mkdir(parents=True, exist_ok=True)
    drop_partials(out)
    progress, made = Progress("val", log_every), set()
    with open_tar(tar_path, what) as tar:
        for member in tar:
            name = Path(member.name).name
            if member.isfile() and name.endswith(".tar"):
                raise train_archive_as_val(tar_path, name)
            if not (member.isfile() and is_image(name)):
                continue
            wnid = val_label(labels, name, tar_path)
            if wnid not in made:
                (out / wnid).mkdir(exist_ok=True)
                made.add(wnid)
            written = write_image(read_member(tar, member), member.size, out / wnid / name)
            progress.add(1, written, member.size)
    mark_done(out, progress.images)
    progress.log(note=f" in {len(made)} classes")


def count_images(folder: Path) -> tuple[int, int]:
    """(images, class folders) of an ImageFolder split, or of one class folder."""
    images = classes = 0
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir():
                classes += 1
                images += count_images(Path(entry.path))[0]
            elif is_image(entry.name):
                images += 1
    return images, classes


def claim_output(out: Path, splits: Sequence[str]) -> None:
    """Create each split folder with its owner marker; refuse a split this tool did not create.

    The marker is per split: a train/ made by this tool says nothing about a val/ made by hand.
    """
    for split in splits:
        claim_folder(out / split)


def counts_match(split: str, folder: Path, expected: int) -> bool:
    """Log the image count of a split against the expected one."""
    images, classes = count_images(folder)
    if images == expected:
        log.info("%s: %d images in %d classes, as expected: OK", split, images, classes)
        return True
    log.warning("WARNING: %s: %d images in %d classes, expected %d (difference %+d)",
                split, images, classes, expected, images - expected)
    return False


def run(args: argparse.Namespace) -> int:
    """Prepare the requested splits; returns the exit code."""
    made = output_format(args)
    shards = made == "shards"
    if args.from_parquet is not None or made == "parquet":
        # Imported here: it reads through the trainer's shard reader (torch), which the other
        # ways of this tool do without (a start of a second instead of several).
        from imagenet.tools import parquetwrite

        if args.from_parquet is not None:
            return parquetwrite.folder_from_parquet(args)
        return parquetwrite.parquet_from_folder(args)
    if args.from_folder is not None:
        return shards_from_folder(args)
    if args.train_tar is None and args.val_tar is None:
        raise UsageError("nothing to do: pass --train-tar and/or --val-tar (or --from-folder)")
    for path, what in ((args.train_tar, "ILSVRC2012_img_train.tar"),
                       (args.val_tar, "ILSVRC2012_img_val.tar")):
        if path is not None and not path.is_file():
            raise UsageError(f"{path}: file not found; pass the path to {what}")
    # Read the labels before the long train pass so a bad labels file fails in seconds.
    labels = None
    if args.val_tar is not None:
        labels = read_val_labels(args.devkit, args.val_csv, args.val_labels)
    if shards:
        return shards_from_archives(args, labels)
    splits = [s for s, tar in (("train", args.train_tar), ("val", args.val_tar)) if tar]
    claim_output(args.out, splits)
    ok = True
    if args.train_tar is not None:
        prepare_train(args.train_tar, args.out / "train", args.log_every)
        ok &= counts_match("train", args.out / "train", args.expect_train)
    if labels is not None:
        prepare_val(args.val_tar, labels, args.out / "val", args.log_every)
        ok &= counts_match("val", args.out / "val", args.expect_val)
    return 1 if args.strict and not ok else 0


def output_format(args: argparse.Namespace) -> str:
    """"folder", "shards" or "parquet", checked against the other arguments."""
    if args.shard_size <= 0 or (args.shard_max_images or 1) < 1:
        raise UsageError("--shard-size and --shard-max-images must be positive")
    if args.from_parquet is not None:
        if args.from_folder or args.train_tar or args.val_tar or args.format not in (None,
                                                                                    "folder"):
            raise UsageError("--from-parquet writes an ImageFolder: drop the other inputs and "
                             "--format")
        return "folder"
    if args.format == "parquet" and args.from_folder is None:
        raise UsageError("--format parquet is written from an ImageFolder: give "
                         "--from-folder DIR")
    if args.from_folder is not None:
        if args.format == "folder":
            raise UsageError("--from-folder writes shards or Parquet: drop --format folder")
        if args.train_tar or args.val_tar:
            raise UsageError("give --from-folder or the archives (--train-tar/--val-tar), "
                             "not both")
        return args.format or "shards"
    return args.format or "folder"


def as_trainer_error(exc: Exception) -> TrainerError:
    """One user-facing error for what can go wrong while the archives stream (exit code 1)."""
    if isinstance(exc, TrainerError):
        return exc
    if isinstance(exc, OSError):  # disk full, permissions, a vanished mount
        where = f"{exc.filename}: " if exc.filename else ""
        return RunError(f"{where}{exc.strerror or exc}; fix it and rerun the same command to "
                        "resume (finished classes are kept)")
    return RunError(f"archive read failed ({exc}); the file may be truncated or corrupt: check "
                    "its size/md5 and rerun the same command to resume")


def main(argv: Sequence[str] | None = None) -> int:
    """The command line entry point: returns the process exit code."""
    args = get_args_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="%(message)s", stream=sys.stdout, force=True)
    try:
        return run(args)
    except (TrainerError, OSError, tarfile.TarError) as exc:
        return report(as_trainer_error(exc), args.debug)
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
