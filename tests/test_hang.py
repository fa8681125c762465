"""--hang-timeout: a rank that stops making progress is noticed within the timeout, every rank
writes its Python stacks to OUTPUT_DIR/hang/, one line names the rank that stopped and where,
every process exits with the requeue code 143 and none is left behind; --resume auto then
continues exactly. A compile, a checkpoint load and an upload pause the clock, with a bound of
their own. Real processes, real signals (SIGSTOP), a real blocked read (a FIFO), real compiles
and slow storage (fault injection: a ``sitecustomize`` that throttles reads and uploads)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import (
    MAIN,
    ROOT,
    TINY,
    TINY18,
    child_env,
    load_checkpoint,
    prestarted_cmd,
    run_main,
    write_image_folder,
)
from test_fault_tolerance import Live, _tagged_pids

from imagenet.data.samplers import ResumableDistributedSampler
from imagenet.launching import watchdog

HANG = 8  # --hang-timeout of these tests, seconds (the chaos matrix's hang scenarios use 8 too)
LIMIT = HANG + 60  # every process gone within this much of the hang (the bound)


def gone(token: str, within: float = 30) -> bool:
    """True once no process of the run tagged ``token`` is left."""
    deadline = time.monotonic() + within
    while _tagged_pids(token) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _tagged_pids(token)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("hang") / "data", classes=2,
                              train_per_class=24, val_per_class=2)


def main(*args: str) -> list[str]:
    return [sys.executable, MAIN, *TINY, "-p", "1", "--hang-timeout", str(HANG), *args]


def forked(command: list[str]) -> list[str]:
    """``python main.py ...`` forked from the pre-imported trainer instead (its mp.spawn ranks
    too): for the runs that are neither stopped nor watched, the references and resumes."""
    assert command[:2] == [sys.executable, MAIN], command
    return prestarted_cmd(*command[2:])


@pytest.mark.slow
def test_a_loader_worker_blocked_on_a_read_ends_the_run_with_its_stacks(tmp_path):
    """One process: a training file that never gives its bytes (a FIFO with no writer), read
    by the loader worker; the training process waits for the batch forever without the watch."""
    root = write_image_folder(tmp_path / "data", classes=2, train_per_class=20, val_per_class=2)
    os.mkfifo(root / "train" / "class0" / "zz_never.jpg")  # sample 20 of 41: last of class0
    # A seed whose first 16 samples (the augmented-samples preview, read in the training
    # process itself) leave the FIFO to the workers.
    seed = next(s for s in range(100)
                if 20 not in ResumableDistributedSampler(41, seed=s).indices()[:16])
    out = tmp_path / "out"
    live = Live(main(str(root), "-b", "4", "-j", "1", "--seed", str(seed), "--epochs", "1",
                     "--output-dir", str(out)), timeout=LIMIT + 60)
    live.wait_for("Epoch: [0]")
    started = time.monotonic()
    code = live.finish()
    assert code == 143, live.output
    assert time.monotonic() - started < LIMIT
    line = next(x for x in live.output.splitlines() if x.startswith("error: hang:"))
    assert "rank 0 made no progress" in line and "waiting for the training batch" in line
    assert f"--hang-timeout {HANG}" in line and str(out / "hang") in line
    assert "Traceback" not in live.output
    own = (out / "hang" / "rank0.txt").read_text()
    assert "Thread" in own and "_get_data" in own  # the main thread, waiting for the batch
    workers = list((out / "hang").glob("rank0-worker*.txt"))
    assert workers and any("read_bytes" in w.read_text() or "open" in w.read_text()
                           for w in workers), [w.read_text() for w in workers]
    report = json.loads((out / "hang" / "report.json").read_text())
    assert report["rank"] == 0 and report["hang_timeout"] == HANG
    assert gone(live.token)  # the worker blocked in open() too


def two_processes(launcher: str, data: Path, out: Path, *extra: str) -> list[str]:
    """A 2-process run of 2 x 2 images per step and one loader worker each, the same training
    under mp.spawn (-b and -j per node) and torchrun (per process)."""
    args = main(str(data), "-b", "4" if launcher == "spawn" else "2", "-j", "1", "--seed", "0",
                "--epochs", "2", "--output-dir", str(out), *extra)
    if launcher == "spawn":
        return [*args, "--nproc-per-node", "2"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", *args[1:]]


@pytest.fixture(scope="module")
def whole(data, tmp_path_factory) -> Path:
    """The uninterrupted run both launchers' stopped and resumed runs must end as."""
    out = tmp_path_factory.mktemp("whole")
    ran = Live(forked(two_processes("spawn", data, out)), timeout=600)
    assert ran.finish() == 0, ran.output
    return out


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_a_stopped_rank_is_named_and_every_process_ends(data, whole, tmp_path, launcher):
    """Two processes; rank 1 stopped with SIGSTOP in the middle of epoch 1: rank 0 waits in the
    gradient all-reduce. Then --resume auto ends as an uninterrupted run does (mp.spawn's: the
    launcher does not change what is trained)."""

    def command(out: Path, *extra: str) -> list[str]:
        return two_processes(launcher, data, out, *extra)

    out = tmp_path / "out"
    live = Live(command(out), timeout=LIMIT + 120)
    rank1 = rank_pid(live.token, 1, within=120)  # found first: the stop follows the line at once
    live.wait_for("Epoch: [1][")  # its first step (the epoch's rest is under a second)
    os.kill(rank1, signal.SIGSTOP)
    stopped = time.monotonic()
    code = live.finish()
    assert time.monotonic() - stopped < LIMIT
    assert gone(live.token), "a process of the run is left"
    line = next(x for x in live.output.splitlines() if "error: hang:" in x)
    assert "rank 1 stopped answering" in line, live.output[-3000:]
    assert f"pid {rank1}" in line
    if launcher == "spawn":  # torchrun reports its workers' failure with its own exit code
        assert code == 143, live.output[-3000:]
    assert (out / "hang" / "rank0.txt").is_file() and (out / "hang" / "rank1.txt").is_file()
    assert "Thread" in (out / "hang" / "rank1.txt").read_text()  # asked for before it ended
    resumed = command(out, "--resume", "auto")
    resumed = Live(forked(resumed) if launcher == "spawn" else resumed, timeout=600)
    assert resumed.finish() == 0, resumed.output
    a, b = (load_checkpoint(d / "checkpoint.pth.tar") for d in (whole, out))
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key


