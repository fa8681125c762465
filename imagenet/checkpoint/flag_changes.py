"""Run-defining flags: those that differ from the checkpoint's, and those every rank must share.

A resumed run is the run its command line describes. ``log_changes`` says, at start-up, where
that differs from the run that wrote the checkpoint (a changed --lr or --epochs, another layout);
``check_ranks_agree`` refuses ranks that were started with different run-defining flags.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from imagenet.errors import UsageError, on_every_rank
from imagenet.settings.flags import Config
from imagenet.settings.launch import Layout

log = logging.getLogger(__name__)

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
