"""ImageFolder (and --dummy) datasets and their loaders; ``TrainData``, what the trainer asks of
any training source (the order and seeds of the samples: ``samplers``).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset
from torchvision import datasets

import imagenet.data.index as index
import imagenet.data.transforms as T
from imagenet.data.samplers import (
    NoSingleImageBatches,
    ResumableDistributedSampler,
    SeededDataset,
    ShardSampler,
    train_batches,
)
from imagenet.data.transforms import CornerCrop, sized_by_epoch
from imagenet.errors import DataError, UsageError
from imagenet.launching.preemption import ignore_stop_signals, stop_signals_blocked, worker_stacks
from imagenet.launching.watchdog import stacks_dir
from imagenet.settings.flags import Config
from imagenet.settings.images import CropSchedule, image_backend
from imagenet.settings.launch import Layout
from imagenet.settings.plan import Plan

log = logging.getLogger(__name__)


class DummyDataset(Dataset):
    """Synthetic uint8 images for speed tests: one random tensor, labels cycling the classes."""

    def __init__(self, size: int, num_classes: int, image_size: int) -> None:
        self.size, self.num_classes = size, num_classes
        self.transform: Callable | None = None  # progressive resizing: the epoch's crop
        g = torch.Generator().manual_seed(0)
        self.image = torch.randint(0, 256, (3, image_size, image_size), dtype=torch.uint8,
                                   generator=g)
        self.classes = [f"class{i}" for i in range(num_classes)]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.image if self.transform is None else self.transform(self.image)
        return image, index % self.num_classes


class TrainData(Protocol):
    """The training data as the trainer sees it, whatever the source (ImageFolder or shards)."""

    loader: DataLoader  # this rank's micro-batches, from the position set last to the epoch's end
    order_seed: int  # the epoch's sample order is a function of (order_seed, epoch)
    aug_seed: int  # augmentation randomness: (aug_seed, epoch, sample)

    @property
    def batches(self) -> int:
        """Micro-batches per rank in a whole epoch (the same on every rank)."""

    @property
    def images(self) -> int:
        """Images trained on per epoch, all ranks together."""

    # True when the epoch's order is one sequence strided over the ranks: then any layout can
    # go on with the rest of it (``continue_after``), whatever layout trained the first part.
    continues_any_layout: bool

    def set_position(self, epoch: int, samples_done: int) -> None:
        """Continue ``epoch`` after this rank's first ``samples_done`` samples."""

    def continue_after(self, epoch: int, images: int) -> None:
        """Continue ``epoch`` after its first ``images`` images, all ranks together (without
        ``continues_any_layout``: as this layout's steps so far trained them)."""

    def reseed(self, order_seed: int, aug_seed: int) -> None:
        """Adopt a checkpoint's seeds (before the first epoch is loaded)."""

    def preview(self, epoch: int, count: int) -> torch.Tensor:
        """Up to ``count`` augmented images of this rank's first batch of ``epoch``, stacked."""


class FolderTrain:
    """``TrainData`` of a map-style dataset: ``ResumableDistributedSampler`` + ``SeededDataset``."""

    def __init__(self, loader: DataLoader, sampler: ResumableDistributedSampler,
                 dataset: SeededDataset, finish: Callable | None = None) -> None:
        self.loader, self.sampler, self.dataset = loader, sampler, dataset
        self.finish = finish  # a loader batch -> device tensors (--decode-on-device)

    @property
    def order_seed(self) -> int:
        return self.sampler.seed

    @property
    def aug_seed(self) -> int:
        return self.dataset.seed

    @property
    def batches(self) -> int:
        return train_batches(self.sampler.num_samples,
                             self.loader.batch_sampler.batch_size)  # type: ignore[union-attr]

    @property
    def images(self) -> int:
        return self.sampler.num_samples * self.sampler.world_size

    continues_any_layout = True

    @property
    def order_size(self) -> int:
        """Items in an epoch's order: the dataset (the sampler pads it for the ranks)."""
        return self.sampler.size

    def set_position(self, epoch: int, samples_done: int) -> None:
        self.sampler.set_epoch(epoch, start=samples_done)

    def continue_after(self, epoch: int, images: int) -> None:
        self.sampler.continue_epoch(epoch, images)

    def reseed(self, order_seed: int, aug_seed: int) -> None:
        self.sampler.seed, self.dataset.seed = order_seed, aug_seed

    def preview(self, epoch: int, count: int) -> torch.Tensor:
        position = self.sampler.epoch, self.sampler.skip
        self.sampler.set_epoch(epoch)
        keys = self.sampler.keys()[:count]
        self.sampler.continue_epoch(*position)
        batch = self.loader.collate_fn([self.dataset[key] for key in keys])
        return self.finish(batch, torch.device("cpu"))[0] if self.finish else batch[0]


