"""Killed, signalled and restarted runs end bitwise equal to a run that was never interrupted.

Real processes and real signals: main.py (single process, --multiprocessing-distributed and
torchrun) is killed with SIGKILL or sent SIGTERM / SIGUSR1 / SIGINT at a chosen step or save,
by the run itself at a failpoint (``IMAGENET_FAILPOINTS``: the signal is real, its handler the
trainer's own); resumed runs must end with exactly the uninterrupted run's state. The tests of
signals from outside at outside times (during start-up, to a torchrun worker) send their own. The
flags use everything that carries state across a resume: MixUp/CutMix (the training step's RNG),
random erasing (the data pipeline's RNG), EMA, a warm-up + cosine schedule, label smoothing;
the fp16 GradScaler has a test of its own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import (
    MAIN,
    SMALL_ARCH,
    child_env,
    fault_at,
    load_checkpoint,
    prestarted_cmd,
    run_group,
    write_image_folder,
)

from imagenet.cli import child_exit
from imagenet.launching.preemption import PREEMPT_EXIT_CODE
from imagenet.settings.plan import free_port

STEPS = 6  # optimizer steps per epoch in every layout below (48 images)
FLAGS = ["-a", SMALL_ARCH, "--train-crop-size", "32", "--val-resize-size", "36",
         "--val-crop-size", "32", "-p", "1", "--lr", "0.05", "--epochs", "2", "--seed", "0",
         "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--random-erase", "0.25",
         "--model-ema", "--model-ema-steps", "2", "--lr-warmup-epochs", "1",
         "--lr-scheduler", "cosine", "--label-smoothing", "0.1"]
SINGLE = ["-b", "8"]  # one process: 48 / 8 = 6 steps
SPAWN = ["-b", "8", "--multiprocessing-distributed", "--nproc-per-node", "2"]  # 4 per process
PROGRESS = re.compile(r"Epoch: \[(\d+)\]\[\s*(\d+)/(\d+)\]")


class Live:
    """main.py (or torchrun) in its own process group, stdout and stderr read line by line.

    A ``prestarted_cmd`` runs forked from the pre-imported trainer, in a process group of its
    own: ``signal_group`` and ``group`` reach the run's group, as they reach a plain start's."""

    def __init__(self, cmd: list[str], timeout: float = 600, **env: str) -> None:
        self.token = uuid.uuid4().hex  # finds this run's processes in /proc
        self.pidfile = Path(tempfile.gettempdir()) / f"imagenet-run-{self.token}.pid"
        self._group: int | None = None
        # SIGINT as in a terminal, even when the tests run as a background job (a
        # non-interactive shell starts those with SIGINT ignored, and children inherit it).
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                      signal.SIG_DFL),
                                     env=child_env(PYTHONUNBUFFERED="1", FT_TOKEN=self.token,
                                                   IMAGENET_TEST_RUN_PIDFILE=str(self.pidfile),
                                                   **env))
        self.lines: list[str] = []
        self._watchdog = threading.Timer(timeout, self.kill_all)
        self._watchdog.start()

    def wait_for(self, text: str) -> None:
        """Read output until a line contains ``text``."""
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line)
            if text in line:
                return
        raise AssertionError(f"'{text}' never printed:\n{self.output}")

    @property
    def group(self) -> int:
        """The run's process group (``helpers.run_group``)."""
        if self._group is None:
            self._group = run_group(self.proc, self.pidfile)
        return self._group

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to every process of the run (as SLURM or a terminal does)."""
        try:
            os.killpg(self.group, sig)
        except ProcessLookupError:
            pass

    def kill_all(self) -> None:
        """The watchdog: SIGKILL the group and every process tagged with this run's token.

        torchrun starts its workers in sessions of their own, out of reach of ``killpg``; they
        hold the output pipe, so without this a hung worker would block ``finish`` forever.
        """
        self.signal_group(signal.SIGKILL)
        for group in {self.proc.pid, self._group or self.proc.pid}:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in _tagged_pids(self.token):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def finish(self) -> int:
        """Read the rest of the output; the exit code."""
        self.lines.extend(self.proc.stdout)  # type: ignore[arg-type]
        code = self.proc.wait()
        self._watchdog.cancel()
        self.pidfile.unlink(missing_ok=True)
        return code

    @property
    def output(self) -> str:
        return "".join(self.lines)


def run_cmd(data: Path, out: Path, *extra: str, flags: list[str] = FLAGS) -> list[str]:
    """main.py with the resume-test flags on ``data``, writing to ``out``. Forked from the
    pre-imported trainer: these runs are signalled once they train, never while they start
    (the tests of signals during start-up build their own plain commands)."""
    return prestarted_cmd(str(data), *flags, "--output-dir", str(out), *extra)


def run_to_end(cmd: list[str]) -> str:
    live = Live(cmd)
    code = live.finish()
    assert code == 0, live.output
    return live.output


def fault_run(cmd: list[str], faults: str) -> tuple[int, str]:
    """Run ``cmd`` to its end with the failpoints ``faults`` armed (``IMAGENET_FAILPOINTS``,
    see ``helpers.fault_at``): the run signals or kills itself where they say. Its exit code
    and output."""
    live = Live(cmd, IMAGENET_FAILPOINTS=faults)
    code = live.finish()
    return code, live.output


def assert_equal(a, b, where: str = "") -> None:
    """Nested checkpoint values equal, tensors bitwise."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs (max abs diff " \
            f"{(a.double() - b.double()).abs().max().item():.3g})"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(set(a) ^ set(b))}"
        for key in a:
            assert_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


