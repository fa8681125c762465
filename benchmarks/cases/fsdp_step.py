"""Step time of --fsdp against DDP at world size 2 (gloo on loopback), and where FSDP's time goes.

Every variant is our real training step (imagenet.training.models.wrap +
imagenet.training.engine.train_one_epoch) on synthetic batches; all of them live in the same two
processes and are timed in interleaved rounds, so a busy moment on a shared machine hits them all.
Then one profiled step per FSDP variant splits rank 0's time into FSDP's all-gathers,
reduce-scatters and the rest, and the collectives alone are timed on a tensor the size of the model.
Run by hand (not a test):

    python benchmarks/bench.py fsdp-step [-a resnet50] [--image-size 64] [-b 8] [--steps 3]
        [--rounds 4]

Variants marked "experiment" are not flags: they try what could make FSDP faster on CPU/gloo.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from imagenet.launching.process_group import DistInfo
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import Layout
from imagenet.settings.plan import free_port
from imagenet.training import fsdp
from imagenet.training.engine import Step, train_one_epoch
from imagenet.training.models import wrap
from imagenet.training.optim import build_engine


def async_prefetch(model: torch.nn.Module) -> None:
    """Experiment: all-gathers issued asynchronously, one unit ahead in forward and backward
    (gloo then runs them on its own thread while this one computes)."""
    units = [m for m in model.modules() if isinstance(m, fsdp.FSDPModule) and m is not model]
    model._set_unshard_async_op(True)  # torch's private switch; the public API has none yet
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            unit.set_modules_to_forward_prefetch([units[i + 1]])
        if i > 0:
            unit.set_modules_to_backward_prefetch([units[i - 1]])


class ReduceScatterByAllReduce(DefaultReduceScatter):
    """Experiment: reduce-scatter as gloo's all-reduce of the whole buffer, then this rank's
    slice (twice the bytes of a ring reduce-scatter, but gloo's all-reduce is its fastest)."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        dist.all_reduce(input_tensor, group=group)
        if op == dist.ReduceOp.AVG:
            input_tensor.div_(group.size())
        output_tensor.copy_(input_tensor.chunk(group.size())[group.rank()])
        return None


def reduce_scatter_by_all_reduce(model: torch.nn.Module) -> None:
    """Experiment: every unit reduce-scatters with ``ReduceScatterByAllReduce``."""
    for module in model.modules():
        if isinstance(module, fsdp.FSDPModule):
            module.set_custom_reduce_scatter(ReduceScatterByAllReduce())


def stage_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Experiment: coarser units, the containers that hold the rule's blocks (ResNet's stages)."""
    blocks = {id(b) for b in fsdp.repeated_blocks(model)}
    return [m for m in model.modules()
            if any(id(c) in blocks for c in m.children()) and m is not model]


# name: (main.py flags, what to do before wrapping, what to do after)
VARIANTS = {
    "DDP": ([], None, None),
    "FSDP ZeRO-3 (--fsdp)": (["--fsdp"], None, None),
    "FSDP ZeRO-2 (--fsdp --fsdp-zero 2)": (["--fsdp", "--fsdp-zero", "2"], None, None),
    "ZeRO-2 + --fsdp-reduce-dtype bf16": (["--fsdp", "--fsdp-zero", "2", "--fsdp-reduce-dtype",
                                           "bf16"], None, None),
    "ZeRO-2 + async prefetch (experiment)": (["--fsdp", "--fsdp-zero", "2"], None,
                                             async_prefetch),
    "ZeRO-2, a unit per stage (experiment)": (["--fsdp", "--fsdp-zero", "2"], stage_units, None),
    "ZeRO-2, reduce-scatter by all-reduce (exp.)": (["--fsdp", "--fsdp-zero", "2"], None,
                                                    reduce_scatter_by_all_reduce),
}


def build(info: DistInfo, args: argparse.Namespace, name: str):
    """Engine of one variant (same initial weights in every variant)."""
    flags, units, after = VARIANTS[name]
    cfg = parse_config(["--dummy", "-a", args.arch, "--lr", "0.01", "-p", "1000000", *flags])
    torch.manual_seed(0)
    raw = torchvision.models.get_model(args.arch, num_classes=1000)
    if units is not None:  # the experiment's units instead of the rule's (what wrap does)
        fsdp.shard(raw, cfg, info.device, units(raw))
        model = raw
    else:
        model = wrap(raw, cfg, info)
    if after is not None:
        after(raw)
    layout = Layout(info.world_size, args.batch_size, 1, 0)
    return build_engine(cfg, raw, model, info.device, layout, args.steps, 1000)


def profile_step(engine, batch) -> dict[str, float]:
    """Milliseconds of one step in FSDP's all-gathers, reduce-scatters and copies (rank 0)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        train_one_epoch(engine, [batch], Step())
        total = time.perf_counter() - start
    spent: dict[str, float] = defaultdict(float)
    for event in prof.events():
        label = event.name.split(" (")[0]
        if label in ("FSDP::all_gather", "FSDP::post_backward_reduce",
                     "FSDP::all_gather_copy_out", "FSDP::post_backward_rs_wait"):
            spent[label] += event.cpu_time_total / 1e3
    spent["step"] = total * 1e3
    return dict(spent)


