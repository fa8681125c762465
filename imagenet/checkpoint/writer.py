"""Checkpoint writes that do not hold up training: the state is copied off the model at the step
boundary (``to_host``), and rank 0 writes it in a thread of its own (``Writer``) while training
goes on. One write at a time: a save waits for the previous one; a stop, a time limit and the
end of the run wait for the write under way (``run.checkpointing.finish_saves``), and so does a
process that exits meanwhile (the thread is not a daemon). The files appear atomically, as
before (``files.atomic_save``): a kill during the write leaves the previous checkpoint whole.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch


def to_host(obj: Any) -> Any:
    """A copy of ``obj`` that training may go on from: every tensor copied to the CPU, every
    container new (the optimizer's groups, the schedule's lists), numpy arrays copied."""
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach()
        return tensor.to("cpu", copy=True) if tensor.device.type != "cpu" else tensor.clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, Mapping):
        return {key: to_host(value) for key, value in obj.items()}
    if isinstance(obj, tuple):
        return tuple(to_host(value) for value in obj)
    if isinstance(obj, list):
        return [to_host(value) for value in obj]
    return obj


class Writer:
    """Rank 0's checkpoint writes, one at a time, in a thread of their own."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.seconds: float | None = None  # how long the last finished write took

    def submit(self, write: Callable[[], None]) -> None:
        """Start ``write`` once the write under way (if any) has finished; its error is raised
        by the next ``submit`` or ``wait``."""
        self.wait()

        def run() -> None:
            start = time.perf_counter()
            try:
                write()
            except BaseException as exc:  # raised in the training thread by wait()
                self.error = exc
            finally:
                self.seconds = time.perf_counter() - start

        self.thread = threading.Thread(target=run, name="checkpoint-writer")
        self.thread.start()

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def wait(self) -> float | None:
        """Wait for the write under way; raise its error; the seconds it took (None: none)."""
        thread, self.thread = self.thread, None
        if thread is None:
            return None
        thread.join()
        error, self.error = self.error, None
        if error is not None:
            raise error
        return self.seconds

    def wait_quietly(self) -> None:
        """``wait``, its error dropped: on a path that already ends with an error of its own."""
        try:
            self.wait()
        except Exception:
            pass