RUN_STATE = ("epoch", "step_in_epoch", "global_step", "state_dict", "ema", "optimizer",
             "scheduler", "best_acc1", "rng")


def assert_same_run(out: Path, reference: Path) -> None:
    """Final checkpoint and model_best equal the uninterrupted run's; nothing left over."""
    got = load_checkpoint(out / "checkpoint.pth.tar")
    want = load_checkpoint(reference / "checkpoint.pth.tar")
    for key in RUN_STATE:
        assert_equal(got[key], want[key], key)
    best = load_checkpoint(out / "model_best.pth.tar")
    want_best = load_checkpoint(reference / "model_best.pth.tar")
    assert_equal(best["state_dict"], want_best["state_dict"], "model_best")
    assert best["best_acc1"] == got["best_acc1"] == want["best_acc1"]
    assert not list(out.glob(".*tmp*")), "temp files left behind"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("ft") / "data", train_per_class=16)


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> dict[str, Path]:
    """Uninterrupted runs without loader workers: one process, and two (mp.spawn)."""
    base = tmp_path_factory.mktemp("reference")
    runs = {"single": run_cmd(data, base / "single", *SINGLE, "-j", "0"),
            "spawn": run_cmd(data, base / "spawn", *SPAWN, "-j", "0")}
    for cmd in runs.values():
        run_to_end(cmd)
    return {name: base / name for name in runs}


def step_line(epoch: int, step: int) -> str:
    return f"Epoch: [{epoch}][{step}/{STEPS}]"


def boundary_kill_then_finish(cmd: list[str], out: Path, resumed_step: int) -> None:
    """Resume ``cmd`` (no mid-epoch saves) from step ``resumed_step`` of epoch 0, SIGKILL it in
    epoch 1 so that it resumes from the epoch-end checkpoint, then run it to the end."""
    # Its saves: the trained epoch 0 before its validation, then epoch 0's end: killed (the
    # whole job) once that one is on disk, while epoch 1 trains.
    code, output = fault_run([*cmd, "--resume", "auto"],
                             fault_at("save.done", 2, "sigkill(group)"))
    assert code in (-signal.SIGKILL, 128 + signal.SIGKILL), output
    assert f"(epoch 0, step {resumed_step}," in output, output
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step_in_epoch"], ckpt["global_step"]) == (1, 0, STEPS)
    output = run_to_end([*cmd, "--resume", "auto"])
    assert "(epoch 1, step 0," in output, output


