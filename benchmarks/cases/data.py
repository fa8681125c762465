"""Per-core data-pipeline speed: classic PIL vs our tensor and PIL backends vs decode alone; the
tensor pipeline with each decoder (torchvision's decode_jpeg, TorchCodec's when installed).

Run by hand (not a test), e.g.::

    python benchmarks/bench.py data                # 200 generated photo-like JPEGs
    python benchmarks/bench.py data --images DIR   # your own JPEGs (searched recursively)

One process, one thread (DataLoader workers also run with one thread each), timed in CPU seconds:
img/s here x the number of workers is roughly what a loader can deliver on idle cores. Also
prints how far the tensor backend's validation images are from the PIL backend's (mean absolute
pixel difference), the prerequisite for both backends reaching the same accuracy.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision import transforms as v1
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from benchmarks.harness import write_photo_like_jpegs
from imagenet.data import transforms as T

IMAGE_SUFFIXES = {".jpg", ".jpeg"}


def images_per_second(paths: Sequence[Path], steps: dict[str, Callable[[Path], object]],
                      passes: int) -> dict[str, float]:
    """Images per CPU-second of each step over ``paths``, robust to load from other jobs.

    Every pass re-seeds the RNG, so it repeats the same crops; each image's time is its fastest
    over the passes, which drops the passes that other processes disturbed (caches, clocks).
    CPU time of this process, not wall time, so time spent descheduled does not count either.
    """
    for step in steps.values():  # warm-up: first-call allocations, lazy imports
        for path in paths[:10]:
            step(path)
    seconds = {name: np.full((passes, len(paths)), np.inf) for name in steps}
    for p in range(passes):
        for name, step in steps.items():  # take turns, so slow phases hit all pipelines
            torch.manual_seed(0)
            for i, path in enumerate(paths):
                start = time.process_time()
                step(path)
                seconds[name][p, i] = time.process_time() - start
    return {name: len(paths) / s.min(axis=0).sum() for name, s in seconds.items()}


def installed_torchcodec() -> bool:
    from imagenet.settings.images import torchcodec_installed

    return torchcodec_installed()


def pil_loader(path: Path) -> Image.Image:
    """torchvision ImageFolder's default loader, as the classic script uses it."""
    with open(path, "rb") as f:
        return Image.open(f).convert("RGB")


def decode_only(path: Path) -> torch.Tensor:
    """The ceiling: read + libjpeg-turbo decode, no transform."""
    return decode_jpeg(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8),
                       mode=ImageReadMode.RGB)


def pipelines(crop: int, resize: int, interpolation: str) -> dict[str, dict[str, Callable]]:
    """{"train"|"val": {name: path -> sample}} for every pipeline compared."""
    norm = v1.Normalize(T.IMAGENET_MEAN, T.IMAGENET_STD)
    classic_train = v1.Compose([v1.RandomResizedCrop(crop), v1.RandomHorizontalFlip(),
                                v1.ToTensor(), norm])
    classic_val = v1.Compose([v1.Resize(resize), v1.CenterCrop(crop), v1.ToTensor(), norm])
    plain_v2 = v2.Compose([v2.RandomResizedCrop(crop, antialias=True), v2.RandomHorizontalFlip()])

    def plain_v2_packed(path: Path) -> torch.Tensor:
        # Its output is HWC in memory; default_collate's stack would pay for packing it.
        return plain_v2(decode_only(path)).contiguous()

    def ours(tf: Callable, backend: str) -> Callable:
        return lambda path: tf(T.load_image(path, backend))

    def codec(tf: Callable) -> dict[str, Callable]:
        """The tensor pipeline with TorchCodec decoding (--decoder torchcodec), if installed."""
        if not installed_torchcodec():
            return {}
        return {"ours, tensor, --decoder torchcodec": ours(tf, "torchcodec")}

    train = {b: T.train_transform(crop, interpolation, backend=b) for b in T.BACKENDS}
    val = {b: T.val_transform(resize, crop, interpolation, backend=b) for b in T.BACKENDS}
    return {
        "train": {
            "classic PIL (float, normalised)": lambda p: classic_train(pil_loader(p)),
            "decode_jpeg + plain v2 (uint8)": plain_v2_packed,
            "ours, backend=tensor (uint8)": ours(train["tensor"], "tensor"),
            **codec(train["tensor"]),
            "ours, backend=pil (uint8)": ours(train["pil"], "pil"),
            "decode_jpeg only (ceiling)": decode_only,
        },
        "val": {
            "classic PIL (float, normalised)": lambda p: classic_val(pil_loader(p)),
            "ours, backend=tensor (uint8)": ours(val["tensor"], "tensor"),
            **codec(val["tensor"]),
            "ours, backend=pil (uint8)": ours(val["pil"], "pil"),
            "decode_jpeg only (ceiling)": decode_only,
        },
    }


