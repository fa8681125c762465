"""Whether a --sharded-checkpoint directory is whole: its trainer state, torch's ``.metadata``
and every shard file ``.metadata`` names, at least as long as it says.

A save never leaves a directory half written (it is written under a temporary name and
swapped in), but a copy that stopped, a full disk or a hand can. Found here, that is one line
before anything is loaded instead of a CheckpointException from every rank. A ``.metadata``
that could run code is refused (``dcpread``), not reported as a missing part.
"""

from __future__ import annotations

from pathlib import Path

from imagenet.checkpoint import dcpread


def missing_part(path: Path, meta_name: str) -> str | None:
    """What keeps checkpoint directory ``path`` from loading ("its shard file __0_0.distcp is
    missing"); None when it is whole. ``meta_name``: the trainer state file rank 0 adds."""
    if not path.exists():
        return "it does not exist"
    if not path.is_dir():
        return "it is not a directory"
    if not (path / meta_name).is_file():
        return f"it has no {meta_name} (not written with --sharded-checkpoint?)"
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