# (flags, -j, reference run, loader workers per process). The references use -j 0: the data
# pipeline is seeded per sample, so the result must not depend on the loader workers.
# --multiprocessing-distributed splits -j across the node's processes (-j 2 -> 1 per process).
LAYOUTS = {"single -j 0": (SINGLE, "0", "single", 0), "single -j 2": (SINGLE, "2", "single", 2),
           "spawn -j 2": (SPAWN, "2", "spawn", 1)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sigkill_mid_epoch_and_at_epoch_boundary_resume_bitwise(data, reference, tmp_path,
                                                                layout):
    flags, workers, ref, per_process = LAYOUTS[layout]
    out = tmp_path / "out"
    cmd = run_cmd(data, out, *flags, "-j", workers)
    # Mid-epoch: checkpoints every 2 steps; the whole job killed once step 2's is on disk.
    code, output = fault_run([*cmd, "--save-every", "2"],
                             fault_at("save.done", 1, "sigkill(group)"))
    assert code == -signal.SIGKILL, output
    assert f"; {per_process} loader worker(s) per process;" in output, output
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (0, 2), output
    assert len(ckpt["rng"]) == ckpt["world_size"] == (2 if flags is SPAWN else 1)
    boundary_kill_then_finish(cmd, out, ckpt["step_in_epoch"])
    assert_same_run(out, reference[ref])


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_143(data, reference, tmp_path):
    out = tmp_path / "out"
    # To the whole group, as SLURM does: the two loader workers must ignore it.
    cmd = run_cmd(data, out, *SINGLE, "-j", "2")
    code, output = fault_run(cmd, fault_at("train.step", 3, "sigterm(group)"))
    assert code == 143, output
    assert "SIGTERM received" in output and "Traceback" not in output
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    stopped = re.search(r"stopped by SIGTERM at epoch 0 step (\d+)", output)
    assert stopped, output
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (0, int(stopped.group(1))) == (0, 3)
    output = run_to_end([*cmd, "--resume", "auto"])
    first = PROGRESS.search(output)
    assert first and int(first.group(2)) == ckpt["step_in_epoch"] + 1, output
    assert_same_run(out, reference["single"])


@pytest.mark.slow
def test_sigusr1_under_spawn_then_sigkill_at_epoch_boundary_resume_bitwise(data, reference,
                                                                          tmp_path):
    out = tmp_path / "out"
    # SLURM's --signal reaches the parent, both ranks and their loader workers; the parent
    # forwards it as well, so each rank gets it twice: that must still count as one signal.
    # Rank 0 sends it to the job's group after its second step; with two ranks the stop is
    # agreed one step later (StopFlag.should_stop): both finish step 3, save it, exit.
    code, output = fault_run(run_cmd(data, out, *SPAWN, "-j", "2"),
                             fault_at("train.step@0", 2, "sigusr1(group)"))
    assert code == 143, output
    assert "stopped by SIGUSR1" in output and "without saving" not in output, output
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (0, 3), output
    assert "stopped by SIGUSR1 at epoch 0 step 3;" in output, output
    assert len(ckpt["rng"]) == 2 and ckpt["world_size"] == 2
    # The rest without loader workers: the data, and so the result, do not depend on them.
    boundary_kill_then_finish(run_cmd(data, out, *SPAWN, "-j", "0"), out, ckpt["step_in_epoch"])
    assert_same_run(out, reference["spawn"])


@pytest.mark.slow
def test_ctrl_c_saves_too(data, tmp_path):
    out = tmp_path / "out"
    # Ctrl-C reaches the terminal's whole group: the loader workers must ignore it.
    code, output = fault_run(run_cmd(data, out, *SINGLE, "-j", "2"),
                             fault_at("train.step", 2, "sigint(group)"))
    assert code == 143, output
    assert "SIGINT received" in output and "Traceback" not in output
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (0, 2), output


@pytest.mark.slow
def test_a_second_different_signal_during_training_exits_at_once_without_saving(data,
                                                                                tmp_path):
    out = tmp_path / "out"
    live = Live(run_cmd(data, out, *SINGLE, "-j", "0"))
    live.wait_for(step_line(0, 2))
    # Stopped while both are sent, the run receives them together however busy the machine is:
    # no step (and no save) can complete between the first and the second.
    for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGUSR1, signal.SIGCONT):
        live.signal_group(sig)
    code = live.finish()
    output = live.output
    assert code == PREEMPT_EXIT_CODE, output
    # Python runs pending handlers by signal number: either may count as the first.
    assert output.count("received: finishing this step") == 1, output
    assert re.search(r"second signal \(SIG(TERM|USR1)\): exiting now without saving", output)
    assert "stopped by" not in output and "Traceback" not in output, output
    assert not list(out.glob("*.pth.tar")) and not list(out.glob(".*tmp*")), output


