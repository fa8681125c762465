"""What a checkpoint save to slow storage costs the training steps that overlap it.

Saves are asynchronous (imagenet/checkpoint/rundir.py): at the step boundary the state is copied
off the model (``to_host``), rank 0's writer thread serializes and writes it while training goes
on. This measures, in one process on the trainer's own pieces (build_run on --dummy data, the
real ``after_step`` hook with --save-every), the time of each step:

- in an epoch without saves (the baseline),
- in an epoch that saves every N steps to a folder whose writes are throttled to R MB/s: the
  steps that overlap a write in the background, the steps of the same epoch that do not (the
  control, measured under the same conditions), and the step that took the save (the copy off
  the model, on the training path).

The throttle is injected in-process (every write of the checkpoint's file object sleeps for its
bytes at R MB/s, as a slow network file system's write() blocks): this machine has no
device-mapper or cgroup-v2 I/O throttling. Run by hand (not a test):

    python benchmarks/bench.py async-save -a mobilenet_v3_small --size 128 --steps 200 \\
        --save-every 50 --mb-per-s 4
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.cases.checkpoint import build
from imagenet.checkpoint import files
from imagenet.launching.preemption import StopFlag
from imagenet.run.build import Run
from imagenet.run.checkpointing import finish_saves, saver
from imagenet.training.engine import Hooks, Step, train_one_epoch


def throttle(mb_per_s: float) -> None:
    """Every write of a checkpoint file sleeps for its bytes at ``mb_per_s`` (fault injection)."""
    write = files._WriteErrors.write

    def slow_write(self, data) -> int:
        written = write(self, data)
        time.sleep(len(data) / (mb_per_s * 2**20))
        return written

    files._WriteErrors.write = slow_write


@dataclasses.dataclass
class Steps:
    """Each step's seconds, and whether a write was under way during it."""

    seconds: list[float] = dataclasses.field(default_factory=list)
    overlapped: list[bool] = dataclasses.field(default_factory=list)
    saving: list[bool] = dataclasses.field(default_factory=list)  # the step that took a save


def epoch(run: Run, save_every: int) -> Steps:
    """One epoch, saving every ``save_every`` steps (0: never), each step timed."""
    cfg = dataclasses.replace(run.cfg, save_every=save_every)
    run.plan = dataclasses.replace(run.plan, cfg=cfg)
    save = saver(run, StopFlag())
    steps, last = Steps(), [time.perf_counter()]
    busy_at_start = [run.writer.busy]

    def after_step(step: Step, check_finite) -> bool:
        busy = busy_at_start[0] or run.writer.busy  # a write ran during this step
        thread = run.writer.thread
        stop = save(step, check_finite)
        now = time.perf_counter()
        steps.seconds.append(now - last[0])
        steps.overlapped.append(busy)
        steps.saving.append(run.writer.thread is not None and run.writer.thread is not thread)
        last[0], busy_at_start[0] = now, run.writer.busy
        return stop

    run.step = Step()
    run.data.train.set_position(0, 0)
    train_one_epoch(run.engine, run.data.train_loader, run.step, Hooks(after_step=after_step))
    finish_saves(run)
    return steps


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    parser.add_argument("-a", "--arch", default="resnet18", help="(default: resnet18)")
    parser.add_argument("-b", "--batch-size", type=int, default=8, help="(default: 8)")
    parser.add_argument("--size", type=int, default=64, help="image side (default: 64)")
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch (default: 40)")
    parser.add_argument("--save-every", type=int, default=20, help="(default: 20)")
    parser.add_argument("--mb-per-s", type=float, default=4.0,
                        help="the slow folder's write rate (default: 4 MB/s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice)")


def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    throttle(args.mb_per_s)
    with tempfile.TemporaryDirectory() as folder:
        run = build(args.arch, args.batch_size, args.size, args.steps, Path(folder))
        epoch(run, 0)  # warm-up
        base = epoch(run, 0)
        saving = epoch(run, args.save_every)
        size = (Path(folder) / files.CHECKPOINT).stat().st_size
    # The first step of an epoch carries the loader's start: left out. Medians: a shared
    # machine's other work lands on a few steps.
    base_s = median(base.seconds[1:])
    pairs = list(zip(saving.seconds, saving.overlapped, saving.saving))[1:]
    over = median([s for s, o, took in pairs if o and not took])
    free = median([s for s, o, took in pairs if not o and not took])
    took = median([s for s, _, t in pairs if t])
    n_over = sum(o and not t for _, o, t in pairs)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.arch} -b "
          f"{args.batch_size} at {args.size} px, {args.steps} steps, --save-every "
          f"{args.save_every}, checkpoint {size / 2**20:.1f} MB written at {args.mb_per_s:g} "
          f"MB/s (about {size / 2**20 / args.mb_per_s:.1f} s a write)")
    print(f"step in an epoch without saves {base_s:5.3f} s")
    print(f"step with no write under way {free:6.3f} s  (same epoch: the control)")
    print(f"step overlapping a write    {over:7.3f} s  ({n_over} steps)  "
          f"{100 * (over / free - 1):+6.1f}% against the control")
    print(f"step that took the save     {took:7.3f} s  (the copy off the model; a synchronous "
          f"save would add the whole write)")
    print(f"epoch: {sum(saving.seconds):.1f} s saving vs {sum(base.seconds):.1f} s without")
