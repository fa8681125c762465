"""torchvision.io's decode_jpeg vs TorchCodec's, side by side on the same JPEGs (--decoder).

Run by hand (not a test), e.g.::

    python benchmarks/bench.py decoders                 # 200 generated photo-like 500x375 JPEGs
    python benchmarks/bench.py decoders --images DIR    # your own JPEGs (searched recursively)
    python benchmarks/bench.py decoders --device cuda   # nvJPEG, batches of --batch

One thread, CPU seconds (``time.process_time``) on the CPU, wall time with a synchronize on CUDA.
The two decoders alternate round by round (``--rounds``), so a load that comes and goes on the
machine falls on both; the line to read is the median of the per-round ratios. Also checks that
both give the same pixels on every file (the trainer's promise whichever decoder runs).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks import harness
from imagenet.data import transforms

DECODERS = {"torchvision": "tensor", "torchcodec": "torchcodec"}


def one_round(files: list[torch.Tensor], backend: str, device: torch.device, batch: int
              ) -> float:
    """Seconds to decode every file once with ``backend``."""
    def on_the_cpu() -> None:
        for data in files:
            transforms.decode(data, backend)

    if device.type == "cpu":
        return harness.cpu_seconds(on_the_cpu)

    def on_the_device() -> None:
        for i in range(0, len(files), batch):
            transforms.decode_batch(files[i:i + batch], device, backend)
        torch.cuda.synchronize(device)

    torch.cuda.synchronize(device)
    return harness.seconds(on_the_device)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    parser.add_argument("--images", type=Path, help="a folder of JPEGs (default: generated)")
    parser.add_argument("--count", type=int, default=200, help="generated JPEGs")
    parser.add_argument("--rounds", type=int, default=7,
                        help="timed rounds of each decoder, taking turns (default: 7)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda to decode with nvJPEG (default: cpu)")
    parser.add_argument("--batch", type=int, default=64, help="images per call on CUDA")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        if args.images:
            paths = sorted(p for p in args.images.rglob("*")
                           if p.suffix.lower() in (".jpg", ".jpeg"))
        else:
            paths = harness.write_photo_like_jpegs(Path(tmp), args.count)
        files = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8) for p in paths]
    same = sum(torch.equal(transforms.decode(f, "tensor"), transforms.decode(f, "torchcodec"))
               for f in files)
    print(f"{len(files)} JPEGs, {sum(f.numel() for f in files) / len(files) / 1024:.0f} KB on "
          f"average; the same pixels from both decoders: {same}/{len(files)}")
    for backend in DECODERS.values():  # warm-up: libraries loaded, caches filled
        one_round(files[:16], backend, device, args.batch)
    times: dict[str, list[float]] = {name: [] for name in DECODERS}
    for r in range(args.rounds):
        order = list(DECODERS.items()) if r % 2 == 0 else list(DECODERS.items())[::-1]
        for name, backend in order:
            times[name].append(one_round(files, backend, device, args.batch))
    for name, values in times.items():
        print(f"{name:12s} {len(files) / statistics.median(values):8.0f} img/s "
              f"(median of {args.rounds} rounds, {device.type})")
    ratios = [tc / tv for tv, tc in zip(times["torchvision"], times["torchcodec"])]
    print(f"torchcodec / torchvision speed: {1 / statistics.median(ratios):.2f}x "
          f"(per-round ratios {min(1 / r for r in ratios):.2f}-{max(1 / r for r in ratios):.2f})")