@dataclass
class Data:
    """Everything the trainer needs from the data side."""

    train: TrainData
    val_loader: DataLoader
    num_classes: int
    classes: list[str]
    val_size: int
    # --decode-on-device: a loader batch -> (uint8 images, labels) on the device (data.device)
    train_finish: Callable | None = None
    val_finish: Callable | None = None
    # Training images per class (an ImageFolder's; None for tar shards): the per-class report
    # and --class-balanced-loss.
    train_counts: list[int] | None = None
    listed: str = ""  # how the ImageFolders were read (how_listed), for the start-up line

    @property
    def train_loader(self) -> DataLoader:
        return self.train.loader


class StopSafeLoader(DataLoader):
    """A DataLoader whose workers start with the stop signals blocked: SIGTERM to the whole
    process group (scancel, Ctrl-C) while one starts must not kill it. torch's worker sets a
    SIGTERM handler of its own before ``worker_init_fn`` can ignore the signal."""

    def _get_iterator(self):  # where the workers are started (once, when persistent)
        kill_workers_at_exit()
        with stop_signals_blocked():
            return super()._get_iterator()


# How loader workers start: forked on Linux under every launcher. A process that mp.spawn
# started has "spawn" as its default, and each of its workers imported torch and the trainer
# again (seconds of CPU per worker and loader) where a single process's and torchrun's ranks'
# are forked; elsewhere (macOS, Windows) the platform's default.
WORKER_START = "fork" if sys.platform.startswith("linux") else None


def loader_options(workers: int, prefetch: int = 4) -> dict[str, Any]:
    """DataLoader options shared by every loader with worker processes (``prefetch``: batches
    queued per worker)."""
    # Workers ignore SIGTERM/SIGUSR1/SIGINT sent to the whole process group (SLURM, Ctrl-C): the
    # training process saves first and then shuts them down.
    return {"persistent_workers": True, "prefetch_factor": prefetch,
            "multiprocessing_context": WORKER_START,
            "worker_init_fn": partial(init_worker, stacks=stacks_dir(), parent=os.getpid())
            } if workers > 0 else {}


def init_worker(worker_id: int, stacks: str | None = None, parent: int | None = None) -> None:
    """A loader worker's start: deaf to the stop signals (the training process stops it), dying
    with its training process ``parent`` (or at once, if that ended while this worker started),
    and ready to write its Python stacks into ``stacks`` when a hang is reported
    (``launching.preemption``; passed along, not inherited: workers may be spawned)."""
    ignore_stop_signals(worker_id)
    worker_stacks(stacks, parent)


def check_folder(root: Path, need_val: bool = True) -> tuple[Path, Path]:
    """train/ and val/ under ``root`` (val/ unless ``need_val`` is False: --val-data) or a
    UsageError that says what to give instead."""
    if not root.is_dir():
        raise UsageError(f"data folder '{root}' does not exist: give the dataset root that holds "
                         "train/ and val/ (ImageFolder layout), tar shards (a folder or URL "
                         "with _info.json, a .tar pattern or pipe:), or --demo for the "
                         "built-in data, or --dummy for synthetic data")
    train, val = root / "train", root / "val"
    for part in (train, val) if need_val else (train,):
        if not part.is_dir():
            raise UsageError(f"'{part}' is missing: the data folder must hold train/<class>/*.jpg "
                             "and val/<class>/*.jpg (see python -m imagenet.tools.prepare for "
                             "the ILSVRC archives)")
    return train, val


