"""Before -e or the last validation writes anything: its folder and --predictions can be written;
and -e --val-data FOLDER, another ImageFolder labelled with the checkpoint's classes (no DIR).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import imagenet.checkpoint.rundir as rundir
from imagenet.checkpoint.resume_from import Decided
from imagenet.data.folder import Data, build_transforms, folder_loaders, other_val_folder
from imagenet.data.index import IndexFiles
from imagenet.errors import TrainerError, UsageError
from imagenet.launching.collectives import DistInfo, raise_agreed
from imagenet.settings.decoders import image_backend
from imagenet.settings.flags import Config
from imagenet.settings.plan import Plan

log = logging.getLogger(__name__)


def check_outputs(cfg: Config, info: DistInfo) -> None:
    """-e's OUTPUT_DIR (the reports go there) and --predictions can be written; rank 0
    checks, every rank raises its error. Collective."""
    error = None
    if info.is_main:
        try:
            if cfg.predictions:
                check_predictions_path(Path(cfg.predictions))
            if cfg.evaluate:
                rundir.prepare_folder(Path(cfg.output_dir))
        except TrainerError as exc:
            error = exc
    raise_agreed(error)


def check_predictions_path(path: Path) -> None:
    """--predictions FILE: a file (not a folder) in a folder that exists (made) and is writable."""
    if path.is_dir():
        raise UsageError(f"--predictions {path} is a folder; give a file name, e.g. "
                         f"{path / 'predictions.csv'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--predictions {path}: cannot create its folder "
                         f"({exc.strerror})") from None
    if not os.access(path.parent, os.W_OK):
        raise UsageError(f"--predictions {path}: its folder is not writable")


def checkpoint_classes(continues: Decided | None
                       ) -> tuple[Path, list[str] | None, list[int] | None]:
    """-e's checkpoint (``continues``, decided and read once), its class names and training
    images per class (either None when it does not record them)."""
    if continues is None or continues.path is None:
        raise UsageError("-e --val-data FOLDER evaluates a checkpoint and labels the folder's "
                         "images with its class names: give --resume PATH")
    meta = continues.ckpt or {}
    classes, counts = meta.get("classes"), meta.get("train_class_counts")
    return continues.path, list(classes) if classes else None, list(counts) if counts else None


def build_eval_data(plan: Plan, rank: int, aug_seed: int, pin_memory: bool,
                    indexes: IndexFiles | None = None, continues: Decided | None = None
                    ) -> Data:
    """-e --val-data FOLDER: that folder's images labelled with the checkpoint's classes; DIR
    is not read (nothing trains: the images stand in as the training set, which no step
    reads); ``indexes``: where its folder index is kept; ``continues``: the checkpoint -e
    evaluates (decided and read once)."""
    cfg = plan.cfg
    path, classes, counts = checkpoint_classes(continues)
    folder = Path(cfg.val_data)  # type: ignore[arg-type]
    if classes is None:
        classes = sorted(p.name for p in folder.iterdir() if p.is_dir()) \
            if folder.is_dir() else []
        log.info("=> %s names no classes: label i is the i-th class folder of %s in sorted "
                 "order, as the classic script assumes", path, folder)
    _, val_tf = build_transforms(cfg, plan.crops)
    val = other_val_folder(folder, classes, val_tf, image_backend(cfg), files=indexes)
    stand_in, val_loader = folder_loaders(cfg, val, val, rank, plan.layout, aug_seed, pin_memory)
    return Data(stand_in, val_loader, len(classes), list(classes), len(val), train_counts=counts)
