"""Does the trainer work on this node's GPUs, and is it fast? About ten minutes; run by hand.

    python benchmarks/gpu_smoke.py                 # all local GPUs; work files in a temp folder
    python benchmarks/gpu_smoke.py --out /scratch/smoke --keep

Every line of the table at the end is one check, PASS / FAIL / info, with its numbers:

- every launcher on all local GPUs (main.py's own spawn, --multiprocessing-distributed,
  torchrun, and srun inside a SLURM allocation), each process on its own GPU and none on GPU 0
  but rank 0's;
- DDP and FSDP with --compile --amp bf16 (--channels-last with DDP): no graph compiled after the
  first epoch;
- SIGTERM in the middle of an epoch, then --resume auto: the final weights are bitwise those of
  an uninterrupted run;
- ResNet-50, bf16 + channels_last + compile, on --dummy data and on a JPEG folder it writes
  (decoded on the GPU, and by the loader workers): img/s per GPU, the share of time waiting for
  data, max memory per GPU; against the targets (A100: >= 3,000 img/s per GPU on --dummy, >= 95%
  of that on JPEGs with 16 cores per GPU, data-wait < 5%).

Without a CUDA device it says so in one line and exits 0. tests/test_cuda.py runs the same
checks at a small scale.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data import write_photo_like_jpegs  # noqa: E402

TARGET_DUMMY = 3000  # img/s per A100, ResNet-50 bf16 + channels_last + compile
TARGET_REAL = 0.95  # of the --dummy img/s, on JPEGs, with 16 cores per GPU
TARGET_WAIT = 0.05  # share of the training time waiting for data
FAST = ["-a", "resnet50", "--amp", "bf16", "--channels-last", "--compile", "-b", "256",
        "-p", "20"]


@dataclass
class Result:
    """One line of the table: ``ok`` None means information only (no target applies)."""

    name: str
    ok: bool | None
    numbers: str


@dataclass
class Scale:
    """How big the runs are: the full smoke test, or tests/test_cuda.py's small one."""

    unique_images: int = 1000  # distinct JPEGs written; the folders hard-link them
    train_per_gpu: int = 20000  # images per GPU and epoch in the throughput runs
    small_per_gpu: int = 512  # in the functional runs
    tiny: tuple[str, ...] = ("-a", "resnet18", "--train-crop-size", "64", "--val-resize-size",
                             "72", "--val-crop-size", "64", "-b", "32", "-p", "2")
    timeout: float = 900
    targets: bool = True  # judge img/s against the targets (the full scale only)


SMALL = Scale(unique_images=64, train_per_gpu=256, small_per_gpu=128, targets=False)


