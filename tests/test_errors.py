"""The one error line: whole, even when the ranks of a node write theirs at the same moment."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from helpers import ROOT, child_env

WRITER = """
import sys, time
from imagenet.errors import RunError, report
rank, start = int(sys.argv[1]), float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))  # both ranks write at the same moment
for i in range(3000):
    report(RunError(f"stopped by SIGTERM at step {i}; checkpoint saved"), rank=rank)
"""


def test_error_lines_of_two_ranks_never_run_together():
    # Both ranks share one stderr pipe, unbuffered (PYTHONUNBUFFERED=1, as under SLURM and in
    # containers): every line must still be one rank's whole line.
    env = child_env(PYTHONUNBUFFERED="1")
    read, write = os.pipe()
    start = str(time.time() + 2)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(r), start], stderr=write,
                              env=env, cwd=ROOT) for r in (0, 1)]
    os.close(write)
    with open(read) as stream:
        lines = stream.read().splitlines()
    for p in procs:
        assert p.wait(timeout=60) == 0
    assert len(lines) == 6000
    for line in lines:
        assert line.count("error:") == 1 and line.endswith("checkpoint saved"), line
