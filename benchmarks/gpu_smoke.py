"""Does the trainer work on this node's GPUs, and is it fast? Run by hand.

    python benchmarks/gpu_smoke.py --quick         # one GPU's table in at most ~7 minutes
    python benchmarks/gpu_smoke.py                 # all local GPUs, every launcher (~15 min)
    python benchmarks/gpu_smoke.py --out /scratch/smoke --keep

Every line of the table printed at the end is one check, PASS / FAIL / info, with its numbers:

- ResNet-50, bf16 + channels_last + compile, -b 256: on --dummy data (at least 200 steps an
  epoch), and on a JPEG folder it writes with every core, decoded by the loader workers and on
  the GPU: img/s per GPU, the share of time waiting for data, what the epoch boundary costs (the
  wait in the first steps of epoch 1), peak memory; which path --decode-on-device auto picks
  here and why; against the targets (>= 97% of the steady step rate on --dummy, >= 95% of
  --dummy on JPEGs under auto with data-wait < 5%, the device path at least the workers' where
  auto picks it);
- DDP and FSDP with --compile --amp bf16 (--channels-last with DDP): no graph compiled after the
  first epoch;
- SIGTERM in the middle of an epoch, then --resume auto: the final weights are bitwise those of
  an uninterrupted run;
- (not --quick) every launcher on all local GPUs (main.py's own spawn,
  --multiprocessing-distributed, torchrun, and srun inside a SLURM allocation), each process on
  its own GPU; fp32 without compile (the classic's settings); --seed (cuDNN autotuning off).

Without a CUDA device it says so in one line and exits 0. tests/test_cuda.py runs the same
checks at a small scale; --cpu-dry-run N runs them on the CPU (checks this script).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
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
from harness import write_photo_like_jpegs  # noqa: E402

TARGET_DUMMY = 3000  # img/s per A100, ResNet-50 bf16 + channels_last + compile
TARGET_STEADY = 0.97  # of the steady step rate, for a whole --dummy epoch
TARGET_REAL = 0.95  # of the --dummy img/s, on JPEGs, with 16 cores per GPU
TARGET_WAIT = 0.05  # share of the training time waiting for data
FAST = ["-a", "resnet50", "--amp", "bf16", "--channels-last", "--compile", "-b", "256",
        "-p", "20"]
CLASSIC = ["-a", "resnet50", "-b", "256", "-p", "20"]  # fp32, eager: the classic's settings
PROGRESS = re.compile(r"Epoch: \[(\d+)\]\[ *(\d+)/(\d+)\]  Time +([\d.]+)  Data +([\d.]+)")


@dataclass
class Result:
    """One line of the table: ``ok`` None means information only (no target applies)."""

    name: str
    ok: bool | None
    numbers: str


@dataclass
class Scale:
    """How big the runs are: the full smoke test, --quick, or tests/test_cuda.py's small one."""

    unique_images: int = 1000  # distinct JPEGs written; the folders hard-link them
    train_per_gpu: int = 20000  # images per GPU and epoch in the JPEG throughput runs
    dummy_per_gpu: int = 256 * 200  # images per GPU and epoch on --dummy (200 steps of 256)
    small_per_gpu: int = 512  # in the functional runs
    tiny: tuple[str, ...] = ("-a", "resnet18", "--train-crop-size", "64", "--val-resize-size",
                             "72", "--val-crop-size", "64", "-b", "32", "-p", "2")
    timeout: float = 900
    targets: bool = True  # judge img/s against the targets (not at the small scale)
    quick: bool = False  # one GPU's table, no launchers, no extra settings


QUICK = Scale(unique_images=2000, train_per_gpu=256 * 60, timeout=300, quick=True)
SMALL = Scale(unique_images=64, train_per_gpu=256, dummy_per_gpu=256, small_per_gpu=128,
              targets=False)


@dataclass
class Node:
    """What the checks share: GPUs, the work folder, the data folders."""

    gpus: int  # processes per launcher (GPUs, or --cpu-dry-run's processes)
    work: Path
    scale: Scale
    folders: dict[str, Path] = field(default_factory=dict)
    cpu: bool = False  # --cpu-dry-run: the same runs on the CPU (to check this script)
    workers: int | None = None  # --workers: -j for the JPEG runs (and no --dummy run)

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


