"""The check of the validation images before training: what it costs next to decoding them.

Before the first step, every rank checks its shard of val/ with ``transforms.check_image_file``
(a JPEG or PNG is accepted from its first 8 and last 12 bytes; anything else is decoded). This
script times that check and a full decode (``transforms.load_image``, what validation does
before resizing) on the same files, and extrapolates to ImageNet's 50,000 validation images.
Run by hand (not a test)::

    # Draws 3,000 ImageNet-sized JPEGs (500x375, quality 90) under --work-dir, then times.
    python benchmarks/bench.py val-check

    # Real data (the first --limit images of val/):
    python benchmarks/bench.py val-check --data /data/imagenet --limit 5000

The page cache is left as it is: the first pass over freshly drawn files is warm. To see a cold
network filesystem, point --data at it before anything else has read it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks import harness
from imagenet.data.transforms import check_image_file, load_image

IMAGENET_VAL = 50_000


def draw_images(folder: Path, count: int) -> list[Path]:
    """``count`` 500x375 JPEGs of smooth noise (about ImageNet's median size and file size)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = sorted(folder.glob("*.jpg"))
    if len(paths) >= count:
        return paths[:count]
    rng = np.random.default_rng(0)
    for i in range(len(paths), count):
        small = rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)
        img = Image.fromarray(small).resize((500, 375), Image.BICUBIC)
        img.save(folder / f"{i:06d}.jpg", quality=90)
    return sorted(folder.glob("*.jpg"))[:count]


def seconds(fn, paths: list[Path]) -> float:
    """Wall time of ``fn(path, "tensor")`` over ``paths``."""
    def every_path() -> None:
        for path in paths:
            fn(path, "tensor")

    return harness.seconds(every_path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    parser.add_argument("--data", type=Path, help="dataset root with val/ (default: draw JPEGs)")
    parser.add_argument("--limit", type=int, default=3000, help="images (default: 3000)")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/bench_val_check"),
                        help="where the drawn JPEGs are kept (default: runs/bench_val_check)")


def run(args: argparse.Namespace) -> None:
    if args.data:
        paths = sorted((args.data / "val").glob("*/*"))[:args.limit]
    else:
        paths = draw_images(args.work_dir / "val", args.limit)
    mean_kb = sum(p.stat().st_size for p in paths) / len(paths) / 1000
    print(f"{len(paths)} images, {mean_kb:.0f} kB on average")
    check = seconds(check_image_file, paths)
    decode = seconds(load_image, paths)
    for name, total in (("check before training", check), ("full decode", decode)):
        per = total / len(paths)
        print(f"{name:>22}: {total:7.2f} s, {per * 1e6:8.0f} us/image; ImageNet val "
              f"({IMAGENET_VAL:,}) {per * IMAGENET_VAL:7.1f} s on one rank, "
              f"{per * IMAGENET_VAL / 8:6.1f} s on each of 8")
    print(f"the check costs {check / decode:.1%} of decoding the same images")