@pytest.mark.slow
def test_fp16_grad_scaler_state_is_checkpointed_and_restored_bitwise(data, tmp_path):
    # squeezenet1_1: fp16 autocast on the CPU is ~25x slower than fp32 for resnet18, ~7x here.
    flags = [*FLAGS, "-a", "squeezenet1_1", "--amp", "fp16", *SINGLE, "-j", "0"]
    reference = tmp_path / "reference"
    run_to_end(run_cmd(data, reference, flags=flags))
    out = tmp_path / "out"
    cmd = run_cmd(data, out, flags=flags)
    # Saves at steps 2 and 4, before epoch 0's validation, at its end, then at epoch 1's step
    # 2: killed once that fifth one is on disk.
    code, output = fault_run([*cmd, "--save-every", "2"],
                             fault_at("save.done", 5, "sigkill(group)"))
    assert code == -signal.SIGKILL, output
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (1, 2), output
    # Every step moves the scaler (a skipped step halves the scale, a good one counts towards
    # growth): a resume that started from a fresh scaler would end elsewhere.
    assert ckpt["scaler"] != torch.amp.GradScaler("cpu").state_dict(), ckpt["scaler"]
    output = run_to_end([*cmd, "--resume", "auto"])
    assert f"(epoch 1, step {ckpt['step_in_epoch']}," in output, output
    assert_same_run(out, reference)
    got = load_checkpoint(out / "checkpoint.pth.tar")
    want = load_checkpoint(reference / "checkpoint.pth.tar")
    assert want["scaler"] is not None
    assert_equal(got["scaler"], want["scaler"], "scaler")


@pytest.mark.slow
def test_three_processes_resume_bitwise(data, tmp_path):
    # With 3+ ranks a sum's rounding depends on how DDP groups the gradients into buckets, and
    # DDP regroups them after a process's first backward: a resumed process must not take its
    # first step in another grouping than the uninterrupted run took that step in.
    flags = [*FLAGS, "-a", "squeezenet1_1", "-b", "12", "-j", "0", "--multiprocessing-distributed",
             "--nproc-per-node", "3"]  # 4 steps per epoch; squeezenet: 3 CPU processes fit
    reference = tmp_path / "reference"
    run_to_end(run_cmd(data, reference, flags=flags))
    out = tmp_path / "out"
    cmd = run_cmd(data, out, flags=flags)
    code, output = fault_run([*cmd, "--save-every", "2"],
                             fault_at("save.done", 1, "sigkill(group)"))
    assert code == -signal.SIGKILL, output
    assert load_checkpoint(out / "checkpoint.pth.tar")["step_in_epoch"] == 2, output
    run_to_end([*cmd, "--resume", "auto"])
    assert_same_run(out, reference)


def _tagged_processes(token: str):
    """(pid, environment, command line) of every process whose FT_TOKEN is ``token``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = dict(item.split("=", 1) for item in
                       (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in item)
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if env.get("FT_TOKEN") == token:
            yield int(entry.name), env, cmdline


def _tagged_pids(token: str) -> list[int]:
    return [pid for pid, _, _ in _tagged_processes(token)]


def _worker_pid(token: str, rank: int) -> int | None:
    """The torchrun worker of ``rank`` of the run tagged ``token``."""
    for pid, env, cmdline in _tagged_processes(token):
        if env.get("RANK") == str(rank) and "main.py" in cmdline:
            return pid
    return None


@pytest.mark.slow
def test_torchrun_restart_after_a_killed_worker_loses_at_most_save_every_steps(
        data, reference, tmp_path):
    out = tmp_path / "out"
    every = 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "2", "--monitor-interval", "0.5", MAIN, str(data), *FLAGS,
           "-b", "4", "-j", "0", "--save-every", str(every), "--output-dir", str(out),
           "--dist-timeout", "60"]  # a restart that cannot re-form the group fails fast
    live = Live(cmd, timeout=400)
    live.wait_for(step_line(1, 3))
    pid = _worker_pid(live.token, rank=1)
    assert pid is not None, live.output
    os.kill(pid, signal.SIGKILL)
    code = live.finish()
    assert code == 0, live.output
    output = live.output
    resumed = re.search(r"=> loaded checkpoint .*\(epoch (\d+), step (\d+),", output)
    assert resumed, output
    before = output[:resumed.start()]
    done = max(int(e) * STEPS + int(s) for e, s, _ in PROGRESS.findall(before))
    resumed_at = int(resumed.group(1)) * STEPS + int(resumed.group(2))
    lost = done - resumed_at
    print(f"torchrun restart: killed after step {done}, resumed at step {resumed_at}: "
          f"{lost} step(s) redone (--save-every {every})")
    assert 0 <= lost <= every
    assert_same_run(out, reference["spawn"])


@pytest.mark.slow
def test_a_second_signal_exits_at_once_but_a_duplicate_delivery_does_not(tmp_path):
    script = """