def collectives(numel: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of all-reduce, reduce-scatter and all-gather for ``numel`` floats."""
    world = dist.get_world_size()
    full, shard = torch.randn(numel - numel % world), torch.empty(numel // world)
    ops = {"all-reduce (DDP)": lambda: dist.all_reduce(full),
           "reduce-scatter (FSDP)": lambda: dist.reduce_scatter_tensor(shard, full),
           "all-gather (FSDP)": lambda: dist.all_gather_into_tensor(full, shard)}
    out = {}
    for name, op in ops.items():
        op()  # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            op()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) * 1e3
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    """One of the two processes: time every variant, profile, time the collectives."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=1800))
    info = DistInfo(rank, rank, world, world, torch.device("cpu"), "gloo")
    engines = {name: build(info, args, name) for name in args.variants}
    images = torch.randint(0, 256, (args.batch_size, 3, args.image_size, args.image_size),
                           dtype=torch.uint8)
    batch = (images, torch.randint(0, 1000, (args.batch_size,)))
    times: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():  # warm-up: allocator, oneDNN kernels, lazy FSDP init
        train_one_epoch(engine, [batch] * 2, Step())
    for _ in range(args.rounds):
        for name, engine in engines.items():
            dist.barrier()
            start = time.perf_counter()
            train_one_epoch(engine, [batch] * args.steps, Step())
            dist.barrier()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    profiles = {name: profile_step(engine, batch) for name, engine in engines.items()
                if name != "DDP"}
    numel = sum(p.numel() for p in torchvision.models.get_model(args.arch).parameters())
    comm = collectives(numel, repeats=5)
    dist.barrier()
    if rank == 0:
        results.update(times=times, profiles=profiles, comm=comm, numel=numel)
    dist.destroy_process_group()


def compute_only(args: argparse.Namespace) -> float:
    """ms per step of the same per-process batch in one process: no communication at all."""
    torch.set_num_threads(1)
    cfg = parse_config(["--dummy", "-a", args.arch, "--lr", "0.01", "-p", "1000000"])
    torch.manual_seed(0)
    raw = torchvision.models.get_model(args.arch, num_classes=1000)
    engine = build_engine(cfg, raw, raw, torch.device("cpu"), Layout(1, args.batch_size, 1, 0),
                          args.steps, 1000)
    images = torch.randint(0, 256, (args.batch_size, 3, args.image_size, args.image_size),
                           dtype=torch.uint8)
    batch = (images, torch.randint(0, 1000, (args.batch_size,)))
    train_one_epoch(engine, [batch] * 2, Step())
    start = time.perf_counter()
    train_one_epoch(engine, [batch] * args.steps, Step())
    return (time.perf_counter() - start) / args.steps * 1e3


def report(args: argparse.Namespace, results, alone: float) -> None:
    """Print the table."""
    times, profiles, comm = results["times"], results["profiles"], results["comm"]
    base = statistics.median(times["DDP"])
    print(f"\n{args.arch} {args.image_size}px, batch {args.batch_size} per process, 2 processes "
          f"x 1 thread, gloo on loopback; median of {args.rounds} rounds x {args.steps} steps")
    print("(paired: the median over rounds of the ratio to DDP's time in the same round, which "
          "cancels slow phases of a shared machine)")
    print(f"{'variant':<46}{'ms/step':>9}{'vs DDP':>8}{'paired':>8}   all rounds (ms)")
    print(f"{'compute only (1 process, no comm)':<46}{alone:>9.0f}{alone / base:>8.2f}")
    for name, values in times.items():
        median = statistics.median(values)
        paired = statistics.median(v / d for v, d in zip(values, times["DDP"]))
        print(f"{name:<46}{median:>9.0f}{median / base:>8.2f}{paired:>8.2f}   "
              f"{', '.join(f'{v:.0f}' for v in values)}")
    print("\nwhere one profiled FSDP step goes on rank 0 (ms; the collectives are blocking on "
          "CPU/gloo, so they add to the compute):")
    print(f"{'variant':<46}{'step':>7}{'all-gather':>11}{'reduce':>8}{'copy-out':>9}{'rest':>7}")
    for name, spent in profiles.items():
        gather, reduce = spent.get("FSDP::all_gather", 0), spent.get("FSDP::post_backward_reduce",
                                                                      0)
        copy = spent.get("FSDP::all_gather_copy_out", 0)
        rest = spent["step"] - gather - reduce - copy
        print(f"{name:<46}{spent['step']:>7.0f}{gather:>11.0f}{reduce:>8.0f}{copy:>9.0f}"
              f"{rest:>7.0f}")
    mb = results["numel"] * 4 / 2**20
    print(f"\none collective over all {results['numel'] / 1e6:.1f}M parameters ({mb:.0f} MB fp32),"
          " 2 processes (median of 5):")
    for name, ms in comm.items():
        print(f"  {name:<24}{ms:>8.1f} ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    parser.add_argument("-a", "--arch", default="resnet50",
                        help="architecture (default: resnet50)")
    parser.add_argument("--image-size", type=int, default=64, help="pixels")
    parser.add_argument("-b", "--batch-size", type=int, default=8, help="images per process")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        metavar="VARIANT", help="variants to time, by name as printed "
                                                "(default: all)")


def run(args: argparse.Namespace) -> None:
    if "DDP" not in args.variants:
        args.variants.insert(0, "DDP")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = mp.Manager().dict()
    mp.spawn(worker, args=(2, free_port(), args, results), nprocs=2)
    report(args, results, compute_only(args))
