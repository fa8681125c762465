"""Every validation image of this rank's share readable, checked before training.

The check opens each file (``transforms.check_image_file``: its first and last bytes), which on
a network file system is a round trip per file: ``THREADS`` threads keep several in flight. A
run's start begins it in the background as soon as the data set is listed
(``ImageCheck.start``), so that it runs while the model is built and the checkpoint loads; the
preflight waits for its answer. The answer is the first bad image in the shard's order, as a
check one file after the other would give.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torchvision.datasets import DatasetFolder

from imagenet.data.transforms import check_image_file
from imagenet.errors import DataError
from imagenet.launching import watchdog

THREADS = 8  # files checked at once


class ImageCheck:
    """The check of ``paths``, running in the background once started."""

    def __init__(self, paths: Sequence[str], backend: str) -> None:
        self.paths, self.backend = paths, backend
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="image-check")
        self._result: Future | None = None

    def start(self) -> ImageCheck:
        """Begin checking in the background."""
        self._result = self._pool.submit(self._first_bad)
        return self

    def result(self) -> DataError | None:
        """The first unreadable image's error (None: all readable); waits for the check."""
        try:
            return self._result.result() if self._result is not None else self._first_bad()
        finally:
            self._pool.shutdown(wait=False)

    def cancel(self) -> None:
        """Stop checking (the run ended before it needed the answer)."""
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _first_bad(self) -> DataError | None:
        # Each worker takes files in order; the answer is the first bad one in that order.
        with ThreadPoolExecutor(THREADS, thread_name_prefix="image-check-file") as files:
            for path, error in zip(self.paths, files.map(self._check, self.paths)):
                watchdog.beat(f"checking validation image {path}")  # progress, for the hang watch
                if error is not None:
                    self._stop.set()  # the files not yet checked are skipped
                    return error
        return None

    def _check(self, path: str) -> DataError | None:
        if self._stop.is_set():
            return None
        try:
            check_image_file(path, self.backend)
        except DataError as exc:
            return exc
        return None


def image_check(dataset: Any, rank: int, world_size: int, backend: str) -> ImageCheck | None:
    """The check of this rank's share of an ImageFolder's images (every world_size-th, as the
    validation's ShardSampler takes them); None for other datasets (--dummy; tar shards are
    read whole to check)."""
    if not isinstance(dataset, DatasetFolder):
        return None
    return ImageCheck([path for path, _ in dataset.samples[rank::world_size]], backend)
