"""A pre-imported ``main.py`` for tests whose subject comes after start-up (docs/testing.md).

Importing torch and torchvision costs a process ~5 s of CPU before it does anything
(torchvision 0.29 imports ``torch._dynamo`` eagerly), and the suite starts hundreds of
``main.py`` processes. ``helpers.run_main`` therefore starts them through this file:

- ``python prestart.py serve SOCKET`` (one per test process, started on first use) imports the
  trainer once and waits on a Unix socket;
- ``python prestart.py run SOCKET ARGS...`` (what ``run_main`` executes, a plain Python process
  that imports no torch) hands the server its arguments, environment, working folder and its
  stdin/stdout/stderr; the server forks a real child that becomes ``python main.py ARGS...``
  (its own process and process group, ``sys.argv``, ``__main__.__file__``, environment and
  stdio set as a fresh start would have them) and runs to its end as a whole interpreter does
  (atexit, thread joins). The client exits with the child's exit status, or dies of its signal.
  The signals the client gets (SIGTERM, SIGINT, SIGUSR1, SIGHUP) are passed on; when the client
  dies (a test's timeout kills it) the child's process group is killed. A test that signals
  the run's whole process group (SIGKILL, SIGSTOP, a group SIGTERM as SLURM sends it) reads the
  run's pid from ``IMAGENET_TEST_RUN_PIDFILE`` (``helpers.run_group``).

A run whose environment differs from the server's in anything but ``RUNTIME_ONLY`` (variables
read only while running, never while importing) and ``RUNTIME_PREFIXES`` (those of libraries the
server has not imported) is started as a plain ``python main.py``: the client execs it.
Everything about start-up itself (imports, signals before the handlers, launchers, how mp.spawn
starts its children, torchrun) is tested with plain starts, never through here. A forked run's
mp.spawn children are forked from it (``fork_ranks``), as spawned children that imported
nothing again: each starts without the run's Python signal handlers, as exec leaves a child.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAIN = str(ROOT / "main.py")
# Where the client writes the pid of the run it started (its process group's id): a plain
# start's own pid (exec keeps it), a forked run's as the server reports it. Tests that signal
# the run's process group (as SLURM or a terminal does) read it (helpers.run_group).
PIDFILE = "IMAGENET_TEST_RUN_PIDFILE"
# Read by the trainer while it runs, never at import: a run that sets them can be pre-imported.
RUNTIME_ONLY = {"TMPDIR", "TORCH_HOME", "HF_HOME", "HF_HUB_OFFLINE", "IMAGENET_NOTICE_AFTER",
                "PYTHONUNBUFFERED", "XDG_CACHE_HOME", "HOME", "PWD", "OLDPWD", "_", "SHLVL",
                "FT_TOKEN", "CHAOS_TOKEN", PIDFILE,
                # pytest names the running test here: every test's runs hold another value
                "PYTEST_CURRENT_TEST",
                # inductor reads it at each use (a compile sets it in the test process)
                "TORCHINDUCTOR_CACHE_DIR",
                # read by Intel's OpenMP runtime as it loads; torch's Linux wheels load GNU's
                # libgomp. scikit-learn sets it when imported (MLflow, W&B, Ray import it
                # lazily, in the test process too)
                "KMP_DUPLICATE_LIB_OK",
                # read at import, and again by become_main for the run it forks
                "IMAGENET_FAILPOINTS",
                # --time-limit slurm's job and end time (imagenet.settings.choices, the plan)
                "SLURM_JOB_ID", "SLURM_JOB_END_TIME"}
# Read by a library only when it is imported: runtime-only while the server has not imported it
# (the trainer imports each of them when a run asks for it: --log-to, an s3:// path). botocore
# and boto3 read AWS_* only as a session or client is made, never at import (TensorBoard's
# writer, which the server imports, imports them where they are installed).
RUNTIME_PREFIXES = {"AWS_": ("aiobotocore", "s3fs"), "MLFLOW_": ("mlflow",),
                    "WANDB_": ("wandb",)}
FORWARD = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)


def _send(conn: socket.socket, data: bytes, fds: list[int]) -> None:
    head = struct.pack("!I", len(data))
    conn.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    conn.sendall(data)


def _receive(conn: socket.socket) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    msg, anc, _flags, _addr = conn.recvmsg(4, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    if len(msg) < 4:  # a client sends its 4-byte header in one message, with its fds
        raise EOFError
    size, body = struct.unpack("!I", msg)[0], b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise EOFError
        body += chunk
    return body, list(fds)


# ---------------------------------------------------------------- the client


def differs(served: dict, env: dict[str, str]) -> list[str]:
    """The variables of ``env`` that make a run differ from the server's (``served``, what it
    wrote next to its socket): those that differ and may be read at import."""
    base, prefixes = served["env"], tuple(served["runtime_prefixes"])
    return sorted(k for k in base.keys() | env.keys() if base.get(k) != env.get(k)
                  and k not in RUNTIME_ONLY and not k.startswith(prefixes))


def _tell_pid(pid: int) -> None:
    """Write the run's pid where the caller asked (PIDFILE), in one step."""
    path = os.environ.get(PIDFILE)
    if path:
        with open(path + ".new", "w") as f:
            f.write(str(pid))
        os.replace(path + ".new", path)


