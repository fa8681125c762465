"""Room in /dev/shm for the loader workers' batches, checked before training starts.

Loader workers hand every batch to the training process in POSIX shared memory (/dev/shm on
Linux), whatever torch.multiprocessing's sharing strategy: 'file_descriptor' and
'file_system' both create the segment with shm_open there, so switching strategy does not help
(measured: both fail alike on a 1 MB /dev/shm). Docker gives containers 64 MB, less than one
ImageNet batch of 256 images; the workers then fail to allocate shared memory ("No space left
on device"; a bus error on older torch) and the run hangs or dies with a worker's traceback
(measured: a tiny run on a 128 KB /dev/shm hung). One line at start-up says what to change.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
