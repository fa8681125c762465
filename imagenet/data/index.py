"""The folder index: what ImageFolder's scan finds (the class folders and their image files) kept
in a file, so that a later start - a requeued job, another rank, ``-e`` - reads it instead of
listing every folder of the data set again.

**How a change is noticed.** The index records, for every folder it listed (the root, each class
folder and any folder below one), the folder's inode, modification time and change time
(``os.stat``, nanoseconds). Adding, removing or renaming an entry in a folder changes that
folder's modification and change times; a tool that restores the modification time (``rsync
-t``, ``cp -p``, ``tar x``) still moves the change time, which no call can set back; a folder
replaced by another copy has another inode. A start therefore stats each recorded folder (one
``stat`` per folder, several at once: ImageNet's 1,001, against listing its 1.28 M files; about
0.1 s on a local disk for 200,000 files in 1,000 folders) and lists again only
the folders whose record differs, reading the rest from the index; the index is then rewritten.
Folders whose times were within ``SETTLE_NS`` of the moment they were listed are never taken
from the index (a file system with one-second or two-second timestamps could hide a file added
right after the listing).

**What it cannot notice.** A file whose contents change in place under the same name (that
changes no folder; the index holds names, not contents, so its listing is still right), and a
file system that does not keep folder times (some object-store mounts such as s3fs or gcsfuse
fake them): give ``--cache-dir none`` there.

**Damage.** The file is gzip (its CRC covers every byte) holding JSON that is checked before
use: a truncated, damaged or foreign file is never used; the folder is listed again and one line
says so. So is one with an entry that no folder can hold (a name with a '/' or a NUL, '.', '..'
or empty): planted in the cache folder, it would lead the trainer to files outside the data
folder. Writes go to a temporary file renamed into place: readers never see half an index.

The index is named after the folder's absolute path and the root folder's inode: node-local
copies of a data set (another inode on each node) get one index each.

Every validation image of this rank's share readable, checked before training.

The check opens each file (``transforms.check_image_file``: its first and last bytes), which on
a network file system is a round trip per file: ``THREADS`` threads keep several in flight. A
run's start begins it in the background as soon as the data set is listed
(``ImageCheck.start``), so that it runs while the model is built and the checkpoint loads; the
preflight waits for its answer. The answer is the first bad image in the shard's order, as a
check one file after the other would give.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchvision.datasets import DatasetFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

from imagenet.data.transforms import check_image_file
from imagenet.errors import DataError
from imagenet.launching import watchdog

log = logging.getLogger(__name__)

FORMAT, VERSION = "imagenet-trainer folder index", 1
SETTLE_NS = 2_000_000_000  # a folder changed this recently when listed is listed again next time
SUBFOLDER = "folder-index"
STAT_THREADS = 16  # folders stat'ed at once when an index is checked

# A folder's record: [identity (inode, mtime_ns, ctime_ns) or None when unsettled, its
# sub-folders, its image files], both sorted.
Record = list


@dataclass(frozen=True)
class IndexFiles:
    """Where folder indexes are kept (``folder`` None: nowhere, every start lists the folders)
    and whether this process writes the ones it builds."""

    folder: Path | None
    write: bool = True


@dataclass
class Listing:
    """One ImageFolder root as its scan sees it, and how it was obtained."""

    root: str
    classes: list[str]
    # per class (in ``classes`` order): its folders, each (path, image file names), in
    # ImageFolder's order (sorted paths, sorted names)
    folders: list[list[tuple[str, list[str]]]]
    how: str = "listed"  # "listed": no index; "index": read; "updated": re-listed in part
    # folders listed again because they changed since the index was written, and new ones
    # (relative paths; "" is the root)
    changed: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    why: str = ""  # why an index could not be used ("" when there was none or it was used)

    @property
    def images(self) -> int:
        return sum(len(names) for folders in self.folders for _, names in folders)

    def samples(self, class_to_idx: Mapping[str, int], allow_empty: bool = False
                ) -> list[tuple[str, int]]:
        """torchvision's ``make_dataset``: (path, label) for each image, classes in name order;
        the same FileNotFoundError for a class without images."""
        position = {name: i for i, name in enumerate(self.classes)}
        out: list[tuple[str, int]] = []
        empty = []
        for name in sorted(class_to_idx):
            label, before = class_to_idx[name], len(out)
            for path, names in self.folders[position[name]]:
                prefix = path if path.endswith(os.sep) else path + os.sep
                out.extend((prefix + n, label) for n in names)
            if len(out) == before:
                empty.append(name)
        if empty and not allow_empty:
            raise FileNotFoundError(f"Found no valid file for the classes "
                                    f"{', '.join(sorted(empty))}. Supported extensions are: "
                                    f"{', '.join(IMG_EXTENSIONS)}")
        return out


def identity(path: str) -> list[int]:
    """What tells a changed folder: inode, modification and change times (ns)."""
    st = os.stat(path)
    return [st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def list_folder(path: str, files: bool = True) -> Record:
    """One folder's record, its identity taken before its entries are listed (an entry added
    meanwhile changes the folder after that, so the next start notices it)."""
    listed_at = time.time_ns()
    ident = identity(path)
    dirs, images = [], []
    with os.scandir(path) as entries:
        for entry in entries:
            try:
                is_dir = entry.is_dir()  # follows symbolic links, as os.walk does
            except OSError:
                is_dir = False
            if is_dir:
                dirs.append(entry.name)
            elif files and has_file_allowed_extension(entry.name, IMG_EXTENSIONS):
                images.append(entry.name)
    settled = max(ident[1], ident[2]) < listed_at - SETTLE_NS
    return [ident if settled else None, sorted(dirs), sorted(images)]


def identities(root: str, old: Mapping[str, Record]) -> dict[str, list[int] | None]:
    """The identity of every folder ``old`` records (None: gone), taken ``STAT_THREADS`` at a
    time: on a network file system each stat is a round trip, and they overlap."""
    def one(rel: str) -> list[int] | None:
        try:
            return identity(os.path.join(root, rel) if rel else root)
        except OSError:
            return None

    settled = [rel for rel, record in old.items() if record[0] is not None]
    if len(settled) < 2 * STAT_THREADS:
        return {rel: one(rel) for rel in settled}
    with ThreadPoolExecutor(STAT_THREADS, thread_name_prefix="folder-index") as pool:
        return dict(zip(settled, pool.map(one, settled, chunksize=64)))


@dataclass
class Walked:
    """What ``walk`` found: every folder's record, and which ones it listed and why."""

    records: dict[str, Record] = field(default_factory=dict)
    changed: list[str] = field(default_factory=list)  # its record no longer holds
    new: list[str] = field(default_factory=list)  # no record
    unsettled: list[str] = field(default_factory=list)  # recorded as too recent to trust

    @property
    def listed(self) -> int:
        return len(self.changed) + len(self.new) + len(self.unsettled)


