"""Object storage and other fsspec filesystems: ``s3://``, ``gs://``, ``az://`` or any fsspec URL.

Used for tar shards (``shards.streams``) and for ``--output-dir`` / ``--resume`` URLs
(``storage``). fsspec and the protocol's backend (s3fs, gcsfs, adlfs, ...) are optional: the
extra ``cloud`` installs fsspec, s3fs and gcsfs; a missing one is one line that names it.
Credentials and endpoints come from the backend's usual configuration (AWS_* variables and
``~/.aws``, ``AWS_ENDPOINT_URL`` for S3-compatible stores, GOOGLE_APPLICATION_CREDENTIALS, ...)
or from ``FSSPEC_<PROTOCOL>_<OPTION>`` variables (fsspec's own).

Uploads never leave a partial file where a reader looks: on object stores (S3, GCS, Azure) an
object becomes visible only when its upload completes - a single PUT, or the completion of a
multipart / resumable upload - so a finished local file is uploaded straight to its key and a
reader sees the old object or the new one. Other filesystems (sftp, hdfs, ``local://``, ...)
get a temporary name first and a rename; they have folders, made where a file goes, as for a
local path (``make_folder``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from imagenet.errors import UsageError
from imagenet.settings.images import SCHEME

CLOUD_EXTRA = "pip install 'imagenet-trainer[cloud]'"
HUB_EXTRA = "pip install 'imagenet-trainer[parquet]'"  # hf:// (huggingface_hub's HfFileSystem)
# Protocols whose uploads are atomic: the object appears only once it is complete.
WHOLE_OBJECT_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}
def protocol(url: str) -> str:
    """The URL's scheme, lower case: ``s3://b/x`` -> ``s3``."""
    match = SCHEME.match(url)
    return match.group(1).lower() if match else ""


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for ``url``; UsageError naming what to install."""
    try:
        import fsspec
    except ImportError:
        raise UsageError(f"{url}: reading or writing {protocol(url)}:// URLs needs fsspec and "
                         f"its backend: {CLOUD_EXTRA}") from None
    quiet_backends()
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as exc:  # fsspec names the backend package, e.g. "Install s3fs to ..."
        extra = f"{HUB_EXTRA} installs huggingface_hub" if protocol(url) == "hf" else \
            f"{CLOUD_EXTRA} installs s3fs and gcsfs"
        raise UsageError(f"{url}: {first_line(exc)} ({extra})") from None
    except ValueError as exc:  # an unknown protocol
        raise UsageError(f"{url}: {first_line(exc)}") from None


def quiet_backends() -> None:
    """The backends' INFO lines ("Found credentials in environment variables") are not the
    run's news: warnings only, unless the user configured those loggers."""
    for name in ("botocore", "aiobotocore", "s3fs", "gcsfs", "fsspec", "google", "azure"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


def whole_objects(fs: Any) -> bool:
    """True when an upload to ``fs`` becomes visible only once complete (object stores)."""
    names = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(name in WHOLE_OBJECT_PROTOCOLS for name in names)


def make_folder(fs: Any, folder: str) -> None:
    """Make ``folder`` and its parents where ``fs`` has folders (sftp, hdfs, ``local://``);
    object stores have none (and s3fs's makedirs would create a bucket)."""
    if folder and not whole_objects(fs):
        fs.makedirs(folder, exist_ok=True)


def upload(fs: Any, local: Path, key: str) -> None:
    """Put the finished file ``local`` at ``key`` so that a reader never sees part of it."""
    if whole_objects(fs):
        fs.put_file(str(local), key)
        return
    parent, name = key.rsplit("/", 1) if "/" in key else ("", key)
    make_folder(fs, parent)
    tmp = f"{parent}/.{name}.tmp-{os.getpid()}" if parent else f".{name}.tmp-{os.getpid()}"
    fs.put_file(str(local), tmp)
    fs.mv(tmp, key)


def download(fs: Any, key: str, local: Path) -> None:
    """Copy ``key`` to the local file ``local`` (a temp name, then a rename: never partial)."""
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(f".{local.name}.tmp-{os.getpid()}")
    try:
        fs.get_file(key, str(tmp))
        os.replace(tmp, local)
    finally:
        tmp.unlink(missing_ok=True)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
