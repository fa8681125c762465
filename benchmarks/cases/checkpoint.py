"""What --save-every costs: checkpoint size and write time, and step time with and without it.

Uses the trainer's own pieces (build_run on --dummy data, the real after_step hook that saves
with ``run.checkpointing.save``: RNG gather, torch.save to a temp file, fsync, os.replace), on the
CPU, with 1000 classes and SGD momentum buffers as in an ImageNet run. Run by hand (not a test):

    python benchmarks/bench.py checkpoint -a resnet18 resnet50 -b 8 --size 64 --steps 12 \\
        --save-every 3 --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch

from benchmarks import harness
from imagenet.checkpoint import files
from imagenet.checkpoint.resume_from import Decided
from imagenet.launching.preemption import StopFlag
from imagenet.launching.process_group import DistInfo
from imagenet.run import checkpointing
from imagenet.run.build import Run, build_run
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import Layout
from imagenet.settings.plan import fixed_plan
from imagenet.training.engine import Hooks, Step, train_one_epoch

TABLE = harness.Table(("arch", "<10", ""), ("size MB", ">8", ".1f"), ("write s", ">8", ".3f"),
                      ("step s", ">8", ".3f"), ("step s saving", ">14", ".3f"),
                      ("overhead", ">9", ""), sep=" ")


def build(arch: str, batch: int, size: int, steps: int, output_dir: Path) -> Run:
    """A one-process run on synthetic 1000-class data with ``steps`` steps per epoch."""
    cfg = parse_config(["--dummy", "--dummy-size", str(batch * steps), "--dummy-val-size", "8",
                        "-a", arch, "-b", str(batch), "-j", "0", "--seed", "0",
                        "--train-crop-size", str(size), "--val-crop-size", str(size),
                        "--val-resize-size", str(size), "--output-dir", str(output_dir),
                        "-p", "1000000"])
    return build_run(fixed_plan(cfg, Layout(1, batch, 1, 0)), DistInfo(), Decided(None))


def epoch_time(run: Run, save_every: int) -> float:
    """Seconds per step over one epoch, saving every ``save_every`` steps (0: never)."""
    cfg = dataclasses.replace(run.cfg, save_every=save_every)
    run.plan = dataclasses.replace(run.plan, cfg=cfg)
    hooks = Hooks(after_step=checkpointing.saver(run, StopFlag()))
    run.step = Step()
    run.data.train.set_position(0, 0)
    seconds = harness.seconds(lambda: train_one_epoch(run.engine, run.data.train_loader,
                                                      run.step, hooks))
    return seconds / run.engine.opts.steps_per_epoch


def write_time(run: Run, reps: int) -> tuple[float, int]:
    """Median seconds of one checkpointing.save (model, optimizer, scheduler, RNG) until the file
    is on disk (saves are written in the background: ``async-save`` times what a step
    waits), and its bytes."""
    def save() -> None:
        checkpointing.save(run, is_best=False)
        run.writer.wait()

    times = [harness.seconds(save) for _ in range(reps)]
    path = run.output_dir / files.CHECKPOINT
    return sorted(times)[len(times) // 2], path.stat().st_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    parser.add_argument("-a", "--arch", nargs="+", default=["resnet18", "resnet50"],
                        help="architectures to measure, one after the other "
                             "(default: resnet18 resnet50)")
    parser.add_argument("-b", "--batch-size", type=int, default=8,
                        help="images per step (default: 8)")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--steps", type=int, default=12, help="steps per timed epoch")
    parser.add_argument("--save-every", type=int, default=3, help="optimizer steps")
    parser.add_argument("--reps", type=int, default=5, help="timed saves")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder; "
                        "use the checkpoint file system of your cluster to measure it)")


def run(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, -b {args.batch_size}, "
          f"{args.size} px, {args.steps} steps per epoch, --save-every {args.save_every}")
    TABLE.header()
    for arch in args.arch:
        with tempfile.TemporaryDirectory(dir=args.dir) as folder:
            run = build(arch, args.batch_size, args.size, args.steps, Path(folder))
            epoch_time(run, 0)  # warm-up: allocator, first-iteration kernels, loader
            base = epoch_time(run, 0)
            saving = epoch_time(run, args.save_every)
            seconds, size = write_time(run, args.reps)
        overhead = (saving - base) / base
        TABLE.row(arch, size / 2**20, seconds, base, saving, f"{100 * overhead:.1f}%")
    print("overhead = extra time per step with --save-every; about write s / (N x step s)")
