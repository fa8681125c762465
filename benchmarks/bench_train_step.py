"""Train-step throughput: fp32 vs channels_last vs bf16 vs bf16+channels_last, side by side.

Runs our real training step (imagenet.engine.train_one_epoch) on synthetic uint8 batches, so it
measures what main.py does per step, and reports the machine's fp32/bf16 matmul peak and the share
of it the step reaches. Run by hand (not a test):

    python benchmarks/bench_train_step.py -a resnet18 -b 32 --size 224 --threads 2 --steps 6
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from imagenet.config import parse_config  # noqa: E402
from imagenet.engine import Step, TrainContext, train_one_epoch  # noqa: E402
from imagenet.optim import build_criterion, build_optimizer, build_scheduler  # noqa: E402

VARIANTS = {"fp32": ([], None), "channels_last": (["--channels-last"], None),
            "bf16": (["--amp", "bf16"], torch.bfloat16),
            "bf16+channels_last": (["--amp", "bf16", "--channels-last"], torch.bfloat16)}


def matmul_peak(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """Achieved GFLOP/s of an n x n matmul (the practical peak of this CPU for ``dtype``)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e9


def train_flops_per_image(arch: str, size: int) -> float:
    """Forward FLOPs x 3 (forward + backward), counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    model = torchvision.models.get_model(arch)
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(1, 3, size, size))
    return 3.0 * counter.get_total_flops()


def step_rate(arch: str, batch: int, size: int, steps: int, variant: str) -> float:
    """Images per second of our train step for one precision/layout variant."""
    flags, dtype = VARIANTS[variant]
    cfg = parse_config(flags + ["-a", arch, "-b", str(batch)])
    torch.manual_seed(0)
    model = torchvision.models.get_model(arch)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model, cfg)
    ctx = TrainContext(model=model, criterion=build_criterion(cfg), optimizer=optimizer,
                       scheduler=build_scheduler(optimizer, cfg, 1000),
                       device=torch.device("cpu"), steps_per_epoch=steps, amp_dtype=dtype,
                       channels_last=cfg.channels_last, print_freq=10**6)
    images = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8)
    target = torch.randint(0, 1000, (batch,))
    train_one_epoch(ctx, [(images, target)] * 2, Step())  # warm-up (allocator, oneDNN kernels)
    start = time.perf_counter()
    train_one_epoch(ctx, [(images, target)] * steps, Step())
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-a", "--arch", default="resnet18")
    parser.add_argument("-b", "--batch-size", type=int, default=32)
    parser.add_argument("--size", type=int, default=224, help="image size, pixels")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peak = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    flops = train_flops_per_image(args.arch, args.size)
    print(f"{args.arch} {args.size}px batch {args.batch_size}, {args.threads} threads; "
          f"{flops / 1e9:.2f} GFLOP per trained image")
    print(f"matmul peak: fp32 {peak['fp32']:.1f} GFLOP/s, bf16 {peak['bf16']:.1f} GFLOP/s")
    print(f"{'variant':<20}{'img/s':>8}{'vs fp32':>9}{'GFLOP/s':>9}{'of peak':>9}")
    base = None
    for variant in VARIANTS:
        rate = step_rate(args.arch, args.batch_size, args.size, args.steps, variant)
        base = base or rate
        achieved = rate * flops / 1e9
        p = peak["bf16" if "bf16" in variant else "fp32"]
        print(f"{variant:<20}{rate:8.1f}{rate / base:8.2f}x{achieved:9.0f}{achieved / p:8.0%}")


if __name__ == "__main__":
    main()
