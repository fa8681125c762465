"""Train-step throughput: fp32 vs channels_last vs bf16 vs bf16+channels_last, side by side.

Runs our real training step (imagenet.training.engine.train_one_epoch) on synthetic uint8 batches,
so it measures what main.py does per step, next to the textbook torch loop on the same model and
variant (the reference it must keep up with), and reports the machine's fp32/bf16 matmul peak and
the share of it the step reaches. Run by hand (not a test):

    python benchmarks/bench.py train-step -a resnet18 -b 32 --size 224 --threads 2 --steps 6

``--distill TEACHER_ARCH`` times the step instead without and with a --distill-teacher of that
architecture (its forward on every batch, no gradients): the teacher's extra cost per step.

    python benchmarks/bench.py train-step -a resnet18 --distill resnet50 -b 32 --size 224
"""

from __future__ import annotations

import argparse
import time

import torch
import torchvision

from benchmarks import harness
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import Layout
from imagenet.training.engine import Step, train_one_epoch
from imagenet.training.optim import build_engine

VARIANTS = {"fp32": ([], None), "channels_last": (["--channels-last"], None),
            "bf16": (["--amp", "bf16"], torch.bfloat16),
            "bf16+channels_last": (["--amp", "bf16", "--channels-last"], torch.bfloat16)}


def matmul_peak(dtype: torch.dtype, budget: float = 3.0) -> float:
    """Best achieved GFLOP/s of square matmuls (the practical peak of this CPU for ``dtype``).

    Sizes grow from 256 to 2048 while one product takes under ``budget``/8 seconds: a CPU
    without native bf16 (no AVX512-BF16/AMX) multiplies bf16 at ~1 GFLOP/s, where a fixed 2048
    matmul would take a minute.
    """
    best, n = 0.0, 256
    while n <= 2048:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        start = time.perf_counter()
        a @ b  # warm-up (and the size probe)
        first = time.perf_counter() - start
        reps = max(1, min(5, int(budget / 8 / max(first, 1e-9))))
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - start) / 1e9)
        if first > budget / 8:
            break
        n *= 2
    return best


def train_flops_per_image(arch: str, size: int) -> float:
    """Forward FLOPs x 3 (forward + backward), counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    model = torchvision.models.get_model(arch).eval()  # eval: batch 1 at any size (BatchNorm)
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
    engine = build_engine(cfg, model, model, torch.device("cpu"), Layout(1, batch, 1, 0),
                          steps, 1000)
    assert engine.opts.amp_dtype == dtype
    images = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8)
    target = torch.randint(0, 1000, (batch,))
    return timed(lambda n: train_one_epoch(engine, [(images, target)] * n, Step()), batch, steps)


def timed(run_steps, batch: int, steps: int) -> float:
    """Images per second of ``run_steps(steps)`` after ``run_steps(2)`` as warm-up (allocator,
    oneDNN kernel selection)."""
    run_steps(2)
    return batch * steps / harness.seconds(lambda: run_steps(steps))


def plain_rate(arch: str, batch: int, size: int, steps: int, variant: str) -> float:
    """Images per second of the textbook torch loop (float batch ready, SGD, nothing else):
    the reference our step is held to, under the same precision/layout variant."""
    flags, dtype = VARIANTS[variant]
    channels_last = "--channels-last" in flags
    torch.manual_seed(0)
    model = torchvision.models.get_model(arch)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    criterion = torch.nn.CrossEntropyLoss()
    images = torch.randn(batch, 3, size, size).contiguous(memory_format=fmt)
    target = torch.randint(0, 1000, (batch,))

    def run_steps(n: int) -> None:
        for _ in range(n):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = criterion(model(images), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return timed(run_steps, batch, steps)


def measure(arch: str, batch: int, size: int, steps: int,
            variants: list[str] | None = None) -> dict:
    """Print and return the matmul peaks, FLOPs per image and each variant's img/s."""
    peak = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    flops = train_flops_per_image(arch, size)
    print(f"{arch} {size}px batch {batch}, {torch.get_num_threads()} threads; "
          f"{flops / 1e9:.2f} GFLOP per trained image")
    print(f"matmul peak: fp32 {peak['fp32']:.1f} GFLOP/s, bf16 {peak['bf16']:.1f} GFLOP/s")
    if peak["bf16"] < peak["fp32"]:
        print("  (bf16 matmul is slower than fp32 here: no native bf16 instructions. Autocast's "
              "bf16 convolutions go through oneDNN and can beat that rate, so see both columns)")
    print("ours = imagenet.training.engine's step from a uint8 batch; plain = the textbook torch "
          "loop on a ready float batch, same variant")
    print(f"{'variant':<20}{'img/s':>8}{'plain':>8}{'vs plain':>9}{'vs fp32':>9}{'GFLOP/s':>9}"
          f"{'of fp32 pk':>11}{'of own pk':>10}", flush=True)
    rates, plain, of_peak, of_fp32 = {}, {}, {}, {}
    for variant in variants or list(VARIANTS):
        rates[variant] = rate = step_rate(arch, batch, size, steps, variant)
        plain[variant] = plain_rate(arch, batch, size, steps, variant)
        achieved = rate * flops / 1e9
        of_fp32[variant] = achieved / peak["fp32"]
        of_peak[variant] = achieved / peak["bf16" if "bf16" in variant else "fp32"]
        print(f"{variant:<20}{rate:8.1f}{plain[variant]:8.1f}{rate / plain[variant]:8.2f}x"
              f"{rate / rates.get('fp32', rate):8.2f}x{achieved:9.0f}{of_fp32[variant]:11.0%}"
              f"{of_peak[variant]:10.0%}", flush=True)
    return {"peak": peak, "flops": flops, "rates": rates, "plain": plain, "of_peak": of_peak,
            "of_fp32_peak": of_fp32}


