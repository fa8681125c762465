"""End-to-end main.py throughput on a JPEG folder: the classic settings vs ours, in one run.

Makes an ImageFolder of photo-like ImageNet-size JPEGs (or takes --data DIR), then trains one
epoch with each configuration as a subprocess and reads the throughput back from metrics.jsonl:

- classic: the PIL pipeline in fp32 (``--image-backend pil``), as pytorch/examples trains;
- ours, fp32: the fast data path alone (``--image-backend tensor``);
- ours, fast: the fast data path plus ``--amp bf16 --channels-last``.

Run by hand (not a test)::

    python benchmarks/bench.py e2e                       # generated data, resnet18, 224 px
    python benchmarks/bench.py e2e --data /data/imagenet-subset -a resnet50
    python benchmarks/bench.py e2e -a mobilenet_v3_small --train-crop-size 128 --lr 0.05

Any flag this subcommand does not know is passed to main.py for every configuration (no ``--``
needed). On a CPU-only machine the model step dominates; use a small --arch (e.g.
mobilenet_v3_small) or a smaller crop to see the data path's share.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks import harness

PASSES_FLAGS_TO_MAIN = True  # bench.py: the flags it does not know go to main.py
CLASSIC = "classic (PIL, fp32)"
CONFIGS = {
    CLASSIC: ["--image-backend", "pil"],
    "ours, fp32 (tensor decode)": ["--image-backend", "tensor"],
    "ours, fast (tensor+bf16+channels_last)": ["--image-backend", "tensor", "--amp", "bf16",
                                               "--channels-last"],
}


def make_folder(root: Path, classes: int, per_class: int) -> Path:
    """train/ and val/ of photo-like JPEGs (val: a quarter as many)."""
    for split, n in (("train", per_class), ("val", max(1, per_class // 4))):
        for c in range(classes):
            harness.write_photo_like_jpegs(root / split / f"c{c}", n,
                                           seed=1000 * c + (split == "val"))
    return root


def one_epoch(data: Path, out: Path, flags: Sequence[str], args: argparse.Namespace
              ) -> dict | None:
    """One epoch of main.py: its metrics.jsonl record, or None (stderr shown) if it failed."""
    proc = harness.run_main([str(data), "-a", args.arch, "-b", str(args.batch_size), "-j",
                             str(args.workers), "--epochs", "1", "-p", "1000", "--output-dir",
                             str(out), *flags, *args.main_args])
    if proc.returncode != 0:
        print(f"\n!! {harness.failure(proc)}", file=sys.stderr, flush=True)
        return None
    return harness.last_metrics(out)


def compare(data: Path, workdir: Path, args: argparse.Namespace,
            configs: dict[str, list[str]] = CONFIGS) -> dict[str, dict | None]:
    """Train one epoch per configuration on ``data``; print and return each metrics record."""
    print(f"{args.arch}, -b {args.batch_size}, -j {args.workers}, data {data}; main.py flags "
          f"for all: {' '.join(args.main_args) or '(none)'}")
    print(f"{'configuration':<40}{'train img/s':>12}{'vs classic':>11}{'val acc1':>9}",
          flush=True)
    records: dict[str, dict | None] = {}
    for i, (name, flags) in enumerate(configs.items()):
        records[name] = record = one_epoch(data, workdir / f"run{i}", flags, args)
        if record is None:
            print(f"{name:<40}{'failed':>12}", flush=True)
            continue
        rate = record["train_images_per_sec"]
        base = (records.get(CLASSIC) or {}).get("train_images_per_sec")
        ratio = f"{rate / base:10.2f}x" if base else f"{'n/a':>11}"
        print(f"{name:<40}{rate:12.1f}{ratio}{record['val_acc1']:9.2f}", flush=True)
    return records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's flags; the rest of the command line goes to main.py."""
    parser.allow_abbrev = False  # a main.py flag must not pass for an abbreviation of ours
    parser.epilog = "Unknown flags are passed to main.py."
    add_run_arguments(parser, per_class=48)


def add_run_arguments(group, per_class: int) -> None:
    """The flags of the main.py runs and of the data generated for them (speed's too)."""
    group.add_argument("--data", type=Path, help="ImageFolder root (default: generate one)")
    group.add_argument("-a", "--arch", default="resnet18", help="main.py -a (default: resnet18)")
    group.add_argument("-b", "--batch-size", type=int, default=32, help="main.py -b (default: 32)")
    group.add_argument("-j", "--workers", type=int, default=2, help="main.py -j (default: 2)")
    group.add_argument("--classes", type=int, default=4, help="generated classes")
    group.add_argument("--per-class", type=int, default=per_class,
                       help=f"generated train images/class (default: {per_class})")


def run(args: argparse.Namespace) -> int:
    """Generate or take the data, run every configuration; exit 1 if any failed."""
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or make_folder(Path(tmp) / "data", args.classes, args.per_class)
        records = compare(data, Path(tmp), args)
    return 0 if all(records.values()) else 1
