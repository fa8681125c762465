"""End-to-end main.py throughput on a JPEG folder: the classic settings vs ours, in one run.

Makes an ImageFolder of photo-like ImageNet-size JPEGs (or takes DIR), then trains one epoch with
each configuration as a subprocess and reads the throughput back from metrics.jsonl. Run by hand:

    python benchmarks/bench_e2e.py                       # generated data, resnet18, 224 px
    python benchmarks/bench_e2e.py --data /data/imagenet-subset -a resnet50

On a CPU-only machine the model step dominates; use a small --arch (e.g. mobilenet_v3_small) or a
smaller crop to see the data path's share.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data import write_photo_like_jpegs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "classic (PIL, fp32)": ["--image-backend", "pil"],
    "ours (tensor decode)": ["--image-backend", "tensor"],
    "ours (tensor + channels_last)": ["--image-backend", "tensor", "--channels-last"],
}


def make_folder(root: Path, classes: int, per_class: int) -> Path:
    """train/ and val/ of photo-like JPEGs (val: a quarter as many)."""
    for split, n in (("train", per_class), ("val", max(1, per_class // 4))):
        for c in range(classes):
            write_photo_like_jpegs(root / split / f"c{c}", n, seed=1000 * c + (split == "val"))
    return root


def run(data: Path, out: Path, flags: list[str], args: argparse.Namespace) -> dict:
    """One epoch of main.py; returns its metrics.jsonl record."""
    cmd = [sys.executable, str(ROOT / "main.py"), str(data), "-a", args.arch, "-b",
           str(args.batch_size), "-j", str(args.workers), "--epochs", "1", "-p", "1000",
           "--output-dir", str(out), *flags, *args.extra]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="ImageFolder root (default: generate one)")
    parser.add_argument("-a", "--arch", default="resnet18")
    parser.add_argument("-b", "--batch-size", type=int, default=32)
    parser.add_argument("-j", "--workers", type=int, default=2)
    parser.add_argument("--classes", type=int, default=4)
    parser.add_argument("--per-class", type=int, default=48, help="generated train images/class")
    parser.add_argument("extra", nargs="*", help="more main.py flags for every configuration")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or make_folder(Path(tmp) / "data", args.classes, args.per_class)
        print(f"{args.arch}, -b {args.batch_size}, -j {args.workers}, data {data}")
        print(f"{'configuration':<32}{'train img/s':>12}{'vs classic':>11}{'val acc1':>9}")
        base = None
        for name, flags in CONFIGS.items():
            record = run(data, Path(tmp) / name.split()[0] / str(len(flags)), flags, args)
            rate = record["train_images_per_sec"]
            base = base or rate
            print(f"{name:<32}{rate:12.1f}{rate / base:10.2f}x{record['val_acc1']:9.2f}")


if __name__ == "__main__":
    main()
