"""SIGTERM / SIGUSR1 / SIGINT: finish the step, save once, exit with PREEMPT_EXIT_CODE.

A signal only sets a flag; the training loop asks ``should_stop()`` after each optimizer step. With
several ranks the flag is OR-ed across ranks (one small all-reduce on a gloo side group, started one
step and read the next, so it never stalls the GPU) so that every rank stops after the same step
and the collective checkpoint save cannot deadlock. A second signal exits at once.
"""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

PREEMPT_EXIT_CODE = 143  # documented in README: "saved on a signal; requeue to resume"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopFlag:
    """Set by the signal handlers; agreed across ranks by ``should_stop``."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._group = None
        self._pending: tuple[torch.Tensor, object] | None = None

    def install(self) -> None:
        """Catch the preemption signals in this process."""
        for sig in SIGNALS:
            signal.signal(sig, self._handle)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # A CPU group for control messages: the flag lives on the host even with NCCL.
            self._group = dist.new_group(backend="gloo")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            log.warning("second signal (%s): exiting now without saving", name)
            os._exit(PREEMPT_EXIT_CODE)
        self.requested = name
        log.warning("%s received: finishing this step, saving a checkpoint, then exiting "
                    "with code %d", name, PREEMPT_EXIT_CODE)

    def should_stop(self) -> bool:
        """True on every rank once any rank was signalled (agreed one step later)."""
        if self._group is None:
            return self.requested is not None
        agreed = False
        if self._pending is not None:
            flag, work = self._pending
            work.wait()  # type: ignore[attr-defined]
            agreed = bool(flag.item())
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32)
        self._pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group,
                                               async_op=True))
        return agreed

    def drain(self) -> None:
        """Finish the outstanding all-reduce so every rank issued the same collectives."""
        if self._pending is not None:
            self._pending[1].wait()  # type: ignore[attr-defined]
            self._pending = None

    def uninstall(self) -> None:
        """Restore default signal handling."""
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
