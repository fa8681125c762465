"""DDP overhead on this machine: 1 process vs 2 processes at the same global batch, and the time
of one gradient all-reduce over gloo on loopback.

Run by hand (not a test):

    python benchmarks/bench.py distributed [--arch resnet18] [--image-size 64]
        [--global-batch 32] [--steps 6] [--rounds 2] [--reduce-archs resnet18 resnet50]

Training throughput drives imagenet.training.engine.train_one_epoch on synthetic uint8 images at one
global batch: 1 process x 1 thread, 1 process x 2 threads, 2 DDP processes x 1 thread. On a 2-core
CPU this shows the cost of DDP, not a speed-up; on a shared (busy) box intra-op threads
oversubscribe the cores, which is why 1 x 2 can be far slower than 1 x 1.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from imagenet.data.folder import DummyDataset
from imagenet.data.samplers import ResumableDistributedSampler, SeededDataset
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import Layout
from imagenet.settings.plan import free_port
from imagenet.training.engine import Step, train_one_epoch
from imagenet.training.optim import build_engine


def join(rank: int, world: int, port: int) -> None:
    """gloo process group on loopback."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))


def train_speed(rank: int, world: int, port: int, args: argparse.Namespace, threads: int,
                results: dict) -> None:
    """Images/s (all ranks) of train_one_epoch over ``args.steps`` steps, after 2 warm-up steps."""
    torch.set_num_threads(threads)
    if world > 1:
        join(rank, world, port)
    torch.manual_seed(0)
    raw = torchvision.models.get_model(args.arch, num_classes=1000)
    model = DDP(raw) if world > 1 else raw
    cfg = parse_config(["--dummy", "-a", args.arch, "--lr", "0.01", "--wd", "0", "-p", "1000000"])
    layout = Layout(world, args.global_batch // world, 1, 0)
    engine = build_engine(cfg, raw, model, torch.device("cpu"), layout, args.steps, 1000)
    for phase, steps in (("warm-up", 2), ("timed", args.steps)):  # warm-up: allocator, buckets
        size = args.global_batch * steps
        data = SeededDataset(DummyDataset(size, 1000, args.image_size), seed=0)
        loader = DataLoader(data, batch_size=args.global_batch // world,
                            sampler=ResumableDistributedSampler(size, rank, world))
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        train_one_epoch(engine, loader, Step())
        if world > 1:
            dist.barrier()
        if rank == 0 and phase == "timed":
            results["images_per_sec"] = size / (time.perf_counter() - start)
    if world > 1:
        dist.destroy_process_group()


def allreduce_time(rank: int, world: int, port: int, archs: list[str], repeats: int,
                   results: dict) -> None:
    """Median seconds of one all-reduce of a model's gradients: flat, and in 25 MB buckets."""
    torch.set_num_threads(1)
    join(rank, world, port)
    for arch in archs:
        numel = sum(p.numel() for p in torchvision.models.get_model(arch).parameters())
        flat = torch.randn(numel)
        bucket = 25 * 2**20 // 4  # DDP's default bucket_cap_mb, in float32 elements
        for name, parts in (("flat", [flat]), ("25MB buckets", list(flat.split(bucket)))):
            for part in parts:  # warm-up (connection buffers)
                dist.all_reduce(part)
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                for part in parts:
                    dist.all_reduce(part)
                times.append(time.perf_counter() - start)
            if rank == 0:
                results[(arch, name)] = (numel, statistics.median(times))
    dist.destroy_process_group()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    parser.add_argument("--arch", default="resnet18",
                        help="architecture trained (default: resnet18)")
    parser.add_argument("--image-size", type=int, default=64, help="pixels")
    parser.add_argument("--global-batch", type=int, default=32, help="images per step, all ranks")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps")
    parser.add_argument("--rounds", type=int, default=2, help="repeats of each configuration")
    parser.add_argument("--reduce-archs", nargs="+", default=["resnet18", "resnet50"],
                        help="models whose gradient all-reduce is timed "
                             "(default: resnet18 resnet50)")
    parser.add_argument("--repeats", type=int, default=5, help="timed all-reduces per model")


def run(args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cores = os.cpu_count() or 1
    manager = mp.Manager()

    # (processes, threads each): the same 2 cores as 1x2 and 2x1; 1x1 shows what threading buys.
    configs = [(1, 1), (1, min(2, cores)), (2, 1)]
    speeds: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
    for _ in range(args.rounds):  # interleaved, so a busy moment on a shared box hits all
        for world, threads in configs:
            results = manager.dict()
            mp.spawn(train_speed, args=(world, free_port(), args, threads, results),
                     nprocs=world)
            speeds[(world, threads)].append(results["images_per_sec"])
    print(f"\ntraining {args.arch} at {args.image_size}px, global batch {args.global_batch}, "
          f"{args.steps} timed steps, gloo on loopback, {cores} CPU cores; "
          f"best of {args.rounds} rounds")
    print(f"{'processes':>9} {'threads/proc':>12} {'batch/proc':>10} {'images/s':>9} "
          f"{'vs 1x1':>7}   all rounds")
    base = max(speeds[configs[0]])
    for (world, threads), values in speeds.items():
        print(f"{world:>9} {threads:>12} {args.global_batch // world:>10} {max(values):>9.1f} "
              f"{max(values) / base:>6.2f}x   {', '.join(f'{v:.1f}' for v in values)}")

    results = manager.dict()
    mp.spawn(allreduce_time, args=(2, free_port(), args.reduce_archs, args.repeats, results),
             nprocs=2)
    print("\ngradient all-reduce, 2 processes, gloo on loopback (median of "
          f"{args.repeats})")
    print(f"{'model':>10} {'params':>11} {'MB':>7} {'how':>13} {'ms':>8} {'GB/s algo':>9}")
    for (arch, how), (numel, seconds) in sorted(results.items()):
        mb = numel * 4 / 2**20
        print(f"{arch:>10} {numel:>11,} {mb:>7.1f} {how:>13} {seconds * 1e3:>8.1f} "
              f"{numel * 4 / seconds / 1e9:>9.2f}")
