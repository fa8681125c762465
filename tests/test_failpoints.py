"""Failpoints (imagenet/settings/failpoints.py): the spec's grammar, each action in this process,
a real signal through a real run's own handler, and a run with none armed (or all armed to
print) ending exactly as one without the variable."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import (
    SMALL_ARCH,
    TINY,
    child_env,
    fault_at,
    load_checkpoint,
    run_main,
    write_image_folder,
)
from test_fault_tolerance import assert_equal

from imagenet.settings import failpoints
from imagenet.settings.failpoints import FailpointSpecError, configure, failpoint, parse

# Every point in the trainer (docs/testing.md, "Placing a fault").
POINTS = ("train.start", "train.step", "validate.batch", "save.write", "save.done",
          "log.epoch", "epoch.end")


@pytest.fixture
def armed():
    """``configure`` for one test; nothing armed afterwards (as the variable left it)."""
    yield configure
    configure(os.environ.get(failpoints.VARIABLE))


def test_the_grammar_is_fail_rs_terms_chained_per_point():
    points = parse(" train.step = 2*off -> 1*sigterm(group) ; save.write=error(EIO);"
                   "validate.batch@1=sleep(50)->print(here);")
    assert points == {"train.step": [[2, "off", None], [1, "sigterm", "group"]],
                      "save.write": [[None, "error", "EIO"]],
                      "validate.batch@1": [[None, "sleep", "50"], [None, "print", "here"]]}
    assert parse("") == parse(" ; ") == {}
    assert fault_at("train.step", 3, "sigkill") == "train.step=2*off->1*sigkill"


@pytest.mark.parametrize("spec, says", [
    ("train.step", "is not NAME=ACTIONS"),
    ("=sigterm", "is not NAME=ACTIONS"),
    ("train.step=", "is not NAME=ACTIONS"),
    ("train.step=x*sigterm", "the count before \\* is not a number"),
    ("train.step=sigterm(", "no closing parenthesis"),
    ("train.step=explode", "unknown action 'explode'"),
    ("train.step=sigterm(everyone)", "takes \\(group\\) or \\(parent\\)"),
    ("train.step=sleep", "sleep needs milliseconds"),
    ("train.step=exit(one)", "takes a whole number"),
    ("save.write=error(ENOPE)", "takes an errno name"),
    ("train.step=off(3)", "off takes no argument"),
    ("train.step@one=sigterm", "the rank after @ is not a number"),
    ("a=off;a=print", "'a' is given twice"),
])
def test_a_spec_that_does_not_parse_is_one_error_naming_the_variable(spec, says):
    with pytest.raises(FailpointSpecError, match=f"^IMAGENET_FAILPOINTS: .*{says}"):
        parse(spec)


def test_a_bad_spec_ends_the_process_at_import_with_one_line():
    proc = subprocess.run([sys.executable, "-c", "import imagenet.settings.failpoints"],
                          capture_output=True, text=True, timeout=60,
                          env=child_env(IMAGENET_FAILPOINTS="train.step=explode"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "error: IMAGENET_FAILPOINTS: 'train.step=explode': unknown action 'explode' (one of "
        "error, exit, off, panic, print, sighup, sigint, sigkill, sigstop, sigterm, sigusr1, "
        "sleep)"]


def test_counts_pass_hits_then_act_then_the_point_is_off(armed, capfd):
    armed("p=2*off->2*print(hit)->off;q=print")
    for _ in range(6):
        failpoint("p")
    failpoint("q")
    failpoint("unarmed")
    assert capfd.readouterr().err == "failpoint p: hit\n" * 2 + "failpoint q: reached\n"


def test_a_rank_filter_acts_only_in_that_rank(armed, capfd, monkeypatch):
    armed("p@1=print(one);p=print(all)")
    monkeypatch.setenv("RANK", "0")
    failpoint("p")
    monkeypatch.setenv("RANK", "1")
    failpoint("p")
    assert capfd.readouterr().err == "failpoint p: all\n" * 2 + "failpoint p: one\n"


def test_errors_panics_and_sleeps_happen_where_the_point_is(armed):
    armed("w=error;e=error(EIO);x=panic(boom);s=sleep(60)")
    with pytest.raises(OSError) as full:
        failpoint("w")
    assert full.value.errno == errno.ENOSPC and full.value.filename is None
    with pytest.raises(OSError) as broken:
        failpoint("e")
    assert broken.value.errno == errno.EIO
    with pytest.raises(RuntimeError, match="^failpoint x: boom$"):
        failpoint("x")
    start = time.monotonic()
    failpoint("s")
    assert time.monotonic() - start >= 0.06


def test_a_signal_action_sends_the_real_signal_to_this_process(armed):
    got = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, _frame: got.append(signum))
    try:
        armed(fault_at("p", 2, "sigusr1"))
        failpoint("p")
        assert got == []
        failpoint("p")
        failpoint("p")
        assert got == [signal.SIGUSR1]  # Python ran the handler before failpoint returned
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.slow
def test_a_signal_at_a_point_reaches_the_trainers_own_stop_handler():
    # The trainer's StopFlag, as train() installs it; the point passed twice, signalled once.
    code = ("from imagenet.launching.preemption import StopFlag\n"
            "from imagenet.settings.failpoints import failpoint\n"
            "flag = StopFlag(); flag.install()\n"
            "failpoint('train.step'); print('first:', flag.requested, flush=True)\n"
            "failpoint('train.step'); print('second:', flag.requested, flag.should_stop())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=child_env(
                              IMAGENET_FAILPOINTS=fault_at("train.step", 2, "sigterm")))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["first: None", "second: SIGTERM True"], proc.stdout
    assert "SIGTERM received: finishing this step" in proc.stderr + proc.stdout


def test_exit_ends_the_process_at_once_with_its_code():
    code = ("from imagenet.settings.failpoints import failpoint\n"
            "import atexit; atexit.register(print, 'atexit ran')\n"
            "print('before', flush=True); failpoint('p'); print('after')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=child_env(IMAGENET_FAILPOINTS="p=exit(7)"))
    assert (proc.returncode, proc.stdout) == (7, "before\n"), proc.stderr


def test_sigstop_pauses_the_process_there_until_it_is_continued():
    from imagenet.launching.failures import is_stopped

    code = ("from imagenet.settings.failpoints import failpoint\n"
            "print('before', flush=True); failpoint('p'); print('after', flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=child_env(IMAGENET_FAILPOINTS="p=sigstop"))
    try:
        assert proc.stdout.readline() == "before\n"  # type: ignore[union-attr]
        deadline = time.monotonic() + 60
        while not is_stopped(proc.pid):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.communicate(timeout=60)[0] == "after\n"
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0


def test_nothing_armed_is_one_check_and_nothing_else(armed, monkeypatch):
    armed(None)

    def hit(name: str) -> None:
        raise AssertionError(f"{name}: looked up with nothing armed")

    monkeypatch.setattr(failpoints, "_hit", hit)
    for name in POINTS:
        assert failpoint(name) is None


# ---------------------------------------------------------------- real runs



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("failpoints") / "data")


def tiny_run(data, out, **env: str) -> subprocess.CompletedProcess:
    """Two epochs of a tiny run (3 steps each), forked from the pre-imported trainer."""
    return run_main(str(data), *TINY, "-a", SMALL_ARCH, "-p", "1", "--epochs", "2", "--seed",
                    "0", "--output-dir", str(out), env=child_env(**env))


@pytest.mark.slow
def test_unset_or_printing_failpoints_change_nothing_in_a_run(data, tmp_path):
    plain = tiny_run(data, tmp_path / "plain")
    printed = tiny_run(data, tmp_path / "printed",
                       IMAGENET_FAILPOINTS=";".join(f"{p}=print" for p in POINTS))
    assert plain.returncode == printed.returncode == 0, plain.stderr + printed.stderr
    assert "failpoint" not in plain.stdout + plain.stderr
    passed = re.findall(r"^failpoint (\S+): reached$", printed.stderr, flags=re.M)
    assert set(passed) == set(POINTS), printed.stderr
    assert passed.count("train.step") == 6 and passed.count("epoch.end") == 2, passed
    assert passed.count("log.epoch") == 2, passed
    got, want = (load_checkpoint(tmp_path / name / "checkpoint.pth.tar")
                 for name in ("printed", "plain"))
    for key in ("state_dict", "optimizer", "best_acc1", "global_step", "rng"):
        assert_equal(got[key], want[key], key)
