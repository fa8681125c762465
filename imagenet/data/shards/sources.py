"""Which shards a run reads, how many samples each holds, and the class names.

The data argument chooses the source (``--data-format`` overrides the choice):

- a folder holding ``train/`` and ``val/``: the classic ImageFolder;
- a folder, an ``http(s)://`` base URL or an object-storage prefix (``s3://``, ``gs://``, any
  fsspec URL) holding ``_info.json``: the shards it lists (split
  ``train`` for training, ``validation`` or ``val`` for validation);
- a shard pattern: ``/data/train-{000000..000146}.tar``, ``https://host/train-{0000..1023}.tar``
  or ``pipe:aws s3 cp s3://bucket/train-{0000..1023}.tar -`` (a command whose output is the
  shard). The validation shards come from ``--val-data`` or from the ``_info.json`` beside the
  training shards (for ``pipe:``, fetched by the same command with the file name replaced).

Sample counts come from ``_info.json`` (the layout of the published ImageNet shards:
``splits.<split>.filenames`` and ``shard_lengths``); local shards without one are counted by
reading their headers. Class names come from its ``classes`` list (written by
``python -m imagenet.tools.prepare``), else ``--num-classes`` names them 0..N-1.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from imagenet.data.shards.streams import CommandFailed, open_shard, read_small_file
from imagenet.data.shards.tarreader import SampleReader
from imagenet.errors import DataError, UsageError
from imagenet.settings.images import INFO_NAMES, is_remote, is_shard_pattern

log = logging.getLogger(__name__)

TRAIN_SPLITS = ("train",)
VAL_SPLITS = ("validation", "val")
_BRACES = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)")


@dataclass(frozen=True)
class ShardList:
    """Shards of one split, in stored order, and the samples in each."""

    urls: tuple[str, ...]
    counts: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class ShardSet:
    """What a run reads: training and validation shards, and the class names."""

    train: ShardList
    val: ShardList
    classes: list[str]
    notes: tuple[str, ...] = ()  # what rank 0 warns about (Parquet rows in class order)


def expand_braces(pattern: str) -> list[str]:
    """``a{1..3}b`` -> a1b a2b a3b (zero padding kept), ``{x,y}`` -> x y; several braces nest."""
    match = _BRACES.search(pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    body = match.group(1)
    numbers = _RANGE.fullmatch(body)
    if numbers:
        lo, hi = numbers.groups()
        width = len(lo) if lo.lstrip("-").startswith("0") else 0
        step = 1 if int(hi) >= int(lo) else -1
        items = [f"{i:0{width}d}" for i in range(int(lo), int(hi) + step, step)]
    else:
        items = body.split(",")
    return [head + item + rest for item in items for rest in expand_braces(tail)]


def resolve(data: str, val_data: str | None, num_classes: int | None) -> ShardSet:
    """The shards and classes of a run, from the data argument and the flags."""
    if is_shard_pattern(data):
        info, info_url = find_info(data)
        train = counted(data, info, info_url)
        val = None if val_data else split_of(info, info_url, VAL_SPLITS, partial(beside, data))
    else:
        info, info_url = base_info(data)
        base = data.rstrip("/")
        train = split_of(info, info_url, TRAIN_SPLITS, lambda name: f"{base}/{name}")
        val = None if val_data else split_of(info, info_url, VAL_SPLITS,
                                             lambda name: f"{base}/{name}")
    if val_data:
        val_info, val_info_url = find_info(val_data)
        val = counted(val_data, val_info, val_info_url)
    assert val is not None
    return ShardSet(train, val, classes_of(info, info_url, num_classes))


# ---- locating shards and their _info.json


def _file_segment(pattern: str) -> tuple[int, int]:
    """Where the shard file name (with its braces) is in ``pattern``: (start, end)."""
    anchor = pattern.find("{")
    if anchor < 0:
        anchor = pattern.rfind(".tar")
    if anchor < 0:
        raise UsageError(f"'{pattern}' names no shard: a shard pattern names .tar files, e.g. "
                         "/data/train-{000000..000146}.tar")
    space = re.compile(r"\s").search(pattern, anchor)
    end = space.start() if space else len(pattern)
    start = max(pattern.rfind("/", 0, end), pattern.rfind(" ", 0, end)) + 1
    if "{" in pattern[:start] or "{" in pattern[end:]:
        raise UsageError(f"'{pattern}': braces may only stand in the shard file name "
                         "(e.g. /data/train-{000000..000146}.tar)")
    return start, end


def beside(pattern: str, name: str) -> str:
    """``pattern`` with its shard file name replaced by ``name`` (same folder, URL or command)."""
    start, end = _file_segment(pattern)
    return pattern[:start] + name + pattern[end:]


def shard_names(pattern: str) -> list[tuple[str, str]]:
    """(url, file name) of every shard a pattern names."""
    start, end = _file_segment(pattern)
    return [(pattern[:start] + name + pattern[end:], name)
            for name in expand_braces(pattern[start:end])]


def find_info(pattern: str) -> tuple[dict | None, str]:
    """The ``_info.json`` beside the shards of ``pattern`` (None if there is none) and its URL.

    A ``pipe:`` command that fails for every name is reported with its stderr (an expired
    credential is not a missing file); one that stalls, at once.
    """
    failed: list[CommandFailed] = []
    for name in INFO_NAMES:
        url = beside(pattern, name)
        try:
            info = load_info(url)
        except CommandFailed as exc:
            failed.append(exc)
            if exc.stalled:
                break
            continue
        if info is not None:
            return info, url
    if failed:
        raise DataError(f"cannot fetch the {INFO_NAMES[0]} beside '{pattern}': {failed[0]}; "
                        "fix the command (path, credentials) or put the file there (the sample "
                        "counts are needed before training)")
    return None, beside(pattern, INFO_NAMES[0])


def base_info(base: str) -> tuple[dict, str]:
    """The ``_info.json`` of a shard folder or base URL; UsageError if it has none."""
    for name in INFO_NAMES:
        url = f"{base.rstrip('/')}/{name}"
        info = load_info(url)
        if info is not None:
            return info, url
    if not is_remote(base) and not Path(base).is_dir():
        raise UsageError(f"data '{base}' does not exist: give an ImageFolder root (train/, "
                         "val/), a shard folder or URL with _info.json, or a shard pattern")
    raise UsageError(f"no _info.json in '{base}': give the shards as a pattern "
                     "('.../train-{000000..000009}.tar') and --val-data, or add an _info.json; "
                     "a Hugging Face data set of Parquet files there: --data-format parquet")


def load_info(url: str) -> dict | None:
    """A parsed ``_info.json``; None if missing, DataError if it is not a valid one."""
    raw = read_small_file(url)
    if raw is None:
        return None
    try:
        info = json.loads(raw)
        splits = info["splits"]
        for split in splits.values():
            names, lengths = split["filenames"], split["shard_lengths"]
            if len(names) != len(lengths) or not all(
                    isinstance(n, int) and n >= 0 for n in lengths):
                raise ValueError("filenames and shard_lengths do not match")
        return info
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DataError(f"{url} is not a valid shard _info.json ({exc}); it needs "
                        "splits.<split>.filenames and shard_lengths") from None


# ---- counts


def split_of(info: dict | None, info_url: str, names: tuple[str, ...],
             locate: Callable[[str], str]) -> ShardList:
    """The split of ``info`` called one of ``names``; ``locate`` makes a file name a URL."""
    splits = (info or {}).get("splits", {})
    for name in names:
        if name in splits:
            split = splits[name]
            return ShardList(tuple(locate(f) for f in split["filenames"]),
                             tuple(split["shard_lengths"]))
    flag = "the data argument" if names == TRAIN_SPLITS else "--val-data"
    raise UsageError(f"{info_url} has no split {' or '.join(names)}"
                     f"{'' if info else ' (no such file)'}: give those shards with {flag}")


def counted(pattern: str, info: dict | None, info_url: str) -> ShardList:
    """The shards of ``pattern`` with their counts from ``info``, or counted if local."""
    shards = shard_names(pattern)
    if info is None:
        if any(is_remote(url) for url, _ in shards):
            raise UsageError(f"no _info.json beside '{pattern}' (looked for {info_url}): the "
                             "sample count of every shard is needed before training; put an "
                             "_info.json there (see README, 'Tar shards')")
        return count_local(shards)
    lengths = {}
    for split in info["splits"].values():
        lengths.update(zip(split["filenames"], split["shard_lengths"]))
    missing = [name for _, name in shards if name not in lengths]
    if missing:
        raise DataError(f"{info_url} does not list {missing[0]}"
                        f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}: "
                        "the pattern names shards it does not count")
    return ShardList(tuple(url for url, _ in shards), tuple(lengths[n] for _, n in shards))


def count_local(shards: list[tuple[str, str]]) -> ShardList:
    """Count the samples of local shards by reading their headers (seeks past the data)."""
    start, counts = time.perf_counter(), []
    for url, _ in shards:
        reader = SampleReader(open_shard(url), url, frozenset())
        try:
            counts.append(reader.skip(1 << 62))
        finally:
            reader.close()
    log.info("=> no _info.json: counted %d samples in %d shards in %.1f s", sum(counts),
             len(counts), time.perf_counter() - start)
    return ShardList(tuple(url for url, _ in shards), tuple(counts))


def classes_of(info: dict | None, info_url: str, num_classes: int | None) -> list[str]:
    """Class names from ``info``'s ``classes``, else 0..N-1 from --num-classes."""
    names = (info or {}).get("classes")
    if names is not None:
        if num_classes is not None and num_classes != len(names):
            raise UsageError(f"--num-classes {num_classes} but {info_url} lists "
                             f"{len(names)} classes")
        return [str(n) for n in names]
    if num_classes is None:
        raise UsageError(f"{info_url} lists no class names: give --num-classes N (1000 for "
                         "the published ImageNet-1k shards)")
    return [str(i) for i in range(num_classes)]