import os, signal, time
from imagenet.launching.preemption import PREEMPT_EXIT_CODE, StopFlag
from imagenet.errors import Preempted
assert PREEMPT_EXIT_CODE == Preempted.exit_code == 143
flag = StopFlag()
flag.install()
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGTERM)  # the same signal again at once: one delivery
print("stop requested:", flag.requested, flag.should_stop(), flush=True)
time.sleep(1.2)
os.kill(os.getpid(), signal.SIGUSR1)  # a real second signal
time.sleep(5)
print("still alive", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=child_env(), timeout=60)
    assert proc.returncode == 143, proc.stdout + proc.stderr
    assert "stop requested: SIGTERM True" in proc.stdout
    assert "still alive" not in proc.stdout
    assert "second signal (SIGUSR1): exiting now" in proc.stderr + proc.stdout


# ---- --multiprocessing-distributed: the parent's exit code when a child dies of a signal


def waiting_for_a_missing_node(out: Path, spawn: bool = True) -> list[str]:
    """A job whose one rank waits for node 1 of 2, which never comes: the rank sits in the
    rendezvous, before any stop handler is installed, until the signal arrives. ``spawn``:
    started by main.py's mp.spawn, else main.py's own process is the rank."""
    started = ["--multiprocessing-distributed", "--nproc-per-node", "1"] if spawn else []
    return [sys.executable, MAIN, "--dummy", *started, "--world-size", "2", "--rank", "0",
            "--dist-url", f"tcp://127.0.0.1:{free_port()}", "--dist-timeout", "300",
            "--output-dir", str(out)]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_spawned_rank_killed_before_its_handlers_still_exits_with_the_preemption_code(tmp_path,
                                                                                      sig):
    live = Live(waiting_for_a_missing_node(tmp_path / "out"), timeout=120)
    live.wait_for("per node ->")  # logged once the parent forwards these signals
    os.kill(live.proc.pid, sig)  # to the parent only, as `kill` or `scancel --signal` do
    code = live.finish()
    assert code == PREEMPT_EXIT_CODE, live.output
    name = signal.Signals(sig).name
    assert f"training process 0 of this node was killed by {name} before it could save" \
        in live.output, live.output
    assert "Traceback" not in live.output


