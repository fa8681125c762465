"""``--output-dir`` and ``--resume`` on object storage: a local staging folder mirrored to the URL.

The trainer writes OUTPUT_DIR as on a local disk (atomic checkpoint files, metrics.jsonl,
config.json, tb/) into a staging folder on this node, under the temp dir ($TMPDIR: give it room
for two checkpoints; the start-up space check covers it). Rank 0 uploads what changed
(``objectstore.upload``: a reader never sees a partial object):

- after every checkpoint save, before any rank goes on or exits: a preempted run's last
  checkpoint is in the bucket before the job ends (at the end of an epoch, once the epoch's
  metrics.jsonl line and TensorBoard events are written: ``outputs``);
- once more when the run ends, however it ends; then the local copies the URLs hold are
  removed (``release``): the staging folder keeps only what the upload could not send.

Best files go up before checkpoint.pth.tar, the order they are written locally: a kill in
between leaves a best file ahead of the checkpoint, which a resume adopts, never a checkpoint
whose best has no file.

At start, a run that continues the URL's run (``--resume auto`` or a torchrun restart, with a
checkpoint there; or ``--resume URL/checkpoint.pth.tar``) downloads checkpoint.pth.tar, the best
files, metrics.jsonl, config.json, trackers.json (the MLflow/W&B runs it continues), and
--keep-checkpoints' checkpoints.json with the epoch checkpoints it names. TensorBoard events stay
in the bucket: the resumed run writes a new events file whose purge marker hides what a killed
run logged after its checkpoint (TensorBoard reads a folder's files together). A fresh run in a
used URL moves the earlier run's record to URL/previous/<its start time>/, as on a disk.

``-e`` stages into a folder of its own (it never touches a training run's staging folder on the
same node), downloads the checkpoint of ``--resume auto``, and uploads what it writes: the
per-class reports, the confusion matrix's events. ``--predictions URL`` (training or ``-e``) is
written to a local file and uploaded with the rest: inside the --output-dir URL as part of its
folder, elsewhere on its own.

Object storage has no lock that dies with its holder: a second run on the same URL is not
refused. A warning says so; the lock on the staging folder covers this host only.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import imagenet.checkpoint.rundir as rundir
import imagenet.data.objectstore as objectstore
import imagenet.launching.watchdog as watchdog
from imagenet.checkpoint import files
from imagenet.errors import RunError, UsageError
from imagenet.reporting.logger import METRICS, RUN_IDS
from imagenet.settings.flags import CACHE, DEMO_DATA
from imagenet.settings.plan import Staging

log = logging.getLogger(__name__)

# What a resume of the URL's run reads (with --keep-checkpoints' epoch files, RECORD_PATTERNS).
RESUME_RECORD = (files.BEST, files.BEST_EMA, files.HISTORY_INDEX, RUN_IDS, files.CHECKPOINT,
                 METRICS, rundir.CONFIG)
# Top-level names that stay local. The default --cache-dir (folder index, compiled graphs)
# is rebuilt where it is missing: it stays on this node, kept between runs.
NOT_UPLOADED = {rundir.PREVIOUS, DEMO_DATA, CACHE}


@dataclass
class Remote:
    """The URLs of this run and their local stand-ins; rank 0 syncs them."""

    output_url: str | None
    staging: Path | None
    resume_url: str | None = None
    resume_local: Path | None = None
    uploads: dict[str, Path] = field(default_factory=dict)  # URL -> local file, outside staging
    # What the output URL holds: path inside the staging folder -> signature() when sent or
    # downloaded. A path here that the staging folder no longer has is deleted from the URL.
    sent: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    # The files of ``uploads`` when sent: URL -> signature(). Kept apart from ``sent``, where
    # such a URL was taken for a staging file the run had removed, and deleted.
    uploaded: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, staged: Staging | None) -> Remote | None:
        """What to sync for the plan's ``staged`` URLs (None: none)."""
        if staged is None:
            return None
        return cls(staged.output_url, staged.staging, staged.resume_url, staged.resume_local,
                   dict(staged.uploads))

    def attach(self, continuing: bool, training: bool) -> None:
        """Rank 0, before the resume: check the URLs, fill the staging folder (``continuing``:
        with what a resume of the URL's run reads; -e, not ``training``: its checkpoint alone),
        fetch a --resume URL."""
        if self.output_url is not None and self.staging is not None:
            fs, root = self._fs()
            check_writable(fs, root, self.output_url)
            if training:
                log.warning("--output-dir %s is object storage, which has no lock: a second run "
                            "on it would not be refused (the lock on the local staging folder "
                            "%s covers this host only); do not start two", self.output_url,
                            self.staging)
            clear_staging(self.staging)
            if training and not objectstore.whole_objects(fs):
                for tmp in fs.glob(f"{root}/.*.tmp-*"):  # left by a killed writer
                    fs.rm(tmp)
            if continuing:
                self._pull(fs, root, training)
        for url, local in self.uploads.items():
            fs, key = objectstore.filesystem(url)
            check_writable(fs, key.rsplit("/", 1)[0], url, "--predictions")
            local.unlink(missing_ok=True)  # an earlier run's on this node: not this run's
        if self.resume_url is not None and not self._pulled(self.resume_local):
            self._fetch_resume()
            rel = self._resume_key()
            if rel is not None and self.resume_local is not None:  # not uploaded back
                self.sent[rel] = signature(self.resume_local)

    def _resume_key(self) -> str | None:
        """The --resume file's path inside the staging folder (None: not there). The URL's
        copy is read, never deleted: previous/ (where the trainer points users to an earlier
        run) is not uploaded, so its file was taken for one the run had removed."""
        if self.staging is None or self.resume_local is None \
                or not self.resume_local.is_relative_to(self.staging):
            return None
        return self.resume_local.relative_to(self.staging).as_posix()

    def _pulled(self, path: Path | None) -> bool:
        """True for a file of the staging folder that ``_pull`` downloaded."""
        return (path is not None and self.staging is not None and path.parent == self.staging
                and path.name in self.sent)

    def _fs(self) -> tuple[Any, str]:
        assert self.output_url is not None
        fs, root = objectstore.filesystem(self.output_url)
        fs.invalidate_cache()  # listings cached before another run wrote
        return fs, root.rstrip("/")

    def _pull(self, fs: Any, root: str, training: bool) -> None:
        """Download what a resume of the URL's run reads (-e: the checkpoint), if that run left
        a checkpoint."""
        assert self.staging is not None
        if not fs.exists(f"{root}/{files.CHECKPOINT}"):
            return
        names = [*RESUME_RECORD, *sorted(key.rsplit("/", 1)[-1] for pattern in
                                         rundir.RECORD_PATTERNS
                                         for key in fs.glob(f"{root}/{pattern}"))] \
            if training else [files.CHECKPOINT]
        for name in names:
            if fs.exists(f"{root}/{name}"):
                local = self.staging / name
                guarded(f"download {self.output_url}/{name}",
                        lambda n=name, p=local: objectstore.download(fs, f"{root}/{n}", p))
                self.sent[name] = signature(local)
        log.info("=> downloaded the run's record from %s to %s", self.output_url, self.staging)

    def _fetch_resume(self) -> None:
        assert self.resume_url is not None and self.resume_local is not None
        fs, path = objectstore.filesystem(self.resume_url)
        if not fs.exists(path):
            raise UsageError(f"--resume: no checkpoint at {self.resume_url}; check the URL, or "
                             "use --resume auto to continue OUTPUT_DIR/checkpoint.pth.tar")
        guarded(f"download {self.resume_url}",
                lambda: objectstore.download(fs, path, self.resume_local))

    def push(self) -> None:
        """Upload the staging folder's new and changed files, best files first and
        checkpoint.pth.tar last; delete the copies of files this run has since removed. Then
        the files of ``uploads``, once written. No upload counts toward --hang-timeout (a
        checkpoint of GBs on a slow link)."""
        with watchdog.paused(f"uploading the run's files to {self.output_url or 'their URLs'}"):
            self._push_staging()
            for url, local in self.uploads.items():
                if local.is_file() and self.uploaded.get(url) != signature(local):
                    fs, key = objectstore.filesystem(url)
                    guarded(f"upload {local} to {url}",
                            lambda f=fs, p=local, k=key: objectstore.upload(f, p, k))
                    self.uploaded[url] = signature(local)

    def _push_staging(self) -> None:
        if self.output_url is None or self.staging is None or not self.staging.is_dir():
            return
        fs, root = self._fs()
        present = {p.relative_to(self.staging).as_posix(): p for p in record_files(self.staging)}
        for rel in sorted(present, key=upload_order):
            mark = signature(present[rel])
            if self.sent.get(rel) != mark:
                guarded(f"upload {rel} to {self.output_url}",
                        lambda r=rel: objectstore.upload(fs, present[r], f"{root}/{r}"))
                self.sent[rel] = mark
        for rel in sorted(set(self.sent) - set(present)):
            if rel != self._resume_key():
                guarded(f"delete {self.output_url}/{rel}", lambda r=rel: fs.rm(f"{root}/{r}"))
            del self.sent[rel]

    def release(self) -> None:
        """Rank 0, after the last push: remove the local copies the URLs now hold (the
        checkpoints, the record, the reports; a downloaded --resume file), which would otherwise
        take room in $TMPDIR until the next run on this URL. A file the push could not send
        stays, with the lock, the folder index and the demo data."""
        if self.staging is not None and self.staging.is_dir():
            for path in record_files(self.staging):
                rel = path.relative_to(self.staging).as_posix()
                if self.sent.get(rel) == signature(path):
                    path.unlink()
                    del self.sent[rel]  # the URL keeps it: no later push deletes it there
            for folder in sorted(self.staging.rglob("*"), reverse=True):  # tb/, sub/ when empty
                if folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
                    folder.rmdir()
        for url, local in self.uploads.items():
            if local.is_file() and self.uploaded.get(url) == signature(local):
                local.unlink()
                remove_if_empty(local.parent)  # the URL's own folder (plan.staging_dir)
        if self.resume_local is not None and self._resume_key() is None:
            self.resume_local.unlink(missing_ok=True)  # a download from another URL
            remove_if_empty(self.resume_local.parent)

    def move_previous_run(self) -> str | None:
        """A fresh run: the URL's earlier record to URL/previous/<its start time>/; returns
        that URL (None when there was nothing to move)."""
        if self.output_url is None:
            return None
        fs, root = self._fs()
        present = [name for name in rundir.RECORD if fs.exists(f"{root}/{name}")]
        present += sorted(key.rsplit("/", 1)[-1] for pattern in rundir.RECORD_PATTERNS
                          for key in fs.glob(f"{root}/{pattern}"))  # --keep-checkpoints'
        if not present:
            return None
        stamp = started_at(fs, f"{root}/{rundir.CONFIG}").strftime("%Y-%m-%d_%H-%M-%S")
        dest = f"{root}/{rundir.PREVIOUS}/{stamp}"
        for n in range(2, 1000):
            if not fs.exists(dest):
                break
            dest = f"{root}/{rundir.PREVIOUS}/{stamp}-{n}"
        for name in present:  # object stores: server-side copies, then deletes
            guarded(f"move {self.output_url}/{name} aside",
                    lambda m=name: move(fs, f"{root}/{m}", f"{dest}/{m}"))
        return f"{self.output_url}/{dest[len(root) + 1:]}"