def _plain(args: list[str]) -> None:
    _tell_pid(os.getpid())  # exec keeps the pid: this process becomes the run
    os.execv(sys.executable, [sys.executable, MAIN, *args])


def run(sock: str, args: list[str]) -> None:
    """Have the server at ``sock`` start ``main.py args`` for this process; exit as it did."""
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(sock)
        with open(sock + ".env") as f:
            served = json.load(f)
    except OSError:
        _plain(args)
    if differs(served, dict(os.environ)):
        conn.close()
        _plain(args)
    request = {"args": args, "env": dict(os.environ), "cwd": os.getcwd()}
    _send(conn, json.dumps(request).encode(), [0, 1, 2])
    for sig in FORWARD:
        signal.signal(sig, lambda signum, _f: conn.sendall(struct.pack("!I", signum)))
    while True:
        reply = b""
        while len(reply) < 8:
            try:
                chunk = conn.recv(8 - len(reply))
            except InterruptedError:
                continue
            if not chunk:
                sys.stderr.write("prestart: the server went away\n")
                os._exit(70)
            reply += chunk
        kind, value = struct.unpack("!ii", reply)
        if kind != 2:
            break
        _tell_pid(value)  # the run started: its pid (kind 2), then how it ended
    if kind == 1:  # killed by a signal: die of it too (subprocess reports -signal)
        for sig in FORWARD:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {value})
        os.kill(os.getpid(), value)
    os._exit(value)


# ---------------------------------------------------------------- the server


