"""Progressive resizing under --compile: graphs compiled, compile time and step time per size.

Runs the trainer's real training step (engine.train_one_epoch through build_engine) on synthetic
uint8 batches, epoch after epoch at growing crop sizes (each epoch ends with a short batch, as a
data set that does not divide by the batch does), then validates at the validation size.
Variants: "static" is main.py --compile (models.compile_model: static shapes, a graph
per size and batch shape), "dynamic" plain torch.compile (a dynamic-shape graph after the first
change of size), "eager" no compile. torch's own counters count the graphs. Run by hand:

    python benchmarks/bench.py progressive -a resnet18 -b 16 --sizes 96 112 128 --val-size 160
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchvision

from benchmarks import harness
from imagenet.evaluation.validate import evaluate
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import Layout
from imagenet.settings.plan import fixed_plan
from imagenet.training.engine import Step, train_one_epoch
from imagenet.training.models import compile_model
from imagenet.training.optim import build_engine


def batches(n: int, batch: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(size)
    return [(torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8, generator=g),
             torch.randint(0, 10, (b,), generator=g)) for b in [batch] * n + [batch // 2 + 1]]


def graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def run_variant(variant: str, args: argparse.Namespace) -> list[dict]:
    """One row per size (and one for validation): graphs so far, first and typical step."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    flags = ["data", "-a", args.arch, "--epochs", str(len(args.sizes)), "--train-crop-size",
             str(args.sizes[-1]), "--train-crop-start", str(args.sizes[0]),
             "--train-crop-ramp", "0", str(len(args.sizes) - 1), "--train-crop-multiple", "8"]
    cfg = parse_config(flags)
    raw = torchvision.models.get_model(args.arch, num_classes=10)
    sizes = len(fixed_plan(cfg, Layout(1, 1, 1, 0)).train_sizes)
    model = {"static": lambda: compile_model(raw, "inductor", sizes),
             "dynamic": lambda: torch.compile(raw),
             "eager": lambda: raw}[variant]()
    engine = build_engine(cfg, raw, model, torch.device("cpu"), Layout(1, args.batch, 1, 0),
                          args.steps + 1, 10)
    rows = []
    for epoch, size in enumerate(args.sizes):
        times = []
        for images, target in batches(args.steps, args.batch, size):
            start = time.perf_counter()
            train_one_epoch(engine, [(images, target)], Step(epoch))
            times.append(time.perf_counter() - start)
        rows.append({"size": size, "graphs": graphs(), "first_s": times[0],
                     "step_ms": 1000 * statistics.median(times[1:-1])})
    val = batches(args.steps, args.batch, args.val_size)
    start = time.perf_counter()
    evaluate(engine, model, val, sum(len(target) for _, target in val))
    rows.append({"size": f"val {args.val_size}", "graphs": graphs(),
                 "first_s": time.perf_counter() - start, "step_ms": float("nan")})
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    p.add_argument("-a", "--arch", default="resnet18",
                   help="torchvision architecture (default: %(default)s)")
    p.add_argument("-b", "--batch", type=int, default=16,
                   help="images per full batch (default: %(default)s)")
    p.add_argument("--sizes", type=int, nargs="+", default=[96, 112, 128],
                   help="training crop sizes, px, one epoch each (default: 96 112 128)")
    p.add_argument("--val-size", type=int, default=160,
                   help="validation crop, px (default: %(default)s)")
    p.add_argument("--steps", type=int, default=4,
                   help="full batches per size (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2,
                   help="torch CPU threads (default: %(default)s)")
    p.add_argument("--variants", nargs="+", default=["static", "dynamic", "eager"],
                   help="what to compare: static (main.py --compile), dynamic (plain "
                        "torch.compile), eager (default: all three)")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    print(f"{args.arch}, batch {args.batch} (+ a short batch per epoch), {args.threads} threads")
    table = harness.Table(("variant", "8", ""), ("size", ">8", ""), ("graphs", ">6", ""),
                          ("first step s", ">12", ".2f"), ("step ms", ">8", ".1f"), sep=" ")
    table.header()
    for variant in args.variants:
        for row in run_variant(variant, args):
            table.row(variant, str(row["size"]), row["graphs"], row["first_s"], row["step_ms"])
