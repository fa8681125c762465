"""Before the first training step: claim the output folder, check that the run can finish.

Rank 0 decides what only it sees (the output folder, its lock, the disk); the ranks share the
check of the validation images; every rank then raises the same error, or none does, so no rank
starts training while another has stopped. An error found here costs seconds, not an epoch.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

import imagenet.checkpoint.disk as disk
import imagenet.checkpoint.rundir as rundir
from imagenet.checkpoint import files
from imagenet.checkpoint.resume_from import Decided
from imagenet.checkpoint.storage import Remote
from imagenet.data.samplers import shard_batches
from imagenet.data.valcheck import image_check
from imagenet.errors import DataError, RunError
from imagenet.launching.collectives import DistInfo, on_rank0, raise_agreed
from imagenet.run.build import Run
from imagenet.settings.decoders import image_backend
from imagenet.settings.flags import Config

log = logging.getLogger(__name__)

def check_before_training(run: Run, resumed: Path | None) -> None:
    """Room for the checkpoints (rank 0), every validation image or shard readable (all ranks,
    each its share); then rank 0 moves an earlier run's record aside. Collective."""
    on_rank0(run.dist, lambda: check_room(run, resumed))
    raise_agreed(first_bad_val_shard(run) or first_bad_val_image(run))
    on_rank0(run.dist, lambda: keep_history(run.output_dir, resumed, run.outputs.remote))


def continues_folder(folder: Path, resumed: Path | None) -> bool:
    """True when the run resumes a checkpoint of OUTPUT_DIR, so it continues that record."""
    return resumed is not None and resumed.resolve().parent == folder.resolve()


def keep_history(folder: Path, resumed: Path | None, remote: Remote | None = None) -> None:
    """A fresh run in a used folder: move the earlier run's record to previous/<start time>
    (on object storage too, when OUTPUT_DIR stands for a URL)."""
    if continues_folder(folder, resumed):
        return
    moved = rundir.move_previous_run(folder)
    remote_moved = remote.move_previous_run() if remote is not None else None
    for where, dest in ((folder, moved), (remote and remote.output_url, remote_moved)):
        if dest is not None:
            log.info("=> %s held an earlier run: moved its checkpoints, metrics.jsonl, "
                     "config.json and tb/ to %s (this run starts fresh; --resume auto continues "
                     "a run instead)", where, dest)


def checkpoint_bytes(run: Run) -> tuple[int, int]:
    """Estimated sizes of checkpoint.pth.tar and (with --model-ema) model_best_ema.pth.tar.

    The weights and buffers, the optimizer's per-parameter state (momentum, Adam's moments)
    and the EMA copy; the rest of a checkpoint is a few kB.
    """
    model = sum(t.numel() * t.element_size() for t in run.raw_model.state_dict().values())
    params = sum(p.numel() * p.element_size() for p in run.raw_model.parameters())
    ema = model if run.engine.parts.ema is not None else 0
    return model + params * optimizer_slots(run.engine.parts.optimizer) + ema, ema


def optimizer_slots(optimizer: torch.optim.Optimizer) -> int:
    """Tensors the optimizer keeps per parameter."""
    group = optimizer.param_groups[0]
    if isinstance(optimizer, torch.optim.SGD):
        return int(bool(group["momentum"]))
    if isinstance(optimizer, torch.optim.RMSprop):
        return 1 + int(group["momentum"] > 0) + int(bool(group["centered"]))
    return 2 + int(bool(group.get("amsgrad")))  # Adam / AdamW and, by default, others