def rank_pid(token: str, rank: int, within: float = 30) -> int:
    """The training process of ``rank`` in the run tagged ``token``: torchrun gives it RANK
    (its loader workers, forked later, inherit it: the lowest pid); mp.spawn starts the ranks
    in order (the children running spawn_main)."""
    from test_fault_tolerance import _tagged_processes

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = list(_tagged_processes(token))
        torchrun = sorted(pid for pid, env, cmdline in found
                          if env.get("RANK") == str(rank) and "main.py" in cmdline)
        if torchrun:
            return torchrun[0]
        spawned = sorted(pid for pid, _, cmdline in found if "spawn_main" in cmdline
                         and parent(pid) not in {p for p, _, c in found if "spawn_main" in c})
        if len(spawned) > rank:
            return spawned[rank]
        time.sleep(0.2)
    raise AssertionError(f"no process of rank {rank}")


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def test_the_line_names_the_rank_where_and_the_folder(tmp_path):
    stopped = {"rank": 3, "what": "epoch 2, step 7 trained", "progress": 100.0, "pid": 42,
               "host": "node7/abc", "silent": True}
    line = watchdog.describe(stopped, 300, 412.0, tmp_path / "hang")
    assert line.startswith("hang: rank 3 stopped answering (its last progress 312 s ago)")
    assert "it was at: epoch 2, step 7 trained (host node7, pid 42)" in line
    assert str(tmp_path / "hang") in line and "exit 143" in line
    busy = {**stopped, "silent": False}
    assert "made no progress for 312 s (--hang-timeout 300)" in \
        watchdog.describe(busy, 300, 412.0, tmp_path)


@pytest.mark.parametrize("timeout", [8.0, 300.0])
def test_the_rank_silent_since_the_hang_began_is_named_under_any_timeout(tmp_path, timeout):
    """Rank 1's heartbeat stopped when the progress did (SIGSTOP, a lost link): it is the rank
    named, as stopped. Under a --hang-timeout shorter than the watch's usual 10 s of silence, it
    used to count as alive, and rank 0, waiting for it in the all-reduce, was named instead."""
    store = dist.HashStore()
    dog = watchdog.Watchdog(timeout, 0, 2, tmp_path, store, "t", "h")
    now = time.time()
    last = now - timeout  # the last progress of both ranks, and rank 1's last heartbeat
    beats = {0: (now, "waiting for the gradient all-reduce"), 1: (last, "epoch 0, step 3 trained")}
    try:
        for rank, (alive, what) in beats.items():
            store.set(f"t/heartbeat/{rank}", json.dumps({"alive": alive, "progress": last,
                                                         "what": what, "host": "h", "pid": 1}))
        stopped = dog._who_stopped(now)
    finally:
        dog.close()
    assert stopped["rank"] == 1 and stopped["silent"], stopped


