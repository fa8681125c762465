"""Checkpoint files: atomic writes, safe loads, strict model loading, which file a resume uses.

Every checkpoint carries a checksum of its own contents (``CHECKSUM``: a SHA-256 of every tensor's
bytes, shapes and dtypes and of every other value, in order), computed when it is written and
checked when it is loaded: a flipped bit or a truncated copy is named at once, never trained on.
A file written before checksums (the classic script's, an older run's) loads as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import shutil
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

import imagenet.launching.watchdog as watchdog
from imagenet.errors import CheckpointError, UsageError, is_write_failure, write_failure
from imagenet.settings.failpoints import failpoint
from imagenet.training.models import is_sharded, without_dropped_aux

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pth.tar"
BEST = "model_best.pth.tar"
BEST_EMA = "model_best_ema.pth.tar"  # --model-ema: the EMA weights at their best top-1
# --keep-checkpoints: the best epoch checkpoints (epochs done, 3 digits or more) and their index
EPOCH_FILE, EPOCH_PATTERN = "checkpoint_epoch{:03d}.pth.tar", "checkpoint_epoch*.pth.tar"
HISTORY_INDEX = "checkpoints.json"
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP / DataParallel and torch.compile
ZIP_MAGIC, PICKLE_MAGIC = b"PK\x03\x04", b"\x80"  # torch.save's zip format; legacy / pickle
# --sharded-checkpoint: a directory per checkpoint (checkpoint.dcp/ ...) whose trainer state (no
# weights) is this file; the weights are torch.distributed.checkpoint shards next to it.
SHARDED_META = "trainer_state.pth.tar"
CHECKSUM = "checksum"  # the key of a checkpoint's own checksum ("sha256:HEX"); see the docstring


def state_digest(obj: Any) -> str:
    """"sha256:HEX" of ``obj``: every tensor's dtype, shape and bytes, every other value's repr,
    the keys and the order, as ``torch.load`` gives them back."""
    digest = hashlib.sha256()
    _feed(digest, obj)
    return f"sha256:{digest.hexdigest()}"


def _feed(digest: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().cpu().contiguous()
        digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, np.ndarray):
        digest.update(f"A{obj.dtype}{obj.shape}".encode())
        digest.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, Mapping):
        digest.update(b"{")
        for key, value in obj.items():
            _feed(digest, key)
            _feed(digest, value)
        digest.update(b"}")
    elif isinstance(obj, (list, tuple)):
        digest.update(b"(" if isinstance(obj, tuple) else b"[")
        for value in obj:
            _feed(digest, value)
        digest.update(b"]")
    else:
        digest.update(f"{type(obj).__name__}:{obj!r};".encode())


def with_checksum(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` with its checksum added (a dict checkpoint written by ``atomic_save``)."""
    content = {k: v for k, v in obj.items() if k != CHECKSUM}
    return {**content, CHECKSUM: state_digest(content)}


def check_checksum(obj: Any, path: Path, advice: str) -> None:
    """CheckpointError when ``obj`` (loaded from ``path``) does not match the checksum written
    with it; nothing to check for a file without one."""
    if not isinstance(obj, Mapping) or CHECKSUM not in obj:
        return
    content = {k: v for k, v in obj.items() if k != CHECKSUM}
    if state_digest(content) != obj[CHECKSUM]:
        raise CheckpointError(f"{path} is damaged: its contents do not match the checksum "
                              f"written with it (a flipped bit, a bad copy; a file edited by hand "
                              f"must drop its '{CHECKSUM}' entry); {advice}")


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_save(obj: Mapping[str, Any], path: Path, copies: Sequence[Path] = ()) -> None:
    """torch.save to a temp file in the same folder, fsync, then os.replace into place.

    ``copies`` (e.g. model_best) get the same bytes and are replaced *before* ``path``: a kill in
    between leaves a copy newer than ``path``, never a ``path`` whose best_acc1 has no copy.
    """
    tmp = _tmp_name(path)
    try:
        try:
            _save_and_sync(with_checksum(obj), tmp)
            for copy in copies:
                atomic_copy(tmp, copy)
            os.replace(tmp, path)
        except OSError as exc:
            if not is_write_failure(exc, path.parent):
                raise
            kept = "; the previous file is kept" if path.is_file() else ""
            raise CheckpointError(write_failure(path, path.parent, exc) + kept) from None
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


