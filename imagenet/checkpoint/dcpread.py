"""Reading a --sharded-checkpoint directory as ``torch.load(weights_only=True)`` reads a file:
nothing in it runs code.

torch.distributed.checkpoint reads a directory's ``.metadata`` with a plain ``pickle.load`` and
its non-tensor values (the optimizer's lr, betas, ...) with ``torch.load(weights_only=False)``,
so a crafted directory runs whatever it names. Here ``.metadata`` is unpickled building only
the records DCP writes (``ALLOWED``) and each value with ``weights_only``; anything else is
``Refused`` (one line naming the directory). Every read of a directory goes through
``read_metadata``, ``load`` or ``load_everything``.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from imagenet.errors import CheckpointError

METADATA = ".metadata"
# What a .metadata written by torch.distributed.checkpoint holds (besides torch's dtypes, any of
# which may name a tensor's): its records, the shard files' places, tensor sizes and layouts,
# and the checkpoint_id it was saved under (a Path when the trainer saves).
ALLOWED = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a torch.layout from its name
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
}
TRUST = "use a checkpoint directory that this trainer wrote"


class Refused(CheckpointError):
    """A directory that holds something that could run code when loaded; nothing was run."""


class _Forbidden(pickle.UnpicklingError):
    """A global that ``.metadata`` may not name (the message is its name)."""


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only what DCP's metadata is made of (``ALLOWED``)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Forbidden(f"{module}.{name}")


def _plain_name(name: Any) -> bool:
    """A file name in the directory itself (not a path out of it)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name \
        and "\0" not in name


def read_metadata(path: Path, name: str = METADATA) -> Metadata:
    """Directory ``path``'s DCP metadata, unpickled safely; Refused for one that names anything
    else, or shard files outside the directory (FileNotFoundError: none; other errors: damaged)."""
    with open(path / name, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except _Forbidden as exc:
            raise Refused(f"refusing {path}: its {name} names {exc}, which could run code when "
                          "loaded (only torch.distributed.checkpoint's own records are "
                          f"accepted); {TRUST}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise ValueError(f"it holds a {type(metadata).__name__}, not DCP's metadata")
    for info in metadata.storage_data.values():
        shard = getattr(info, "relative_path", None)
        if not _plain_name(shard):
            raise Refused(f"refusing {path}: its {name} places a shard at {shard!r}, not a file "
                          f"in the directory; {TRUST}")
    return metadata


class Reader(FileSystemReader):
    """DCP's file system reader, with ``read_metadata``'s safe unpickling; ``refused``: its
    refusal (DCP takes any error reading .metadata for a missing one and reads on)."""

    refused: Refused | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # DCP's per-rank metadata, when saved without coordination
        try:
            metadata = read_metadata(Path(self.path),
                                     METADATA if rank is None else f"__{rank}{METADATA}")
        except Refused as exc:
            self.refused = self.refused or exc
            raise
        if metadata.storage_meta is None:  # as FileSystemReader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _UnsafeValue(Exception):
    """A value (its key ``fqn``) that weights_only would not load; ``what`` says why."""

    def __init__(self, fqn: str, what: str) -> None:
        super().__init__(f"{fqn}: {what}")
        self.fqn, self.what = fqn, what


class _SafeValues:
    """``load_bytes`` of DCP's planners with weights_only (theirs call torch.load unsafely)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"GLOBAL (\S+)", str(exc))
            raise _UnsafeValue(fqn, f"it calls {found.group(1)}" if found else
                               "unsupported pickle content") from None
        if self.flatten_state_dict:  # what DefaultLoadPlanner.load_bytes does with it
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class Planner(_SafeValues, DefaultLoadPlanner):
    """DCP's default load planner, its values loaded with weights_only."""


class _EverythingPlanner(_SafeValues, _EmptyStateDictLoadPlanner):
    """The planner of DCP's ``dcp_to_torch_save`` (every entry), values with weights_only."""


@contextlib.contextmanager
def _refusals_named(reader: Reader) -> Iterator[None]:
    """A refusal inside DCP's load (which wraps every error) raised as itself."""
    try:
        yield
    except CheckpointException as exc:
        if reader.refused is not None:
            raise reader.refused from None
        for error, _ in exc.failures.values():
            if isinstance(error, Refused):  # another rank's
                raise error from None
            if isinstance(error, _UnsafeValue):
                raise Refused(f"refusing {reader.path}: its value {error.fqn} contains Python "
                              "objects that could run code when loaded (only tensors and plain "
                              f"values are accepted; {error.what}); {TRUST}") from None
        raise


def load(state: dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """``dcp.load`` of ``state`` from directory ``path``, read safely; Refused, or DCP's
    CheckpointException for damage. Collective unless ``no_dist``."""
    reader = Reader(path)
    with _refusals_named(reader):
        dcp.load(state, storage_reader=reader, planner=Planner(), no_dist=no_dist)


def load_everything(path: Path) -> dict[str, Any]:
    """Every entry of directory ``path`` in this process (as DCP's ``dcp_to_torch_save`` reads
    it, whose reader cannot be chosen), read safely."""
    state: dict[str, Any] = {}
    reader = Reader(path)
    with _refusals_named(reader):
        _load_state_dict(state, storage_reader=reader, planner=_EverythingPlanner(),
                         no_dist=True)
    return state
