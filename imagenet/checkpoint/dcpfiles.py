"""Whether a --sharded-checkpoint directory is whole: its trainer state, torch's ``.metadata``
and every shard file ``.metadata`` names, at least as long as it says; and whether those files
hold the bytes they were written with (``SHARD_SUMS``: a SHA-256 of each, kept in the trainer
state, whose own checksum covers it, as a single file's covers its tensors).

A save never leaves a directory half written (it is written under a temporary name and
swapped in), but a copy that stopped, a full disk or a hand can. Found here, that is one line
before anything is loaded instead of a CheckpointException from every rank. A ``.metadata``
that could run code is refused (``dcpread``), not reported as a missing part.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SHARD_SUMS = "shard_sha256"  # the trainer state's entry: DCP's file name -> its SHA-256


def missing_part(path: Path, meta_name: str) -> str | None:
    """What keeps checkpoint directory ``path`` from loading ("its shard file __0_0.distcp is
    missing"); None when it is whole. ``meta_name``: the trainer state file rank 0 adds."""
    if not path.exists():
        return "it does not exist"
    if not path.is_dir():
        return "it is not a directory"
    if not (path / meta_name).is_file():
        return f"it has no {meta_name} (not written with --sharded-checkpoint?)"
    from imagenet.checkpoint import dcpread  # torch.distributed.checkpoint: when one is read

    try:
        metadata = dcpread.read_metadata(path)
    except FileNotFoundError:
        return "its .metadata is missing"
    except dcpread.Refused:
        raise
    except Exception as exc:  # a damaged pickle raises many types (EOF, Unpickling, ...)
        reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else \
            type(exc).__name__
        return f"its .metadata is damaged ({reason})"
    needed: dict[str, int] = {}  # shard file -> bytes it must hold at least
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return f"its shard file {name} is missing"
        have = shard.stat().st_size
        if have < size:
            return f"its shard file {name} is truncated ({have} of at least {size} bytes)"
    return None


def dcp_files(path: Path) -> list[str]:
    """The files torch.distributed.checkpoint wrote in ``path``: .metadata and the shards."""
    from imagenet.checkpoint import dcpread

    return sorted(p.name for p in path.iterdir()
                  if p.name == dcpread.METADATA or p.suffix == ".distcp")


def file_sums(path: Path, names: list[str]) -> dict[str, str]:
    """The SHA-256 of each of ``names`` in ``path`` (read in 1 MiB blocks)."""
    sums = {}
    for name in names:
        digest = hashlib.sha256()
        with open(path / name, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        sums[name] = digest.hexdigest()
    return sums


def damaged_file(path: Path, written: dict[str, str] | None, rank: int = 0,
                 world_size: int = 1) -> str | None:
    """Which of directory ``path``'s files differs from the checksum ``written`` with it
    ("its shard file __0_0.distcp does not match ..."); None when all match, or when the
    directory predates the checksums. Each rank checks its share of the files."""
    if not written:
        return None
    from imagenet.checkpoint import dcpread

    for name in sorted(written)[rank::world_size]:
        what = name if name == dcpread.METADATA else f"shard file {name}"
        if not (path / name).is_file():
            return f"its {what} is missing"
        if file_sums(path, [name])[name] != written[name]:
            return f"its {what} does not match the checksum written with it"
    return None
