"""CUDA-only paths; each test skips cleanly on a machine without a GPU (CI has none).

What can be checked on the CPU is checked elsewhere (bf16 autocast, the backend choice, pinned
memory being asked for only on CUDA, the device data path's geometry, the compile order and
counts); these need the real device. The slow ones are benchmarks/gpu_smoke.py's checks at a
small scale: every launcher on all local GPUs, DDP / FSDP / compile / bf16 / channels_last,
SIGTERM + resume bitwise, ResNet-50 on --dummy and JPEGs.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import ROOT, tiny_engine, tiny_net, write_image_folder

from imagenet.data import device as gpu_data
from imagenet.data import prefetch
from imagenet.data.folder import build_datasets
from imagenet.data.samplers import SeededDataset
from imagenet.settings.flags import parse_config
from imagenet.settings.images import crop_schedule
from imagenet.training.engine import Step, train_one_epoch

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_smoke  # noqa: E402

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
    from imagenet.settings.launch import choose_backend

    assert torch.distributed.is_nccl_available()
    assert choose_backend(None, "cuda") == "nccl"


def test_nvjpeg_crops_are_the_cpu_path_s_crops(tmp_path: Path):
    """The same boxes and flips from the same seeds; nvJPEG's pixels differ from libjpeg-turbo's
    by rounding only."""
    root = write_image_folder(tmp_path / "data", classes=2, train_per_class=8, size=64)
    cfg = parse_config(["data", "--train-crop-size", "32"])
    cpu_set, _, _ = build_datasets(cfg, crop_schedule(cfg), root)
    encoded, _, _ = build_datasets(cfg, crop_schedule(cfg), root, encoded=True)
    keys = [(1, i) for i in range(len(cpu_set))]
    cpu = torch.stack([SeededDataset(cpu_set, 3)[k][0] for k in keys]).float()
    batch = gpu_data.collate([SeededDataset(encoded, 3)[k] for k in keys])
    images, labels = gpu_data.device_crops(cfg)[0](batch, torch.device("cuda"))
    assert images.is_cuda and labels.is_cuda and images.shape == cpu.shape
    diff = (images.cpu().float() - cpu).abs()
    assert diff.mean() < 2 and diff.amax() < 40, (diff.mean(), diff.amax())


def test_side_stream_batches_arrive_whole():
    """Batches copied on the side stream equal their source when the training stream uses
    them (the stream waits, the memory is not reused early)."""
    device = torch.device("cuda")
    batches = [(torch.full((64, 3, 32, 32), i, dtype=torch.uint8).pin_memory(),
                torch.full((64,), i).pin_memory()) for i in range(20)]
    seen = []
    for images, labels in prefetch.device_batches(batches, device, None):
        assert images.is_cuda and labels.is_cuda
        seen.append((int(images.float().mean()), int(labels[0])))
        torch.cuda._sleep(100_000)  # a busy training stream
    assert seen == [(i, i) for i in range(20)]


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> gpu_smoke.Node:
    """gpu_smoke's node at its small scale, with its JPEG folders written."""
    node = gpu_smoke.Node(torch.cuda.device_count(), tmp_path_factory.mktemp("smoke"),
                          gpu_smoke.SMALL)
    gpu_smoke.write_folders(node)
    return node


@pytest.mark.slow
@pytest.mark.parametrize("check", tuple(gpu_smoke.CHECKS))
def test_gpu_smoke_check(node: gpu_smoke.Node, check: str):
    results = gpu_smoke.CHECKS[check](node)
    assert results and all(r.ok is not False for r in results), gpu_smoke.table(results)
