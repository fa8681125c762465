"""RNG states in checkpoints: every rank's captured, gathered to rank 0, and restored.

Stored as tensors and plain containers only, so checkpoints load with ``weights_only=True``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from imagenet.settings import devices


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, CUDA per device)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                  float(gauss)),
        "torch": torch.get_rng_state(),
    }
    if devices.rng_device() is not None:
        # This process's device only: a restart may see fewer GPUs per process (torchrun with
        # 8 visible -> srun --gpus-per-task=1), and the others' streams are not this rank's.
        state["cuda_device"] = devices.get_rng_state()
    return state


def cuda_state_to_restore(state: dict[str, Any], device: int, devices: int
                          ) -> torch.Tensor | None:
    """The saved CUDA RNG state for this process's device ``device`` of ``devices`` visible.

    Older checkpoints hold every visible device's state ("cuda"); only an entry for ``device``
    applies, and one that this process cannot see is skipped instead of raising IndexError.
    """
    if "cuda_device" in state:
        return state["cuda_device"]
    every = state.get("cuda") or []
    return every[device] if device < min(len(every), devices) else None


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what ``capture_rng`` returned (checkpoints without numpy/cuda entries too)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    used = devices.rng_device()
    if used is not None:
        cuda = cuda_state_to_restore(state, *used)
        if cuda is not None:
            devices.set_rng_state(cuda)


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
