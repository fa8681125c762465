"""The trainer's three speed comparisons in one run, side by side, with the ratios.

1. data pipeline img/s per worker (one thread): classic PIL vs ours, and decode alone (ceiling);
2. train step img/s: fp32 / channels_last / bf16 / bf16+channels_last, the fp32 and bf16 matmul
   peaks, and the fraction of peak each variant reaches;
3. end-to-end main.py img/s on a JPEG folder: the classic settings vs ours with the fast settings.

Sections 1 and 3 use the same photo-like ImageNet-size JPEGs (generated, or --data DIR's train
images). It only drives bench_data.py, bench_train_step.py and bench_e2e.py; see those for what
each measures. Run by hand (not a test), on a quiet machine::

    python benchmarks/bench_speed.py                          # everything, ~15-30 min on 2 cores
    python benchmarks/bench_speed.py --skip e2e --steps 4     # sections 1 and 2 only

Flags it does not know go to main.py in section 3 (as with bench_e2e.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_data  # noqa: E402
import bench_e2e  # noqa: E402
import bench_train_step  # noqa: E402

SECTIONS = ("data", "step", "e2e")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Flags of the three sections; unknown ones are main.py flags for section 3."""
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Unknown flags are passed to main.py (section 3).")
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
    e2e = parser.add_argument_group("3. end to end")
    e2e.add_argument("--data", type=Path, help="ImageFolder root (default: generate one)")
    e2e.add_argument("-a", "--arch", default="resnet18", help="main.py -a")
    e2e.add_argument("-b", "--batch-size", type=int, default=32, help="main.py -b")
    e2e.add_argument("-j", "--workers", type=int, default=2, help="main.py -j")
    e2e.add_argument("--classes", type=int, default=4, help="generated classes")
    e2e.add_argument("--per-class", type=int, default=50, help="generated train images/class")
    args, rest = parser.parse_known_args(argv)
    args.main_args = [a for a in rest if a != "--"]
    return args


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


def main(argv: Sequence[str] | None = None) -> None:
    """Run the sections that are not skipped and print the ratios together at the end."""
    args = parse_args(argv)
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


if __name__ == "__main__":
    main()
