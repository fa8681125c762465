"""tests/prestart.py, which ``run_main`` starts its runs through: a run forked from the
pre-imported trainer is the run a plain ``python main.py`` makes (the same weights, bitwise,
the same exit codes), and a run whose client is killed (a test's timeout) is killed with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import helpers
import pytest
import torch
from helpers import TINY, child_env, load_checkpoint, prestarted_cmd, run_main


def served() -> str:
    """The socket of this process's prestart server, once it has imported the trainer."""
    prestarted_cmd()
    return up(str(helpers._prestart["socket"]), helpers._prestart["server"])


def up(sock: str, server: subprocess.Popen) -> str:
    """``sock`` once ``server`` listens there (it has imported the trainer)."""
    deadline = time.monotonic() + 120
    while not Path(sock).exists():
        assert server.poll() is None and time.monotonic() < deadline, \
            "the prestart server never came up"
        time.sleep(0.2)
    return sock


@pytest.mark.slow
def test_a_prestarted_run_is_the_plain_run(image_folder, tmp_path):
    served()
    args = [str(image_folder), *TINY, "--epochs", "1", "--seed", "0"]
    plain = run_main(*args, "--output-dir", str(tmp_path / "plain"), plain=True)
    forked = run_main(*args, "--output-dir", str(tmp_path / "forked"))
    assert plain.returncode == forked.returncode == 0, forked.stderr
    a, b = (load_checkpoint(tmp_path / name / "checkpoint.pth.tar")["state_dict"]
            for name in ("plain", "forked"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "=> first step" in forked.stdout
    # Its exit codes are the run's: a usage error is 2, with its one line.
    bad = run_main(str(tmp_path / "nodata"), *TINY, "--output-dir", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "does not exist" in bad.stderr


@pytest.mark.slow
def test_a_prestarted_runs_ranks_are_forked_and_train_as_spawned_ones(image_folder, tmp_path):
    """mp.spawn's children of a forked run are forked from it (prestart.fork_ranks): its
    ranks import nothing again, and train what a plain start's spawned ranks train, bitwise."""
    served()
    args = [str(image_folder), *TINY, "--epochs", "1", "--seed", "0",
            "--multiprocessing-distributed", "--nproc-per-node", "2", "--dist-backend", "gloo"]
    plain = run_main(*args, "--output-dir", str(tmp_path / "plain"), plain=True)
    pidfile = tmp_path / "run.pid"
    client = subprocess.Popen(
        prestarted_cmd(*args, "--output-dir", str(tmp_path / "forked")),
        env=child_env(IMAGENET_TEST_RUN_PIDFILE=str(pidfile)), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    lines = [""]
    while "Epoch:" not in lines[-1]:  # the ranks are training
        lines.append(client.stdout.readline())
        assert lines[-1] or client.poll() is None, "".join(lines)
    run = helpers.run_group(client, pidfile)
    ranks = [cmd for cmd in map(_command_line, helpers.descendants(run))
             if "resource_tracker" not in cmd]
    output = "".join(lines) + client.communicate(timeout=300)[0]
    assert plain.returncode == client.returncode == 0, output
    assert len(ranks) == 2 and all("prestart.py" in cmd and "spawn_main" not in cmd
                                   for cmd in ranks), ranks
    a, b = (load_checkpoint(tmp_path / name / "checkpoint.pth.tar")["state_dict"]
            for name in ("plain", "forked"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_forked_rank_starts_without_the_runs_signal_handlers(monkeypatch):
    """A spawned child is a fresh interpreter: exec resets every caught signal to its default
    and keeps an ignored one ignored. A forked rank starts the same: SIGTERM kills it until it
    installs its own handler (a rank still starting is preempted, not left running)."""
    import multiprocessing

    import prestart

    import imagenet.cli as cli

    def probe(conn) -> None:
        conn.send([signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)])

    monkeypatch.setattr(cli, "_worker", probe)
    monkeypatch.setattr(cli, "START_METHOD", "spawn")
    prestart.fork_ranks()
    assert cli.START_METHOD == "fork"
    previous = {s: signal.signal(s, handler) for s, handler in (
        (signal.SIGTERM, lambda *_: None), (signal.SIGUSR1, lambda *_: None),
        (signal.SIGINT, signal.SIG_IGN))}
    try:
        ours, theirs = multiprocessing.Pipe()
        child = multiprocessing.get_context("fork").Process(target=cli._worker, args=(theirs,))
        child.start()
        seen = ours.recv()
        child.join(30)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert seen == [signal.SIG_DFL, signal.SIG_DFL, signal.SIG_IGN]


@pytest.mark.slow
def test_a_killed_client_takes_its_run_with_it(image_folder, tmp_path):
    served()
    out = tmp_path / "out"
    client = subprocess.Popen(
        prestarted_cmd(str(image_folder), *TINY, "--epochs", "50", "--output-dir", str(out)),
        env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = ""
    while "Epoch:" not in line:  # the run is training
        line = client.stdout.readline()
        assert line or client.poll() is None, "the run ended before training"
    assert [p for p in os.listdir("/proc") if p.isdigit() and _runs_in(p, out)]
    client.send_signal(signal.SIGKILL)
    client.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alive = [p for p in os.listdir("/proc") if p.isdigit() and _runs_in(p, out)]
        if not alive:
            break
        time.sleep(0.2)
    assert not alive, f"the run went on after its client was killed: {alive}"


def _runs_in(pid: str, out: Path) -> bool:
    """Process ``pid`` holds a file of ``out`` open (the run's folder lock: a forked run's
    command line is the server's)."""
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(str(out))
                   for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


@pytest.mark.slow
def test_a_run_of_a_later_test_is_forked_too(tmp_path, monkeypatch):
    """pytest names the running test in PYTEST_CURRENT_TEST, which every run inherits: the
    server, started by an earlier test, holds another value. It used to count as a difference
    read at import, so every run but those of the test that started the server was a plain
    start (each ~3-5 s of imports, ~250 of them in one suite run)."""
    sock = served()
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_later.py::test_later (call)")
    assert_forked(prestarted_cmd("--help"), sock, tmp_path)


@pytest.mark.slow
def test_a_run_after_scikit_learn_was_imported_is_forked_too(tmp_path, monkeypatch):
    """Importing scikit-learn (MLflow, W&B and Ray import it lazily) sets KMP_DUPLICATE_LIB_OK,
    which only Intel's OpenMP reads: a test process that had imported it started every later
    run plainly (a full run caught it)."""
    sock = served()
    monkeypatch.setenv("KMP_DUPLICATE_LIB_OK", "True")
    assert_forked(prestarted_cmd("--help"), sock, tmp_path)


@pytest.mark.slow
def test_a_run_configured_for_object_storage_and_trackers_is_forked(tmp_path, monkeypatch):
    """s3fs, MLflow and W&B read their variables when the run imports them (an s3:// path,
    --log-to): the server imported none of them, so those variables do not make a plain start."""
    sock = served()
    for name, value in (("AWS_ENDPOINT_URL", "http://127.0.0.1:9"), ("AWS_ACCESS_KEY_ID", "t"),
                        ("MLFLOW_TRACKING_URI", f"file:{tmp_path}"), ("WANDB_MODE", "offline")):
        monkeypatch.setenv(name, value)
    assert_forked(prestarted_cmd("--help"), sock, tmp_path)


@pytest.mark.slow
def test_a_slurm_time_limited_run_is_forked(tmp_path):
    """--time-limit slurm reads SLURM_JOB_ID and SLURM_JOB_END_TIME while it plans the run,
    never at import: such a run (the time-limit chains) need not start plainly."""
    sock = served()
    assert_forked(prestarted_cmd("--help"), sock, tmp_path, SLURM_JOB_ID="4242",
                  SLURM_JOB_END_TIME="1900000000")


@pytest.mark.slow
def test_the_first_run_of_a_test_process_waits_for_its_server(tmp_path, monkeypatch):
    """The server imports the trainer for ~5 s after a test process first asks for a run. The
    client used to find no socket yet and start that run plainly, importing everything beside
    the server (the first run of each xdist worker, a cold compile's among them)."""
    monkeypatch.setattr(helpers, "_prestart", {})  # as in a test process that has none yet
    cmd = prestarted_cmd("--help")
    try:
        assert_forked(cmd, str(helpers._prestart["socket"]), tmp_path)
    finally:
        helpers._prestart["server"].kill()
        helpers._prestart["server"].wait()


def _threads(rank: int, found) -> None:
    found.put((rank, torch.get_num_threads()))


def test_the_test_process_and_its_ranks_compute_on_one_thread():
    """As every run a test starts (OMP_NUM_THREADS=1): three workers share two cores, and an
    OpenMP team of two waiting for a core spins (3x the CPU of one thread, measured)."""
    import multiprocessing

    assert torch.get_num_threads() == 1
    assert os.environ["OMP_NUM_THREADS"] == "1"
    found = multiprocessing.get_context("forkserver").SimpleQueue()
    helpers.start_ranks(_threads, (found,), nprocs=2)
    assert sorted(found.get() for _ in range(2)) == [(0, 1), (1, 1)]


@pytest.mark.slow
def test_a_variable_set_by_the_test_that_starts_the_server_does_not_stay_in_it(
        tmp_path, monkeypatch):
    """Each test process starts its server on first use, from whichever test runs first there.
    It used to inherit that test's environment: a test that set a variable for its own runs
    (test_trackers sets MLFLOW_ALLOW_FILE_STORE) left it in the server, and every later test's
    runs differed from it and started plainly (a CI run's whole worker did)."""
    sock = str(tmp_path / "server")
    monkeypatch.setenv("IMAGENET_TEST_SET_BY_A_TEST", "1")
    server = helpers.start_prestart_server(sock)
    try:
        monkeypatch.delenv("IMAGENET_TEST_SET_BY_A_TEST")
        up(sock, server)
        cmd = [sys.executable, helpers.PRESTART, "run", sock, "--help"]
        assert_forked(cmd, sock, tmp_path)
    finally:
        server.kill()
        server.wait()


def assert_forked(cmd: list[str], sock: str, tmp_path: Path, **extra: str) -> None:
    """Run ``cmd`` (a prestart client asking for ``--help``) from this test's environment and
    ``extra``, and assert that the server at ``sock`` forked its run; a plain start fails
    naming the variables that differed from the server's."""
    import json

    import prestart

    pidfile = tmp_path / "run.pid"
    env = child_env(IMAGENET_TEST_RUN_PIDFILE=str(pidfile), **extra)
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    usage, _ = client.communicate(timeout=120)
    assert client.returncode == 0 and "usage:" in usage
    differ = prestart.differs(json.loads(Path(sock + ".env").read_text()), env)
    assert int(pidfile.read_text()) != client.pid, \
        f"a plain start: it differed from the server in {differ}"
