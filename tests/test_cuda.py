"""CUDA-only paths; each test skips cleanly on a machine without a GPU (CI has none).

What can be checked on the CPU is checked elsewhere (bf16 autocast, the backend choice, pinned
memory being asked for only on CUDA); these need the real device.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import tiny_engine, tiny_net

from imagenet.engine import Step, train_one_epoch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _epoch_syncs(steps: int) -> int:
    """Host-device syncs torch reports during one training epoch of ``steps`` steps."""
    device = torch.device("cuda")
    model = tiny_net((8,), classes=10).to(device)
    engine = tiny_engine(model, "--lr", "0.01", "--wd", "0", "--amp", "bf16", "-p", "1000000",
                         steps=steps, batch=4, classes=10, device="cuda")
    batches = [(torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8).pin_memory(),
                torch.randint(0, 10, (4,)).pin_memory()) for _ in range(steps)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_one_epoch(engine, batches, Step())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_training_steps_do_not_wait_for_the_device():
    # The epoch end reads its sums back (a few syncs); the steps themselves add none, so twice
    # the steps must not mean more syncs.
    assert _epoch_syncs(6) == _epoch_syncs(3)


def test_nccl_is_chosen_for_cuda():
    from imagenet.launch import choose_backend

    assert torch.distributed.is_nccl_available()
    assert choose_backend(None, "cuda") == "nccl"
