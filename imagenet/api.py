"""``imagenet.train(argv)``: main.py's training run as a function, for launchers that call Python.

Ray Train's ``TorchTrainer`` creates the process group, sets RANK / LOCAL_RANK / WORLD_SIZE and
then calls a function in every worker (in a thread of the worker process): that function calls
``train`` with main.py's flags (``examples/ray_train.py``). ``train``

- uses a process group that already exists (never a second init) and leaves it to its creator;
  without one it joins as main.py would (torchrun's variables, ``--dist-url``), or trains alone;
- trains in this process: it never spawns (``--multiprocessing-distributed`` and
  ``--nproc-per-node`` are main.py's); several visible GPUs without a launcher mean GPU 0 (or
  ``--gpu``);
- counts --time-limit from its call (main.py: from the process's start);
- returns the final metrics (main.py prints them) and raises ``TrainerError`` subclasses
  (``imagenet.errors``) where main.py prints one line and exits;
- tells ``on_checkpoint`` of every checkpoint, on every rank, the same number of times
  (``imagenet.run.outputs.Saved``); ``resume_from`` is a checkpoint of this run to continue (Ray's
  ``get_checkpoint()`` after a restart).

Stopping on SIGTERM is main.py's: signal handlers belong to the main thread, and a caller that
runs ``train`` in another thread (Ray) stops its workers itself.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from imagenet.errors import UsageError
from imagenet.launching.failures import stop_together
from imagenet.launching.process_group import cleanup, init_distributed, owns_group
from imagenet.reporting.logger import console
from imagenet.run.outputs import Outputs, Saved
from imagenet.settings import devices
from imagenet.settings.devices import Accelerator
from imagenet.settings.flags import Config, parse_config
from imagenet.settings.launch import Launch, plan_launch
from imagenet.settings.plan import make_plan
from imagenet.training.models import check_start

__all__ = ["Saved", "train"]

log = logging.getLogger(__name__)


def train(argv: Sequence[str], *, on_checkpoint: Callable[[Saved], None] | None = None,
          resume_from: str | os.PathLike | None = None) -> dict[str, float]:
    """Train (or evaluate with -e) with main.py's flags in this process; the final metrics.

    ``on_checkpoint(saved)`` runs on every rank after every checkpoint save; ``resume_from``
    (a checkpoint file of this run) becomes OUTPUT_DIR/checkpoint.pth.tar and is resumed.
    """
    called = time.time()  # --time-limit counts from here, not from Python's start
    cfg = parse_flags(argv)
    if resume_from is not None:
        cfg = replace(cfg, resume=str(resume_from) if cfg.evaluate else "auto")
    accel = devices.detect()
    group = (dist.get_rank(), dist.get_world_size()) \
        if dist.is_available() and dist.is_initialized() else None
    plan = make_plan(cfg, os.environ, accel, plan_in_process(cfg, accel), group,
                     started=called)
    with console_logging(plan.ranks().rank, cfg.debug):
        check_start(plan)  # main.py's checks
        from imagenet.run.trainer import run_training  # heavy imports only where training happens

        info = init_distributed(plan)
        try:
            outputs = Outputs(on_checkpoint=on_checkpoint,
                              resume_from=None if resume_from is None or cfg.evaluate
                              else Path(resume_from))
            # A group of this process's own has no launcher to stop the others when one
            # fails; a caller's group (Ray) has.
            together = stop_together(plan, info) if owns_group() else contextlib.nullcontext()
            with together:
                return run_training(plan, info, outputs)
        finally:
            cleanup()  # destroys only a group that init_distributed created


def parse_flags(argv: Sequence[str]) -> Config:
    """main.py's flags as a Config; argparse's message as a UsageError instead of an exit."""
    if isinstance(argv, str):
        raise UsageError("imagenet.train takes a list of flags, as main.py's argv: "
                         "['/data/imagenet', '-a', 'resnet50', ...]")
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            cfg = parse_config(list(argv))
    except SystemExit:
        lines = [ln for ln in said.getvalue().splitlines() if ln.strip()]
        raise UsageError(lines[-1].split("error: ", 1)[-1] if lines else
                         "invalid flags") from None
    if cfg.env_check:
        raise UsageError("--env-check is main.py's (python main.py --env-check)")
    return cfg


def plan_in_process(cfg: Config, accel: Accelerator) -> Launch:
    """How this process trains: in the caller's group, under a launcher, or alone (the launch
    part of its plan)."""
    if dist.is_available() and dist.is_initialized():
        return Launch("env", reason="the caller's process group")
    if cfg.multiprocessing_distributed or (cfg.nproc_per_node or 0) > 1:
        raise UsageError("imagenet.train trains in this process and starts no others: drop "
                         "--multiprocessing-distributed / --nproc-per-node and start one "
                         "process per device with a launcher (Ray Train, torchrun), or run "
                         "main.py")
    launch = plan_launch(cfg, os.environ, accel)
    if launch.mode == "spawn":  # several GPUs and no launcher: main.py would spawn
        return Launch("single", reason="one process (imagenet.train does not spawn)")
    return launch


@contextlib.contextmanager
def console_logging(rank: int, debug: bool) -> Iterator[None]:
    """The trainer's log lines on the console (rank 0: progress; others: warnings), through
    the ``imagenet`` logger only: the caller's logging stays as it was."""
    logger = logging.getLogger("imagenet")
    handler, level = console(rank, debug)  # main.py's console
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