@pytest.mark.slow
@pytest.mark.parametrize("spawn", [True, False], ids=["spawn", "one process"])
@pytest.mark.parametrize("after", [0, 1.5, 6])  # the imports: the test below
def test_ctrl_c_while_a_job_starts_or_waits_for_its_peers_exits_130_at_once(tmp_path, after,
                                                                             spawn):
    # Ctrl-C reaches every process of the terminal's group. ``after`` seconds: a rank starting
    # Python and importing torch and the trainer (a KeyboardInterrupt there printed a traceback;
    # inside a class definition it became a RuntimeError and exit 1; in main.py's code mp.spawn's
    # wrapper turned it into exit 0), or waiting for its missing peer (torch's rendezvous heard
    # the interrupt only when --dist-timeout ended).
    cmd = waiting_for_a_missing_node(tmp_path / "out", spawn)  # --dist-timeout 300
    live = Live(cmd, timeout=200)
    if spawn:
        live.wait_for("per node ->")  # the parent is starting its child
    time.sleep(after)
    live.signal_group(signal.SIGINT)
    sent = time.monotonic()
    code = live.finish()
    if code == -signal.SIGINT:  # before Python's own handler existed: the shell says 130 too
        assert not spawn and after == 0 and not live.output, live.output
        return
    if code == 1 and re.search(r"Fatal Python error: init_\w+:", live.output):
        # Python's own start, before main.py's first line: a KeyboardInterrupt in site's .pth
        # files (init_import_site) or in the io module's import (init_sys_streams) is CPython's
        # fatal error (both seen with three test workers on two busy cores).
        assert not spawn and after == 0 and "imagenet" not in live.output, live.output
        return
    assert code == 130, live.output
    assert "interrupted" in live.output, live.output
    assert "Traceback" not in live.output and "RuntimeError" not in live.output, live.output
    assert time.monotonic() - sent < 60, live.output  # at once, not after --dist-timeout


@pytest.mark.slow
@pytest.mark.parametrize("where", ["one process", "spawn child"])
def test_ctrl_c_while_python_imports_waits_for_the_import(tmp_path, where):
    # A KeyboardInterrupt inside an import can land in a class definition (a RuntimeError from
    # __set_name__: a traceback and exit 1; seen at 2.2 s into a one-process job) or in code
    # that swallows it. Python reports every finished import (-X importtime); the signal is
    # sent once torchvision has begun importing, on the way to imagenet.run.trainer (a spawned
    # child held it back already; a rank of its own did not).
    live = Live(waiting_for_a_missing_node(tmp_path / "out", where != "one process"),
                timeout=200, PYTHONPROFILEIMPORTTIME="1")
    if where == "spawn child":
        live.wait_for("per node ->")  # the parent's imports are done; the child's begin
    live.wait_for(" torchvision.extension\n")
    live.signal_group(signal.SIGINT)
    code = live.finish()
    assert code == 130, live.output
    assert "Traceback" not in live.output and "RuntimeError" not in live.output, live.output
    imported = re.search(r"\|\s+imagenet\.run\.trainer$", live.output, re.M)
    assert imported, live.output[-3000:]  # the import finished, then the interrupt came
    assert "interrupted" in live.output[imported.end():], live.output[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_waiting_for_the_others_says_for_whom_and_stops_on_ctrl_c(tmp_path, rank):
    cmd = waiting_for_a_missing_node(tmp_path / "out", spawn=False)
    cmd[cmd.index("--rank") + 1] = str(rank)
    port = cmd[cmd.index("--dist-url") + 1].rsplit(":", 1)[1]
    live = Live(cmd, timeout=120, IMAGENET_NOTICE_AFTER="1")
    live.wait_for("waiting ")
    said = {0: f"=> waiting at 127.0.0.1:{port} for rank 1 (1 of 2 processes arrived; "
               "--dist-timeout 300s, 29",
            1: f"[rank 1] WARNING: waiting for rank 0's rendezvous store at 127.0.0.1:{port} "
               "(--dist-timeout 300s); is rank 0 started?"}[rank]
    assert said in live.lines[-1], live.output
    live.signal_group(signal.SIGINT)
    assert live.finish() == 130, live.output
    assert live.output.count("interrupted") == 1 and "Traceback" not in live.output, live.output


def test_child_exit_codes():
    preempted = child_exit(1, -signal.SIGUSR1, "SIGUSR1")
    assert preempted[0] == PREEMPT_EXIT_CODE and "requeue" in preempted[1]
    assert child_exit(0, -signal.SIGKILL, "SIGKILL") == (
        1, "training process 0 of this node was killed by SIGKILL; stopped the others")
    assert child_exit(0, -signal.SIGINT, "SIGINT") == (
        130, "training process 0 of this node was interrupted; stopped the others")
    assert child_exit(1, 130, None)[0] == 130  # KeyboardInterrupt in main.py's code
    assert child_exit(1, 143, None)[0] == 143  # saved on a signal: its own code
    assert child_exit(1, 2, None) == (
        2, "training process 1 of this node exited with code 2; stopped the others")