def distill_cost(arch: str, teacher_arch: str, batch: int, size: int, steps: int) -> dict:
    """Our fp32 step's time without and with a --distill-teacher of ``teacher_arch`` (randomly
    initialised: the weights do not change the cost), and the teacher's forward alone."""
    from imagenet.training.distill import Teacher

    cfg = parse_config(["-a", arch, "-b", str(batch)])
    images = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8)
    target = torch.randint(0, 1000, (batch,))
    torch.manual_seed(0)
    teacher_model = torchvision.models.get_model(teacher_arch).eval().requires_grad_(False)
    teacher = Teacher(teacher_model, teacher_arch, teacher_arch, "", 0.5, 1.0, "soft")
    seconds = {}
    for name, chosen in (("student", None), ("student + teacher", teacher)):
        torch.manual_seed(0)
        model = torchvision.models.get_model(arch)
        engine = build_engine(cfg, model, model, torch.device("cpu"), Layout(1, batch, 1, 0),
                              steps, 1000, teacher=chosen)
        rate = timed(lambda n, e=engine: train_one_epoch(e, [(images, target)] * n, Step()), batch,
                     steps)
        seconds[name] = batch / rate
    floats = torch.randn(batch, 3, size, size)
    seconds["teacher forward"] = batch / timed(
        lambda n: [teacher.outputs(floats) for _ in range(n)], batch, steps)
    extra = seconds["student + teacher"] - seconds["student"]
    print(f"{arch} student, {teacher_arch} teacher, {size}px batch {batch}, "
          f"{torch.get_num_threads()} threads (fp32)")
    for name, value in seconds.items():
        print(f"{name:<20}{1000 * value:9.1f} ms/step")
    print(f"the teacher's extra cost: {1000 * extra:.1f} ms/step, "
          f"+{extra / seconds['student']:.0%} of the student's step", flush=True)
    return {"seconds": seconds, "extra": extra}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    parser.add_argument("-a", "--arch", default="resnet18", help="architecture (default: resnet18)")
    parser.add_argument("-b", "--batch-size", type=int, default=32,
                        help="images per step (default: 32)")
    parser.add_argument("--size", type=int, default=224, help="image size, pixels")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="which variants to time (bf16 without native bf16 is slow)")
    parser.add_argument("--distill", metavar="TEACHER_ARCH", default=None,
                        help="time the step without and with a --distill-teacher of this "
                             "architecture instead of the variants")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    if args.distill:
        distill_cost(args.arch, args.distill, args.batch_size, args.size, args.steps)
        return
    measure(args.arch, args.batch_size, args.size, args.steps, args.variants)
