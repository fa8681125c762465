"""Parse, choose how to launch, start the training processes, turn errors into exit codes."""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence

import torch
import torch.multiprocessing as mp

from imagenet.config import Config, parse_config
from imagenet.distributed import (
    Launch,
    check_sync_bn,
    choose_backend,
    cleanup,
    init_distributed,
    per_process_batch,
    per_process_workers,
    plan_launch,
    rendezvous,
    resolve_ranks,
)
from imagenet.errors import TrainerError
from imagenet.logger import setup_logging

log = logging.getLogger(__name__)


def _worker(local_index: int, cfg: Config, launch: Launch, batch: int, workers: int,
            master: dict[str, str]) -> None:
    """One training process (also the body of every mp.spawn child)."""
    os.environ.update(master)  # the parent's rendezvous choice (spawn mode only)
    rank = resolve_ranks(launch, local_index, cfg, os.environ)[0]
    setup_logging(rank, cfg.debug)
    if launch.mode == "spawn":
        # Children die with a message, not a traceback; mp.spawn then stops their siblings.
        try:
            _train(cfg, launch, local_index, batch, workers)
        except TrainerError as exc:
            # stderr like main()'s "error:" line (rank 0's log handler writes to stdout)
            tag = "" if rank == 0 else f"[rank {rank}] "
            print(f"{tag}error: {exc}", file=sys.stderr, flush=True)
            if cfg.debug:
                traceback.print_exc()
            sys.exit(exc.exit_code)
    else:
        _train(cfg, launch, local_index, batch, workers)


def _train(cfg: Config, launch: Launch, local_index: int, batch: int, workers: int) -> None:
    from imagenet.trainer import run_training  # heavy imports only where training happens

    info = init_distributed(cfg, launch, local_index)
    try:
        if info.device.type == "cpu" and info.rank == 0 and not cfg.no_accel:
            log.info("=> no CUDA device: training on the CPU")
        run_training(cfg, info, batch, workers)
    finally:
        cleanup()


def _spawn(cfg: Config, launch: Launch, batch: int, workers: int) -> int:
    """mp.spawn-style start of ``launch.nprocs`` children; returns the first failing code."""
    # Decided once here (not in each child) so that every child uses the same MASTER_ADDR/PORT.
    env = dict(os.environ)
    rendezvous(cfg, launch, env)
    master = {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT") if k in env}
    ctx = mp.start_processes(_worker, args=(cfg, launch, batch, workers, master),
                             nprocs=launch.nprocs, join=False, start_method="spawn")

    def forward(signum: int, _frame) -> None:
        for p in ctx.processes:
            if p.is_alive():
                os.kill(p.pid, signum)

    # Ctrl-C reaches the children from the terminal already; SIGTERM/SIGUSR1 (SLURM, kill) are
    # forwarded so every rank saves.
    handlers = {sig: signal.signal(sig, how) for sig, how in (
        (signal.SIGINT, signal.SIG_IGN), (signal.SIGTERM, forward), (signal.SIGUSR1, forward))}
    try:
        while not ctx.join():
            pass
    except mp.ProcessExitedException as exc:
        # join() has stopped the other children; say which one ended the job (its own message,
        # if any, came before; a signal death such as the OOM killer's has none).
        how = (f"was killed by {exc.signal_name}" if exc.signal_name
               else f"exited with code {exc.exit_code}")
        print(f"training process {exc.error_index} of this node {how}; stopped the others",
              file=sys.stderr, flush=True)
        return exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1
    except mp.ProcessRaisedException as exc:
        print(f"error: training process {exc.error_index} of this node failed:\n{exc}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        for sig, previous in handlers.items():
            signal.signal(sig, previous)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The command line entry point: returns the process exit code."""
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_config(argv)
        if cfg.env_check:
            from imagenet.envcheck import run_env_check

            return run_env_check(cfg)
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        launch = plan_launch(cfg, os.environ, cuda_count)
        if launch.mode != "single":  # impossible requests fail here, not in every rank
            device_type = "cuda" if cuda_count and not cfg.no_accel else "cpu"
            choose_backend(cfg.dist_backend, device_type)
            check_sync_bn(cfg.sync_bn, device_type)
        if launch.mode != "spawn":
            _worker(0, cfg, launch, cfg.batch_size, cfg.workers, {})
            return 0
        setup_logging(0, cfg.debug)
        batch = per_process_batch(cfg.batch_size, launch.nprocs)
        workers = per_process_workers(cfg.workers, launch.nprocs)
        log.info("=> %s; -b %d per node -> %d per process; -j %d per node -> %d per process",
                 launch.reason, cfg.batch_size, batch, cfg.workers, workers)
        return _spawn(cfg, launch, batch, workers)
    except TrainerError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