class IndexedFolder(datasets.ImageFolder):
    """An ImageFolder whose scan is a ``Listing`` (``data.index``: read from the folder index,
    or listed): the same classes, samples, order and errors as torchvision's own scan."""

    def __init__(self, root: str, listing: index.Listing, **kwargs: Any) -> None:
        self.listing = listing
        super().__init__(root, **kwargs)
        self.listed = listing.how  # "index", "updated" or "listed" (see data.index)
        del self.listing  # the samples hold what the dataset needs

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        if not self.listing.classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
        return list(self.listing.classes), {c: i for i, c in enumerate(self.listing.classes)}

    def make_dataset(self, directory: str, class_to_idx: dict[str, int],  # type: ignore[override]
                     extensions: Any = None, is_valid_file: Any = None,
                     allow_empty: bool = False) -> list[tuple[str, int]]:
        return self.listing.samples(class_to_idx, allow_empty)


def listed(folder: Path, files: index.IndexFiles | None, what: str = "") -> index.Listing:
    """``folder``'s listing through its index (``data.index``); a folder that cannot be listed
    is a DataError that names it."""
    try:
        listing = index.folder_listing(folder, files)
    except OSError as exc:
        raise DataError(f"{what}{folder}: cannot list it ({exc.strerror or exc})") from None
    line = index.describe(listing)
    if line:
        log.info("%s", line)
    return listing


def image_folder(folder: Path, transform, backend: str, loader: Callable | None = None,
                 files: index.IndexFiles | None = None) -> IndexedFolder:
    """An ImageFolder whose errors name the folder instead of a traceback; ``loader`` reads a
    file (default: decodes it with ``backend``); ``files``: where its folder index is kept."""
    try:
        return IndexedFolder(str(folder), listed(folder, files), transform=transform,
                             loader=loader or partial(T.load_image, backend=backend))
    except FileNotFoundError as exc:
        raise DataError(f"{folder}: {exc} (every class folder needs at least one image)"
                        ) from None


class ClassMappedFolder(IndexedFolder):
    """An ImageFolder labelled with the indices of another class list (the training data's or
    a checkpoint's), matched by folder name: any order, any subset; an unknown folder is an
    error that names it."""

    def __init__(self, root: str, classes: Sequence[str], listing: index.Listing,
                 **kwargs: Any) -> None:
        self.label_of = {name: i for i, name in enumerate(classes)}
        super().__init__(root, listing, **kwargs)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        found, _ = super().find_classes(directory)
        unknown = [c for c in found if c not in self.label_of]
        if unknown:
            known = ", ".join(list(self.label_of)[:5])
            raise DataError(f"{directory}: class folder(s) {', '.join(unknown[:5])}"
                            f"{' and more' if len(unknown) > 5 else ''} are not among the "
                            f"model's {len(self.label_of)} classes ({known}, ...); rename or "
                            "remove them")
        return found, {c: self.label_of[c] for c in found}


def other_val_folder(folder: Path, classes: Sequence[str], transform: Callable,
                     backend: str, loader: Callable | None = None,
                     files: index.IndexFiles | None = None) -> ClassMappedFolder:
    """--val-data FOLDER: validation images labelled by ``classes`` (matched by name)."""
    if not folder.is_dir():
        raise UsageError(f"--val-data {folder}: no such folder; give an ImageFolder (one "
                         "sub-folder of images per class)")
    try:
        val = ClassMappedFolder(str(folder), classes, listed(folder, files, "--val-data "),
                                transform=transform,
                                loader=loader or partial(T.load_image, backend=backend))
    except FileNotFoundError as exc:
        raise DataError(f"--val-data {folder}: {exc} (every class folder needs at least one "
                        "image)") from None
    absent = [c for c in classes if c not in val.class_to_idx]
    log.info("=> validation images from %s: %d images of %d of the %d classes%s", folder,
             len(val), len(val.classes), len(classes),
             f" (none of {', '.join(absent[:5])}{', ...' if len(absent) > 5 else ''})"
             if absent else "")
    return val


def class_counts(dataset: Dataset, num_classes: int) -> list[int] | None:
    """Images per class of a dataset that lists its labels (``targets``), else None."""
    targets = getattr(dataset, "targets", None)
    if targets is None:
        return None
    return torch.bincount(torch.as_tensor(targets, dtype=torch.long),
                          minlength=num_classes).tolist()


