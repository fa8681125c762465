"""Hugging Face image datasets in Parquet (``--data-format parquet``): each Parquet file is a shard.

The Hub's layout, as the ``datasets`` library writes it: ``data/train-00000-of-00004.parquet``,
``data/validation-00000-of-00001.parquet`` (or ``train/0000.parquet``, the Hub's converted
branch; ``val``, ``valid`` or ``test`` where a set names its evaluation split so). Columns: an
``Image`` feature (a struct of ``bytes`` and ``path``) and a ``ClassLabel`` (an integer), whose
class names ``datasets`` stores in each file's schema metadata (key ``huggingface``).

Each file's row count comes from its footer, so the files are shards with known counts and the
tar-shard machinery (``plan``, ``reader``) gives the same guarantees: an epoch order fixed by
the seed whatever the world size, every validation image once, mid-epoch resume. A reader holds
one row group at a time (``iter_batches``): files are streamed, never loaded whole. Read with
pyarrow, an optional extra (``pip install 'imagenet-trainer[parquet]'``), imported only here.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path
from typing import Any

from imagenet.data.objectstore import filesystem, first_line
from imagenet.data.shards.plan import STREAMS
from imagenet.data.shards.sources import ShardList, ShardSet
from imagenet.data.shards.streams import open_shard
from imagenet.data.shards.tarreader import IMAGE_EXTENSIONS, SampleReader, ShardError
from imagenet.errors import DataError, UsageError
from imagenet.settings.images import is_url

PARQUET_EXTRA = "pip install 'imagenet-trainer[parquet]'"
TRAIN_SPLIT = "train"
VAL_SPLITS = ("validation", "val", "valid", "test")  # the first one present is validated on
_SPLIT_IN_NAME = re.compile(r"^([A-Za-z]+)(?=[-_.])")
READ_ROWS = 64  # rows per record batch read from a row group
SORTED_SHARE = 0.5  # of the training row groups holding one class: the rows are in class order


def is_parquet(url: str) -> bool:
    return url.endswith(".parquet")


def pyarrow_parquet() -> Any:
    """``pyarrow.parquet``; UsageError naming the extra when pyarrow is missing."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError(f"--data-format parquet reads Parquet with pyarrow: {PARQUET_EXTRA}"
                         ) from None
    return pq


def open_parquet(url: str) -> Any:
    """A ``pyarrow.parquet.ParquetFile`` of a local path or fsspec URL; ShardError naming the
    file when it is missing, cut short or not Parquet."""
    pq = pyarrow_parquet()
    try:
        if is_url(url):
            fs, path = filesystem(url)
            return pq.ParquetFile(fs.open(path, "rb"))
        return pq.ParquetFile(url)
    except FileNotFoundError:
        raise ShardError(f"Parquet file {url} does not exist") from None
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise ShardError(f"Parquet file {url} cannot be read ({first_line(exc)}): it is cut "
                         "short or damaged; copy it again") from None


# ---- which files, how many rows, which classes


def list_files(root: str) -> list[str]:
    """The .parquet files under a folder or URL (a file: itself), in stored (sorted) order."""
    if is_parquet(root):
        return [root]
    if is_url(root):
        fs, path = filesystem(root)
        protocol = root.split("://", 1)[0]
        found = sorted(fs.glob(f"{path.rstrip('/')}/**/*.parquet"))
        return [f"{protocol}://{p}" for p in found]
    if not Path(root).is_dir():
        raise UsageError(f"data '{root}' does not exist: give a folder or URL of Parquet files "
                         "in the Hugging Face Hub's layout (data/train-*.parquet, ...)")
    return sorted(str(p) for p in Path(root).rglob("*.parquet")  # not .cache/ (the Hub's)
                  if not any(part.startswith(".") for part in p.relative_to(root).parts))


