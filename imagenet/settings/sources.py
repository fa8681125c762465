"""What the data argument names, decided from its form (and, for a folder, what it holds):
an ImageFolder, or tar shards (a pattern, ``pipe:``, a URL, a folder with ``_info.json``); and
which names are read over a network. ``data`` and ``shards`` read them; the plan decides with
``data_format`` once.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from imagenet.errors import UsageError

INFO_NAMES = ("_info.json", "info.json")  # timm tries them in this order
SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_NOT_FSSPEC = {"http", "https", "file"}  # http(s) has its own reader; file:// is a local path


def is_url(text: str | os.PathLike | None) -> bool:
    """True for an fsspec URL (``s3://bucket/x``, ``gs://...``), not a local path or http(s)."""
    match = SCHEME.match(str(text or ""))
    return bool(match) and match.group(1).lower() not in _NOT_FSSPEC


def is_remote(url: str) -> bool:
    """Whether ``url`` is read by downloading (http(s), a pipe: command, object storage)."""
    return url.startswith(("http://", "https://", "pipe:")) or is_url(url)


def is_shard_pattern(data: str) -> bool:
    """A shard list rather than a folder or base URL."""
    return data.startswith("pipe:") or "{" in data or data.endswith(".tar")


def data_format(data: str, requested: str) -> str:
    """"folder", "shards" or "parquet": ``requested`` unless "auto", else what ``data`` looks
    like."""
    if requested != "auto":
        return requested
    if data.startswith("hf://") or data.endswith(".parquet"):
        return "parquet"
    if is_remote(data) or is_shard_pattern(data):
        return "shards"
    root = Path(data)
    if root.is_dir() and not any((root / name).is_file() for name in INFO_NAMES) and any(
            next(root.glob(f"{'*/' * depth}*.parquet"), None) for depth in range(3)):
        return "parquet"  # the Hub's layout: *.parquet, data/*.parquet, default/train/*.parquet
    folder = (root / "train").is_dir() and (root / "val").is_dir()
    shards = any((root / name).is_file() for name in INFO_NAMES)
    if folder and shards:
        raise UsageError(f"'{data}' holds both an ImageFolder (train/, val/) and shards "
                         "(_info.json): give --data-format folder or --data-format shards")
    tars = [p for p in root.glob("*.tar") if not p.name.endswith(".pth.tar")] \
        if root.is_dir() else []  # checkpoints (*.pth.tar) are not shards
    if not folder and not shards and tars:
        raise UsageError(f"'{data}' holds .tar files but no _info.json: give the training "
                         f"shards as a pattern ('{data}/train-{{000000..000009}}.tar') and "
                         "the validation shards with --val-data")
    return "shards" if shards else "folder"