def check_same_classes(train: Sequence[str], val: Sequence[str], root: Path) -> None:
    """Validation must use the training label set, in the same order."""
    if list(train) != list(val):
        only_train = sorted(set(train) - set(val))[:5]
        only_val = sorted(set(val) - set(train))[:5]
        raise DataError(f"{root}: val/ classes differ from train/ classes (only in train: "
                        f"{only_train or 'none'}; only in val: {only_val or 'none'}); labels "
                        "would be wrong")


def build_transforms(cfg: Config, crops: CropSchedule) -> tuple[Callable, Callable]:
    """Per-sample training augmentation (at each epoch's crop size) and validation transform,
    from the flags."""
    train_tf = sized_by_epoch(crops, partial(
        T.train_transform, interpolation=cfg.interpolation, auto_augment=cfg.auto_augment,
        ra_magnitude=cfg.ra_magnitude, augmix_severity=cfg.augmix_severity,
        random_erase=cfg.random_erase, backend=image_backend(cfg), min_scale=cfg.train_crop_scale))
    val_tf = T.val_transform(cfg.val_resize_size, cfg.val_crop_size, cfg.interpolation,
                             backend=image_backend(cfg))
    return train_tf, val_tf


def build_datasets(cfg: Config, crops: CropSchedule, data_root: Path, encoded: bool = False,
                   files: index.IndexFiles | None = None
                   ) -> tuple[Dataset, Dataset, list[str]]:
    """Train and validation datasets producing uint8 CHW images and integer labels (with
    ``encoded``: JPEG bytes and crop boxes, decoded on the device; see data.device);
    ``files``: where the folder indexes are kept."""
    if cfg.dummy:
        train = DummyDataset(cfg.dummy_size, cfg.dummy_classes,
                             max(crops.sizes(cfg.epochs)) if crops.progressive else crops.end)
        if crops.progressive:
            train.transform = sized_by_epoch(crops, CornerCrop)
        val = DummyDataset(cfg.dummy_val_size, cfg.dummy_classes, cfg.val_crop_size)
        return train, val, train.classes
    train_dir, val_dir = check_folder(data_root, need_val=cfg.val_data is None)
    if encoded:
        import imagenet.data.device as device_decoding  # --decode-on-device only

        train_tf, val_tf = device_decoding.item_transforms(cfg, crops)
        loader = device_decoding.read_encoded
    else:
        (train_tf, val_tf), loader = build_transforms(cfg, crops), None
    train = image_folder(train_dir, train_tf, image_backend(cfg), loader, files)
    if cfg.val_data is not None:
        val = other_val_folder(Path(cfg.val_data), train.classes, val_tf, image_backend(cfg),
                               loader, files)
    else:
        val = image_folder(val_dir, val_tf, image_backend(cfg), loader, files)
        check_same_classes(train.classes, val.classes, data_root)
    return train, val, train.classes


def check_one_batch(per_process: int, batch_size: int, world_size: int) -> None:
    """An epoch must hold at least one training batch of two or more images per process."""
    if per_process < min(2, batch_size):
        raise UsageError(f"the training set gives each of the {world_size} process(es) "
                         f"{per_process} image(s) per epoch: not one batch BatchNorm can train on "
                         "(it needs 2 images); add training images or use fewer processes")


def stop_workers(loader: DataLoader) -> None:
    """Stop ``loader``'s persistent workers now (torch has no public call for it); the next
    ``iter(loader)`` starts new ones, with the dataset as it is then."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None


def shutdown_workers(*loaders: DataLoader) -> None:
    """Stop the persistent workers of ``loaders`` now, then any loader worker of this process
    that no loader holds."""
    for loader in loaders:
        stop_workers(loader)
    kill_stray_workers()


_kill_at_exit: multiprocessing.util.Finalize | None = None


def kill_workers_at_exit() -> None:
    """Have multiprocessing's exit handler kill this process's loader workers before it
    terminates and joins them (``kill_stray_workers``). A finalizer of its own, not atexit: in
    an mp.spawn child that handler runs when the child's function returns, before atexit."""
    global _kill_at_exit
    if _kill_at_exit is None:
        _kill_at_exit = multiprocessing.util.Finalize(None, kill_stray_workers, exitpriority=100)


