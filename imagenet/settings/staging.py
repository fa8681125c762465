"""Where an object-storage --output-dir, --resume or --predictions is on this node: the plan
replaces each URL by a local path once (``stage``), and every later stage reads those paths;
``checkpoint.storage.Remote`` mirrors them to the URLs.

Pure (no I/O): every process computes the same paths.
"""

from __future__ import annotations

import hashlib
import re
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


def staging_dir(url: str, evaluate: bool = False) -> Path:
    """The local folder that stands for ``url`` on this node (the same on every rank);
    ``evaluate``: -e's own, apart from a training run's."""
    digest = hashlib.sha1(url.encode()).hexdigest()[:12]
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", url.rstrip("/").rsplit("/", 1)[-1])[:40]
    return Path(tempfile.gettempdir()) / "imagenet-trainer" / \
        f"{tail}-{digest}{'-eval' if evaluate else ''}"


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
