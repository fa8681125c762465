"""Batches on the device before the step asks for them.

``DeviceBatches`` turns a loader's batches into device tensors (uint8 images, labels): decoded and
cropped on the device (``finish``, --decode-on-device) or copied there. With loader workers it
does so in a thread of its own, on a CUDA stream of its own, up to ``ahead`` batches before the
step that trains on them:

- each batch is handed over with an event the training stream waits for, and its memory is kept
  from the caching allocator until the training stream is done with it (``record_stream``);
- the thread waits for its stream after each batch (its own, not the training thread's): memory
  that nvJPEG writes asynchronously is never reused early (torchvision #9606), and the
  decoder's host synchronisations no longer hold up the step;
- an error in the thread (a bad file, a dead worker) is raised in the training thread, as it
  would have been without the thread; an iteration ended early stops the thread.

Without loader workers the batches are made on the training thread, in turn: the loader then
augments in this process, borrowing the global random streams that the training step and the
checkpoint use, which a second thread must not touch. No collective ever runs in the thread.

Iterating starts the work at once (``iter(...)``): the trainer asks for the next epoch's batches
before it validates and saves (``run.trainer``), so they are ready when training resumes.

Room in /dev/shm for the loader workers' batches, checked before training starts.

Loader workers hand every batch to the training process in POSIX shared memory (/dev/shm on
Linux), whatever torch.multiprocessing's sharing strategy: 'file_descriptor' and
'file_system' both create the segment with shm_open there, so switching strategy does not help
(measured: both fail alike on a 1 MB /dev/shm). Docker gives containers 64 MB, less than one
ImageNet batch of 256 images; the workers then fail to allocate shared memory ("No space left
on device"; a bus error on older torch) and the run hangs or dies with a worker's traceback
(measured: a tiny run on a 128 KB /dev/shm hung). One line at start-up says what to change.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from imagenet.settings import devices

Finish = Callable[[object, torch.device], tuple[torch.Tensor, torch.Tensor]]
AHEAD = 3  # batches made before the step asks for them (the thread's queue)
POLL = 0.1  # seconds between looks at a stop while the queue is full or empty
JOIN = 10.0  # seconds to wait for the thread to leave after a stop


class _Done:
    """The end of the loader's batches."""


class _Failed:
    """An exception in the thread, raised in the training thread."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class DeviceBatches:
    """``loader``'s batches as device tensors, made ahead (see the module docstring).

    ``finish`` turns a loader batch into device tensors (``data.device.DeviceCrops``); None
    copies a batch of uint8 images. ``threaded``: make them in a thread (the loader must read in
    worker processes).
    """

    def __init__(self, loader: Iterable, device: torch.device, finish: Finish | None,
                 threaded: bool = False, ahead: int = AHEAD) -> None:
        self.loader, self.device, self.finish = loader, device, finish
        self.threaded, self.ahead = threaded, ahead

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def load(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """A loader batch as device tensors."""
        if self.finish is not None:
            return self.finish(batch, self.device)
        images, labels = batch
        return (images.to(self.device, non_blocking=True),
                labels.to(self.device, non_blocking=True))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.threaded:
            return _Ahead(self)
        return _InTurn(self)


class _InTurn:
    """Batches made on the training thread: on CUDA one batch ahead on a side stream (the copy
    of batch k+1 overlaps the step on batch k), elsewhere in turn."""

    def __init__(self, batches: DeviceBatches) -> None:
        self.batches = batches
        self.source = iter(batches.loader)  # the loader starts now (workers prefetch)
        self.stream = devices.side_stream(batches.device)
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.ended = False

    def __iter__(self) -> _InTurn:
        return self

    def _make(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        batch = next(self.source, None)
        if batch is None:
            return None
        if self.stream is None:
            return self.batches.load(batch)
        with self.stream:
            return self.batches.load(batch)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stream is None:
            made = self._make()
            if made is None:
                raise StopIteration
            return made
        if self.pending is None and not self.ended:
            self.pending = self._make()
        if self.pending is None:
            raise StopIteration
        ready, self.pending = self.pending, self._make() if not self.ended else None
        if self.pending is None:
            self.ended = True
        current = devices.current_stream(self.batches.device)
        current.wait_stream(self.stream)
        for t in ready:
            t.record_stream(current)
        return ready


class _Ahead:
    """Batches made by a thread of their own (see the module docstring). The thread holds the
    queue and the stop, not this iterator: an iterator dropped early (a stop, an error in the
    step) stops its thread when it is freed."""

    def __init__(self, batches: DeviceBatches) -> None:
        self.device = batches.device
        self.queue: queue.Queue = queue.Queue(maxsize=max(batches.ahead, 1))
        self.stop = threading.Event()
        source = iter(batches.loader)  # the loader starts now, in the thread that asked
        self.thread = threading.Thread(target=_produce, daemon=True, name="imagenet-batches",
                                       args=(source, batches.load, self.device, self.queue,
                                             self.stop))
        self.thread.start()
        self.done = False

    def __iter__(self) -> _Ahead:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.done:
            raise StopIteration
        while True:
            try:
                item = self.queue.get(timeout=POLL)
                break
            except queue.Empty:
                if not self.thread.is_alive() and self.queue.empty():
                    self.done = True
                    raise RuntimeError("the batch thread ended without a word") from None
        if isinstance(item, _Done):
            self.close()
            raise StopIteration
        if isinstance(item, _Failed):
            self.close()
            raise item.error
        ready, event = item
        if event is not None:
            current = devices.current_stream(self.device)
            current.wait_event(event)
            for t in ready:
                t.record_stream(current)
        return ready

    def close(self) -> None:
        """Stop the thread (an iteration ended early: a stop, an error) and wait for it."""
        self.done = True
        _stop(self.queue, self.stop)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=JOIN)

    def __del__(self) -> None:
        _stop(self.queue, self.stop)


def _stop(q: queue.Queue, stop: threading.Event) -> None:
    """Ask the thread to leave, and empty its queue so that a put waiting for room sees it."""
    stop.set()
    with contextlib.suppress(queue.Empty):
        while True:
            q.get_nowait()


def _put(q: queue.Queue, stop: threading.Event, item: object) -> bool:
    """Queue ``item`` unless stopped meanwhile (False)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=POLL)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterator, load: Callable, device: torch.device, q: queue.Queue,
             stop: threading.Event) -> None:
    """The thread: take the loader's batches, make them device tensors on this thread's stream,
    queue them with the event that marks them ready."""
    try:
        stream = devices.side_stream(device)
        if stream is not None:
            devices.set_current(device)
        for batch in source:
            if stop.is_set():
                return
            event = None
            with stream if stream is not None else contextlib.nullcontext():
                ready = load(batch)
                if stream is not None:
                    event = devices.ready_event(stream)
            if stream is not None:
                stream.synchronize()  # this thread's stream only: see the module docstring
            if not _put(q, stop, (ready, event)):
                return
        _put(q, stop, _Done())
    except BaseException as exc:  # raised in the training thread, whatever it is
        if not stop.is_set():
            _put(q, stop, _Failed(exc))