def walk(root: str, old: Mapping[str, Record]) -> Walked:
    """Every folder's record under ``root`` (relative path -> record), ``old`` records kept
    where the folder is unchanged, the others listed. The root must be listable; a folder
    below it that cannot be listed is left out, as os.walk leaves it out."""
    found = Walked()
    now = identities(root, old)
    stack = [""]
    while stack:
        rel = stack.pop()
        path = os.path.join(root, rel) if rel else root
        record = old.get(rel)
        if record is None or record[0] is None or now.get(rel) != record[0]:
            why = found.new if record is None else \
                found.unsettled if record[0] is None else found.changed
            try:
                record = list_folder(path, files=bool(rel))  # the root's files are not images
            except OSError:
                if not rel:
                    raise
                continue
            why.append(rel)
        found.records[rel] = record
        stack.extend(os.path.join(rel, name) if rel else name for name in record[1])
    return found


def listing_of(root: str, records: Mapping[str, Record]) -> Listing:
    """The classes and their folders in ImageFolder's order, from the records."""
    classes = records[""][1]
    folders: list[list[tuple[str, list[str]]]] = []
    for name in classes:
        found, stack = [], [name]
        while stack:
            rel = stack.pop()
            if rel in records:
                found.append((os.path.join(root, rel), records[rel][2]))
                stack.extend(os.path.join(rel, sub) for sub in records[rel][1])
        folders.append(sorted(found, key=lambda item: item[0]))
    return Listing(root, list(classes), folders)


