"""ILSVRC2012 val labels (image stem -> wnid) from the devkit, Kaggle's CSV or a plain text file."""

from __future__ import annotations

import csv
import re
import tarfile
from pathlib import Path

from imagenet.errors import UsageError
from imagenet.tools.matfile import MatFileError, load_mat

WNID = re.compile(r"n\d{8}")
DEVKIT_META = "data/meta.mat"
DEVKIT_TRUTH = "data/ILSVRC2012_validation_ground_truth.txt"


def read_val_labels(devkit: Path | None, val_csv: Path | None,
                    val_labels: Path | None) -> dict[str, str]:
    """The labels from whichever one source was given; every value is checked to be a wnid."""
    for path, reader in ((devkit, devkit_labels), (val_csv, csv_labels),
                         (val_labels, text_labels)):
        if path is None:
            continue
        if not path.is_file():
            raise UsageError(f"{path}: file not found; pass the val labels file")
        try:
            return checked(reader(path), path)
        except (UnicodeDecodeError, ValueError) as exc:  # a binary or garbled file
            raise UsageError(f"{path}: cannot read the val labels ({exc})") from None
    raise UsageError("val labels needed: pass --devkit, --val-csv or --val-labels")


def checked(labels: dict[str, str], source: Path) -> dict[str, str]:
    """``labels`` after checking every wnid; a wnid becomes a folder name, so it must be one."""
    for stem, wnid in labels.items():
        if not WNID.fullmatch(wnid):
            raise UsageError(f"{source}: label {wnid!r} of {stem} is not a wnid like n01440764")
    if not labels:
        raise UsageError(f"{source}: no labels found")
    return labels


def devkit_labels(path: Path) -> dict[str, str]:
    """Labels from ILSVRC2012_devkit_t12.tar.gz: meta.mat maps class ids to wnids."""
    files: dict[str, bytes] = {}
    try:
        with tarfile.open(path, mode="r:*") as tar:
            for member in tar:
                for wanted in (DEVKIT_META, DEVKIT_TRUTH):
                    src = tar.extractfile(member) if member.name.endswith(wanted) else None
                    if src is not None:
                        files[wanted] = src.read()
    except tarfile.TarError as exc:
        raise UsageError(f"{path}: not a tar archive ({exc}); expected the devkit") from None
    missing = [name for name in (DEVKIT_META, DEVKIT_TRUTH) if name not in files]
    if missing:
        raise UsageError(f"{path}: no {', '.join(missing)} inside; expected "
                         "ILSVRC2012_devkit_t12.tar.gz (or use --val-csv / --val-labels)")
    try:
        synsets = load_mat(files[DEVKIT_META])["synsets"]
        id_to_wnid = {int(s["ILSVRC2012_ID"][0]): s["WNID"] for s in synsets}
    except (MatFileError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise UsageError(f"{path}: cannot read {DEVKIT_META} ({exc})") from None
    labels = {}
    # Line i of the ground truth is the class id of ILSVRC2012_val_<i>.JPEG.
    for i, class_id in enumerate(files[DEVKIT_TRUTH].decode().split(), start=1):
        if int(class_id) not in id_to_wnid:
            raise UsageError(f"{path}: ground truth line {i} has class id {class_id}, "
                             "which meta.mat does not list")
        labels[f"ILSVRC2012_val_{i:08d}"] = id_to_wnid[int(class_id)]
    return labels


def csv_labels(path: Path) -> dict[str, str]:
    """Labels from Kaggle's LOC_val_solution.csv: the first token of PredictionString."""
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        if rows.fieldnames is None or not {"ImageId", "PredictionString"} <= set(rows.fieldnames):
            raise UsageError(f"{path}: expected a header 'ImageId,PredictionString' "
                             "(Kaggle LOC_val_solution.csv)")
        return {row["ImageId"]: (row["PredictionString"] or "?").split()[0] for row in rows}


def text_labels(path: Path) -> dict[str, str]:
    """Labels from '<filename> <wnid>' lines."""
    labels = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise UsageError(f"{path}: line {number} is not '<filename> <wnid>': {line!r}")
        labels[Path(parts[0]).name.rsplit(".", 1)[0]] = parts[1]
    return labels
