"""--sharded-checkpoint: checkpoint.dcp/, a torch.distributed.checkpoint directory.

Every rank writes its own shards of the model, optimizer and EMA (nothing is gathered, so no host
needs the whole state); rank 0 adds ``trainer_state.pth.tar`` with everything else a classic
checkpoint holds, and the SHA-256 of every file DCP wrote (``dcpfiles.SHARD_SUMS``), checked
before a directory's weights are read. A directory is written under a temporary name and
swapped into place, so a kill leaves the previous one dcpfiles. It resumes at any world size
(torch reshards on load) and ``python -m imagenet.tools.unshard`` turns it into the classic
single file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel

import imagenet.training.fsdp as fsdp
from imagenet.checkpoint import dcpfiles, dcpread, files, states
from imagenet.errors import CheckpointError, on_every_rank
from imagenet.launching.process_group import barrier, gathered, raise_agreed, share

SHARDED = ("state_dict", "optimizer", "ema")  # the keys whose tensors DCP holds


def _link_copy(src: Path, dst: Path) -> None:
    """A copy of directory ``src`` at ``dst`` (hard links where possible), swapped in."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, copy_function=_link_or_copy)
    files.replace_dir(tmp, dst)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # files are never edited in place, only replaced
    except OSError:
        shutil.copy2(src, dst)


