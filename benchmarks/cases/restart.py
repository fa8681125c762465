"""What a restart costs: the time to the first training step of a cold start and of the requeued
start of the same job, side by side. Run by hand (not a test)::

    # A 200,000-file ImageFolder (1,000 classes x 190 train + 10 val tiny JPEGs, made once under
    # --root), local disk and a simulated network file system (--latency-us, see below):
    python benchmarks/bench.py restart folder --latency-us 0 100 200

    # --compile on the CPU (resnet18, 32 px crops, a 24-image folder): a cold start compiles;
    # the requeued start loads the graphs the first one kept in OUTPUT_DIR/cache:
    python benchmarks/bench.py restart compile

Each leg is a real ``main.py`` process stopped by SIGTERM once its first step is printed (it
saves, as on preemption, and exits 143); the requeued leg is the same command with ``--resume
auto``. The numbers are what config.json's ``starts`` records: seconds from the moment the
process started to the end of its first step, and each stage of it.

**The simulated network file system** (``--latency-us E``, as ``folder``'s legs run): listing a
folder costs E us per entry, charged after every 100 entries and at the end (READDIRPLUS hands
out about that many at once; a file system that lists ImageNet's 1.28 M files in a few minutes,
or ImageNet-21K's 14 M in half an hour, spends 100-130 us per file), and each ``os.stat`` and each
``open`` of a file under the data folder costs 2 x E (a round trip). It is Python-level: the
training process patches ``os.scandir``, ``os.stat`` and ``builtins.open`` before it imports the
trainer (the loader workers fork from it), and sleeps. Nothing else is slowed: the interpreter,
the imports and the checkpoint are on the local disk. The time it slept is reported next to each
leg, so the numbers can be checked against it.
"""

from __future__ import annotations

import argparse
import builtins
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

ROOT = harness.ROOT
SMALL = ["-a", "resnet18", "--train-crop-size", "32", "--val-resize-size", "36",
         "--val-crop-size", "32", "-b", "8", "-p", "1", "--seed", "0", "--lr", "0.01"]


# ---------------------------------------------------------------- the simulated slow file system


def slow_file_system(root: str, entry_s: float, report: str) -> None:
    """Patch this process so that ``root``'s folders list, stat and open slowly (see the module
    docstring); at exit write the seconds slept to ``report``."""
    import atexit

    slept = {"listing": 0.0, "stat": 0.0, "open": 0.0}
    real_scandir, real_stat, real_open = os.scandir, os.stat, builtins.open

    def under(path: object) -> bool:
        try:
            return os.fspath(path).startswith(root)  # type: ignore[arg-type]
        except TypeError:
            return False

    def pause(kind: str, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        slept[kind] += time.perf_counter() - start

    class SlowScandir:
        def __init__(self, it) -> None:
            self.it, self.pending = it, 0

        def __iter__(self):
            return self

        def __next__(self):
            try:
                entry = next(self.it)
            except StopIteration:
                pause("listing", self.pending * entry_s)
                self.pending = 0
                raise
            self.pending += 1
            if self.pending == 100:
                pause("listing", 100 * entry_s)
                self.pending = 0
            return entry

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.it.close()

        def close(self):
            self.it.close()

    def scandir(path=".", *args, **kwargs):
        it = real_scandir(path, *args, **kwargs)
        return SlowScandir(it) if under(path) else it

    def stat(path, *args, **kwargs):
        if under(path):
            pause("stat", 2 * entry_s)
        return real_stat(path, *args, **kwargs)

    def slow_open(file, *args, **kwargs):
        if under(file):
            pause("open", 2 * entry_s)
        return real_open(file, *args, **kwargs)

    os.scandir, os.stat, builtins.open = scandir, stat, slow_open

    def write_report() -> None:
        if os.getpid() == main_pid:  # not the forked loader workers
            with real_open(report, "w") as f:
                json.dump(slept, f)

    main_pid = os.getpid()
    atexit.register(write_report)


def child(argv: list[str]) -> None:
    """Run main.py with ``argv``, under the simulated file system when its variables say so (a
    leg's process: ``harness.child_command("restart", ...)``)."""
    root, entry_us = os.environ.get("SLOWFS_ROOT"), float(os.environ.get("SLOWFS_US", "0"))
    if root and entry_us > 0:
        slow_file_system(root, entry_us * 1e-6, os.environ["SLOWFS_REPORT"])
    sys.argv = [str(ROOT / "main.py"), *argv]
    sys.path.insert(0, str(ROOT))
    import runpy

    runpy.run_path(str(ROOT / "main.py"), run_name="__main__")


# ---------------------------------------------------------------- legs


def make_folder(root: Path, classes: int, train: int, val: int, size: int = 48) -> Path:
    """``classes`` x (``train`` + ``val``) tiny JPEGs (one image per class, written as files)."""
    done = root / ".complete"
    if done.exists():
        return root
    from PIL import Image

    for c in range(classes):
        buf = io.BytesIO()
        Image.new("RGB", (size, size), ((37 * c) % 256, 80, 160)).save(buf, "JPEG", quality=80)
        for split, n in (("train", train), ("val", val)):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                (folder / f"n{c:08d}_{i}.JPEG").write_bytes(buf.getvalue())
    done.touch()
    return root


def leg(args: list[str], out: Path, stop_at: str, env: dict[str, str], log: Path,
        timeout: float = 1800) -> int:
    """Run main.py (through ``child``) until a line starting ``stop_at`` prints, then
    SIGTERM it (it saves and exits 143); its exit code. Output goes to ``log``."""
    cmd = harness.child_command("restart", *args, "--output-dir", str(out))
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=ROOT)
        deadline = time.monotonic() + timeout
        signalled = False
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.write(line)
            if not signalled and line.startswith(stop_at):
                proc.send_signal(signal.SIGTERM)
                signalled = True
            if time.monotonic() > deadline:
                proc.kill()
        return proc.wait()


