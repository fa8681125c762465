"""RNG states in checkpoints: every rank's captured, gathered to rank 0, and restored.

Stored as tensors and plain containers only, so checkpoints load with ``weights_only=True``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, CUDA per device)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                  float(gauss)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what ``capture_rng`` returned (checkpoints without numpy/cuda entries too)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng(rank: int, world_size: int) -> list[dict[str, Any]] | None:
    """Every rank's RNG state, on rank 0 (None elsewhere). Collective."""
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