def move(fs: Any, src: str, dst: str) -> None:
    """Move a file, or every file under a folder (object stores have no folders to move)."""
    objects = fs.find(src) if fs.isdir(src) else [src]
    for key in objects:
        target = dst + key[len(src):]
        objectstore.make_folder(fs, target.rsplit("/", 1)[0])  # previous/<start>/ on sftp, ...
        fs.mv(key, target)


def check_writable(fs: Any, root: str, url: str, flag: str = "--output-dir") -> None:
    """Write and delete a small object under ``root``; UsageError saying what to check."""
    probe = f"{root}/.write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        objectstore.make_folder(fs, root)  # a new folder, as a local --output-dir is made
        fs.pipe_file(probe, b"")
        fs.rm(probe)
    except Exception as exc:  # the backends raise their own types (credentials, no bucket)
        raise UsageError(f"{flag} {url}: cannot write there "
                         f"({type(exc).__name__}: {objectstore.first_line(exc)}); check the "
                         "bucket name, the credentials and the endpoint "
                         "(AWS_ENDPOINT_URL for S3-compatible stores)") from None


def clear_staging(staging: Path) -> None:
    """An empty staging folder but for its lock (held by this run), the demo data and the
    cache (built before, and no part of the record): what a previous run on this node left may
    be older than the URL's record."""
    for path in staging.iterdir():
        if path.name in (rundir.LOCK, DEMO_DATA, CACHE):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def remove_if_empty(folder: Path) -> None:
    """Remove ``folder`` where nothing is left in it (another run may be filling it)."""
    with contextlib.suppress(OSError):
        folder.rmdir()