def device_batches(loader: Iterable, device: torch.device, finish: Finish | None,
                   threaded: bool = False) -> Iterable:
    """``loader`` as the training step should read it: on the device, finished by ``finish``,
    made ahead in a thread when ``threaded`` (see ``DeviceBatches``); unchanged on the CPU
    without ``finish``."""
    if device.type != "cuda" and finish is None:
        return loader
    return DeviceBatches(loader, device, finish, threaded)


# --------------------------------------------- room in /dev/shm for the loader workers' batches

SHM = Path("/dev/shm")


def free_bytes(path: Path = SHM) -> int | None:
    """Bytes free in the shared-memory file system; None where there is none to check."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def shared_memory_error(free: int, procs: int, workers: int, in_flight: int,
                        batch_bytes: int) -> str | None:
    """The error for a /dev/shm with ``free`` bytes when ``procs`` processes on this host each
    have ``workers`` workers holding up to ``in_flight`` batches of ``batch_bytes``; or None."""
    need = procs * workers * in_flight * batch_bytes
    if workers == 0 or need <= free:
        return None
    suggest = max(1, -(-2 * need // 2**30))  # GB, twice the need, rounded up
    return (f"{SHM} has {_mb(free)} free, but {procs} process(es) x {workers} loader "
            f"worker(s) x up to {in_flight} batch(es) of {_mb(batch_bytes)} need about "
            f"{_mb(need)} there: give the container more (docker run --shm-size={suggest}g, "
            "or --ipc=host; Kubernetes: an emptyDir with medium Memory on /dev/shm), or lower "
            "-j / -b (-j 0 loads in the training process, without shared memory)")


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB"


def image_bytes(loader, crop: int) -> int:
    """Bytes one image of ``loader``'s batches takes in shared memory: a uint8 crop, or for
    encoded JPEGs (--decode-on-device) the mean size of up to 64 of its files."""
    folder = getattr(loader.dataset, "dataset", loader.dataset)  # inside SeededDataset
    device = sys.modules.get("imagenet.data.device")  # imported for --decode-on-device only
    if device is None or loader.collate_fn is not device.collate \
            or not hasattr(folder, "samples"):
        return 3 * crop * crop
    samples = folder.samples[:: max(1, len(folder.samples) // 64)]
    sizes = [Path(path).stat().st_size for path, _ in samples]
    return max(3 * crop * crop if not sizes else sum(sizes) // len(sizes), 1)


def check_room(loaders: list[tuple[object, int]], batch: int, procs: int,
               free: int | None = None) -> str | None:
    """The error for the worst of ``loaders`` ((DataLoader, crop px) pairs, -b ``batch``) with
    ``procs`` processes on this host, or None. Batches pinned for CUDA leave shared memory as
    soon as the pinning thread copies them: then one per worker is in flight, else all that
    the workers prefetch."""
    free = free_bytes() if free is None else free
    if free is None:
        return None
    for loader, crop in loaders:
        workers = loader.num_workers  # type: ignore[attr-defined]
        in_flight = 1 if loader.pin_memory else loader.prefetch_factor or 1  # type: ignore[attr-defined]
        error = shared_memory_error(free, procs, workers, in_flight,
                                    batch * image_bytes(loader, crop))
        if error:
            return error
    return None
