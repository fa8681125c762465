"""The trainer's three speed comparisons in one run, side by side, with the ratios.

1. data pipeline img/s per worker (one thread): classic PIL vs ours, and decode alone (ceiling);
2. train step img/s: fp32 / channels_last / bf16 / bf16+channels_last, the fp32 and bf16 matmul
   peaks, and the fraction of peak each variant reaches;
3. end-to-end main.py img/s on a JPEG folder: the classic settings vs ours with the fast settings.

Sections 1 and 3 use the same photo-like ImageNet-size JPEGs (generated, or --data DIR's train
images). It only drives the subcommands data, train-step and e2e; see their --help for what each
measures. Run by hand (not a test), on a quiet machine::

    python benchmarks/bench.py speed                          # everything, ~15-30 min on 2 cores
    python benchmarks/bench.py speed --skip e2e --steps 4     # sections 1 and 2 only

Flags it does not know go to main.py in section 3 (as with e2e).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.cases import data as bench_data
from benchmarks.cases import e2e as bench_e2e
from benchmarks.cases import train_step as bench_train_step

PASSES_FLAGS_TO_MAIN = True  # bench.py: the flags it does not know go to main.py (section 3)
SECTIONS = ("data", "step", "e2e")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the three sections; unknown ones are main.py flags for section 3."""
    parser.allow_abbrev = False  # a main.py flag must not pass for an abbreviation of ours
    parser.epilog = "Unknown flags are passed to main.py (section 3)."
    parser.add_argument("--skip", nargs="+", choices=SECTIONS, default=[],
                        help="sections to leave out")
    data = parser.add_argument_group("1. data pipeline")
    data.add_argument("--num-images", type=int, default=200, help="images timed per pipeline")
    data.add_argument("--passes", type=int, default=3, help="timed passes; the best counts")
    data.add_argument("--crop", type=int, default=224, help="crop, pixels")
    step = parser.add_argument_group("2. train step")
    step.add_argument("--step-arch", default="resnet18",
                      help="architecture of the timed step (default: resnet18)")
    step.add_argument("--step-batch", type=int, default=32,
                      help="images per timed step (default: 32)")
    step.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    step.add_argument("--threads", type=int, default=2, help="torch threads for the step")
    bench_e2e.add_run_arguments(parser.add_argument_group("3. end to end"), per_class=50)


def data_section(paths: Sequence[Path], args: argparse.Namespace) -> dict[str, float]:
    """Section 1; returns its headline ratios."""
    torch.set_num_threads(1)  # per worker: a loader worker runs one thread
    print(f"\n=== 1. data pipeline, per worker (1 thread): {bench_data.describe(paths)}")
    rates = bench_data.measure(paths, crop=args.crop, passes=args.passes)["train"]
    ours, classic = rates["ours, backend=tensor (uint8)"], rates["classic PIL (float, normalised)"]
    ceiling = rates["decode_jpeg only (ceiling)"]
    return {"data: ours / classic (train)": ours / classic,
            "data: ours / decode-only ceiling": ours / ceiling}


def step_section(args: argparse.Namespace) -> dict[str, float]:
    """Section 2; returns its headline ratios."""
    torch.set_num_threads(args.threads)
    print("\n=== 2. train step (synthetic uint8 batches, our train_one_epoch)")
    result = bench_train_step.measure(args.step_arch, args.step_batch, args.crop, args.steps)
    rates = result["rates"]
    out = {f"step: {v} / fp32": rates[v] / rates["fp32"] for v in rates if v != "fp32"}
    out.update({f"step: {v}, fraction of fp32 matmul peak": f
                for v, f in result["of_fp32_peak"].items()})
    out.update({f"step: {v}, fraction of bf16 matmul peak": f
                for v, f in result["of_peak"].items() if "bf16" in v})
    return out


def e2e_section(data: Path, workdir: Path, args: argparse.Namespace) -> dict[str, float]:
    """Section 3; returns its headline ratio."""
    print("\n=== 3. end to end, main.py, one epoch")
    records = bench_e2e.compare(data, workdir, args)
    classic = records.get(bench_e2e.CLASSIC)
    out = {}
    for name, record in records.items():
        if name != bench_e2e.CLASSIC and record and classic:
            out[f"e2e: {name} / classic"] = (record["train_images_per_sec"]
                                             / classic["train_images_per_sec"])
    return out


def run(args: argparse.Namespace) -> None:
    """Run the sections that are not skipped and print the ratios together at the end."""
    torch.manual_seed(0)
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None and ("data" not in args.skip or "e2e" not in args.skip):
            data = bench_e2e.make_folder(Path(tmp) / "data", args.classes, args.per_class)
        if "data" not in args.skip:
            paths = sorted(p for p in (data / "train").rglob("*")
                           if p.suffix.lower() in bench_data.IMAGE_SUFFIXES)
            ratios.update(data_section(paths[:: max(1, len(paths) // args.num_images)]
                                       [: args.num_images], args))
        if "step" not in args.skip:
            ratios.update(step_section(args))
        if "e2e" not in args.skip:
            ratios.update(e2e_section(data, Path(tmp), args))
    print("\n=== ratios")
    for name, value in ratios.items():
        print(f"{name:<58}" + (f"{value:8.0%}" if "fraction" in name else f"{value:8.2f}x"))