def _watch(conn: socket.socket, child: int) -> None:
    """In the forked monitor: pass signals on to ``child``, report how it ended, and kill its
    process group if the client goes away first."""
    while True:
        try:
            pid, status = os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            pid, status = child, 0
        if pid == child:
            if os.WIFSIGNALED(status):
                reply = struct.pack("!ii", 1, os.WTERMSIG(status))
            else:
                reply = struct.pack("!ii", 0, os.waitstatus_to_exitcode(status))
            try:
                conn.sendall(reply)
            except OSError:
                pass
            os._exit(0)
        ready, _, _ = select.select([conn], [], [], 0.02)
        if ready:
            data = conn.recv(4)
            if len(data) < 4:  # the client is gone: so is its run
                try:
                    os.killpg(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(child, 0)
                os._exit(0)
            try:
                os.kill(child, struct.unpack("!I", data)[0])
            except ProcessLookupError:
                pass


def serve(sock: str) -> dict:
    """Import the trainer, then fork a child per request; returns (in that child) its request."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # as main.py's first line
    before = dict(os.environ)
    import imagenet.cli  # noqa: F401  (parse, plan, launch)
    import imagenet.evaluation.validate  # noqa: F401  (the trainer's, at the first validation)
    import imagenet.run.trainer  # noqa: F401  (what a training process imports after its plan)
    from imagenet.reporting.logger import preload_writers

    # The writers a rank 0 start imports before training, by the start's own call: TensorBoard's
    # is ~0.3 s of CPU, half of a tiny forked run's (botocore and boto3 come with it where
    # installed: TensorBoard's file layer imports them for s3:// logdirs).
    preload_writers("tensorboard", main_rank=True)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock + ".new")
    listener.listen(64)
    prefixes = [prefix for prefix, modules in RUNTIME_PREFIXES.items()
                if not any(name in sys.modules for name in modules)]
    with open(sock + ".env.new", "w") as f:  # what a run's environment must match
        json.dump({"env": before, "runtime_prefixes": prefixes}, f)
    os.replace(sock + ".env.new", sock + ".env")
    os.replace(sock + ".new", sock)  # clients connect once everything is imported
    parent = os.getppid()
    while True:
        ready, _, _ = select.select([listener], [], [], 1.0)
        while True:  # reap the monitors
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if os.getppid() != parent:  # the test process is gone
            os._exit(0)
        if not ready:
            continue
        conn, _ = listener.accept()
        if os.fork() != 0:
            conn.close()
            continue
        listener.close()  # the monitor
        try:
            body, fds = _receive(conn)
            request = json.loads(body)
            child = os.fork()
        except BaseException:
            os._exit(1)
        if child != 0:
            for fd in fds:
                os.close(fd)
            try:  # its own group before anyone can signal it (it sets the same itself)
                os.setpgid(child, child)
            except OSError:
                pass
            try:
                conn.sendall(struct.pack("!ii", 2, child))  # the run's pid, for PIDFILE
            except OSError:
                pass
            _watch(conn, child)
        conn.close()  # the run
        os.setpgid(0, 0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        request["set_by_imports"] = sorted(k for k in os.environ if before.get(k) != os.environ[k])
        return request


def become_main(request: dict) -> None:
    """In the forked child: set the process up as ``python main.py ARGS`` would have it."""
    import tempfile

    import __main__

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # gettempdir() asks TMPDIR again
    for name in request["set_by_imports"]:  # as the imports would have set them here
        if name == "TORCHINDUCTOR_CACHE_DIR":  # inductor's default: under this run's TMPDIR
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            cache_dir()
        else:
            raise RuntimeError(f"prestart: the imports set {name}: teach become_main about it")
    from imagenet.settings import failpoints

    failpoints.configure_from_environment()  # the run's, as its own import would read them
    sys.argv = [MAIN, *request["args"]]
    sys.path[0] = str(ROOT)
    __main__.__file__ = MAIN  # mp.spawn's children run main.py, as they would
    sys.stdout.reconfigure(line_buffering=os.isatty(1))
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)


def fork_ranks() -> None:
    """In the forked run: mp.spawn's children are forked from it (imported already), each
    starting as a spawned child does: the Python signal handlers the run installed are gone
    (exec resets a caught signal to its default and keeps an ignored one ignored)."""
    import imagenet.cli as cli

    spawned = cli._worker

    def worker(*args, **kwargs):
        for sig in signal.valid_signals():
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.SIG_DFL)
        return spawned(*args, **kwargs)

    cli._worker = worker
    cli.START_METHOD = "fork"


if __name__ == "__main__":
    mode, sock = sys.argv[1], sys.argv[2]
    if mode == "run":
        run(sock, sys.argv[3:])
    request = serve(sock)
    become_main(request)
    fork_ranks()
    from imagenet.cli import end_process, main

    end_process(main(own_process=True))  # as main.py ends
