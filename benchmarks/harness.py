"""What the benchmarks share: the repository on ``sys.path``, timing, the table they print,
running ``main.py`` (or a case's own helper process) and reading what it wrote, the data they draw.

Imports only the standard library at the top: a case's helper process starts through
``bench.py`` (``child_command``), and some of them time their own start-up.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench.py"
CHILD = "_child"  # bench.py _child CASE ARGS...: a case's helper process, not a subcommand
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------- processes


def bench_command(*args: str) -> list[str]:
    """``python benchmarks/bench.py ARGS``: a subcommand in a fresh interpreter."""
    return [sys.executable, str(BENCH), *args]


def child_command(case: str, *args: str) -> list[str]:
    """The command that runs ``child(args)`` of the case module ``case`` in a fresh interpreter
    (it imports nothing but bench.py, this module and that case)."""
    return bench_command(CHILD, case, *args)


def run_main(argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
    """``main.py ARGV`` in a fresh interpreter, its output captured (text)."""
    kwargs.setdefault("capture_output", "stdout" not in kwargs)
    return subprocess.run([sys.executable, str(ROOT / "main.py"), *argv], text=True, **kwargs)


def failure(proc: subprocess.CompletedProcess, tail: int = 4000) -> str:
    """One message for a command that failed: its exit code, the command, the end of stderr."""
    return f"failed (exit {proc.returncode}): {' '.join(map(str, proc.args))}\n" \
           f"{(proc.stderr or '')[-tail:]}"


def prepare(folder: Path, out: Path, *flags: str) -> None:
    """``python -m imagenet.tools.prepare --from-folder FOLDER --out OUT FLAGS``."""
    subprocess.run([sys.executable, "-m", "imagenet.tools.prepare", "--from-folder", str(folder),
                    *flags, "--out", str(out)], check=True, cwd=ROOT)


def metrics(out: Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl`` (one per epoch), in order."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def last_metrics(out: Path) -> dict:
    """A run's last epoch record."""
    return metrics(out)[-1]


# ---------------------------------------------------------------- timing


def seconds(fn: Callable[[], object]) -> float:
    """Wall seconds (``time.perf_counter``) of ``fn()``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cpu_seconds(fn: Callable[[], object]) -> float:
    """CPU seconds of this process (``time.process_time``) of ``fn()``: time spent descheduled
    by other work on a shared machine does not count."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def best_of(passes: int, fn: Callable[[], object], clock: Callable = seconds) -> float:
    """The fastest of ``passes`` timings of ``fn()`` (the passes others disturbed drop out)."""
    return min(clock(fn) for _ in range(passes))


# ---------------------------------------------------------------- the table


class Table:
    """Fixed-width columns: ``Table(("name", "<10", ""), ("img/s", ">8", ".1f"), sep=" ")``
    prints its header with ``header()`` and one line per ``row(*values)``."""

    def __init__(self, *columns: tuple[str, str, str], sep: str = "") -> None:
        self.columns, self.sep = columns, sep

    def header(self) -> None:
        print(self.sep.join(f"{title:{width}}" for title, width, _ in self.columns), flush=True)

    def row(self, *values: object, end: str = "") -> None:
        cells = [format(value, width + spec)
                 for value, (_, width, spec) in zip(values, self.columns)]
        print(self.sep.join(cells) + end, flush=True)


# ---------------------------------------------------------------- data


def photo_like(rng, width: int, height: int):
    """HWC uint8 image with photo statistics: smooth shapes, lighting gradient, texture, noise."""
    import numpy as np
    from PIL import Image

    out = np.zeros((height, width, 3), np.float32)
    # Coarse-to-fine random fields (bicubic-upsampled noise): large regions down to fine texture.
    for cells, amplitude in ((4, 90), (16, 40), (64, 25), (160, 15)):
        grid = rng.integers(0, 256, (cells * height // width + 2, cells + 2, 3), dtype=np.uint8)
        field = Image.fromarray(grid).resize((width, height), Image.BICUBIC)
        out += (np.asarray(field, np.float32) / 127.5 - 1) * amplitude
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    out += (xx / width * rng.uniform(-60, 60) + yy / height * rng.uniform(-60, 60))[..., None]
    out += rng.normal(0, 9, (height, width, 1)) + rng.normal(0, 3, (height, width, 3))  # sensor
    out += rng.uniform(60, 190, 3)
    return np.clip(out, 0, 255).astype(np.uint8)


def write_photo_like_jpegs(folder: Path, count: int = 200, seed: int = 0,
                           first: int = 0) -> list[Path]:
    """``count`` JPEGs (quality 90) of ImageNet-like sizes (~470x360 on average), deterministic;
    named from ``first`` on (several writers can share a folder)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(first, first + count):
        width = int(np.clip(rng.normal(470, 80), 200, 800))
        # Mostly landscape 4:3, some 3:2, square, portrait and 16:9, like ImageNet's photos.
        aspect = rng.choice([0.75] * 5 + [0.667] * 3 + [0.5625, 1.0, 1.333])
        height = int(np.clip(width * aspect, 150, 800))
        path = folder / f"{i:05d}.jpg"
        Image.fromarray(photo_like(rng, width, height)).save(path, quality=90)
        paths.append(path)
    return paths
