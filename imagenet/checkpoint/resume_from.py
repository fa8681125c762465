"""Which checkpoint a resume uses, the same on every rank.

Rank 0 decides (it writes the checkpoints, so it is the rank that sees them) and tells the others
which file, if any, and its identity. A rank that can read the same file loads it itself; a rank
that cannot - a node-local output folder, or a stale copy from another run - receives rank 0's.
Rank 0's errors (a damaged file, a --resume path that does not exist) are raised on every rank
with the same message. After loading, ``broadcast_weights`` makes the weights and buffers
rank 0's everywhere.

Run-defining flags: those that differ from the checkpoint's, and those every rank must share.

A resumed run is the run its command line describes. ``log_changes`` says, at start-up, where
that differs from the run that wrote the checkpoint (a changed --lr or --epochs, another layout);
``check_ranks_agree`` refuses ranks that were started with different run-defining flags.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import imagenet.errors as errors
from imagenet.checkpoint import files
from imagenet.checkpoint.rundir import CONFIG
from imagenet.errors import TrainerError, UsageError, on_every_rank
from imagenet.launching.process_group import DistInfo
from imagenet.settings.flags import Config
from imagenet.settings.launch import Layout

log = logging.getLogger(__name__)

Found = tuple[Path, dict[str, Any]]


@dataclass
class Decided:
    """The checkpoint a run continues, decided and read once, before anything is built
    (``decide``): ``path`` None is a fresh start; ``ckpt`` its entries (a --sharded-checkpoint
    directory: its trainer state; the shards are read by the resume), the same on every rank,
    held until the resume takes them (``take``). The check for a finished run, the early start
    of the loader, -e --val-data's classes and the resume all read this one copy."""

    path: Path | None = None
    ckpt: dict[str, Any] | None = None

    def take(self) -> Found | None:
        """The checkpoint for the resume to apply (None: a fresh start); this stops holding it
        (the run holds the weights from then on)."""
        if self.path is None:
            return None
        if self.ckpt is None:
            raise RuntimeError(f"{self.path} was already applied by the resume")
        found, self.ckpt = (self.path, self.ckpt), None
        return found


def decide(resume: str | None, output_dir: Path, info: DistInfo, sharded: bool = False,
           restarted: bool = False, repair: bool = False) -> Decided:
    """The checkpoint this run continues, decided once by rank 0 (``chosen``) and read once
    on every rank (``agreed_checkpoint``; ``repair``: see ``load_decided``). Collective, but
    for a fresh start (no --resume, no torchrun restart: the same on every rank)."""
    found = agreed_checkpoint(chosen(resume, output_dir, info, sharded, restarted), resume,
                              output_dir, info, restarted, repair)
    return Decided() if found is None else Decided(*found)


def chosen(resume: str | None, output_dir: Path, info: DistInfo, sharded: bool = False,
           restarted: bool = False) -> Path | None:
    """The checkpoint this run continues (None: a fresh start), chosen by rank 0
    (``files.resolve_resume``), the same on every rank. Rank 0's error (a --resume path that
    does not exist) is raised on every rank."""
    if resume is None and not restarted:
        return None
    if not info.distributed:
        return files.resolve_resume(resume, output_dir, restarted, sharded)
    decision: dict[str, Any] | None = None
    if info.is_main:
        try:
            path = files.resolve_resume(resume, output_dir, restarted, sharded)
            decision = {"path": None if path is None else str(path)}
        except TrainerError as exc:
            decision = {"error": type(exc).__name__, "message": str(exc)}
    decision = _agreed(decision)
    return None if decision["path"] is None else Path(decision["path"])