def val_agreement(paths: Sequence[Path], resize: int = 256, crop: int = 224,
                  interpolation: str = "bilinear") -> dict[str, float]:
    """How far the tensor backend's validation images are from the PIL backend's, in 0..255."""
    tensor_tf = T.val_transform(resize, crop, interpolation, backend="tensor")
    pil_tf = T.val_transform(resize, crop, interpolation, backend="pil")
    diffs, decode_diffs = [], []
    for path in paths:
        fast = tensor_tf(T.load_image(path, "tensor")).int()
        classic = pil_tf(T.load_image(path, "pil")).int()
        diffs.append((fast - classic).abs().flatten())
        decoded = T.load_image(path, "tensor").int() - T.to_chw(T.load_image(path, "pil")).int()
        decode_diffs.append(decoded.abs().float().mean())
    diff = torch.cat(diffs)
    return {"mean_abs": diff.float().mean().item(), "max_abs": diff.max().item(),
            "frac_gt_2": (diff > 2).float().mean().item(),
            "decode_mean_abs": torch.stack(decode_diffs).mean().item()}


def print_table(title: str, rates: dict[str, float]) -> None:
    """One block of the report: img/s, ms/img and ratio to the classic pipeline."""
    classic = next(iter(rates.values()))
    print(f"\n{title}\n{'pipeline':36s} {'img/s':>8s} {'ms/img':>7s} {'vs classic':>10s}")
    for name, rate in rates.items():
        print(f"{name:36s} {rate:8.0f} {1000 / rate:7.2f} {rate / classic:9.2f}x")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    parser.add_argument("--images", type=Path, help="folder of JPEGs (default: generate them)")
    parser.add_argument("--num-images", type=int, default=200,
                        help="images to generate, or the most to take from --images")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated images")
    parser.add_argument("--passes", type=int, default=3, help="timed passes; the best is shown")
    parser.add_argument("--crop", type=int, default=224, help="train/val crop, pixels")
    parser.add_argument("--resize", type=int, default=256, help="val short-side resize, pixels")
    parser.add_argument("--interpolation", default="bilinear", choices=tuple(T.INTERPOLATIONS),
                        help="resize interpolation (default: bilinear, as main.py)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")


def describe(paths: Sequence[Path]) -> str:
    """Count, mean size and file size of the JPEGs."""
    sizes = np.array([Image.open(p).size for p in paths])
    kib = np.mean([p.stat().st_size for p in paths]) / 1024
    return (f"{len(paths)} JPEGs, mean {sizes[:, 0].mean():.0f}x{sizes[:, 1].mean():.0f} px, "
            f"{kib:.0f} KiB; torch threads {torch.get_num_threads()}; torch {torch.__version__}")


def measure(paths: Sequence[Path], crop: int = 224, resize: int = 256,
            interpolation: str = "bilinear", passes: int = 3) -> dict[str, dict[str, float]]:
    """Print and return img/s of every pipeline, {"train"|"val": {name: img/s}}."""
    results = {}
    for split, steps in pipelines(crop, resize, interpolation).items():
        results[split] = rates = images_per_second(paths, steps, passes)
        print_table(f"{split} ({crop} px crop, {interpolation})", rates)
    return results


def print_agreement(agreement: dict[str, float]) -> None:
    """The val_agreement line."""
    print("\nval images, tensor vs pil backend (0..255 scale): mean |diff| "
          f"{agreement['mean_abs']:.3f}, max {agreement['max_abs']:.0f}, "
          f"{100 * agreement['frac_gt_2']:.3f}% of values differ by >2; "
          f"decode alone: mean |diff| {agreement['decode_mean_abs']:.3f}")


def run(args: argparse.Namespace) -> None:
    """Generate or find the images, time every pipeline, print tables and the agreement."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        if args.images:
            paths = sorted(p for p in args.images.rglob("*") if p.suffix.lower()
                           in IMAGE_SUFFIXES)[: args.num_images]
        else:
            paths = write_photo_like_jpegs(Path(tmp), args.num_images, args.seed)
        print(describe(paths))
        measure(paths, args.crop, args.resize, args.interpolation, args.passes)
        print_agreement(val_agreement(paths, args.resize, args.crop, args.interpolation))