def check_room(run: Run, resumed: Path | None) -> None:
    """Fail now when the checkpoints clearly cannot be written, not after an epoch.

    A save writes the new file before replacing the old one, so from the second save on the
    folder holds two checkpoints for a moment; a resumed checkpoint of this folder already
    holds the room of one.
    """
    size, ema = checkpoint_bytes(run)
    limit = disk.file_size_limit()
    if limit is not None and size > limit:
        raise RunError(f"a checkpoint of this run takes about {disk.human(size)}, more than the "
                       f"file size limit (ulimit -f = {disk.human(limit)}); raise the limit "
                       "(ulimit -f unlimited) and start again")
    several_saves = run.cfg.epochs - run.step.epoch > 1 or run.cfg.save_every > 0
    # --keep-checkpoints N: N more whole checkpoints once later saves replace the one they link
    need = (size + ema) * (2 if several_saves else 1) + size * run.cfg.keep_checkpoints
    own = run.output_dir / files.CHECKPOINT
    if continues_folder(run.output_dir, resumed) and own.is_file():
        need -= own.stat().st_size
    free = disk.free_bytes(run.output_dir)
    if free is not None and free < need:
        kept = f"; --keep-checkpoints {run.cfg.keep_checkpoints} keeps as many more" \
            if run.cfg.keep_checkpoints else ""
        raise RunError(f"{run.output_dir} has {disk.human(free)} free, but this run needs about "
                       f"{disk.human(need)} for its checkpoints (one is about "
                       f"{disk.human(size + ema)}, and a save writes the new file before it "
                       f"replaces the old{kept}); free some space or give another --output-dir")


def first_bad_val_shard(run: Run) -> DataError | None:
    """The first missing, truncated or miscounted validation shard of this rank's share."""
    sampler = shard_batches(run.data.val_loader)
    if sampler is None:
        return None
    from imagenet.data.shards.check import first_bad_shard

    start = time.perf_counter()
    bad = first_bad_shard(sampler.shards, run.dist.rank, run.dist.world_size)
    log.debug("checked the validation shards in %.2f s", time.perf_counter() - start)
    if bad is None:
        return None
    return DataError(f"{bad}; found by the check of the validation shards before training")


def first_bad_val_image(run: Run) -> DataError | None:
    """The first unreadable image of this rank's validation shard (the ShardSampler's): the
    answer of the check the start began (``run.val_check``), or of one made now."""
    check = run.val_check or image_check(run.data.val_loader.dataset, run.dist.rank,
                                         run.dist.world_size, image_backend(run.cfg))
    if check is None:  # --dummy, or tar shards (read whole to check)
        return None
    start = time.perf_counter()
    bad = check.result()
    log.debug("validation images checked (waited %.2f s)", time.perf_counter() - start)
    if bad is None:
        return None
    return DataError(f"{bad}; found by the check of the validation images before training: "
                     "fix or remove the file")


def nothing_left(cfg: Config, info: DistInfo, continues: Decided) -> str | None:
    """The line that ends a job whose checkpoint to resume (``continues``, decided and read
    once), one of OUTPUT_DIR (a chain's), has trained every epoch (None: there is training to
    do, or the resume decides). Rank 0 decides. Collective."""
    if cfg.evaluate or continues.path is None:  # the same on every rank
        return None
    line = _finished(cfg, continues) if info.is_main else None
    if info.distributed:
        holder = [line]
        dist.broadcast_object_list(holder, src=0)
        line = holder[0]
    return line


def _finished(cfg: Config, continues: Decided) -> str | None:
    """``nothing_left``'s answer on rank 0: never an error (the resume reports those)."""
    path, ckpt = continues.path, continues.ckpt or {}
    if path is None or path.resolve().parent != Path(cfg.output_dir).resolve():
        return None  # a checkpoint from elsewhere: the resume checks it as usual
    epoch, best = int(ckpt.get("epoch", 0)), files.best_acc1_of(ckpt)
    if epoch < cfg.epochs or ckpt.get("arch", cfg.arch) != cfg.arch:  # another -a: the resume
        return None  # refuses it with its own message
    return (f"=> nothing left to train: {path} has finished {epoch} of --epochs {cfg.epochs} "
            f"(best Acc@1 {best:.3f}); give a larger --epochs to train on")