@contextlib.contextmanager
def single_process_is_meant() -> Iterator[None]:
    """Silence torch's warning that without a process group DCP reads and writes alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def write(tensors: dict[str, Any], meta: dict[str, Any], path: Path, is_main: bool,
          copies: tuple[Path, ...] = ()) -> None:
    """Collective: every rank writes its shards of ``tensors``, rank 0 ``meta``; then the
    directory (and its ``copies``) replace the old ones."""
    tmp = path.with_name(f".{path.name}.tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run
    barrier()
    with single_process_is_meant():
        dcp.save(tensors, checkpoint_id=tmp)
    rank, world_size = share()  # each rank sums its share of the files (all are written now)
    sums: dict[str, str] = {}
    for part in gathered(dcpfiles.file_sums(tmp, dcpfiles.dcp_files(tmp)[rank::world_size])):
        sums.update(part)
    if is_main:
        files.atomic_save({**meta, dcpfiles.SHARD_SUMS: sums}, tmp / files.SHARDED_META)
        for copy in copies:
            _link_copy(tmp, copy)
        files.replace_dir(tmp, path)
    barrier()


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                  ema: AveragedModel | None) -> dict[str, Any]:
    """The (sharded) model, optimizer and EMA as local shards (what DCP writes and reads)."""
    state = {"state_dict": get_model_state_dict(model),
             "optimizer": get_optimizer_state_dict(model, optimizer)}
    if ema is not None:
        state["ema"] = get_model_state_dict(ema.module)
    return state


def local_tensors(state: Any) -> Any:
    """``state`` with each DTensor replaced by this rank's shard (checks that stay local)."""
    if isinstance(state, dict):
        return {k: local_tensors(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(local_tensors(v) for v in state)
    return state.to_local() if isinstance(state, DTensor) else state


def save(model: nn.Module, optimizer: torch.optim.Optimizer, ema: AveragedModel | None,
         meta: dict[str, Any], path: Path, is_main: bool, copies: tuple[Path, ...] = ()) -> None:
    """Write the checkpoint directory at ``path`` (``meta``: the classic payload without
    weights). Collective."""
    fsdp.broadcast_buffers(model)  # DCP would keep an arbitrary rank's statistics
    if ema is not None:
        fsdp.broadcast_buffers(ema)
    write(sharded_state(model, optimizer, ema), meta, path, is_main, copies)


def save_ema_weights(ema: AveragedModel, meta: dict[str, Any], path: Path,
                     is_main: bool) -> None:
    """model_best_ema.dcp: the EMA weights as a model checkpoint directory. Collective."""
    write({"state_dict": get_model_state_dict(ema.module)}, meta, path, is_main)


def load_meta(path: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint directory (no weights)."""
    return files.load_checkpoint(path / files.SHARDED_META)


def load(model: nn.Module, optimizer: torch.optim.Optimizer, ema: AveragedModel | None,
         path: Path, arch: str, classes: list[str], with_optimizer: bool = True
         ) -> dict[str, Any]:
    """Put the directory's model, optimizer (unless ``with_optimizer`` is False) and EMA into
    these (sharded) ones, resharded to this world size; return its trainer state. ``arch`` and
    ``classes``: this run's, checked against the directory's. Collective."""
    meta = load_meta(path)
    if meta.get("arch") and meta["arch"] != arch:
        raise CheckpointError(f"{path} was saved for -a {meta['arch']}, but this run uses "
                              f"-a {arch}; pass -a {meta['arch']} or another checkpoint")
    states.check_resumable(meta, path, classes)  # the class names (no weights here)
    problem = files.incomplete(path)  # each rank sees the directory it reads its shards from
    raise_agreed(CheckpointError(f"{path} is incomplete: {problem}; {files.RESUME_FIX}")
                 if problem else None)
    bad = dcpfiles.damaged_file(path, meta.get(dcpfiles.SHARD_SUMS), *share())  # before any read
    raise_agreed(CheckpointError(f"{path} is damaged: {bad}; {files.RESUME_FIX}")
                 if bad else None)
    saved = {key.split(".")[0] for key in  # model_best_ema.dcp holds the weights only
             dcpread.read_metadata(path).state_dict_metadata}
    state = {k: v for k, v in sharded_state(model, optimizer, ema).items()
             if k in saved and (with_optimizer or k != "optimizer")}
    with single_process_is_meant():
        try:
            dcpread.load(state, path)
        except dcpread.Refused as exc:  # raised on every rank, as DCP's errors are
            raise on_every_rank(exc) from None
        except CheckpointException as exc:  # raised on every rank: damage inside a shard
            raise on_every_rank(CheckpointError(
                f"{path} is damaged ({first_failure(exc)}); {files.RESUME_FIX}")) from None
    bad = states.non_finite(local_tensors(state))
    raise_agreed(CheckpointError(f"{path} holds NaN/infinite values ({bad[0]} and maybe more): "
                                 "it was saved by a run that diverged; use an earlier "
                                 "checkpoint") if bad else None)
    set_model_state_dict(model, state["state_dict"])
    if "optimizer" in state:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    if "ema" in state:
        assert ema is not None
        set_model_state_dict(ema.module, state["ema"])
        ema.n_averaged.copy_(meta["ema"]["n_averaged"])
    return meta


def first_failure(exc: CheckpointException) -> str:
    """The lowest rank's reason in a CheckpointException, on one line."""
    if not exc.failures:
        return "no reason given"
    rank = min(exc.failures)
    error = exc.failures[rank][0]
    text = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
    return f"rank {rank}: {type(error).__name__}" + (f": {text}" if text else "")


def to_single_file(src: Path, dst: Path) -> dict[str, Any]:
    """The classic checkpoint of directory ``src`` written to ``dst``: plain keys, optimizer
    state keyed by index, as ``--fsdp`` without --sharded-checkpoint would have saved it."""
    meta = load_meta(src)
    bad = dcpfiles.damaged_file(src, meta.pop(dcpfiles.SHARD_SUMS, None))
    if bad:
        raise CheckpointError(f"{src} is damaged: {bad}; give another checkpoint directory")
    try:
        tensors = dcpread.load_everything(src)
    except (CheckpointException, RuntimeError, ValueError, EOFError) as exc:
        reason = first_failure(exc) if isinstance(exc, CheckpointException) else \
            str(exc).strip().splitlines()[0][:160]
        raise CheckpointError(f"{src} is damaged ({reason}); give another checkpoint "
                              "directory") from None
    optimizer = tensors.get("optimizer")
    if optimizer:
        names = [n for group in optimizer["param_groups"] for n in group["params"]]
        tensors["optimizer"] = fsdp.by_index(optimizer, names)
    if "ema" in tensors:
        tensors["ema"] = {"n_averaged": meta["ema"]["n_averaged"],
                          **{f"module.{k}": v for k, v in tensors["ema"].items()}}
    # Keep the classic key order: the metadata's (placeholders where the weights go).
    single = {k: tensors.get(k, v) if k in SHARDED else v for k, v in meta.items()}
    files.atomic_save(single, dst)
    return single