def load_decided(path: Path | None, resume: str | None, output_dir: Path,
                 restarted: bool = False, repair: bool = False) -> Found | None:
    """The decided checkpoint ``path`` loaded (a --sharded-checkpoint directory: its trainer
    state; the shards are read later). A damaged checkpoint of OUTPUT_DIR that --resume auto
    (or a torchrun restart, ``restarted``) chose falls back to the newest intact one of the
    same run (``newest_intact``), else is an error: another run's state is never continued;
    ``repair``: the damaged file is replaced by a copy of it (training runs; -e only reads)."""
    if path is None:
        return None
    try:
        return path, files.load_checkpoint(path / files.SHARDED_META if path.is_dir() else path)
    except errors.CheckpointError as exc:
        own = path.resolve().parent == output_dir.resolve()
        if not (own and (resume == "auto" or restarted)) or path.is_dir():
            raise  # a file the user named: its error is the answer
        fallback = newest_intact(output_dir, path)
        if fallback is None:
            raise errors.CheckpointError(
                f"{exc}; no intact checkpoint to fall back to in {output_dir} (this run's "
                f"{files.BEST} and --keep-checkpoints history; an earlier run's, in previous/, "
                "is continued only when named with --resume PATH)") from None
        older, ckpt = fallback
        log.warning("=> %s; resuming from %s instead, the newest intact checkpoint (epoch %s, "
                    "step %s)", exc, older, ckpt.get("epoch"), ckpt.get("global_step"))
        if repair:  # else a run with nothing left to train would end with the damaged file
            _replace_damaged(path, older)
        return fallback


def _replace_damaged(damaged: Path, intact: Path) -> None:
    """Put a copy of ``intact`` where ``damaged`` is (the next save would replace it too)."""
    try:
        files.atomic_copy(intact, damaged)
    except OSError as exc:
        log.warning("=> could not replace the damaged %s (%s); the next save will", damaged, exc)
        return
    log.warning("=> replaced the damaged %s with a copy of %s", damaged, intact)


def fallback_candidates(output_dir: Path) -> list[Path]:
    """The checkpoints --resume auto may fall back to, newest first: OUTPUT_DIR's own history
    (--keep-checkpoints) and best file (a whole checkpoint of its epoch). Never previous/: a
    fresh run moved those there, and continuing one would train on another run's weights."""
    found = {p for name in (files.BEST, files.EPOCH_PATTERN) for p in output_dir.glob(name)}
    return sorted((p for p in found if p.is_file()), key=lambda p: p.stat().st_mtime,
                  reverse=True)


