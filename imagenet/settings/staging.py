"""Where an object-storage --output-dir, --resume or --predictions is on this node: the plan
replaces each URL by a local path once (``stage``), and every later stage reads those paths;
``checkpoint.storage.Remote`` mirrors them to the URLs.

Every process computes the same paths. They lie in a folder of this user's own,
``$TMPDIR/imagenet-trainer-<uid>`` (0700): ``stage`` makes it, or refuses one that another user
owns or could write into (a shared folder let one user's run fail every other user's and
take files another user had left, its folder index included, for its own).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from imagenet.errors import UsageError
from imagenet.settings.flags import Config
from imagenet.settings.sources import is_url


@dataclass(frozen=True)
class Staging:
    """The URLs of a run and their local stand-ins."""

    output_url: str | None
    staging: Path | None  # the local folder that stands for output_url
    resume_url: str | None = None
    resume_local: Path | None = None
    uploads: dict[str, Path] = field(default_factory=dict)  # URL -> local file, outside staging


def staging_root() -> Path:
    """This user's folder of staging folders on this node."""
    return Path(tempfile.gettempdir()) / f"imagenet-trainer-{os.geteuid()}"


def staging_dir(url: str, evaluate: bool = False) -> Path:
    """The local folder that stands for ``url`` on this node (the same on every rank);
    ``evaluate``: -e's own, apart from a training run's."""
    digest = hashlib.sha1(url.encode()).hexdigest()[:12]
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", url.rstrip("/").rsplit("/", 1)[-1])[:40]
    return staging_root() / f"{tail}-{digest}{'-eval' if evaluate else ''}"


def make_private(root: Path, flag: str) -> None:
    """Make ``root`` (0700), or check that the one there is this user's and that no one else can
    write into it; UsageError naming ``flag`` (the URL that needs it) otherwise."""
    try:
        root.mkdir(mode=0o700)
        root.chmod(0o700)  # whatever the umask
        return
    except FileExistsError:
        pass
    except OSError as exc:
        raise UsageError(f"{flag}: cannot create the staging folder {root} ({exc.strerror}); "
                         "set TMPDIR to a folder you can write") from None
    st = root.lstat()
    if not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder (a link or a file)"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to user {st.st_uid}"
    elif st.st_mode & 0o022:
        problem = "is writable by others"
    else:
        root.chmod(0o700)  # this user's own: readable by this user alone, too
        return
    raise UsageError(f"{flag}: the staging folder {root} {problem}, so files someone else put "
                     f"there could be taken for this run's; set TMPDIR to a folder of your "
                     f"own, or have {root} removed")


def stage(cfg: Config) -> tuple[Config, Staging | None]:
    """``cfg`` with a URL --output-dir / --resume / --predictions replaced by local paths, and
    the URLs they stand for (None: no URL)."""
    output_url = cfg.output_dir.rstrip("/") if is_url(cfg.output_dir) else None
    resume_url = cfg.resume if is_url(cfg.resume) else None
    predictions_url = cfg.predictions if is_url(cfg.predictions) else None
    if output_url is None and resume_url is None and predictions_url is None:
        return cfg, None
    if output_url and cfg.sharded_checkpoint:
        raise UsageError(f"--sharded-checkpoint: every rank writes its shards into "
                         f"--output-dir, which {output_url} cannot collect; give a shared "
                         "filesystem path, or drop --sharded-checkpoint")
    make_private(staging_root(), f"--output-dir {output_url}" if output_url else
                 f"--resume {resume_url}" if resume_url else f"--predictions {predictions_url}")
    staging = staging_dir(output_url, cfg.evaluate) if output_url else None
    changes: dict[str, str] = {}
    if staging is not None:
        changes["output_dir"] = str(staging)
    resume_local = None
    if resume_url:
        resume_local = local_path(resume_url, output_url, staging, cfg.evaluate)
        changes["resume"] = str(resume_local)
    uploads = {}
    if predictions_url:
        local = local_path(predictions_url, output_url, staging, cfg.evaluate)
        changes["predictions"] = str(local)
        if staging is None or not local.is_relative_to(staging):
            uploads[predictions_url] = local  # not part of OUTPUT_DIR's folder: on its own
    return replace(cfg, **changes), Staging(output_url, staging, resume_url, resume_local,
                                            uploads)


def local_path(url: str, output_url: str | None, staging: Path | None, evaluate: bool) -> Path:
    """Where the file at ``url`` is on this node: in the staging folder when it is inside the
    --output-dir URL, else in a folder of its own."""
    if staging is not None and output_url is not None and url.startswith(output_url + "/"):
        return staging / url[len(output_url) + 1:]
    return staging_dir(url, evaluate) / url.rstrip("/").rsplit("/", 1)[-1]
