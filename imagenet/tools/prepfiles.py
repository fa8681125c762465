"""What both outputs of ``prepare`` share: the output folder it owns, temporary names, progress
lines, which members are images, the val labels, and reading back its own JSON files.

Imported by ``tools.prepare`` (the command line and the ImageFolder writer) and
``tools.shardwrite`` (the shard writer); it imports neither, so imports run one way.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from imagenet.errors import UsageError

log = logging.getLogger(__name__)

OWNER_MARKER = ".imagenet-prepare"  # in OUT/<split> (shards: in OUT): this tool created it
PART_SUFFIX = ".part"
IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")


class Progress:
    """Logs counts and rate every ``every`` images."""

    def __init__(self, split: str, every: int) -> None:
        self.split, self.every = split, max(every, 1)
        self.start = time.monotonic()
        self.images = self.written = self.bytes = self.last = 0

    def add(self, images: int, written: int, nbytes: int, note: str = "") -> None:
        """Count images (``written`` of them new) and log when a step is due."""
        self.images += images
        self.written += written
        self.bytes += nbytes
        if self.images - self.last >= self.every:
            self.last = self.images
            self.log(note)

    def log(self, note: str = "") -> None:
        """One progress line."""
        secs = max(time.monotonic() - self.start, 1e-9)
        log.info("%s: %d images (%d written, %d already there)%s; %.0f images/s, %.1f MB/s",
                 self.split, self.images, self.written, self.images - self.written, note,
                 self.images / secs, self.bytes / secs / 1e6)


def is_image(name: str) -> bool:
    """Whether an archive member name is an image we keep."""
    return name.lower().endswith(IMAGE_SUFFIXES)


def val_label(labels: dict[str, str], name: str, tar_path: Path) -> str:
    """The wnid of val image ``name``, or a UsageError: labels of another release."""
    wnid = labels.get(name.rsplit(".", 1)[0])
    if wnid is None:
        raise UsageError(f"{tar_path}: no label for {name}; are the labels and the val "
                         "archive from the same release (ILSVRC2012)?")
    return wnid


def train_archive_as_val(tar_path: Path, member: str) -> UsageError:
    """The error for a val archive that holds per-class tars: the train archive, swapped."""
    return UsageError(f"{tar_path}: holds tar {member!r}; this looks like the train archive, "
                      "pass it with --train-tar and ILSVRC2012_img_val.tar with --val-tar")


def claim_folder(folder: Path) -> None:
    """Create ``folder`` with the owner marker, unless this tool made it; refuse any other."""
    if (folder / OWNER_MARKER).is_file():
        return
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise UsageError(f"{folder} exists, is not empty and was not made by this tool; "
                         "move it away or choose another --out")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / OWNER_MARKER).write_text("made by python -m imagenet.tools.prepare\n")
    except OSError as exc:
        raise UsageError(f"{folder}: cannot create the output folder ({exc.strerror})"
                         ) from None


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` through a temporary name."""
    tmp = path.with_name(path.name + PART_SUFFIX)
    tmp.write_text(text)
    os.replace(tmp, path)


def read_own_json(path: Path, fix: str) -> Any:
    """A JSON file this tool wrote earlier; a damaged one is a UsageError that says ``fix``."""
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        reason = str(exc).splitlines()[0][:120]
        raise UsageError(f"{path} is damaged ({reason}); {fix}") from None