def recorded_run(output_dir: Path) -> str | None:
    """The id of the run OUTPUT_DIR records (config.json's ``run_id``); None when it names none
    (written before run ids, or missing or unreadable)."""
    try:
        run_id = json.loads((output_dir / CONFIG).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return str(run_id) if run_id else None


def newest_intact(output_dir: Path, damaged: Path) -> Found | None:
    """The newest checkpoint of ``output_dir`` that loads, matches its checksum and belongs to
    the run recorded there (one naming another run's id is skipped), other than ``damaged``
    (and its hard links); None when there is none."""
    try:
        skip = damaged.stat().st_ino
    except OSError:
        skip = None
    run_id = recorded_run(output_dir)
    for candidate in fallback_candidates(output_dir):
        if skip is not None and candidate.stat().st_ino == skip:
            continue  # the damaged file under another name (a hard link)
        try:
            ckpt = files.load_checkpoint(candidate)
        except errors.CheckpointError as exc:
            log.warning("=> not falling back to %s: %s", candidate, exc)
            continue
        if run_id is not None and ckpt.get("run_id") not in (None, run_id):
            log.warning("=> not falling back to %s: another run's checkpoint (run %s; %s "
                        "records run %s)", candidate, ckpt["run_id"], CONFIG, run_id)
            continue
        return candidate, ckpt
    return None


def identity(ckpt: dict[str, Any]) -> list[Any]:
    """What tells two copies of a checkpoint apart: its position and a sum of its weights."""
    weights = sum(float(t.double().sum()) for t in (ckpt["state_dict"] or {}).values()
                  if isinstance(t, torch.Tensor) and t.is_floating_point())
    return [ckpt.get("epoch"), ckpt.get("step_in_epoch"), ckpt.get("global_step"), weights]


def agreed_checkpoint(path: Path | None, resume: str | None, output_dir: Path, info: DistInfo,
                      restarted: bool = False, repair: bool = False) -> Found | None:
    """The decided checkpoint ``path`` (``decide``) loaded on every rank (None: all start
    fresh); ``restarted``: torchrun restarted the job (its checkpoint is resumed without
    --resume); ``repair``: see ``load_decided``. Collective."""
    if not info.distributed:
        return load_decided(path, resume, output_dir, restarted, repair)
    found, decision = None, None
    if info.is_main:
        try:
            found = load_decided(path, resume, output_dir, restarted, repair)
            decision = {"path": str(found[0]) if found else None,
                        "identity": identity(found[1]) if found else None}
        except TrainerError as exc:
            decision = {"error": type(exc).__name__, "message": str(exc)}
    decision = _agreed(decision)
    if decision["path"] is None:
        if resume == "auto" or restarted:
            _note_ignored_checkpoint(output_dir, info)
        return None
    path = Path(decision["path"])
    if not info.is_main:
        found = _same_copy(path, decision["identity"], info.rank)
    needed = [None] * info.world_size
    dist.all_gather_object(needed, found is None)
    if any(needed):
        received = _broadcast(found[1] if found else None)
        found = found or (path, received)
    return found


def _agreed(decision: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's ``decision`` on every rank; its error raised on every rank."""
    decision = _broadcast(decision)
    if "error" in decision:
        error = getattr(errors, decision["error"], errors.RunError)
        raise errors.on_every_rank(error(decision["message"]))
    return decision


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _same_copy(path: Path, wanted: list[Any], rank: int) -> Found | None:
    """``path`` loaded here if it is the file rank 0 chose; None when this rank cannot read it."""
    try:
        ckpt = files.load_checkpoint(path / files.SHARDED_META if path.is_dir() else path)
    except TrainerError as exc:
        log.warning("cannot use %s on rank %d (%s): receiving rank 0's copy", path, rank, exc)
        return None
    if identity(ckpt) != wanted:
        log.warning("%s on rank %d is not the file rank 0 resumes from (another run's copy on a "
                    "node-local disk?): receiving rank 0's copy", path, rank)
        return None
    return path, ckpt


def _note_ignored_checkpoint(output_dir: Path, info: DistInfo) -> None:
    """Say so when this rank has a checkpoint that rank 0 does not resume from."""
    own = output_dir / files.CHECKPOINT
    if not info.is_main and own.is_file():
        log.warning("rank 0 starts fresh, so %s on rank %d is not used (checkpoints are read "
                    "from rank 0's --output-dir)", own, info.rank)


def broadcast_weights(*modules: nn.Module | None) -> None:
    """Every tensor of the modules' state (parameters and buffers) as rank 0 has it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for module in modules:
            if module is None:
                continue
            for tensor in module.state_dict().values():
                dist.broadcast(tensor, src=0)


# ------------------------------------- the run-defining flags that differ from the checkpoint's

# Flags that say how or where this invocation runs, not what is trained: changing them on a resume
# is routine (another node's paths and ranks, other loader workers, more or fewer logs). Every
# other flag is run-defining; the layout they produce (world size, batch) has a line of its own.
OPERATIONAL = frozenset({
    "data", "workers", "print_freq", "debug", "env_check", "output_dir", "resume", "evaluate",
    "save_every", "start_epoch", "pretrained", "weights", "compile", "channels_last",
    "world_size", "rank", "dist_url", "dist_backend", "dist_timeout", "multiprocessing_distributed",
    "nproc_per_node", "local_rank", "gpu", "no_accel", "bucket_cap_mb", "log_to", "time_limit",
    "keep_checkpoints", "cache_dir", "decoder",  # decoders give the same pixels
    "finetune", "predictions", "tta_flip",  # the start's weights; what validation reports
})


def flag_name(name: str) -> str:
    """The flag of a Config field as --help shows it: '-b/--batch-size', '--lr'."""
    names = next(f for f in dataclasses.fields(Config) if f.name == name).metadata["names"]
    short = [n for n in names if not n.startswith("--")]
    long = [n for n in names if n.startswith("--")]
    return "/".join(short[:1] + long[:1])


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return "unset" if value is None else str(value)


# Flags a resume keeps from the checkpoint whatever the command line says (state.keep_seed).
KEPT = frozenset({"seed"})


def changed_flags(saved: dict[str, Any], cfg: Config) -> Iterator[tuple[str, Any, Any]]:
    """(flag, old, new) for each run-defining flag that differs from the saved config."""
    now = cfg.to_dict()
    # With --global-batch-size on either side, -b decided nothing: the layout line shows the batch.
    by_global = now["global_batch_size"] is not None or saved.get("global_batch_size") is not None
    for name, new in now.items():
        if name in OPERATIONAL | KEPT or name not in saved or saved[name] == new:
            continue
        if name == "batch_size" and by_global:
            continue
        yield flag_name(name), saved[name], new


def log_changes(ckpt: dict[str, Any], cfg: Config, layout: Layout, steps_per_epoch: int) -> None:
    """One start-up line per changed flag (old -> new), and one if the layout changed."""
    for flag, old, new in changed_flags(ckpt.get("config") or {}, cfg):
        log.info("=> changed since the checkpoint: %s %s -> %s", flag, _show(old), _show(new))
    old = (ckpt.get("world_size"), ckpt.get("batch_size"), ckpt.get("grad_accum_steps", 1),
           ckpt.get("steps_per_epoch"))
    new = (layout.world_size, layout.batch_size, layout.grad_accum_steps, steps_per_epoch)
    if None not in old and old != new:
        log.info("=> layout changed since the checkpoint: %s -> %s", _layout(*old),
                 _layout(*new))


def _layout(world: int, batch: int, accum: int, steps: int) -> str:
    return (f"{world} process(es) x {batch} images x {accum} accumulation step(s) = "
            f"global batch {world * batch * accum}, {steps} steps per epoch")


# Flags that may differ between the ranks of one job (each node's paths, rank, device, loader
# workers). Every other flag must be the same on every rank: besides what is trained, -p and
# --save-every decide when the ranks meet in collectives.
PER_RANK = frozenset({
    "data", "workers", "output_dir", "resume", "debug", "env_check", "world_size", "rank",
    "dist_url", "dist_timeout", "multiprocessing_distributed", "nproc_per_node", "local_rank",
    "gpu", "pretrained", "weights", "config", "log_to", "finetune", "predictions", "cache_dir",
})


def shared_flags(cfg: Config) -> dict[str, Any]:
    """The flags every rank of the job must share."""
    return {k: v for k, v in cfg.to_dict().items() if k not in PER_RANK}


def check_ranks_agree(cfg: Config, world_size: int) -> None:
    """Every rank was started with the same shared flags (else one error on every rank).

    Ranks started by hand or by separate launchers on each node can differ (another --epochs on
    one node): they would train different schedules and hang when one finishes first.
    """
    if world_size == 1 or not dist.is_initialized():
        return
    own = shared_flags(cfg)
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, own)
    for rank, theirs in enumerate(every):
        differ = [name for name in own if theirs.get(name) != every[0].get(name)]
        if differ:
            name, more = differ[0], ", ".join(flag_name(n) for n in differ[1:5])
            raise on_every_rank(UsageError(
                f"rank {rank} was started with {flag_name(name)} {_show(theirs.get(name))} and "
                f"rank 0 with {flag_name(name)} {_show(every[0].get(name))}"
                f"{f' (and other {more})' if more else ''}: every rank needs the same flags"))
