"""Parse, choose how to launch, start the training processes, turn errors into exit codes."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from multiprocessing import resource_tracker
from pathlib import Path
from typing import NoReturn

import torch.multiprocessing as mp

from imagenet.errors import INTERRUPTED_EXIT_CODE, TrainerError, report, show_crash_stacks
from imagenet.launching.failures import LOOK, StoppedChildren, exit_within, stop_together
from imagenet.launching.preemption import (
    PREEMPT_EXIT_CODE,
    ignore_interrupts_after_training,
    stop_when_orphaned,
)
from imagenet.launching.process_group import cleanup, init_distributed
from imagenet.reporting.logger import preload_writers, setup_logging, startup_notes
from imagenet.settings import devices
from imagenet.settings.flags import parse_config
from imagenet.settings.plan import Plan, make_plan
from imagenet.training.models import check_start

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_BY = {sig.name for sig in FORWARDED_SIGNALS}  # a child dead of these: preempted
# How ``_spawn`` starts this node's training processes: fresh interpreters, as mp.spawn does.
# The tests' pre-imported runs (tests/prestart.py) fork them from the run, which has imported
# the trainer already; tests about start-up start main.py plainly and keep "spawn".
START_METHOD = "spawn"

log = logging.getLogger(__name__)


def hold_interrupts() -> None:
    """Hold SIGINT back in this thread (and in the threads it starts) while Python imports.

    A KeyboardInterrupt inside an import printed a traceback, became a RuntimeError inside a
    class definition (a failure: exit 1, not 130; one Ctrl-C in 100 during the trainer's
    imports), or went unseen in code that swallows exceptions. main.py holds SIGINT from its
    first line, before torch is imported; a spawned child starts with it held (SpawnStart).
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def take_interrupts() -> None:
    """The imports are done: a Ctrl-C raises KeyboardInterrupt again, one held back now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def end_process(code: int) -> NoReturn:
    """End this process (main.py's, or a rank mp.spawn started) with ``code``, as Python's own
    exit does - the other threads waited for (threading's shutdown, which ends idle thread
    pools too), atexit's handlers (logging's, multiprocessing's: the loader workers), stdout
    and stderr flushed - less its last stage: freeing every module's objects one by one. With
    torch and torchvision loaded that stage costs ~1 CPU-s in every process (each rank, each
    torchrun worker, every start that only printed an error), and nothing is written by then:
    the trainer closes its own files."""
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's exit calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone, a stream closed: as Python's exit
            pass
    os._exit(code)


def _worker(local_index: int, plan: Plan, master: dict[str, str],
            start: SpawnStart | None = None, own_process: bool = True) -> None:
    """One training process: join the others, then train (the body of every mp.spawn child).
    ``own_process``: the process ends with the run (not an in-process caller of ``main``)."""
    if plan.launch.mode == "spawn":  # a process of its own: its crash stacks and console, once
        show_crash_stacks()
        setup_logging(plan.ranks(local_index).rank, plan.cfg.debug)
    try:
        _train_here(local_index, plan, master, start, own_process)
    except KeyboardInterrupt:
        if plan.launch.mode != "spawn":
            raise
        # Ctrl-C before the stop handlers were installed (joining the others): mp.spawn's
        # wrapper would swallow it and exit 0, as if training had completed.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED_EXIT_CODE)
    if own_process and plan.launch.mode == "spawn" and START_METHOD == "spawn":
        end_process(0)  # a spawned rank's teardown (a forked one ends with os._exit already)


class SpawnStart:
    """How a spawned child learns of a Ctrl-C that came while it was starting.

    The children start with SIGINT ignored and blocked (the parent's state while it starts
    them): a KeyboardInterrupt while Python imports torch and the trainer printed a traceback,
    and inside a class definition it even became a RuntimeError (exit 1, not 130). A child
    takes SIGINT back once its imports are done: one that reached it meanwhile is still pending
    and is raised then. One sent before the child existed the parent notes in shared memory; a
    child also stops if its parent died meanwhile (mp.spawn's parent-death signal is SIGINT).
    """

    def __init__(self) -> None:
        self.parent = os.getpid()
        self.flag = mp.get_context("spawn").RawValue("b", 0)
        # Set by a child that stopped to be requeued (a signal, --time-limit): it exits 0, so
        # that mp.spawn's join does not terminate the others (rank 0 may still be writing the
        # stop's checkpoint); the parent exits with the requeue code once every child ended.
        self.requeue = mp.get_context("spawn").RawValue("b", 0)

    def note_interrupt(self, _signum: int = signal.SIGINT, _frame=None) -> None:
        self.flag.value = 1  # a plain store into shared memory: safe in a signal handler

    def take_interrupts(self) -> None:
        """In the child: SIGINT raises KeyboardInterrupt again; raise it now if one came."""
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a pending one: raised
        if self.flag.value or os.getppid() != self.parent:
            raise KeyboardInterrupt


def _train_here(local_index: int, plan: Plan, master: dict[str, str],
                start: SpawnStart | None, own_process: bool) -> None:
    os.environ.update(master)  # the parent's rendezvous choice (spawn mode only)
    cfg, ranks = plan.cfg, plan.ranks(local_index)
    if plan.launch.mode == "spawn":
        # The node's RANK / WORLD_SIZE (PyTorchJob, the classic env://) would mislead any code
        # that reads them in this process: it is one rank of its own now.
        os.environ.update(RANK=str(ranks.rank), WORLD_SIZE=str(ranks.world_size),
                          LOCAL_RANK=str(ranks.local_rank),
                          LOCAL_WORLD_SIZE=str(ranks.local_world_size))
    for note in startup_notes(cfg):
        log.info("%s", note)
    hold_interrupts()  # heavy imports only where training happens
    from imagenet.run.trainer import run_training

    preload_writers(cfg.log_to, ranks.rank == 0)
    ignore_interrupts_after_training()
    if plan.launcher is not None:  # killed, it cannot stop us: we stop, saving, on our own
        stop_when_orphaned(plan.launcher)
    if start is not None:
        start.take_interrupts()
    else:
        take_interrupts()
    try:
        info = init_distributed(plan, local_index)
        try:
            if info.device.type == "cpu" and info.rank == 0 and not cfg.no_accel:
                log.info("=> no accelerator device (torch.accelerator found none): %s on the CPU",
                         "evaluating" if cfg.evaluate else "training")
            try:
                with stop_together(plan, info):  # a failure on any rank ends every rank
                    run_training(plan, info)
            finally:
                if own_process:  # the watch has closed: the teardown gets --hang-timeout
                    exit_within(plan.hang_timeout, info.rank)
        except BaseException:
            cleanup(failed=True)  # NCCL: abort, not wait for peers that may be gone
            raise
        cleanup()
    except TrainerError as exc:
        if plan.launch.mode != "spawn":
            exc.rank = ranks.rank  # type: ignore[attr-defined]  # main() reports it, as this rank
            raise
        # A spawned child dies with the message, not a traceback; mp.spawn stops its siblings.
        code = report(exc, cfg.debug, ranks.rank)
        if code == PREEMPT_EXIT_CODE and start is not None:
            # Every rank stops at the same step; a rank with nothing to write is done before
            # rank 0 has written the checkpoint. Its exit code would have the parent terminate
            # the others: it tells the parent instead, and exits 0.
            start.requeue.value = 1
            return
        sys.exit(code)


def _spawn(plan: Plan, announce: str) -> int:
    """mp.spawn-style start of ``plan.launch.nprocs`` children; returns the first failing code.

    ``announce`` is logged once SIGTERM/SIGUSR1 are forwarded: from then on a signal reaches
    every child, even one sent while the children are being started.
    """
    # Decided once, by the plan (not in each child): every child uses the same MASTER_ADDR/PORT.
    master = plan.meet.variables()
    children: list = []
    pending: list[int] = []  # signals that came before the children existed

    def forward(signum: int, _frame) -> None:
        if not children:
            pending.append(signum)
        for p in children:
            if p.is_alive():
                os.kill(p.pid, signum)

    # SIGTERM/SIGUSR1 (SLURM, kill) are forwarded so every rank saves. Python-level handlers
    # do not reach the spawned children (a fresh interpreter each), unlike SIG_IGN and the
    # blocked-signal mask: the children start with SIGINT ignored and blocked and take it back
    # when they are ready (SpawnStart). Ctrl-C reaches every process of the terminal's group by
    # itself; this process only notes it, and keeps one that comes while it starts the children
    # pending (a blocked signal is kept, even an ignored one; main.py blocks SIGINT in the
    # threads that imports start, or one of them would take it and drop it).
    handlers = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    start = SpawnStart()
    # Started now, not by the first child: starting it unblocks SIGINT in this thread.
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    stopped = StoppedChildren(plan.hang_timeout, plan.ranks, Path(plan.cfg.output_dir))
    try:
        log.info("%s", announce)
        try:
            ctx = mp.start_processes(_worker, args=(plan, master, start),
                                     nprocs=plan.launch.nprocs, join=False,
                                     start_method=START_METHOD)
        finally:
            signal.signal(signal.SIGINT, start.note_interrupt)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        children.extend(ctx.processes)
        for signum in pending:
            forward(signum, None)
        while not ctx.join(timeout=LOOK):
            stopped.look(ctx.processes)
        if stopped.ended is not None or start.requeue.value:
            # a stopped child finished once continued; or the children stopped to be requeued
            code = PREEMPT_EXIT_CODE
    except mp.ProcessExitedException as exc:
        # join() has stopped the other children; say which one ended the job (its own message,
        # if any, came before; a signal death such as the OOM killer's has none).
        code, message = child_exit(exc.error_index, exc.exit_code, exc.signal_name)
        if stopped.ended is not None:  # a child stopped with SIGSTOP: its line came already
            code = PREEMPT_EXIT_CODE
        else:
            print(message, file=sys.stderr, flush=True)
    except mp.ProcessRaisedException as exc:
        print(f"error: training process {exc.error_index} of this node failed:\n{exc}",
              file=sys.stderr, flush=True)
        code = 1
    finally:
        # Preempted: a further Ctrl-C or SIGTERM until this process exits must not turn the
        # exit code a requeue waits for (PREEMPT_EXIT_CODE) into 130.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if code != PREEMPT_EXIT_CODE:
            for sig, previous in handlers.items():
                signal.signal(sig, previous)
    if start.flag.value and code not in (0, PREEMPT_EXIT_CODE, INTERRUPTED_EXIT_CODE):
        print("interrupted (Ctrl-C) while the job was starting or stopping", file=sys.stderr,
              flush=True)
        return INTERRUPTED_EXIT_CODE
    return code


def child_exit(index: int, exit_code: int | None, signal_name: str | None) -> tuple[int, str]:
    """This node's exit code and message when spawned training process ``index`` ended the job.

    A child killed by a forwarded SIGTERM/SIGUSR1 had no handler yet (still starting; or done
    and tearing down): it saved nothing, but the job was still preempted, so the exit code is
    PREEMPT_EXIT_CODE and a requeue runs (it resumes from the last checkpoint, if any).
    """
    if signal_name in PREEMPTED_BY:
        return PREEMPT_EXIT_CODE, (
            f"training process {index} of this node was killed by {signal_name} before it could "
            f"save (it was starting up or shutting down); stopped the others; exit code "
            f"{PREEMPT_EXIT_CODE} so that a requeue resumes from the last checkpoint")
    if signal_name == "SIGINT":  # Ctrl-C while it was starting up: as main() reports it
        return INTERRUPTED_EXIT_CODE, (f"training process {index} of this node was interrupted; "
                                       "stopped the others")
    how = f"was killed by {signal_name}" if signal_name else f"exited with code {exit_code}"
    code = exit_code if exit_code and exit_code > 0 else 1
    return code, f"training process {index} of this node {how}; stopped the others"


def main(argv: Sequence[str] | None = None, *, own_process: bool = False) -> int:
    """The command line entry point: returns the process exit code. ``own_process`` (main.py):
    the process ends when this returns, so a teardown that never ends is ended
    (``launching.failures.exit_within``); an in-process caller's process is never."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # main.py's already
    try:
        return _main(argv, own_process)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # an in-process caller's as it was


def _main(argv: Sequence[str] | None, own_process: bool) -> int:
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    show_crash_stacks()  # each process: main.py's, torchrun's workers (mp.spawn's in _worker)
    try:
        cfg = parse_config(argv)  # imports torchvision (-a)
        if cfg.env_check:
            from imagenet.tools.envcheck import run_env_check

            take_interrupts()
            return run_env_check(cfg)
        plan = make_plan(cfg, os.environ, devices.detect())  # every decision, once
        # This process's console, set once: a spawned child sets its own rank's (_worker).
        setup_logging(0 if plan.launch.mode == "spawn" else plan.ranks(0).rank, cfg.debug)
        check_start(plan)  # before any data is read or process started
        if plan.launch.mode != "spawn":
            _worker(0, plan, {}, own_process=own_process)
            return 0
        take_interrupts()  # _spawn holds them again while it starts the children
        launch, layout = plan.launch, plan.layout
        given = "auto" if cfg.workers is None else f"{cfg.workers} per node"
        batch = f"-b {cfg.batch_size} per node" if cfg.global_batch_size is None \
            else f"--global-batch-size {cfg.global_batch_size}"
        return _spawn(plan, (
            f"=> {launch.reason}; {batch} -> {layout.batch_size} per "
            f"process; -j {given} -> {layout.workers} per process"))
    except TrainerError as exc:
        return report(exc, debug, getattr(exc, "rank", 0))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
