"""CUDA-only paths; each test skips cleanly on a machine without a GPU (CI has none).

What can be checked on the CPU is checked elsewhere (bf16 autocast, the backend choice, pinned
memory being asked for only on CUDA); these need the real device.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from imagenet.engine import Step, TrainContext, train_one_epoch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _epoch_syncs(steps: int) -> int:
    """Host-device syncs torch reports during one training epoch of ``steps`` steps."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ctx = TrainContext(model=model, criterion=nn.CrossEntropyLoss(), optimizer=opt,
                       scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                       device=device, steps_per_epoch=steps, print_freq=10**6,
                       amp_dtype=torch.bfloat16)
    batches = [(torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8).pin_memory(),
                torch.randint(0, 10, (4,)).pin_memory()) for _ in range(steps)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_one_epoch(ctx, batches, Step())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_training_steps_do_not_wait_for_the_device():
    # The epoch end reads its sums back (a few syncs); the steps themselves add none, so twice
    # the steps must not mean more syncs.
    assert _epoch_syncs(6) == _epoch_syncs(3)


def test_nccl_is_chosen_for_cuda():
    from imagenet.distributed import choose_backend

    assert torch.distributed.is_nccl_available()
    assert choose_backend(None, "cuda") == "nccl"
