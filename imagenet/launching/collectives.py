"""The ranks together: who this process is (``DistInfo``), one rank's error raised on every rank
(also a check only rank 0 makes), rank 0's value on every rank, every rank's value, a barrier.
Each works without a process group too (one process).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from imagenet.errors import RunError, TrainerError, on_every_rank

Result = TypeVar("Result")


@dataclass(frozen=True)
class DistInfo:
    """Who this process is; passed around instead of writing into the config."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: no process group

    @property
    def distributed(self) -> bool:
        """True when a process group exists (DDP is used)."""
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only writer of files and progress."""
        return self.rank == 0


def raise_agreed(error: Exception | None) -> None:
    """Every rank raises the error of the lowest rank that has one, or none does. Collective.

    For checks that one rank (or each rank on its share) makes before the ranks go on together:
    a rank that stopped alone would leave the others waiting in their next collective.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Exception | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, error)
        first = next((i for i, e in enumerate(gathered) if e is not None), None)
        if first is not None and first != dist.get_rank():
            error = gathered[first]  # a copy; this rank's own error keeps its traceback
    if isinstance(error, TrainerError):
        on_every_rank(error)  # no rank has to tell the others (failures)
    if error is not None:
        raise error


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (``value`` without a process group). Collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def share() -> tuple[int, int]:
    """This rank and the world size ((0, 1) without a process group): a part of some work."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gathered(value: Any) -> list[Any]:
    """Every rank's ``value``, by rank (``[value]`` without a process group). Collective."""
    rank, world_size = share()
    if world_size == 1:
        return [value]
    values: list[Any] = [None] * world_size
    dist.all_gather_object(values, value)
    return values


def barrier() -> None:
    """Wait for all ranks (no-op without a process group)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def on_rank0(info: DistInfo, check: Callable[[], Result]) -> Result | None:
    """``check()`` on rank 0; its TrainerError is raised on every rank. Collective."""
    error, result = None, None
    if info.is_main:
        try:
            result = check()
        except TrainerError as exc:
            error = exc
        except Exception as exc:
            # A bug: the other ranks must not wait for rank 0 forever; rank 0 keeps the cause.
            error = RunError(f"rank 0 failed its start-up checks ({type(exc).__name__}: {exc})")
            error.__cause__ = exc
    raise_agreed(error)
    return result
