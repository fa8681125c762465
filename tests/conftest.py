"""Shared test helpers: tiny JPEG ImageFolders written under tmp_path, main.py as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAIN = str(ROOT / "main.py")
# Tiny, fast runs: 32 px crops, resnet18, no loader workers unless a test asks.
TINY = ["-a", "resnet18", "--train-crop-size", "32", "--val-resize-size", "36",
        "--val-crop-size", "32", "-b", "8", "-j", "0", "-p", "2", "--lr", "0.01"]


def write_image_folder(root: Path, classes: int = 3, train_per_class: int = 8,
                       val_per_class: int = 3, size: int = 40) -> Path:
    """A real JPEG ImageFolder (train/ and val/) with one colour+pattern per class."""
    from PIL import Image, ImageDraw

    for split, n in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                colour = ((70 * c + 40) % 256, (30 * c + 90 + 5 * i) % 256, (150 - 20 * c) % 256)
                img = Image.new("RGB", (size + i % 5, size), colour)
                draw = ImageDraw.Draw(img)
                draw.rectangle([i % 7, c * 5, i % 7 + 10, c * 5 + 10], fill=(255, 255, 255))
                img.save(folder / f"img{i}.jpg", quality=90)
    return root


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """A 3-class JPEG ImageFolder: 24 train and 9 val images."""
    return write_image_folder(tmp_path / "data")


def child_env(**extra: str) -> dict[str, str]:
    """Environment for subprocesses: the repo importable, few threads, no launcher leftovers."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "SLURM_",
                                "TORCHELASTIC_", "GLOO_SOCKET", "NCCL_SOCKET"))}
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_main(*args: str, timeout: float = 300, env: dict[str, str] | None = None,
             cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run main.py with ``args``; returns the completed process (output captured as text)."""
    return subprocess.run([sys.executable, MAIN, *args], capture_output=True, text=True,
                          timeout=timeout, env=env or child_env(), cwd=cwd or ROOT)


def run_parallel(commands: list[list[str]], envs: list[dict[str, str]], workdir: Path,
                 timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Start several commands at once (e.g. the ranks of one job) and wait for all of them.

    Output goes to files under ``workdir`` (no pipe can fill up and stall a rank). On timeout
    every command's whole process group (its spawned children too) is killed and the test fails.
    """
    import signal
    import time

    workdir.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for i, (cmd, env) in enumerate(zip(commands, envs)):
        out, err = open(workdir / f"cmd{i}.out", "w+"), open(workdir / f"cmd{i}.err", "w+")
        files.append((out, err))
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env, cwd=ROOT,
                                      start_new_session=True))
    deadline, timed_out = time.monotonic() + timeout, False
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait()
    results = []
    for cmd, p, (out, err) in zip(commands, procs, files):
        out.seek(0)
        err.seek(0)
        results.append(subprocess.CompletedProcess(cmd, p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    assert not timed_out, f"timed out after {timeout}s:\n" + "\n".join(
        f"{r.args}\n{r.stdout}\n{r.stderr}" for r in results)
    return results


def join_gloo(rank: int, world: int, port: int):
    """Join a real gloo process group on loopback through imagenet.distributed (as main.py
    does); returns its DistInfo. For the body of mp.spawn'ed test processes."""
    import torch

    from imagenet.config import parse_config
    from imagenet.distributed import init_distributed, plan_launch

    torch.set_num_threads(1)
    cfg = parse_config(["data", "--dist-url", f"tcp://127.0.0.1:{port}", "--world-size",
                        str(world), "--rank", str(rank), "--dist-timeout", "120"])
    info = init_distributed(cfg, plan_launch(cfg, {}, 0), 0)
    assert (info.rank, info.world_size, info.backend) == (rank, world, "gloo")
    return info


def gloo_rank_saving(rank: int, world: int, port: int, out: Path, compute) -> None:
    """mp.spawn body: join gloo, save ``compute(info)`` to ``out/rank{rank}.pt``, leave together.

    ``compute`` must be a module-level function (spawned children unpickle it by name).
    """
    import datetime

    import torch
    import torch.distributed as dist

    from imagenet.distributed import cleanup

    info = join_gloo(rank, world, port)
    try:
        torch.save(compute(info), out / f"rank{rank}.pt")
        dist.barrier(timeout=datetime.timedelta(seconds=60))
    finally:
        cleanup()