def test_a_rank_is_named_with_its_pid_even_if_it_stops_before_its_first_look(tmp_path):
    """A rank's first heartbeat is in the store when its watch starts, not one look later: a
    rank stopped within its first second of training (a tiny epoch) was named "unknown (no
    heartbeat yet)", without its pid (test_a_stopped_rank_is_named_and_every_process_ends
    under torchrun, once)."""
    store = dist.HashStore()
    dog = watchdog.Watchdog(300.0, 1, 2, tmp_path, store, "t", "h").start()
    try:
        assert store.check(["t/heartbeat/1"]), "no heartbeat when the watch started"
        beat = json.loads(store.get("t/heartbeat/1"))
        assert beat["pid"] == os.getpid() and beat["host"] == "h", beat
        other = watchdog.Watchdog(300.0, 0, 2, tmp_path / "0", store, "t", "h")
        try:  # rank 0, alive a whole timeout later, finds rank 1 silent: named with its pid
            later = time.time() + 300
            other._publish(later)
            stopped = other._who_stopped(later)
        finally:
            other.close()
        assert stopped["rank"] == 1 and stopped["pid"] == os.getpid(), stopped
    finally:
        dog.close()


WATCHING = """
import sys, time
from pathlib import Path
from imagenet.launching import watchdog
dog = watchdog.Watchdog(300.0, int(sys.argv[1]), 1, Path(sys.argv[2]))
print(dog.stacks, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_stack_folders_of_killed_ranks_are_removed_by_the_next_start(tmp_path, monkeypatch):
    """A rank killed with SIGKILL (a preemption's last signal, the OOM killer) cannot remove its
    stack folder from the temp folder: the next start removes it, never a live rank's."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the children's temp folder, and this one's
    monkeypatch.setattr(tempfile, "tempdir", None)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ranks = [subprocess.Popen([sys.executable, "-c", WATCHING, str(r), str(tmp_path / "out")],
                              stdout=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    try:
        folders = [Path(p.stdout.readline().strip()) for p in ranks]
        assert all(f.parent == tmp_path and (f / f"rank{r}.txt").is_file()
                   for r, f in enumerate(folders)), folders
        ranks[0].kill()
        ranks[0].wait()
        old = time.time() - watchdog.STALE_AFTER - 1  # from an earlier start
        for folder in folders:
            os.utime(folder, (old, old))
        young = Path(tempfile.mkdtemp(prefix=f"{watchdog.STACKS_PREFIX}2-"))  # a rank starting
        dog = watchdog.Watchdog(300.0, 3, 1, tmp_path / "out")
        dog.close()
        assert not folders[0].exists()  # the killed rank's
        assert folders[1].is_dir() and young.is_dir()  # a live rank's, one just made
        assert not dog.stacks.exists()  # its own, at its end
    finally:
        for p in ranks:
            p.kill()
            p.wait()


ASKED = """
import sys, time
from pathlib import Path
import torch.distributed as dist
from imagenet.launching import watchdog
dog = watchdog.Watchdog(0.5, 0, 2, Path(sys.argv[1]), dist.HashStore(), "t", "h").start()
print(dog.own.name, flush=True)
while True:  # the main thread runs Python, as training does
    time.sleep(0.001)
"""


@pytest.mark.slow
def test_a_rank_asked_for_its_stacks_while_watching_does_not_crash(tmp_path):
    """SIGUSR2 writes a rank's stacks (all threads) into its stack file. It was faulthandler's
    handler, which walks the threads without the GIL while they run: a thread of the watch that
    ended meanwhile crashed the process (SIGSEGV; chaos seed 29003, scenario 24, where another
    rank's watch sent it to a stopped rank, which now only continues it). Four watching ranks,
    stopped, asked and continued 400 times each: none dies, and each file holds its stacks."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ranks = [subprocess.Popen([sys.executable, "-c", ASKED, str(tmp_path / str(r))],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env=env) for r in range(4)]
    try:
        files = [Path(rank.stdout.readline().strip()) for rank in ranks]
        for _ in range(400):  # what the hang watch of another rank does, many times over
            for sent in (signal.SIGSTOP, None, signal.SIGUSR2, signal.SIGCONT):
                for rank in ranks:
                    if sent is not None:
                        rank.send_signal(sent)
                time.sleep(0.01 if sent is None else 0)
            time.sleep(0.02)
            died = [rank.returncode for rank in ranks if rank.poll() is not None]
            assert not died, f"a rank asked for its stacks died: {died}"
        for file in files:  # every thread's stacks, each time
            text = file.read_text()
            assert text.count('File "<string>", line 9 in <module>') >= 300, text[-2000:]
            assert "in _watch" in text, text[-2000:]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


STOPPED_MARGIN = 3  # StoppedChildren's margin beyond --hang-timeout here (30 s in the product)


def with_margin(command: list[str], margin: float) -> list[str]:
    """``command`` (python main.py ...) with mp.spawn's parent ending a stopped child ``margin``
    s after --hang-timeout: main.py runs as __main__, its spawned ranks start as a plain start's."""
    script = ("import runpy, sys; from imagenet.launching import failures; "
              f"failures.StoppedChildren.MARGIN = {margin}; sys.argv = sys.argv[1:]; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")
    return [command[0], "-c", script, *command[1:]]


@pytest.mark.slow
def test_a_rank_stopped_after_the_run_ended_does_not_hold_the_job(data, tmp_path):
    """Chaos seed 29008, scenario 3: rank 0 stopped (SIGSTOP) after the run's last output, when
    its hang watch had closed; rank 1 exited 0 and mp.spawn's parent waited forever. The parent
    now ends a child stopped for longer than --hang-timeout (and a margin for the ranks' own
    watches): one line names it, every process is gone, the exit code is the requeue's, and the
    requeue finds the finished run."""
    out = tmp_path / "out"
    command = main(str(data), "-b", "4", "-j", "1", "--epochs", "1", "--output-dir", str(out),
                   "--nproc-per-node", "2")
    live = Live(with_margin(command, STOPPED_MARGIN), timeout=LIMIT + 120)
    rank0 = rank_pid(live.token, 0, within=120)  # found first: the stop follows the line at once
    live.wait_for("outputs in")
    os.kill(rank0, signal.SIGSTOP)
    stopped = time.monotonic()
    code = live.finish()
    waited = time.monotonic() - stopped
    assert HANG + STOPPED_MARGIN < waited < LIMIT, live.output[-3000:]
    assert gone(live.token), "a process of the run is left"
    assert code == 143, live.output[-3000:]
    line = next(x for x in live.output.splitlines() if x.startswith("error: hang:"))
    assert "training process 0" in line and "rank 0" in line and f"pid {rank0}" in line, line
    assert str(out / "hang") in line, line
    report = json.loads((out / "hang" / "report.json").read_text())
    assert report["rank"] == 0 and report["pid"] == rank0
    assert "Traceback" not in live.output
    again = Live(forked(main(str(data), "-b", "4", "-j", "1", "--epochs", "1", "--output-dir",
                             str(out), "--nproc-per-node", "2", "--resume", "auto")), timeout=300)
    assert again.finish() == 0, again.output[-3000:]
    assert load_checkpoint(out / "checkpoint.pth.tar")["epoch"] == 1


@pytest.mark.slow
def test_a_rank_that_dies_while_its_loader_worker_starts_leaves_no_worker_behind(data, tmp_path):
    """Chaos seed 29013, scenario 23: a rank ended (its hang watch's exit) just after it had
    started its validation loader's workers. An mp.spawn rank's workers were spawned too, each
    ~5 s of imports before its first line of the trainer's; one whose training process died
    meanwhile ran forever: Linux sends PR_SET_PDEATHSIG only while the parent lives, and
    torch's worker loop took its new parent (init) for its training process. Such a worker
    now exits as soon as it starts (the test below), and on Linux workers are forked under
    every launcher (``data.folder.WORKER_START``)."""
    live = Live(main(str(data), "-b", "4", "-j", "1", "--epochs", "1", "--output-dir",
                     str(tmp_path / "out"), "--multiprocessing-distributed",
                     "--nproc-per-node", "1"), timeout=300)
    rank = rank_pid(live.token, 0, within=120)
    deadline = time.monotonic() + 120
    while not any(parent(pid) == rank for pid in _tagged_pids(live.token)):
        assert time.monotonic() < deadline and live.proc.poll() is None, live.output
        time.sleep(0.05)
    os.kill(rank, signal.SIGKILL)  # the worker is still importing torch
    live.proc.wait(timeout=60)  # the launcher; a worker left behind holds the output open
    left = not gone(live.token, within=60)
    live.kill_all()
    live.finish()
    assert not left, "a loader worker outlived its training process"


@pytest.mark.slow
def test_a_worker_whose_training_process_ended_before_it_started_exits(tmp_path):
    """The mechanism of the test above, whatever the start method: a spawned process that gets
    to its ``worker_init_fn`` after its parent ended exits there instead of running on."""
    script = tmp_path / "worker.py"
    script.write_text("""
import multiprocessing, os, sys, time
from imagenet.launching.preemption import die_with_parent

def worker(parent, path):
    while os.getppid() == parent:  # still importing when its training process ended
        time.sleep(0.01)
    die_with_parent(parent)  # a loader worker's first call (worker_init_fn)
    open(path, "w").write("still running")
    time.sleep(60)

if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=worker,
                                                         args=(os.getpid(), sys.argv[1]))
    child.start()
    print(child.pid, flush=True)
    os._exit(0)  # the training process ends (its hang exit) before the worker is ready
""")
    ran = subprocess.run([sys.executable, str(script), str(tmp_path / "ran")], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env=child_env())
    worker = int(ran.stdout)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{worker}").exists() and parent(worker) != 0:
        if time.monotonic() > deadline:
            os.kill(worker, signal.SIGKILL)
            raise AssertionError("the worker ran on after its training process ended")
        time.sleep(0.05)
    assert not (tmp_path / "ran").exists()


@pytest.mark.slow
def test_a_rank_stuck_after_its_run_exits_with_its_stacks(tmp_path):
    """After the watch closes (the run ended), a rank that has not exited within --hang-timeout
    (stuck in its teardown: a process group's destroy, a thread that never ends) writes its
    stacks, names itself in one line and exits with the requeue code."""
    script = f"""
import sys, threading, time
from pathlib import Path
from imagenet.launching import failures
failures.EXIT_AT_LEAST = 0.5  # not a slow teardown's 30 s here
failures.exit_within(1.0, 3, Path({str(tmp_path)!r}))
threading.Event().wait(60)  # the teardown that never ends
"""
    started = time.monotonic()
    ran = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert ran.returncode == 143, ran.stderr
    assert time.monotonic() - started < 30
    lines = [x for x in ran.stderr.splitlines() if "hang:" in x]
    assert len(lines) == 1, ran.stderr
    assert "rank 3" in lines[0] and "had not exited 1 s" in lines[0], lines
    assert str(tmp_path / "hang") in lines[0], lines
    stacks = (tmp_path / "hang" / "rank3-exit.txt").read_text()
    assert "Thread" in stacks and "wait" in stacks, stacks


SLOW = '''"""FAULT INJECTION by tests/test_hang.py (slow storage, a slow link): not the trainer."""
import os, sys, time
from imagenet.checkpoint import files
from imagenet.data import objectstore

_rate = float(os.environ["SLOW_MB_PER_S"]) * 2**20
_load, _upload = files.load_file, objectstore.upload


def _slowly(what, path, call):
    start = time.perf_counter()
    time.sleep(os.path.getsize(path) / _rate)
    result = call()
    print(f"slow storage: {what} {os.path.basename(path)} in {time.perf_counter() - start:.1f} s",
          file=sys.stderr, flush=True)
    return result


files.load_file = lambda path, *a, **k: _slowly("read", path, lambda: _load(path, *a, **k))
objectstore.upload = lambda fs, local, key: _slowly("uploaded", local,
                                                    lambda: _upload(fs, local, key))
'''


@pytest.mark.slow
def test_a_slow_checkpoint_load_and_uploads_do_not_count_toward_the_hang_timeout(data, tmp_path):
    """--hang-timeout 4 and work that takes longer without a step: the checkpoint's load (read
    at 16 MB/s) and the uploads of each save to the --output-dir URL (16 MB/s). The clock
    pauses for each (exit 143 in the middle of the load, before): the run ends with exit 0.
    The compiles of the first step and of the evaluation graph pause it too: the requeue test
    of test_compile_cache.py runs its cold compiles under --hang-timeout 4."""
    hang = 4
    # The --output-dir URL: fsspec's local files (file:// is taken for a path), whose uploads
    # make no folders, unlike an object store: tb/ is made here.
    remote = tmp_path / "bucket" / "run"
    (remote / "tb").mkdir(parents=True)
    url = f"local://{remote}"
    flags = [str(data), *TINY18, "--seed", "0", "--output-dir", url]
    env = {"TMPDIR": str(tmp_path / "tmp")}  # the staging folder, the stack folders
    (tmp_path / "tmp").mkdir()
    first = run_main(*flags, "--epochs", "1", env=child_env(**env), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    site = tmp_path / "slow-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW)
    env.update(PYTHONPATH=f"{site}:{ROOT}", SLOW_MB_PER_S="16")
    proc = run_main(*flags, "--epochs", "2", "--resume", "auto", "--hang-timeout", str(hang),
                    env=child_env(**env), cwd=tmp_path, timeout=1200)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "hang:" not in output
    slow = [line.split() for line in proc.stderr.splitlines()
            if line.startswith("slow storage:")]
    assert [(s[2], s[3]) for s in slow if float(s[5]) > hang][:2] == \
        [("read", "checkpoint.pth.tar"), ("uploaded", "checkpoint.pth.tar")], slow
    start = json.loads((remote / "config.json").read_text())["starts"][-1]
    assert start["stages_s"]["resume"] > hang, start
    last = json.loads((remote / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["epoch"] == 1, last
    assert load_checkpoint(remote / "checkpoint.pth.tar")["epoch"] == 2


PAUSED = """
import json, sys, time
from pathlib import Path
import torch.distributed as dist
from imagenet.launching import watchdog
watchdog.PAUSE_AT_LEAST, watchdog.DUMP_WAIT = 2.0, 0.2  # not 30 min and 3 s here
store = dist.HashStore()
dog = watchdog.Watchdog(0.3, 0, 2, Path(sys.argv[1]), store, "t", "h").start()


def peer(paused):  # rank 1: alive, its last progress long ago; paused, or waiting
    store.set("t/heartbeat/1", json.dumps({
        "alive": time.time(), "progress": 1.0, "host": "h", "pid": 1,
        "what": "compiling the evaluation graph" if paused else "waiting for the all-reduce",
        "paused": time.time() if paused else None}))


watchdog.start_clock("built the model and the data")
for _ in range(30):  # 1.5 s waiting for a rank that compiles: not a hang
    peer(True)
    time.sleep(0.05)
print("waited for a paused peer", flush=True)
with watchdog.paused("compiling the training step for batch shape 8x3x32x32"):
    while True:  # longer than --hang-timeout: not a hang; longer than the pause's bound: one
        peer(False)
        time.sleep(0.05)
"""


@pytest.mark.slow
def test_a_pause_outlasts_the_timeout_within_its_own_bound_and_peers_wait_for_it(tmp_path):
    """A rank that waits (no progress) for a paused rank (compiling, loading, uploading) waits
    with it; a rank's own pause is no hang until its bound (max(30 min, 6 x --hang-timeout);
    2 s here), and then the report says what it was paused for."""
    started = time.monotonic()
    ran = subprocess.run([sys.executable, "-c", PAUSED, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env=child_env())
    assert ran.returncode == 143, ran.stdout + ran.stderr
    assert "waited for a paused peer" in ran.stdout, ran.stderr
    assert time.monotonic() - started < 30
    line = next(x for x in ran.stderr.splitlines() if "hang:" in x)
    assert "rank 0 was paused for 2 s" in line and "compiling the training step" in line, line
    report = json.loads((tmp_path / "hang" / "report.json").read_text())
    assert report["what"].startswith("compiling the training step"), report
    assert report["paused"] and report["pause_bound"] == 2.0 and report["rank"] == 0, report


def test_each_new_batch_shape_of_a_compiled_model_is_a_compile():
    """Static shapes: the first call with a batch shape compiles a graph (in training and in
    evaluation apart); an uncompiled model never compiles."""
    from imagenet.training.models import compiles

    plain = torch.nn.Linear(4, 2)
    compiled = torch.compile(plain)  # lazy: nothing compiles until it is called
    batch, last = torch.zeros(8, 4), torch.zeros(3, 4)
    assert [compiles(compiled, b) for b in (batch, batch, last, last)] == \
        [True, False, True, False]
    compiled.eval()
    assert [compiles(compiled, b) for b in (batch, batch)] == [True, False]
    assert not compiles(plain, batch)