def record_files(staging: Path) -> Iterator[Path]:
    """The staging folder's files that belong in the URL: not hidden (lock, temp files), not
    previous/ (moved on the URL itself) or the demo data."""
    for path in sorted(staging.rglob("*")):
        rel = path.relative_to(staging).parts
        if rel[0] in NOT_UPLOADED or any(part.startswith(".") for part in rel):
            continue
        if path.is_file():
            yield path


def upload_order(rel: str) -> int:
    """Best files first, checkpoint.pth.tar last (the local write order)."""
    if rel in (files.BEST, files.BEST_EMA):
        return 0
    return 2 if rel == files.CHECKPOINT else 1


def signature(path: Path) -> tuple[int, int, int]:
    """What tells a changed file: size, modification time, inode (files are replaced whole)."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def started_at(fs: Any, config_key: str) -> datetime.datetime:
    """The start time config.json records; now when it is missing or damaged."""
    try:
        return datetime.datetime.fromisoformat(json.loads(fs.cat_file(config_key))["started"])
    except Exception:  # missing, damaged or older: the move still needs a name
        return datetime.datetime.now()


def guarded(what: str, action: Callable[[], object]) -> None:
    """Run one transfer; its failure is one RunError that names it."""
    try:
        action()
    except (UsageError, RunError):
        raise
    except Exception as exc:  # the backends raise their own types
        raise RunError(f"cannot {what} ({type(exc).__name__}: "
                       f"{objectstore.first_line(exc)}); the run's files are in the local "
                       "staging folder") from None