def index_path(place: Path, root: str) -> Path:
    """The index file of ``root``: named after its absolute path and the root's inode."""
    absolute = os.path.abspath(root)
    key = f"{absolute}\0{os.stat(root).st_ino}"
    digest = hashlib.sha1(key.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    name = os.path.basename(absolute.rstrip(os.sep)) or "root"
    return place / SUBFOLDER / f"{name}-{digest}.json.gz"


class Damaged(Exception):
    """An index file that must not be used; the message says why."""


def read_index(path: Path, root: str) -> dict[str, Record]:
    """The records of a valid index of ``root``; Damaged otherwise (FileNotFoundError: none)."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            payload = json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, EOFError, zlib.error, ValueError, UnicodeDecodeError) as exc:
        raise Damaged(f"unreadable: {type(exc).__name__}: {exc}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise Damaged("not a folder index")
    if payload.get("version") != VERSION:
        raise Damaged(f"made by another version of the trainer (format {payload.get('version')})")
    if payload.get("root") != os.path.abspath(root) or \
            payload.get("extensions") != list(IMG_EXTENSIONS):
        raise Damaged("made for another folder or other image extensions")
    records = payload.get("folders")
    if not isinstance(records, dict) or not _well_formed(records):
        raise Damaged("its folder records are malformed")
    stray = _stray_name(records)
    if stray is not None:
        raise Damaged(f"it lists {stray!r}, which no folder holds (a path, '.', '..', an empty "
                      "name or a NUL)")
    return records


def _well_formed(records: dict[str, Any]) -> bool:
    """Every record is [identity or None, [names], [names]] and the root has one."""
    def names(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(n, str) for n in value)

    for record in records.values():
        if not (isinstance(record, list) and len(record) == 3 and names(record[1])
                and names(record[2])):
            return False
        ident = record[0]
        if ident is not None and not (isinstance(ident, list) and len(ident) == 3
                                      and all(isinstance(v, int) for v in ident)):
            return False
    return "" in records


def _is_entry(name: str) -> bool:
    """Whether a folder can hold an entry called ``name`` (os.scandir never lists '.', '..')."""
    return name not in ("", ".", "..") and "/" not in name and os.sep not in name \
        and "\0" not in name


def _stray_name(records: dict[str, Record]) -> str | None:
    """The first folder path or entry in ``records`` that is not made of folder entries (it
    would point outside the folder, or twice into it); None when there is none."""
    for rel, record in records.items():
        if rel and not all(_is_entry(part) for part in rel.split(os.sep)):
            return rel
        for name in (*record[1], *record[2]):
            if not _is_entry(name):
                return name
    return None


def write_index(path: Path, root: str, records: Mapping[str, Record]) -> None:
    """Write the index atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, "root": os.path.abspath(root),
               "extensions": list(IMG_EXTENSIONS), "written": time.time(), "folders": records}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=1) as f:
            json.dump(payload, f, separators=(",", ":"))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def folder_listing(folder: str | Path, files: IndexFiles | None = None) -> Listing:
    """``folder``'s listing: from its index when unchanged (folders that changed listed again),
    else listed whole; the index is (re)written when this process writes. Raises what listing
    the folder raises (FileNotFoundError, PermissionError)."""
    root = os.path.expanduser(str(folder))
    if files is None or files.folder is None:
        return listing_of(root, walk(root, {}).records)
    path = index_path(files.folder, root)
    old: dict[str, Record] = {}
    why = ""
    try:
        old = read_index(path, root)
    except FileNotFoundError:
        pass
    except Damaged as exc:
        why = f"the index {path} is damaged or foreign ({exc})"
    found = walk(root, old)
    listing = listing_of(root, found.records)
    listing.why = why
    listing.how = "listed" if not old else "updated" if found.listed else "index"
    listing.changed, listing.new = (found.changed, found.new) if old else ([], [])
    if found.listed and files.write:
        try:
            write_index(path, root, found.records)
        except OSError as exc:
            log.warning("=> cannot write the folder index %s (%s): the next start lists %s "
                        "again", path, exc.strerror or exc, root)
    return listing


def describe(listing: Listing) -> str | None:
    """The start-up line for an index that could not be used as it was (None: nothing to say)."""
    if listing.why:
        return f"=> {listing.why}: listed {listing.root} again"
    changed = listing.changed + listing.new
    if not changed:  # unchanged, or only folders too recent to trust then: no news
        return None
    shown = ", ".join(rel or "." for rel in changed[:3])
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    return (f"=> the folder index of {listing.root} is out of date ({len(changed)} folder(s) "
            f"changed or added since it was written: {shown}{more}): listed them again, the "
            "rest from the index")


# ------------------------------------- every validation image readable, checked before training

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