def split_of_file(root: str, url: str) -> str | None:
    """The split a file of the Hub's layout belongs to: a folder named for it (``train/``) or
    its name's first word (``train-00000-of-00004.parquet``)."""
    rel = url[len(root.rstrip("/")) + 1:] if url.startswith(root.rstrip("/") + "/") else url
    parts = rel.split("/")
    for part in parts[:-1]:
        if part.lower() in (TRAIN_SPLIT, *VAL_SPLITS):
            return part.lower()
    match = _SPLIT_IN_NAME.match(parts[-1])
    return match.group(1).lower() if match else None


def features(file: Any, url: str) -> tuple[str, str, list[str]]:
    """(image column, label column, class names) from a file's ``huggingface`` metadata."""
    meta = (file.schema_arrow.metadata or {}).get(b"huggingface")
    advice = ("write it with the datasets library (a ClassLabel feature) or with python -m "
              "imagenet.tools.prepare --format parquet")
    if meta is None:
        raise DataError(f"Parquet file {url} has no Hugging Face features in its metadata "
                        f"(no 'huggingface' key): its class names are unknown; {advice}")
    try:
        feats = json.loads(meta)["info"]["features"]
        images = [k for k, v in feats.items() if isinstance(v, dict) and v.get("_type") == "Image"]
        labels = [k for k, v in feats.items()
                  if isinstance(v, dict) and v.get("_type") == "ClassLabel"]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DataError(f"Parquet file {url}: its 'huggingface' metadata cannot be read "
                        f"({first_line(exc)}); {advice}") from None
    if not images or not labels:
        missing = "an Image feature" if not images else "a ClassLabel feature (the label)"
        raise DataError(f"Parquet file {url} has no {missing}; {advice}")
    label = "label" if "label" in labels else labels[0]
    names = feats[label].get("names")
    if not names:
        raise DataError(f"Parquet file {url}: its ClassLabel '{label}' lists no class names; "
                        f"{advice}")
    return images[0], label, [str(n) for n in names]


def counted(urls: list[str], what: str, split: str, unlabeled: bool = False
            ) -> tuple[ShardList, tuple[str, str, list[str]], float]:
    """The files with their row counts (from their footers), the features they share, and the
    share of their row groups that hold one class alone; every row checked for image bytes and
    a label of the classes (``check_rows``: -1 passes where ``unlabeled``)."""
    counts, shared, first, single, groups = [], None, "", 0, 0
    for url in urls:
        file = open_parquet(url)
        counts.append(file.metadata.num_rows)
        found = features(file, url)
        if shared is None:
            shared, first = found, url
        elif found != shared:
            raise DataError(f"Parquet file {url} disagrees with {first} on its columns or class "
                            f"names ({what}): the files of one data set must share them")
        single += check_rows(file, url, split, found, unlabeled)
        groups += file.metadata.num_row_groups
    if shared is None:
        raise UsageError(f"no Parquet files for {what}")
    return ShardList(tuple(urls), tuple(counts)), shared, single / max(groups, 1)


