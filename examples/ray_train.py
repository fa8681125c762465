"""Train with Ray Train: main.py's flags, run by ``TorchTrainer`` on N workers.

    python examples/ray_train.py --num-workers 16 --use-gpu --storage-path s3://bucket/ray \\
        -- s3://bucket/imagenet-wds -a resnet50 -b 128 --epochs 90 \\
           --output-dir s3://bucket/runs/r50-ray --save-every 1000

Everything after ``--`` is main.py's command line (``-b`` per worker, as under torchrun). Ray
creates the process group and calls ``train_loop`` in every worker, which calls
``imagenet.train`` with those flags. Every checkpoint the trainer saves is reported to Ray
(``ray.train.report`` on every rank, the same number of times; rank 0 attaches the file), and
Ray keeps the newest ``--num-to-keep`` under ``--storage-path`` (a folder every node sees, or
an ``s3://`` / ``gs://`` URL). When a worker dies, Ray restarts the whole group
(``--max-failures`` times) and ``train_loop`` resumes from ``ray.train.get_checkpoint()``: that
file becomes OUTPUT_DIR/checkpoint.pth.tar and the run continues it, metrics.jsonl and
TensorBoard record included. Give ``--output-dir`` a place every node sees (a shared folder or
a bucket URL): a restarted rank 0 may run on another node.

Needs ``pip install 'imagenet-trainer[ray]'``. The trainer must be importable on every node:
this driver puts the repository on the workers' PYTHONPATH (enough on one machine, or where the
repository has the same path on every node); otherwise install it on the nodes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The driver's flags, and main.py's flags (after ``--``)."""
    argv = list(argv)
    if "--" not in argv:
        raise SystemExit("usage: ray_train.py --num-workers N --storage-path DIR -- "
                         "DATA [main.py flags]")
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, required=True,
                        help="training processes (one per GPU with --use-gpu)")
    parser.add_argument("--storage-path", required=True,
                        help="where Ray keeps the reported checkpoints: a folder every node "
                             "sees, or an s3:// / gs:// URL")
    parser.add_argument("--name", default="imagenet", help="the run's folder in storage")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--max-failures", type=int, default=3,
                        help="restarts of the worker group after a failure (default: 3)")
    parser.add_argument("--num-to-keep", type=int, default=2,
                        help="newest checkpoints Ray keeps in storage (default: 2)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray)")
    parser.add_argument("--num-cpus", type=int, default=None,
                        help="CPUs of a local Ray started here (default: all)")
    return parser.parse_args(argv[:split]), argv[split + 1:]


def train_loop(config: dict) -> None:
    """Each worker: main.py's run, reporting every checkpoint to Ray; after a restart, from
    Ray's newest checkpoint."""
    import ray.train

    import imagenet

    argv = config["argv"]
    resumed = ray.train.get_checkpoint()
    if resumed is None:
        imagenet.train(argv, on_checkpoint=report)
    else:
        with resumed.as_directory() as folder:  # the trainer logs that it resumes from it
            imagenet.train(argv, on_checkpoint=report, resume_from=reported(Path(folder)))


def reported(folder: Path) -> Path:
    """The trainer's checkpoint in a folder ``report`` gave Ray: checkpoint.pth.tar, or the
    checkpoint.dcp directory of --sharded-checkpoint (whatever the trainer named it)."""
    found = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    if len(found) != 1:
        raise RuntimeError(f"Ray's checkpoint {folder} holds {[p.name for p in found]}, not the "
                           "one checkpoint this driver reported")
    return found[0]


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """A hard link (free; the trainer replaces its files, never edits them), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def report(saved) -> None:
    """One trainer checkpoint to Ray: rank 0 with the file (or --sharded-checkpoint's directory,
    every rank's shards: on the shared --output-dir it needs), the others without (every rank
    reports each time: Ray's report is a barrier)."""
    import ray.train

    metrics = {"epoch": saved.epoch, "step_in_epoch": saved.step_in_epoch,
               "global_step": saved.global_step, "best_acc1": saved.best_acc1}
    if saved.rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as folder:
        target = Path(folder) / saved.path.name
        if saved.path.is_dir():
            shutil.copytree(saved.path, target, copy_function=link_or_copy)
        else:
            link_or_copy(saved.path, target)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))


def main(argv: Sequence[str] | None = None) -> int:
    args, trainer_argv = parse(sys.argv[1:] if argv is None else argv)
    try:
        import ray
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
    except ImportError:
        print("error: this driver needs Ray Train: pip install 'imagenet-trainer[ray]'",
              file=sys.stderr)
        return 2

    if not ray.is_initialized():
        pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        ray.init(address=args.address, num_cpus=args.num_cpus,
                 runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    trainer = TorchTrainer(
        train_loop, train_loop_config={"argv": trainer_argv},
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu),
        run_config=RunConfig(name=args.name, storage_path=args.storage_path,
                             failure_config=FailureConfig(max_failures=args.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=args.num_to_keep)))
    try:
        result = trainer.fit()
    except Exception as exc:  # Ray's TrainingFailedError carries the workers' errors
        print(f"error: training failed after {args.max_failures} restart(s): {exc}",
              file=sys.stderr, flush=True)
        return 1
    where = result.checkpoint.path if result.checkpoint else None
    print(f"=> done; newest checkpoint {where}: {result.metrics}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
