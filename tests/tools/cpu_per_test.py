"""The CPU each test costs, counting every process it starts: where the suite's time goes.
Run by hand, as root (not a test)::

    PYTHONPATH=tests/tools .venv/bin/python -m pytest -q -p cpu_per_test --durations=0
    .venv/bin/python tests/tools/cpu_per_test.py --report /tmp/cpu-per-test

As a pytest plugin (``-p cpu_per_test``), each xdist worker moves itself into a cgroup of its
own (cgroup v1's cpuacct, else cgroup v2), and every process a test starts is born into it: the
runs forked from tests/prestart.py's server, their ranks and loader workers, torchrun and its
workers, g++ under inductor, Ray's daemons, ``ip netns exec``. After each test it appends the
cgroup's CPU (user + system) and wall seconds of that test to ``$CPU_PER_TEST_OUT/<worker>.jsonl``
(default /tmp/cpu-per-test). A worker runs one test at a time, so the difference is the test's.
A module fixture is counted in the test that first uses it; a process a test leaves running is
counted in the tests after it. ``tests/tools/process_census.py`` says which interpreters start;
this says what all of a test's processes cost, forked ones included.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

import pytest

OUT = Path(os.environ.get("CPU_PER_TEST_OUT", "/tmp/cpu-per-test"))
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
_usage: Path | None = None  # the cgroup file this worker reads


def _join_cgroup() -> Path | None:
    """Move this process into a cgroup of its own; the file holding its CPU usage."""
    v1 = Path("/sys/fs/cgroup/cpuacct")
    v2 = next((p for p in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
               if (p / "cgroup.controllers").exists()), None)
    for root, usage in ((v1, "cpuacct.usage"), (v2, "cpu.stat")):
        if root is None or not (root / "cgroup.procs").exists():
            continue
        group = root / f"cpu-per-test-{WORKER}-{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            continue
        return group / usage
    return None


def _cpu_seconds(path: Path) -> float:
    text = path.read_text()
    if path.name == "cpuacct.usage":  # nanoseconds
        return int(text) / 1e9
    return int(dict(line.split() for line in text.splitlines())["usage_usec"]) / 1e6


def pytest_configure(config: pytest.Config) -> None:
    global _usage
    _usage = _join_cgroup()
    if _usage is None:
        raise pytest.UsageError("cpu_per_test: cannot make a cgroup here (run as root on Linux)")
    OUT.mkdir(parents=True, exist_ok=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    assert _usage is not None
    cpu, wall = _cpu_seconds(_usage), time.monotonic()
    yield
    record = {"test": item.nodeid, "cpu": round(_cpu_seconds(_usage) - cpu, 3),
              "wall": round(time.monotonic() - wall, 3)}
    with open(OUT / f"{WORKER}.jsonl", "a") as sink:
        sink.write(json.dumps(record) + "\n")


def report(folder: Path, top: int) -> None:
    rows = [json.loads(line) for path in sorted(folder.glob("*.jsonl"))
            for line in path.read_text().splitlines()]
    cpu, wall = sum(r["cpu"] for r in rows), sum(r["wall"] for r in rows)
    print(f"{len(rows)} tests: {cpu:.0f} CPU-s in {wall:.0f} worker-s")
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        files[r["test"].split("::")[0]][0] += r["cpu"]
        files[r["test"].split("::")[0]][1] += r["wall"]
    print(f"\nfiles, most CPU first (top {top}):    CPU-s  worker-s")
    for name, (c, w) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {c:7.1f} {w:8.1f}  {name}")
    print(f"\ntests, most CPU first (top {top}):    CPU-s  worker-s")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        print(f"  {r['cpu']:7.1f} {r['wall']:8.1f}  {r['test'][:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, default=OUT, help="the folder of a profile")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    report(args.report, args.top)


if __name__ == "__main__":
    main()