def check_rows(file: Any, url: str, split: str, found: tuple[str, str, list[str]],
               unlabeled: bool = False) -> int:
    """DataError naming the file, its split and the first row without image bytes or without a
    label of the data set's classes (-1, the Hub's "unlabeled", passes where ``unlabeled``).

    Each row group's statistics in the footer (null counts, the label's min and max; pyarrow
    and ``datasets`` write them) settle it without reading a row; a group without them, or whose
    statistics show a bad row, has its label column read (8 bytes a row), and its image bytes
    too where the file is local (a URL's are checked as they are read).

    Returns how many row groups hold one class alone (by their statistics): rows stored in
    class order, which the shard reader's streams mix only so far."""
    image, label, classes = found
    meta = file.metadata
    column = {meta.schema.column(i).path: i for i in range(meta.num_columns)}
    low = -1 if unlabeled else 0
    row = single = 0
    for group in range(meta.num_row_groups):
        chunk = meta.row_group(group)
        labels = chunk.column(column[label]).statistics
        single += chunk.num_rows > 1 and labels is not None and labels.has_min_max \
            and labels.min == labels.max
        if labels is None or not labels.has_null_count or labels.null_count or \
                not labels.has_min_max or labels.min < low or labels.max >= len(classes):
            values = file.read_row_group(group, columns=[label]).column(0).to_pylist()
            for i, value in enumerate(values):
                if value is None or not low <= value < len(classes):
                    raise DataError(f"Parquet file {url} (split {split}): row {row + i} "
                                    f"{bad_label(value, classes, split)}")
        data = chunk.column(column[f"{image}.bytes"]).statistics
        if data is None or not data.has_null_count:
            if is_url(url):
                continue
        elif not data.null_count:
            row += chunk.num_rows
            continue
        images = file.read_row_group(group, columns=[f"{image}.bytes"]).column(0)
        missing = images.combine_chunks().field("bytes").is_null(nan_is_null=False).to_pylist()
        if True in missing:
            raise DataError(f"Parquet file {url} (split {split}): row {row + missing.index(True)}"
                            " has no image bytes (only a path, or none): write the images "
                            "into the rows (datasets: embed_table_storage, as push_to_hub "
                            "does) or use python -m imagenet.tools.prepare --format parquet")
        row += chunk.num_rows
    return single


def bad_label(value: int | None, classes: list[str], split: str) -> str:
    """What is wrong with a row's label, and what to do."""
    if value is None:
        return "has no label: fill in its label or drop the row"
    if value == -1:
        use = "trained on" if split == TRAIN_SPLIT else "validated on"
        return (f"has label -1 (unlabeled), as the Hub's test splits often have: its split "
                f"cannot be {use}; drop the unlabeled rows, or give labeled validation files "
                "with --val-data")
    names = f"{classes[0]} ... {classes[-1]}" if len(classes) > 2 else ", ".join(classes)
    return (f"has label {value}, but the data set has {len(classes)} classes ({names}): fix its "
            "labels or the ClassLabel names in its metadata")


def files_by_split(root: str) -> dict[str | None, list[str]]:
    """The .parquet files under ``root`` by the split each belongs to (``split_of_file``)."""
    found: dict[str | None, list[str]] = {}
    for url in list_files(root):
        found.setdefault(split_of_file(root, url), []).append(url)
    return found


def val_files(val_data: str) -> tuple[list[str], str]:
    """The files --val-data names and their split: a file itself; of a folder, its validation
    split (``VAL_SPLITS``), else every file that is not a training file."""
    root = val_data.rstrip("/")
    if is_parquet(root):
        return [root], split_of_file(root, root) or "--val-data"
    splits = files_by_split(root)
    split = next((s for s in VAL_SPLITS if s in splits), None)
    if split is not None:
        return splits[split], split
    others = sorted(url for s, urls in splits.items() if s != TRAIN_SPLIT for url in urls)
    if not others and splits:
        raise UsageError(f"--val-data {val_data} holds only training files (train-*.parquet): "
                         "give its validation split, or a file or folder of validation files")
    return others, "--val-data"


