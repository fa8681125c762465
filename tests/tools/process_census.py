"""Which Python processes a command starts, and the CPU each kind costs: where a test run's time
goes. Run by hand (not a test)::

    .venv/bin/python tests/tools/process_census.py -- .venv/bin/python -m pytest -q tests/test_x.py
    .venv/bin/python tests/tools/process_census.py --report census.jsonl   # an earlier census

Every interpreter that starts from this virtual environment (``python main.py``, an mp.spawn
child, torchrun's agent, a helper ``python -c``) records at its exit its command line, its own
CPU time (user + system), whether it imported torch and the test that was running
(``PYTEST_CURRENT_TEST``). A ``.pth`` file in the environment's site-packages loads the recorder
in each of them, for the command's duration only (removed after, even when it fails): a
``sitecustomize`` on ``PYTHONPATH`` would be replaced by the tests' own. Processes made by
``fork`` (loader workers, the runs forked from tests/prestart.py's server) run no new
interpreter and are not counted; nor are processes killed by a signal (no exit handler runs).
The census shows how many processes pay the ~3-5 s of imports that starting torch and
torchvision costs, and for which tests.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import site
import subprocess
import sys
import tempfile
from pathlib import Path

RECORDER = '''
import atexit, json, os, resource, sys, time

_pid, _log = os.getpid(), os.environ.get("IMAGENET_CENSUS")


def _record():
    if os.getpid() != _pid or not _log:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    entry = {"argv": sys.orig_argv[:8], "cpu": round(usage.ru_utime + usage.ru_stime, 2),
             "torch": "torch" in sys.modules,
             "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}
    try:
        with open(_log, "a") as f:
            f.write(json.dumps(entry) + "\\n")
    except OSError:
        pass


atexit.register(_record)
'''


def kind(argv: list[str]) -> str:
    line = " ".join(argv)
    if "spawn_main" in line or "--multiprocessing-fork" in line:
        return "mp.spawn child"
    if "torch.distributed.run" in line or "torchrun" in line:
        return "torchrun agent"
    if "prestart.py" in line:
        return "tests/prestart.py (server or client)"
    if "main.py" in line:
        return "python main.py (a plain start)"
    if "pytest" in line or "xdist" in line or "execnet" in line:
        return "pytest and its workers"
    return "other python (-c, -m, helpers)"


def report(path: Path, top: int) -> None:
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    for e in entries:
        kinds[kind(e["argv"])].append(e["cpu"])
    total = sum(e["cpu"] for e in entries)
    print(f"{len(entries)} interpreters started, {total:.0f} CPU-s in them")
    for name, cpus in sorted(kinds.items(), key=lambda item: -sum(item[1])):
        print(f"  {len(cpus):5d} {sum(cpus):8.0f} CPU-s  {sum(cpus) / len(cpus):5.1f} each  {name}")
    tests: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for e in entries:
        if e["torch"] and e["test"]:
            tests[e["test"]] += e["cpu"]
            counts[e["test"]] += 1
    print(f"tests whose processes imported torch, most CPU first (top {top}):")
    for test, cpu in tests.most_common(top):
        print(f"  {cpu:7.0f} CPU-s {counts[test]:4d} processes  {test}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, help="summarize this census file and exit")
    parser.add_argument("--out", type=Path, help="where to keep the census (default: a temp file)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args()
    if args.report:
        report(args.report, args.top)
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command after --")
    out = args.out or Path(tempfile.mkstemp(prefix="census-", suffix=".jsonl")[1])
    out.write_text("")
    packages = Path(site.getsitepackages()[0])
    recorder, pth = packages / "_imagenet_census.py", packages / "_imagenet_census.pth"
    recorder.write_text(RECORDER)
    pth.write_text("import _imagenet_census\n")
    try:
        code = subprocess.call(command, env={**os.environ, "IMAGENET_CENSUS": str(out)})
    finally:
        pth.unlink(missing_ok=True)
        recorder.unlink(missing_ok=True)
    print(f"census in {out} (exit code of the command: {code})")
    report(out, args.top)
    return code


if __name__ == "__main__":
    sys.exit(main())