@dataclass
class Node:
    """What the checks share: GPUs, the work folder, the data folders."""

    gpus: int  # processes per launcher (GPUs, or --cpu-dry-run's processes)
    work: Path
    scale: Scale
    folders: dict[str, Path] = field(default_factory=dict)
    cpu: bool = False  # --cpu-dry-run: the same runs on the CPU (to check this script)

    def main_py(self, *args: str) -> list[str]:
        """python main.py ARGS (on the CPU: with --no-accel)."""
        return [sys.executable, str(ROOT / "main.py"), *args, *(["--no-accel"] if self.cpu
                                                                  else [])]

    def spawning(self, *args: str) -> list[str]:
        """main.py starting one process per GPU itself (no flag needed with several GPUs)."""
        return self.main_py(*args, *(["--nproc-per-node", str(self.gpus)] if self.cpu else []))

    def torchrun(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={self.gpus}", *self.main_py(*args)[1:]]

    def env(self, **extra: str) -> dict[str, str]:
        """main.py's environment: the repository importable, no launcher leftovers."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
        env["PYTHONPATH"] = str(ROOT)
        return {**env, **extra}


# ---------------------------------------------------------------- running main.py


@dataclass
class Ran:
    """A finished run: exit code, output, and what nvidia-smi saw while it ran."""

    code: int
    out: str
    err: str
    seconds: float
    max_mem_mb: dict[int, int]  # GPU index -> the most memory.used seen
    pids_per_gpu: dict[int, set[int]]  # GPU index -> this run's processes seen on it

    def metrics(self, folder: Path) -> list[dict]:
        path = folder / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] \
            if path.is_file() else []


def nvidia_smi(query: str, what: str) -> list[list[str]]:
    """Rows of an nvidia-smi CSV query; [] without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-{query}={what}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return found


def run(cmd: Sequence[str], env: dict[str, str], timeout: float,
        on_output: Callable[[str, subprocess.Popen], None] | None = None) -> Ran:
    """Run ``cmd``, sampling GPU memory and processes every 2 s; ``on_output`` sees stdout."""
    start = time.monotonic()
    err = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    mem: dict[int, int] = {}
    pids: dict[int, set[int]] = {}
    uuids = {u: int(i) for i, u in nvidia_smi("gpu", "index,uuid")}
    last_sample = 0.0
    while proc.poll() is None and time.monotonic() - start < timeout:
        if on_output is not None:
            on_output("".join(lines), proc)
        if time.monotonic() - last_sample > 2:
            last_sample = time.monotonic()
            for index, used in nvidia_smi("gpu", "index,memory.used"):
                mem[int(index)] = max(mem.get(int(index), 0), int(used))
            ours = descendants(proc.pid)
            for uuid, pid in nvidia_smi("compute-apps", "gpu_uuid,pid"):
                if int(pid) in ours and uuid in uuids:
                    pids.setdefault(uuids[uuid], set()).add(int(pid))
        time.sleep(0.2)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    reader.join(timeout=10)
    err.seek(0)
    return Ran(proc.returncode, "".join(lines), err.read(), time.monotonic() - start, mem, pids)


def failed(name: str, ran: Ran) -> Result:
    """A FAIL line with the end of the run's error output."""
    tail = (ran.err.strip().splitlines() or ["(no output)"])[-1][:160]
    return Result(name, False, f"exit {ran.code} after {ran.seconds:.0f} s: {tail}")


# ---------------------------------------------------------------- the data


def write_folders(node: Node) -> None:
    """Photo-like JPEGs, hard-linked into a small and a large ImageFolder (10 classes)."""
    unique = write_photo_like_jpegs(node.work / "unique", node.scale.unique_images)
    for name, per_gpu in (("small", node.scale.small_per_gpu),
                          ("large", node.scale.train_per_gpu)):
        root = node.work / name
        for split, count in (("train", per_gpu * node.gpus), ("val", max(per_gpu // 10, 1)
                                                              * node.gpus)):
            for i in range(count):
                folder = root / split / f"class{i % 10}"
                folder.mkdir(parents=True, exist_ok=True)
                os.link(unique[i % len(unique)], folder / f"{split}{i:07d}.jpg")
        node.folders[name] = root


# ---------------------------------------------------------------- the checks


def launchers(node: Node) -> list[Result]:
    """Every launcher trains one epoch on all GPUs, one process per GPU."""
    data, tiny = str(node.folders["small"]), node.scale.tiny
    runs = {"main.py (spawns one process per GPU)": node.spawning(data, *tiny),
            "--multiprocessing-distributed": node.spawning(
                data, *tiny, "--multiprocessing-distributed", "-b", str(32 * node.gpus)),
            "torchrun": node.torchrun(data, *tiny)}
    if "SLURM_JOB_ID" in os.environ and shutil.which("srun"):
        runs["srun"] = ["srun", f"--ntasks={node.gpus}", "--nodes=1", "--gpus-per-task=1",
                        f"--ntasks-per-node={node.gpus}", *node.main_py(data, *tiny)]
    results = []
    for name, cmd in runs.items():
        out = node.work / f"launch-{len(results)}"
        ran = run([*cmd, "--epochs", "1", "--output-dir", str(out)], node.env(),
                  node.scale.timeout)
        results.append(launcher_result(f"launcher: {name}", ran, node, out))
    if "srun" not in runs:
        results.append(Result("launcher: srun", None, "not inside a SLURM allocation"))
    return results


def launcher_result(name: str, ran: Ran, node: Node, out: Path) -> Result:
    """PASS when the run finished and each GPU held one of its processes (if visible)."""
    if ran.code != 0:
        return failed(name, ran)
    epoch = (ran.metrics(out) or [{}])[-1]
    per_gpu = {gpu: len(p) for gpu, p in sorted(ran.pids_per_gpu.items())}
    one_each = not per_gpu or (len(per_gpu) == node.gpus and set(per_gpu.values()) == {1})
    seen = f"processes per GPU {per_gpu}" if per_gpu else \
        "one process per GPU not checked (nvidia-smi shows no processes here)"
    return Result(name, one_each, f"{epoch.get('train_images_per_sec', 0):.0f} img/s, "
                                  f"{ran.seconds:.0f} s; {seen}")


def features(node: Node) -> list[Result]:
    """DDP and FSDP with compile and bf16: two epochs, nothing compiled after the first."""
    data, tiny = str(node.folders["small"]), node.scale.tiny
    combos = {"DDP + compile + bf16 + channels_last": ["--compile", "--amp", "bf16",
                                                       "--channels-last"],
              "FSDP + compile + bf16": ["--fsdp", "--compile", "--amp", "bf16"]}
    results = []
    for name, flags in combos.items():
        out = node.work / f"feature-{len(results)}"
        ran = run(node.torchrun(data, *tiny, *flags, "--epochs", "2", "--output-dir", str(out)),
                  node.env(), node.scale.timeout)
        if ran.code != 0:
            results.append(failed(name, ran))
            continue
        graphs = [e.get("compiled_graphs") for e in ran.metrics(out)]
        results.append(Result(name, len(graphs) == 2 and graphs[1] == 0,
                              f"graphs compiled per epoch {graphs}; max memory per GPU "
                              f"{memory(ran)}"))
    return results


def resume_bitwise(node: Node) -> list[Result]:
    """SIGTERM in epoch 1, --resume auto: the same final weights as an uninterrupted run."""
    data, tiny = str(node.folders["small"]), node.scale.tiny
    flags = [data, *tiny, "--epochs", "2", "--seed", "0"]
    whole, cut = node.work / "whole", node.work / "cut"
    ran = run(node.spawning(*flags, "--output-dir", str(whole)), node.env(), node.scale.timeout)
    if ran.code != 0:
        return [failed("SIGTERM + resume: uninterrupted run", ran)]

    def stop_in_epoch_1(out: str, proc: subprocess.Popen) -> None:
        if "Epoch: [1]" in out and not getattr(proc, "signalled", False):
            proc.signalled = True  # type: ignore[attr-defined]
            os.kill(proc.pid, signal.SIGTERM)

    ran = run(node.spawning(*flags, "--output-dir", str(cut)), node.env(), node.scale.timeout,
              stop_in_epoch_1)
    if ran.code != 143:
        return [failed("SIGTERM + resume: stopped run (expects exit 143)", ran)]
    ran = run(node.spawning(*flags, "--output-dir", str(cut), "--resume", "auto"), node.env(),
              node.scale.timeout)
    if ran.code != 0:
        return [failed("SIGTERM + resume: resumed run", ran)]
    a, b = (torch.load(d / "checkpoint.pth.tar", map_location="cpu", weights_only=True)
            for d in (whole, cut))
    differ = [k for k, v in a["state_dict"].items() if not torch.equal(v, b["state_dict"][k])]
    return [Result("SIGTERM + resume bitwise", not differ,
                   f"{len(a['state_dict'])} tensors, {len(differ)} differ"
                   + (f" (first: {differ[0]})" if differ else ""))]


def throughput(node: Node) -> list[Result]:
    """ResNet-50 bf16 + channels_last + compile on --dummy and on JPEGs (decoded on the GPU
    and by the workers): img/s per GPU, data-wait, recompiles, memory; against the targets."""
    per_gpu = node.scale.train_per_gpu
    dummy = ["--dummy", "--dummy-size", str(per_gpu * node.gpus), "--dummy-classes", "10",
             "--dummy-val-size", str(per_gpu // 10 * node.gpus)]
    large = str(node.folders["large"])
    runs = {"--dummy": dummy, "JPEGs, --decode-on-device on": [large, "--decode-on-device", "on"],
            "JPEGs, --decode-on-device off": [large, "--decode-on-device", "off"]}
    speeds: dict[str, float] = {}
    results = []
    for name, args in runs.items():
        out = node.work / f"speed-{len(results)}"
        ran = run(node.torchrun(*args, *FAST, "--epochs", "3", "--output-dir", str(out)),
                  node.env(), node.scale.timeout)
        if ran.code != 0:
            results.append(failed(f"ResNet-50 {name}", ran))
            continue
        later = ran.metrics(out)[1:]  # epoch 0 compiles
        speed = sum(e["train_images_per_sec"] for e in later) / max(len(later), 1) / node.gpus
        wait = max((e["train_data_wait"] for e in later), default=1.0)
        graphs = sum(e.get("compiled_graphs", 0) for e in later)
        speeds[name] = speed
        ok, numbers = speed_verdict(name, speed, wait, speeds, node.scale.targets)
        results.append(Result(f"ResNet-50 {name}", False if graphs else ok,
                              f"{numbers}; {graphs} graphs compiled after epoch 0; max memory "
                              f"per GPU {memory(ran)}"))
    return results


def speed_verdict(name: str, speed: float, wait: float, speeds: dict[str, float],
                  targets: bool = True) -> tuple[bool | None, str]:
    """PASS/FAIL against the targets on an A100 or newer; information elsewhere (and without
    ``targets``: runs too small to measure)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    targeted = targets and any(t in gpu for t in ("A100", "H100", "H200", "B200"))
    numbers = f"{speed:,.0f} img/s per GPU ({gpu}), data-wait {100 * wait:.1f}%"
    if name == "--dummy":
        return (speed >= TARGET_DUMMY if targeted else None), \
            numbers + f" (target {TARGET_DUMMY:,})"
    ratio = speed / max(speeds.get("--dummy", speed), 1e-9)
    cores = len(os.sched_getaffinity(0)) / max(torch.cuda.device_count(), 1)
    numbers += f", {100 * ratio:.0f}% of --dummy with {cores:.0f} cores per GPU " \
               f"(target {100 * TARGET_REAL:.0f}%, data-wait < {100 * TARGET_WAIT:.0f}%)"
    if not targeted or cores < 16:
        return None, numbers
    return ratio >= TARGET_REAL and wait < TARGET_WAIT, numbers


def memory(ran: Ran) -> str:
    """'0: 11.2 GB, 1: 11.0 GB' from the run's nvidia-smi samples."""
    return ", ".join(f"{i}: {mb / 1024:.1f} GB" for i, mb in sorted(ran.max_mem_mb.items())) \
        or "n/a"


# ---------------------------------------------------------------- the table


CHECKS = {"launchers": launchers, "features": features, "resume": resume_bitwise,
          "throughput": throughput}


def table(results: list[Result]) -> str:
    """The results as an aligned text table."""
    width = max(len(r.name) for r in results)
    mark = {True: "PASS", False: "FAIL", None: "info"}
    return "\n".join(f"{r.name:<{width}}  {mark[r.ok]}  {r.numbers}" for r in results)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="work folder (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--only", nargs="+", choices=tuple(CHECKS), default=list(CHECKS),
                        help="run only these checks (default: all of them, in this order)")
    parser.add_argument("--cpu-dry-run", type=int, metavar="N",
                        help="run the checks on the CPU with N processes, at a small scale "
                             "(checks this script, not the GPUs)")
    args = parser.parse_args(argv)
    if args.cpu_dry_run:
        work = args.out or Path(tempfile.mkdtemp(prefix="gpu_smoke-"))
        return report(run_checks(Node(args.cpu_dry_run, work, SMALL, cpu=True), args.only))
    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device here (torch.cuda.is_available() is False); nothing "
              "to check")
        return 0
    work = args.out or Path(tempfile.mkdtemp(prefix="gpu_smoke-"))
    node = Node(torch.cuda.device_count(), work, Scale())
    try:
        return report(run_checks(node, args.only))
    finally:
        if not args.keep and args.out is None:
            shutil.rmtree(work, ignore_errors=True)


def run_checks(node: Node, names: Sequence[str]) -> list[Result]:
    """Write the data, then run the named checks in order."""
    node.work.mkdir(parents=True, exist_ok=True)
    device = "CPU processes" if node.cpu else torch.cuda.get_device_name(0)
    print(f"gpu_smoke: {node.gpus} x {device}, {len(os.sched_getaffinity(0))} cores; work "
          f"folder {node.work}", flush=True)
    write_folders(node)
    results: list[Result] = []
    for name in names:
        start = time.monotonic()
        results += CHECKS[name](node)
        print(f"  {name}: {time.monotonic() - start:.0f} s", flush=True)
    return results


def report(results: list[Result]) -> int:
    """Print the table; exit code 1 if any check failed."""
    print(table(results))
    return 1 if any(r.ok is False for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