def resolve_parquet(data: str, val_data: str | None, unlabeled: bool = False) -> ShardSet:
    """The Parquet files of a run (training and validation) and their class names, every row
    checked (``check_rows``)."""
    root = data.rstrip("/")
    by_split = files_by_split(root)
    if TRAIN_SPLIT not in by_split:
        raise UsageError(f"'{data}' holds no training split in the Hub's layout (found "
                         f"{sum(map(len, by_split.values()))} .parquet files; expected "
                         "data/train-*.parquet or train/*.parquet)")
    train, train_features, sorted_share = counted(by_split[TRAIN_SPLIT], f"{data} train",
                                                  TRAIN_SPLIT, unlabeled)
    if val_data:
        urls, split = val_files(val_data)
        val, val_features, _ = counted(urls, f"--val-data {val_data}", split, unlabeled)
    else:
        split = next((s for s in VAL_SPLITS if s in by_split), None)
        if split is None:
            raise UsageError(f"'{data}' holds no validation split ({', '.join(VAL_SPLITS)}): "
                             "give the validation Parquet files with --val-data")
        val, val_features, _ = counted(by_split[split], f"{data} {split}", split, unlabeled)
    if val_features[2] != train_features[2]:
        raise DataError(f"Parquet file {val.urls[0]} lists other class names than "
                        f"{train.urls[0]}: the splits disagree ({len(val_features[2])} vs "
                        f"{len(train_features[2])} classes)")
    notes = ()
    if sorted_share >= SORTED_SHARE and len(train_features[2]) > 1:
        notes = (f"{sorted_share:.0%} of the training row groups in {data} hold one class "
                 "alone: its rows are stored in class order, and each batch then mixes only "
                 f"the classes of {STREAMS} places of the split; shuffle the rows once before "
                 "writing them (prepare --format parquet does; docs/your-own-data.md, 'The "
                 "shuffle')",)
    return ShardSet(train, val, train_features[2], notes)


# ---- reading


def open_reader(url: str, wanted: frozenset[str]) -> ParquetReader | SampleReader:
    """The samples of one shard: a Parquet file's rows, or a tar shard's members."""
    if is_parquet(url):
        return ParquetReader(url)
    return SampleReader(open_shard(url), url, wanted)


class ParquetReader:
    """The rows of one Parquet file as samples (``tarreader.SampleReader``'s interface):
    ``{"jpg"|"png"|...: bytes, "cls": label, "__key__": ...}``. ``skip`` goes to a row group
    by the footer and reads only the rest of that one group."""

    def __init__(self, url: str) -> None:
        self.url, self.file = url, open_parquet(url)
        self.image, self.label, _ = features(self.file, url)
        meta = self.file.metadata
        self.starts = list(accumulate((meta.row_group(g).num_rows
                                       for g in range(meta.num_row_groups)), initial=0))
        self.total = self.starts[-1]
        self.index = 0
        self._rows: Iterator[tuple[bytes, str | None, int]] = iter(())

    def next(self) -> dict[str, Any] | None:
        if self.index >= self.total:
            return None
        try:
            data, path, label = next(self._rows)
        except StopIteration:
            self._rows = self._read_from(self.index)
            data, path, label = next(self._rows)
        ext = (path or "").rsplit(".", 1)[-1].lower()
        sample = {ext if ext in IMAGE_EXTENSIONS else "jpg": data, "cls": label,
                  "__key__": f"row {self.index}" + (f" ({path})" if path else "")}
        self.index += 1
        return sample

    def skip(self, n: int) -> int:
        """Pass over ``n`` rows (fewer at the end); how many were passed over."""
        target = min(self.index + n, self.total)
        skipped, self.index = target - self.index, target
        self._rows = iter(())  # the next ``next`` reads from the row group holding ``target``
        return skipped

    def close(self) -> None:
        self._rows = iter(())
        self.file.close()

    def _read_from(self, row: int) -> Iterator[tuple[bytes, str | None, int]]:
        group = bisect.bisect_right(self.starts, row) - 1
        drop = row - self.starts[group]
        try:
            batches = self.file.iter_batches(batch_size=READ_ROWS,
                                             row_groups=range(group, len(self.starts) - 1),
                                             columns=[self.image, self.label])
            for batch in batches:
                images = batch.column(0)
                data, paths = images.field("bytes").to_pylist(), images.field("path").to_pylist()
                labels = batch.column(1).to_pylist()
                for i in range(min(drop, len(labels)), len(labels)):
                    if data[i] is None or labels[i] is None:
                        raise ShardError(f"Parquet file {self.url}: a row of row group {group} "
                                         "has no image bytes or no label")
                    yield data[i], paths[i], labels[i]
                drop = max(0, drop - len(labels))
        except (OSError, ValueError) as exc:
            raise ShardError(f"Parquet file {self.url} cannot be read ({first_line(exc)}): it "
                             "is damaged; copy it again") from None
