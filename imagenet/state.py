"""The full run state of every rank: RNG states, gathered to rank 0, and restored."""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.distributed as dist


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (python, torch CPU, CUDA per device)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what ``capture_rng`` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng(rank: int, world_size: int) -> list[dict[str, Any]] | None:
    """Every rank's RNG state, on rank 0 (None elsewhere)."""
    own = capture_rng()
    if world_size == 1 or not dist.is_initialized():
        return [own]
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(own, gathered, dst=0)
    return gathered


def rng_for_rank(saved: list[dict[str, Any]] | None, rank: int) -> dict[str, Any] | None:
    """The saved RNG state of ``rank``, if the checkpoint has one for it."""
    if not saved or rank >= len(saved):
        return None
    return saved[rank]
