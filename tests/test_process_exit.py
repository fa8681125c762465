"""main.py's processes, and the ranks mp.spawn starts, end through ``cli.end_process``: what
Python's own exit does that anything can see (other threads waited for, atexit's handlers run,
stdout and stderr flushed), without its last stage, the interpreter freeing every module's
objects one by one (~1 CPU-s in each process with torch and torchvision loaded). A real
interpreter that imported the trainer; the same script ending with sys.exit shows what the
last stage is."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT, child_env

SCRIPT = """
import atexit, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor

from imagenet.cli import end_process

marks = sys.argv[1]
atexit.register(lambda: open(marks, "a").write("atexit\\n"))


def late():
    time.sleep(0.5)
    open(marks, "a").write("thread\\n")


threading.Thread(target=late).start()  # not a daemon: the exit waits for it
pool = ThreadPoolExecutor(1)
pool.submit(int).result()  # an idle pool's worker: ended, not waited for forever


class Noted:
    def __del__(self, write=os.write):  # by then the module's globals may be gone
        write(2, b"freed at teardown\\n")


kept = Noted()
sys.stdout.write("buffered, no newline")
END
"""


@pytest.mark.slow
@pytest.mark.parametrize("end, freed", [("end_process(3)", False), ("sys.exit(3)", True)])
def test_the_exit_waits_for_threads_runs_atexit_flushes_and_frees_nothing(tmp_path, end, freed):
    marks = tmp_path / "marks"
    proc = subprocess.run([sys.executable, "-c", SCRIPT.replace("END", end), str(marks)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered, no newline"
    assert marks.read_text() == "thread\natexit\n"
    assert ("freed at teardown" in proc.stderr) is freed, proc.stderr