def write_unique(folder: Path, count: int) -> list[Path]:
    """``count`` photo-like JPEGs, written by a process per core (one core writes ~17 a second)."""
    cores = max(1, min(len(os.sched_getaffinity(0)), count // 16 or 1))
    chunk = -(-count // cores)
    jobs = [(folder, min(chunk, count - k * chunk), k, k * chunk) for k in range(cores)
            if count - k * chunk > 0]
    with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
        parts = pool.starmap(write_photo_like_jpegs, jobs)
    return [path for part in parts for path in part]


def write_folders(node: Node) -> None:
    """Photo-like JPEGs, hard-linked into a small and a large ImageFolder (10 classes)."""
    unique = write_unique(node.work / "unique", node.scale.unique_images)
    for name, per_gpu in (("small", node.scale.small_per_gpu),
                          ("large", node.scale.train_per_gpu)):
        root = node.work / name
        for split, count in (("train", per_gpu * node.gpus), ("val", max(per_gpu // 10, 10)
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


@dataclass
class Speed:
    """One throughput run's epoch after the one that compiled."""

    images_per_sec: float  # per GPU
    wait: float  # share of the epoch's time waiting for data
    steady: float  # img/s per GPU of its steady steps (the median progress window)
    boundary: float  # seconds the first progress window of the epoch waited beyond steady
    graphs: int  # compiled after epoch 0
    memory: float | None  # peak device memory, GB (metrics.jsonl)


def speed_of(ran: Ran, out: Path, gpus: int, batch: int = 256) -> Speed:
    """Epoch 1 of a run (epoch 0 compiles): its img/s, data-wait, steady rate, boundary cost."""
    epochs = ran.metrics(out)
    last = epochs[-1] if len(epochs) > 1 else (epochs or [{}])[-1]
    windows = [m for m in PROGRESS.finditer(ran.out) if int(m.group(1)) == len(epochs) - 1]
    steps = [int(m.group(2)) - (int(windows[i - 1].group(2)) if i else 0)
             for i, m in enumerate(windows)]
    times = sorted(float(m.group(4)) for m in windows) or [0.0]
    steady_step = times[len(times) // 2]
    data = [float(m.group(5)) * n for m, n in zip(windows, steps)]
    later = sorted(data[1:]) or [0.0]
    boundary = max(0.0, (data[0] if data else 0.0) - later[len(later) // 2])
    return Speed(last.get("train_images_per_sec", 0.0) / gpus, last.get("train_data_wait", 1.0),
                 batch / steady_step if steady_step else 0.0, boundary,
                 sum(e.get("compiled_graphs", 0) for e in epochs[1:]),
                 last.get("train_max_mem_gb"))


def auto_choice(node: Node) -> str:
    """What --decode-on-device auto picks on this node, and why (the trainer's own rule)."""
    sys.path.insert(0, str(ROOT))
    from imagenet.settings.flags import parse_config
    from imagenet.settings.plan import make_plan

    jobs = [] if node.workers is None else ["-j", str(node.workers)]
    cfg = parse_config([str(node.folders["large"]), *FAST, *jobs])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    plan = make_plan(cfg, env, 0 if node.cpu else torch.cuda.device_count())
    return ("on" if plan.decode.on_device else "off") + f" ({plan.decode.why})"


def throughput(node: Node) -> list[Result]:
    """ResNet-50 bf16 + channels_last + compile on --dummy and on JPEGs (decoded by the workers
    and on the GPU): img/s per GPU, data-wait, the epoch boundary, recompiles, memory; which
    path auto picks; against the targets."""
    per_gpu = node.scale.dummy_per_gpu
    dummy = ["--dummy", "--dummy-size", str(per_gpu * node.gpus), "--dummy-classes", "10",
             "--dummy-val-size", str(max(per_gpu // 20, 256) * node.gpus)]
    large = str(node.folders["large"])
    jobs = [] if node.workers is None else ["-j", str(node.workers)]
    runs = {"--dummy": dummy, "JPEGs, --decode-on-device off": [large, "--decode-on-device",
                                                               "off", *jobs],
            "JPEGs, --decode-on-device on": [large, "--decode-on-device", "on", *jobs]}
    if node.workers is not None:  # auto's rule at another worker count: the two paths only
        del runs["--dummy"]
    speeds: dict[str, Speed] = {}
    results = []
    for name, args in runs.items():
        out = node.work / f"speed-{len(results)}"
        cmd = node.main_py(*args, *FAST) if node.gpus == 1 else node.torchrun(*args, *FAST)
        ran = run([*cmd, "--epochs", "2", "--output-dir", str(out)], node.env(),
                  node.scale.timeout)
        if ran.code != 0:
            results.append(failed(f"ResNet-50 {name}", ran))
            continue
        speed = speeds[name] = speed_of(ran, out, node.gpus)
        ok, numbers = speed_verdict(name, speed, speeds, node)
        results.append(Result(f"ResNet-50 {name}", False if speed.graphs else ok,
                              f"{numbers}; {speed.graphs} graphs compiled after epoch 0; peak "
                              f"memory {memory(ran, speed)}"))
    choice = auto_choice(node)
    picked = speeds.get(f"JPEGs, --decode-on-device {choice.split()[0]}")
    other = speeds.get(f"JPEGs, --decode-on-device {'off' if choice.startswith('on') else 'on'}")
    fine = None if picked is None or other is None else \
        picked.images_per_sec >= 0.97 * other.images_per_sec
    results.append(Result("--decode-on-device auto", fine if node.scale.targets else None,
                          f"picks {choice}" + ("" if picked is None or other is None else
                                               f": {picked.images_per_sec:,.0f} img/s vs "
                                               f"{other.images_per_sec:,.0f} the other way")))
    return results


def speed_verdict(name: str, speed: Speed, speeds: dict[str, Speed], node: Node
                  ) -> tuple[bool | None, str]:
    """PASS/FAIL against the targets on an A100 or newer; information elsewhere (and without
    ``targets``: runs too small to measure)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    targeted = node.scale.targets and any(t in gpu for t in ("A100", "H100", "H200", "B200"))
    numbers = (f"{speed.images_per_sec:,.0f} img/s per GPU ({gpu}; steady steps "
               f"{speed.steady:,.0f}), data-wait {100 * speed.wait:.1f}%, epoch boundary "
               f"{speed.boundary:.2f} s")
    if name == "--dummy":
        of_steady = speed.images_per_sec / max(speed.steady, 1e-9)
        numbers += f", {100 * of_steady:.0f}% of the steady rate (target " \
                   f"{100 * TARGET_STEADY:.0f}%, >= {TARGET_DUMMY:,} img/s)"
        return (of_steady >= TARGET_STEADY and speed.images_per_sec >= TARGET_DUMMY
                if targeted else None), numbers
    dummy = speeds.get("--dummy")
    cores = len(os.sched_getaffinity(0)) / max(node.gpus, 1)
    if dummy is not None:  # --workers runs none
        ratio = speed.images_per_sec / max(dummy.images_per_sec, 1e-9)
        numbers += f", {100 * ratio:.0f}% of --dummy"
    numbers += f" with {cores:.0f} cores per GPU (target {100 * TARGET_REAL:.0f}% of --dummy " \
               f"under auto, data-wait < {100 * TARGET_WAIT:.0f}%)"
    return None, numbers  # judged for the path auto picks: the "--decode-on-device auto" line


def memory(ran: Ran, speed: Speed | None = None) -> str:
    """Peak memory per GPU: the trainer's own (metrics.jsonl) and what nvidia-smi saw."""
    smi = ", ".join(f"{i}: {mb / 1024:.1f} GB" for i, mb in sorted(ran.max_mem_mb.items()))
    own = f"{speed.memory:.1f} GB allocated" if speed and speed.memory is not None else ""
    return "; ".join(x for x in (own, f"nvidia-smi {smi}" if smi else "") if x) or "n/a"


def settings(node: Node) -> list[Result]:
    """The classic's settings (fp32, eager) and --seed (cuDNN autotuning off) on --dummy: what
    each costs against the fast settings (information; the classic script is not run here)."""
    per_gpu = node.scale.dummy_per_gpu // 2
    dummy = ["--dummy", "--dummy-size", str(per_gpu * node.gpus), "--dummy-classes", "10",
             "--dummy-val-size", str(256 * node.gpus)]
    results = []
    for name, flags in (("fp32, no compile (the classic's settings)", CLASSIC),
                        ("--seed 0 (cuDNN autotuning off), fp32", [*CLASSIC, "--seed", "0"])):
        out = node.work / f"settings-{len(results)}"
        cmd = node.main_py(*dummy, *flags) if node.gpus == 1 else node.torchrun(*dummy, *flags)
        ran = run([*cmd, "--epochs", "2", "--output-dir", str(out)], node.env(),
                  node.scale.timeout)
        if ran.code != 0:
            results.append(failed(f"ResNet-50 {name}", ran))
            continue
        speed = speed_of(ran, out, node.gpus)
        results.append(Result(f"ResNet-50 {name}", None,
                              f"{speed.images_per_sec:,.0f} img/s per GPU (steady steps "
                              f"{speed.steady:,.0f})"))
    return results


# ---------------------------------------------------------------- the table


def decoders(node: Node) -> list[Result]:
    """The device path's JPEG decoders (--decoder): torchvision's and, where installed,
    TorchCodec's nvJPEG, batched as the trainer calls them: the same pixels as the CPU decode
    (nvJPEG's IDCT may differ from libjpeg-turbo's by a few levels: the mean and largest
    difference are shown), and img/s."""
    import importlib.util

    from imagenet.data import transforms

    device = torch.device("cpu" if node.cpu else "cuda", 0)
    paths = sorted((node.work / "unique").glob("*.jpg"))[:256]
    files = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8) for p in paths]
    cpu = [transforms.decode(f, "tensor") for f in files]
    results = []
    for name, backend in (("torchvision", "tensor"), ("torchcodec", "torchcodec")):
        if backend == "torchcodec" and importlib.util.find_spec("torchcodec") is None:
            results.append(Result(f"decoder {name} ({device.type})", None, "not installed here"))
            continue
        for _ in range(2):  # warm-up, then timed
            start = time.perf_counter()
            images = [im for i in range(0, len(files), 64)
                      for im in transforms.decode_batch(files[i:i + 64], device, backend)]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
        diffs = [(a.cpu().int() - b.int()).abs() for a, b in zip(images, cpu)]
        shapes = all(a.shape == b.shape for a, b in zip(images, cpu))
        worst = max(int(d.max()) for d in diffs) if shapes else -1
        mean = sum(float(d.float().mean()) for d in diffs) / len(diffs) if shapes else -1.0
        results.append(Result(f"decoder {name} ({device.type})", shapes and mean < 1.0,
                              f"{len(files) / seconds:,.0f} img/s in batches of 64; vs the CPU "
                              f"decode: shapes {'equal' if shapes else 'DIFFER'}, mean |diff| "
                              f"{mean:.3f}, max {worst}"))
    return results


CHECKS = {"launchers": launchers, "features": features, "resume": resume_bitwise,
          "throughput": throughput, "settings": settings, "decoders": decoders}
QUICK_CHECKS = ("throughput", "features", "resume", "decoders")


def table(results: list[Result]) -> str:
    """The results as an aligned text table."""
    width = max(len(r.name) for r in results)
    mark = {True: "PASS", False: "FAIL", None: "info"}
    return "\n".join(f"{r.name:<{width}}  {mark[r.ok]}  {r.numbers}" for r in results)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="work folder (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--quick", action="store_true",
                        help="one GPU's table in at most ~7 minutes: throughput (--dummy, JPEGs "
                             "on both decode paths, the epoch boundary, auto's choice), DDP/FSDP "
                             "+ compile, SIGTERM + resume")
    parser.add_argument("--only", nargs="+", choices=tuple(CHECKS), default=None,
                        help="run only these checks (default: all of them, in this order; "
                             "with --quick: throughput features resume decoders)")
    parser.add_argument("--cpu-dry-run", type=int, metavar="N",
                        help="run the checks on the CPU with N processes, at a small scale "
                             "(checks this script, not the GPUs)")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="throughput: the two JPEG runs with -j N, no --dummy run (checks "
                             "auto's rule at another worker count)")
    args = parser.parse_args(argv)
    names = args.only or (list(QUICK_CHECKS) if args.quick else list(CHECKS))
    if args.cpu_dry_run:
        work = args.out or Path(tempfile.mkdtemp(prefix="gpu_smoke-"))
        return report(run_checks(Node(args.cpu_dry_run, work, SMALL, cpu=True,
                                      workers=args.workers), names))
    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device here (torch.cuda.is_available() is False); nothing "
              "to check")
        return 0
    work = args.out or Path(tempfile.mkdtemp(prefix="gpu_smoke-"))
    node = Node(1 if args.quick else torch.cuda.device_count(), work,
                QUICK if args.quick else Scale(), workers=args.workers)
    env_gpus = {} if not args.quick else {"CUDA_VISIBLE_DEVICES": os.environ.get(
        "CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
    os.environ.update(env_gpus)  # --quick: one GPU, whatever the node has
    try:
        return report(run_checks(node, names))
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
    """Print the table (last: nothing follows it); exit code 1 if any check failed."""
    print(table(results), flush=True)
    return 1 if any(r.ok is False for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