def kill_stray_workers() -> None:
    """Kill this process's DataLoader workers that are still alive (its daemonic children: a
    training process starts no others).

    They ignore SIGTERM (``loader_options``), so multiprocessing's exit handler, which
    terminates its daemonic children and then joins them, would wait for them forever. Called
    when the loaders are shut down, and at exit for any path that never got there: a loader
    whose first batches failed while its iterator was being built (a truncated validation
    shard: the process printed its error and never exited), or a rank interrupted before its
    loaders were shut down (a late SIGINT when mp.spawn's parent died as training ended).
    """
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join()


def build_data(plan: Plan, data_root: str | Path, rank: int, aug_seed: int,
               pin_memory: bool, files: index.IndexFiles | None = None) -> Data:
    """Loaders for this rank: resumable shuffled training shard, unpadded validation shard
    (JPEGs decoded where the plan says); ``files``: where the folder indexes are kept."""
    cfg, on_device = plan.cfg, plan.decode.on_device
    train, val, classes = build_datasets(cfg, plan.crops, Path(data_root), on_device, files)
    finish = None
    if on_device:
        import imagenet.data.device as device_decoding  # --decode-on-device only

        finish = device_decoding.device_crops(cfg)
    folder_train, val_loader = folder_loaders(cfg, train, val, rank, plan.layout, aug_seed,
                                              pin_memory, finish)
    return Data(folder_train, val_loader, len(classes), list(classes), len(val),
                train_finish=finish and finish[0], val_finish=finish and finish[1],
                train_counts=class_counts(train, len(classes)), listed=how_listed(train, val))


def how_listed(*datasets: Dataset) -> str:
    """How the ImageFolders among ``datasets`` were read, in a few words ("" for none)."""
    found = [getattr(d, "listed", None) for d in datasets]
    found = [how for how in found if how is not None]
    if not found:
        return ""
    if all(how == "index" for how in found):
        return "from the folder index"
    if any(how == "listed" for how in found):
        return "listed every folder"
    return "folder index, changed folders listed again"


def folder_loaders(cfg: Config, train: Dataset, val: Dataset, rank: int, layout: Layout,
                   aug_seed: int, pin_memory: bool, finish: tuple | None = None
                   ) -> tuple[FolderTrain, DataLoader]:
    """This rank's loaders of map-style datasets: the resumable training shard and the
    unpadded validation shard; ``finish`` (--decode-on-device): what finishes the training and
    validation batches on the device."""
    batch_size, workers, world_size = layout.batch_size, layout.workers, layout.world_size
    sampler = ResumableDistributedSampler(len(train), rank, world_size,  # type: ignore[arg-type]
                                          seed=cfg.seed or 0, reps=cfg.ra_reps)
    if not cfg.evaluate:  # -e reads no training batch
        check_one_batch(sampler.num_samples, batch_size, world_size)
    if cfg.ra_reps > 1 and rank == 0:
        log.info("=> repeated augmentation: each epoch trains %d images x %d differently "
                 "augmented copies (one pass: %d samples)", -(-len(train) // cfg.ra_reps),
                 cfg.ra_reps, len(train))
    extra = loader_options(workers)
    if finish is not None:  # encoded bytes: nvJPEG reads them from pageable memory itself
        from imagenet.data.device import collate

        extra, pin_memory = {**extra, "collate_fn": collate}, False
    # A private generator: creating loader iterators must not consume the global RNG, which the
    # training step uses (MixUp/CutMix, dropout) and the checkpoint restores.
    seeded = SeededDataset(train, aug_seed)
    train_loader = StopSafeLoader(seeded,
                                  batch_sampler=NoSingleImageBatches(sampler, batch_size),
                                  num_workers=workers, pin_memory=pin_memory,
                                  generator=torch.Generator().manual_seed(aug_seed), **extra)
    val_loader = StopSafeLoader(val, batch_size=batch_size,
                                sampler=ShardSampler(len(val), rank, world_size),  # type: ignore
                                num_workers=workers, pin_memory=pin_memory,
                                generator=torch.Generator().manual_seed(aug_seed), **extra)
    return FolderTrain(train_loader, sampler, seeded, finish and finish[0]), val_loader