def starts(out: Path) -> list[dict]:
    """config.json's record of every start."""
    return json.loads((out / "config.json").read_text())["starts"]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLOWFS_", "TORCHINDUCTOR"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "2"), **extra)
    return env


def show(name: str, record: dict, slept: dict | None = None) -> None:
    stages = ", ".join(f"{k} {v:.2f}" for k, v in record["stages_s"].items())
    extra = f"; compile cache {record['compile_cache']}" if "compile_cache" in record else ""
    injected = "" if not slept else \
        "; simulated latency slept " + ", ".join(f"{k} {v:.2f} s" for k, v in slept.items())
    print(f"  {name:9s} first step after {record['time_to_first_step_s']:7.2f} s  ({stages}; "
          f"{record['notes']}{extra}{injected})", flush=True)


def folder_bench(opts: argparse.Namespace) -> None:
    data = make_folder(Path(opts.root), opts.classes, opts.train, opts.val)
    files = opts.classes * (opts.train + opts.val)
    print(f"{data}: {files} files ({opts.classes} classes x {opts.train} train + {opts.val} "
          f"val); -j {opts.workers}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    try:
        for latency in opts.latency_us:
            for repeat in range(opts.repeats):
                out = work / f"run-{latency}-{repeat}"
                env = child_env(SLOWFS_ROOT=str(data), SLOWFS_US=str(latency))
                args = [str(data), *SMALL, "-j", str(opts.workers), "--epochs", "1"]
                slept = []
                for name, extra in (("cold", []), ("requeued", ["--resume", "auto"])):
                    report = work / f"slept-{latency}-{repeat}-{name}.json"
                    code = leg([*args, *extra], out, "Epoch: [0]", {**env,
                               "SLOWFS_REPORT": str(report)}, work / f"{name}.log")
                    if code != 143:
                        sys.exit(f"{name} leg exited {code}: see {work / f'{name}.log'}")
                    slept.append(json.loads(report.read_text()) if report.exists() else None)
                cold, requeued = starts(out)[-2:]
                print(f"latency {latency} us per entry (run {repeat + 1}):")
                show("cold", cold, slept[0])
                show("requeued", requeued, slept[1])
                print(f"  requeued / cold: "
                      f"{requeued['time_to_first_step_s'] / cold['time_to_first_step_s']:.1%}"
                      f" (the data set stage: {requeued['stages_s']['data']:.2f} s vs "
                      f"{cold['stages_s']['data']:.2f} s)", flush=True)
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)


def compile_bench(opts: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-restart-compile-"))
    try:
        data = make_folder(work / "data", 3, 8, 3, size=40)  # 24 train, 9 val: 3 steps of 8
        out = work / "run"
        args = [str(data), *SMALL, "-j", str(opts.workers), "--compile", "--epochs", "2"]
        # Cold: epoch 0 compiles every shape (training, and validation's 8- and 1-image
        # batches), then the job is stopped at epoch 1's first step. Requeued: resumes epoch 1
        # and runs it to its end (validation included).
        code = leg(args, out, "Epoch: [1]", child_env(), work / "cold.log")
        if code != 143:
            sys.exit(f"cold leg exited {code}: see {work / 'cold.log'}")
        done = subprocess.run(harness.child_command("restart", *args, "--resume", "auto",
                                                    "--output-dir", str(out)),
                              capture_output=True, text=True, env=child_env(), cwd=ROOT)
        (work / "requeued.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            sys.exit(f"requeued leg exited {done.returncode}: see {work / 'requeued.log'}")
        cold, requeued = starts(out)[-2:]
        records = harness.metrics(out)
        print("--compile, resnet18 at 32 px on the CPU, -b 8:")
        show("cold", cold)
        show("requeued", requeued)
        print(f"  requeued / cold: "
              f"{requeued['time_to_first_step_s'] / cold['time_to_first_step_s']:.1%}")
        for r in records:
            print(f"  epoch {r['epoch']}: {r.get('compiled_graphs')} graph(s) traced; compile "
                  f"cache: {r.get('compile_cache_hits')} loaded, "
                  f"{r.get('compile_cache_misses')} compiled")
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    parser.add_argument("what", choices=("folder", "compile"),
                        help="folder: a large ImageFolder's start; compile: --compile's")
    parser.add_argument("--root", default=str(Path(tempfile.gettempdir()) / "bench-restart-200k"),
                        help="where the synthetic folder is made (once) (default: %(default)s)")
    parser.add_argument("--classes", type=int, default=1000,
                        help="class folders (default: %(default)s)")
    parser.add_argument("--train", type=int, default=190,
                        help="training images per class (default: %(default)s)")
    parser.add_argument("--val", type=int, default=10,
                        help="validation images per class (default: %(default)s)")
    parser.add_argument("--latency-us", type=float, nargs="+", default=[0.0, 100.0],
                        help="simulated listing cost per folder entry, microseconds; a stat "
                             "or an open costs twice that; 0 = the local disk as it is "
                             "(default: 0 100)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="cold and requeued starts per latency (default: %(default)s)")
    parser.add_argument("-j", "--workers", type=int, default=2,
                        help="loader workers of the runs (default: %(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the run folders and logs")


def run(opts: argparse.Namespace) -> None:
    folder_bench(opts) if opts.what == "folder" else compile_bench(opts)