class _WriteErrors:
    """A file object for torch.save that keeps the OSError of a failed write: torch's zip
    writer reports it only as 'unexpected pos ...'."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.error = f, None

    def write(self, data: bytes) -> int:
        try:
            written = self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise
        watchdog.beat("writing a checkpoint")  # a write that goes on is progress (however slow)
        return written

    def flush(self) -> None:
        self.f.flush()


def _save_and_sync(obj: Mapping[str, Any], path: Path) -> None:
    """torch.save into ``path`` and fsync; a full disk raises its OSError (ENOSPC, EFBIG)."""
    with open(path, "wb") as f:
        recorder = _WriteErrors(f)
        failpoint("save.write")  # a fault placed where a checkpoint file is written
        try:
            torch.save(obj, recorder)
        except RuntimeError:
            if recorder.error is not None:
                raise recorder.error from None
            raise
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small text file so that ``path`` is always either old or new, never partial."""
    tmp = _tmp_name(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def atomic_copy(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` so that ``dst`` is always either old or new, never partial."""
    tmp = _tmp_name(dst)
    try:
        try:
            os.link(src, tmp)  # free; safe because files are only ever replaced, never edited
        except OSError:  # no hard links on this filesystem (or tmp left by a killed writer)
            tmp.unlink(missing_ok=True)
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(dst.parent)


def atomic_copy_dir(src: Path, dst: Path) -> None:
    """Copy checkpoint directory ``src`` to ``dst`` (hard links where the filesystem allows)
    through a temp directory and ``replace_dir``: ``dst`` is never partial."""
    tmp = _tmp_name(dst)
    shutil.rmtree(tmp, ignore_errors=True)

    def link_or_copy(a: str, b: str) -> None:
        try:
            os.link(a, b)  # free; checkpoint files are replaced, never edited
        except OSError:
            shutil.copy2(a, b)

    try:
        shutil.copytree(src, tmp, copy_function=link_or_copy)
        replace_dir(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def dcp_name(name: str) -> str:
    """The sharded checkpoint directory's name for a file name: checkpoint.pth.tar ->
    checkpoint.dcp."""
    return name.replace(".pth.tar", ".dcp")


def is_checkpoint_dir(path: Path) -> bool:
    """True for a directory written as a sharded checkpoint (its trainer state is in place;
    ``incomplete`` says whether the rest is)."""
    return (path / SHARDED_META).is_file()


def incomplete(path: Path) -> str | None:
    """What keeps sharded checkpoint directory ``path`` from loading; None when it is dcpfiles."""
    from imagenet.checkpoint import dcpfiles  # --sharded-checkpoint's directories only

    return dcpfiles.missing_part(path, SHARDED_META)


def aside(path: Path) -> Path:
    """Where ``replace_dir`` keeps the old directory ``path`` while the new one moves in."""
    return path.with_name(f".{path.name}.old")


RESUME_FIX = ("use another checkpoint (an earlier run's are in previous/), or move it away and "
              "start without --resume")


def existing_dir(path: Path, fix: str = RESUME_FIX) -> Path | None:
    """Checkpoint directory ``path`` when it is whole, else the previous one that a kill during
    ``replace_dir`` left aside, when that one is (said); None when neither is there.

    A ``path`` that is there but not whole, with no whole one aside, is a CheckpointError that
    says ``fix``: a fresh start would go on without the checkpoint the user has.
    """
    problem = incomplete(path)
    if problem is None:
        return path
    old = aside(path)
    if old.exists() and incomplete(old) is None:
        log.warning("=> %s: %s; using %s, the checkpoint it was replacing when a save was "
                    "interrupted", path, problem, old)
        return old
    if path.exists():
        raise CheckpointError(f"{path} is incomplete: {problem}; {fix}")
    return None


def replace_dir(tmp: Path, path: Path) -> None:
    """Put the finished directory ``tmp`` at ``path``. A directory cannot replace another in
    one step: the old one is renamed aside first, where ``existing_dir`` finds it after a kill
    between the two renames."""
    old = aside(path)
    if path.exists():  # else an aside left by a kill is the newest whole one: keep it for now
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def remove_stale_temp_files(folder: Path) -> None:
    """Delete temp files that a killed writer left behind."""
    for name in (CHECKPOINT, BEST, BEST_EMA, EPOCH_PATTERN, HISTORY_INDEX):
        for tmp in folder.glob(f".{name}.tmp-*"):
            tmp.unlink(missing_ok=True)
        for tmp in folder.glob(f".{dcp_name(name)}.tmp"):
            shutil.rmtree(tmp, ignore_errors=True)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint safely (weights_only) or raise CheckpointError saying why."""
    ckpt = load_file(path)
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path} is not a checkpoint (it holds a {type(ckpt).__name__}, "
                              "not a dict with 'state_dict')")
    if "state_dict" not in ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        ckpt = {"state_dict": ckpt}  # a bare state_dict, e.g. torchvision's weights files
    if "state_dict" not in ckpt:
        raise CheckpointError(f"{path} is not a checkpoint: no 'state_dict' key "
                              f"(keys: {', '.join(sorted(map(str, ckpt))[:8])})")
    return ckpt


def load_file(path: Path, advice: str = "use an older copy or start without --resume") -> Any:
    """What torch.save wrote to ``path``, loaded safely (weights_only), or CheckpointError
    saying why not (``advice``: what to do about a damaged file)."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:  # one open: the file's first bytes are read only to say why it failed
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # our error below says what is wrong
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for damaged files (EOF, zip, KeyError)
        raise _unreadable(path, exc, advice) from None
    check_checksum(ckpt, path, advice)
    return ckpt


def _unreadable(path: Path, exc: Exception, advice: str) -> CheckpointError:
    """Why torch.load could not load ``path`` (``exc``), said for the user."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as err:
        return CheckpointError(f"cannot read {path}: {err.strerror or err}")
    if not magic:
        return CheckpointError(f"{path} is empty (truncated); {advice}")
    if not magic.startswith((ZIP_MAGIC, PICKLE_MAGIC)):
        return CheckpointError(f"{path} is not a checkpoint: it was not written by torch.save "
                               f"(starts with {magic!r})")
    if isinstance(exc, pickle.UnpicklingError):
        if "weights only" in str(exc).lower():
            return CheckpointError(
                f"refusing {path}: it contains Python objects that could run code when loaded "
                f"(only tensors and plain containers are accepted; {_blocked(str(exc))})")
        return CheckpointError(f"{path} is not a checkpoint (cannot unpickle: "
                               f"{_first_line(exc)})")
    return CheckpointError(f"{path} is truncated or damaged ({_first_line(exc)}); {advice}")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].split(". ")[0][:160] if text else type(exc).__name__


def _blocked(message: str) -> str:
    """The line of torch's weights_only error that names what was refused."""
    for line in message.splitlines():
        if "GLOBAL" in line or "Unsupported" in line:
            return line.strip()[:160]
    return "unsupported pickle content"


def strip_wrapper_prefixes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove 'module.' / '_orig_mod.' so a state_dict fits the plain model."""
    cleaned = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in WRAPPER_PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix):], True
        cleaned[key] = value
    return cleaned


def load_model_state(model: torch.nn.Module, ckpt: Mapping[str, Any], path: Path,
                     arch: str) -> None:
    """Load weights strictly; name the mismatch (architecture, class count, keys)."""
    saved_arch = ckpt.get("arch")
    if saved_arch and saved_arch != arch:
        raise CheckpointError(f"{path} was saved for -a {saved_arch}, but this run uses "
                              f"-a {arch}; pass -a {saved_arch} or another checkpoint")
    state, _ = without_dropped_aux(strip_wrapper_prefixes(ckpt["state_dict"]), model)
    own = model.state_dict()
    # BatchNorm's step counter is missing from older files; torch's loader fills it in.
    missing = sorted(k for k in set(own) - set(state) if not k.endswith("num_batches_tracked"))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"{path} does not fit -a {arch}: missing keys "
                              f"{_few(missing)}; unexpected keys {_few(unexpected)}")
    for key, value in state.items():
        if own[key].shape != value.shape:
            hint = ""
            if value.ndim >= 1 and own[key].ndim >= 1 and value.shape[1:] == own[key].shape[1:]:
                hint = (f" (saved with {value.shape[0]} classes, this data set has "
                        f"{own[key].shape[0]})")
            raise CheckpointError(f"{path}: '{key}' has shape {tuple(value.shape)} but the "
                                  f"model expects {tuple(own[key].shape)}{hint}")
    if is_sharded(model):
        from imagenet.training import fsdp  # imported by --fsdp runs only

        fsdp.load_model_state(model, state)  # every rank checked it above: none fails alone
    else:
        model.load_state_dict(state, strict=True)


def _few(keys: list[str], n: int = 5) -> str:
    if not keys:
        return "none"
    more = f" and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def best_acc1_on_disk(folder: Path, name: str = BEST) -> float | None:
    """best_acc1 recorded in ``folder``/``name`` (None if absent, unreadable or damaged).

    A damaged copy's best_acc1 is not trusted: a flipped bit that raised it would keep every
    later, better epoch from replacing the file.
    """
    path = folder / name
    if path.is_dir():
        path = path / SHARDED_META
    if not path.is_file():
        return None
    try:  # mmap: the weights are read once, for the checksum, not copied into memory
        best = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        check_checksum(best, path, "the next epoch better than the checkpoint's best "
                                   "replaces it")
        return best_acc1_of(best)
    except Exception as exc:  # a damaged best copy must not stop a resume
        log.warning("ignoring %s: %s", path, str(exc).splitlines()[0] if str(exc) else exc)
        return None


def best_acc1_of(ckpt: Mapping[str, Any], key: str = "best_acc1") -> float:
    """``ckpt[key]`` as a float, 0 when absent (the classic saved best_acc1 as a tensor)."""
    value = ckpt.get(key)
    if value is None:
        return 0.0
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def own_checkpoint(output_dir: Path, sharded: bool, resuming: bool) -> Path | None:
    """OUTPUT_DIR's checkpoint: the kind this run writes (checkpoint.pth.tar, or checkpoint.dcp/
    with ``sharded``), or the other kind where only that one is there or it is newer (a run
    that turned --sharded-checkpoint on or off continues, not starts afresh). Directories only
    when ``resuming`` (a fresh run does not care whether one is whole)."""
    file, directory = output_dir / CHECKPOINT, output_dir / dcp_name(CHECKPOINT)
    if sharded:
        mine = existing_dir(directory) if resuming else None
        other = file if file.is_file() else None
    else:
        mine = file if file.is_file() else None
        other = directory if resuming and incomplete(directory) is None else None
    if other is None or (mine is not None and _written(mine) >= _written(other)):
        return mine
    log.info("=> %s is the newest checkpoint in %s (written %s --sharded-checkpoint): "
             "resuming from it", other.name, output_dir, "without" if sharded else "with")
    return other


def _written(path: Path) -> float:
    """When a checkpoint file or directory was written (its trainer state's time)."""
    return (path / SHARDED_META if path.is_dir() else path).stat().st_mtime


def resolve_resume(resume: str | None, output_dir: Path, restarted: bool,
                   sharded: bool = False) -> Path | None:
    """The checkpoint to resume from, or None for a fresh start.

    'auto' means OUTPUT_DIR/checkpoint.pth.tar if it exists (checkpoint.dcp/ with ``sharded``;
    the other kind when it is the newer: ``own_checkpoint``).
    A torchrun restart always prefers that file (it holds the progress of the attempt that
    failed) and falls back to --resume. An explicit path that does not exist is an error: a
    fresh start would overwrite the checkpoint the user meant to continue. A directory that a
    kill left aside while a save replaced it is used when the directory itself is missing or
    incomplete (``existing_dir``).
    """
    own = own_checkpoint(output_dir, sharded, restarted or resume == "auto")
    if restarted and own is not None:
        return own
    if resume == "auto" or (resume is None and restarted):
        return own
    if resume is None:
        return None
    path = Path(resume)
    found = path if path.is_file() else existing_dir(path)  # a directory: maybe aside
    if found is None:
        raise UsageError(f"--resume: no checkpoint at {path}; check the path, or use "
                         "--resume auto to continue OUTPUT_DIR/checkpoint.pth.tar when present")
    return found
