"""Before the first training step: claim the output folder, check that the run can finish.

Rank 0 decides what only it sees (the output folder, its lock, the disk); the ranks share the
check of the validation images; every rank then raises the same error, or none does, so no rank
starts training while another has stopped. An error found here costs seconds, not an epoch.

What a run says about itself: the derived settings at start-up (also stored in config.json),
what -e evaluates, and where a finished run's results are. Every line goes through logging:
rank 0 prints it, other ranks drop it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import imagenet.checkpoint.rundir as rundir
from imagenet.checkpoint import files
from imagenet.checkpoint.resume_from import Decided
from imagenet.data.index import image_check
from imagenet.data.samplers import shard_batches
from imagenet.errors import DataError, RunError, file_size_limit, free_bytes, human
from imagenet.launching.process_group import DistInfo, on_rank0, raise_agreed
from imagenet.run.build import Run
from imagenet.settings.choices import tracker_names
from imagenet.settings.devices import native_bf16, slow_bf16_warning
from imagenet.settings.flags import Config
from imagenet.settings.images import image_backend

if TYPE_CHECKING:  # object-storage URLs only: built by run.trainer when the plan has them
    from imagenet.checkpoint.storage import Remote

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
    limit = file_size_limit()
    if limit is not None and size > limit:
        raise RunError(f"a checkpoint of this run takes about {human(size)}, more than the "
                       f"file size limit (ulimit -f = {human(limit)}); raise the limit "
                       "(ulimit -f unlimited) and start again")
    several_saves = run.cfg.epochs - run.step.epoch > 1 or run.cfg.save_every > 0
    # --keep-checkpoints N: N more whole checkpoints once later saves replace the one they link
    need = (size + ema) * (2 if several_saves else 1) + size * run.cfg.keep_checkpoints
    own = run.output_dir / files.CHECKPOINT
    if continues_folder(run.output_dir, resumed) and own.is_file():
        need -= own.stat().st_size
    free = free_bytes(run.output_dir)
    if free is not None and free < need:
        kept = f"; --keep-checkpoints {run.cfg.keep_checkpoints} keeps as many more" \
            if run.cfg.keep_checkpoints else ""
        raise RunError(f"{run.output_dir} has {human(free)} free, but this run needs about "
                       f"{human(need)} for its checkpoints (one is about "
                       f"{human(size + ema)}, and a save writes the new file before it "
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


# ----------------------------------------------------------------- what a run says about itself

def describe(run: Run) -> dict[str, Any]:
    """Derived quantities, printed at start-up and stored in config.json."""
    d, layout = run.dist, run.layout
    info = {"world_size": d.world_size, "batch_per_process": layout.batch_size,
            "global_batch": layout.global_batch, "workers_per_process": layout.workers,
            "device": str(d.device), "backend": d.backend,
            "num_classes": run.data.num_classes,
            "train_images": run.data.train.images,
            "val_images": run.data.val_size,
            "steps_per_epoch": run.engine.opts.steps_per_epoch, "lr": run.cfg.lr}
    if run.plan.lr_rule is not None:
        info["lr_rule"] = run.plan.lr_rule
    if run.outputs.remote is not None and run.outputs.remote.output_url:
        info["output_url"] = run.outputs.remote.output_url  # output_dir: its staging folder
    if not run.cfg.evaluate:  # -e says what it evaluates once the weights are loaded
        log.info("=> %s on %s: global batch %d = %d process(es) x %d images x %d accumulation "
                 "step(s); %d loader worker(s) per process; %d classes, %d val images",
                 run.cfg.arch, d.device, layout.global_batch, d.world_size, layout.batch_size,
                 layout.grad_accum_steps, layout.workers, run.data.num_classes,
                 run.data.val_size)
        if run.plan.lr_rule is not None:
            log.info("=> learning rate %g = %s", run.cfg.lr, run.plan.lr_rule)
    slow_bf16 = slow_bf16_warning(run.cfg.amp, d.device.type, native_bf16())
    if slow_bf16 and d.is_main:
        log.warning("%s", slow_bf16)
    return info


def weights_source(run: Run, resumed: Path | None) -> str:
    """Where the evaluated weights come from."""
    cfg = run.cfg
    if resumed is not None:
        return f"checkpoint '{resumed}' (after {run.step.epoch} epoch(s))"
    if cfg.weights or cfg.pretrained:
        return f"torchvision weights {cfg.weights or 'DEFAULT'}"
    return "random initial weights"


def describe_evaluation(run: Run, resumed: Path | None) -> None:
    """What -e evaluates: the weights, the data, its images and classes, and how it runs."""
    cfg, d = run.cfg, run.dist
    data = ("synthetic --dummy data" if cfg.dummy else f"the images of {cfg.val_data}"
            if cfg.val_data else f"the validation split of {cfg.data}")
    log.info("=> evaluating %s with %s on %s: %d images, %d classes; batches of %d per process "
             "x %d process(es) on %s", cfg.arch, weights_source(run, resumed), data,
             run.data.val_size, run.data.num_classes, run.layout.batch_size, d.world_size,
             d.device)
    if resumed is None and not (cfg.weights or cfg.pretrained):
        log.warning("=> -e without --resume, --pretrained or --weights evaluates an untrained "
                    "model: expect chance accuracy")


def finished(run: Run) -> None:
    """Where a finished run's results are: the folder, the best checkpoint, the curves."""
    remote = run.outputs.remote
    out = remote.output_url if remote is not None and remote.output_url else \
        str(run.output_dir.resolve())
    last = files.dcp_name(files.CHECKPOINT) if run.cfg.sharded_checkpoint else files.CHECKPOINT
    best = [best_file(run.best.path, run.best.acc1)]
    if run.best_ema is not None:
        best.append(best_file(run.best_ema.path, run.best_ema.acc1, "EMA, "))
    log.info("=> outputs in %s: %s, %s (the last epoch; --resume auto continues it), "
             "metrics.jsonl, config.json", out, ", ".join(best), last)
    if "tensorboard" in tracker_names(run.cfg.log_to):
        log.info("=> curves: tensorboard --logdir %s/tb", out)


def best_file(path: Path, acc1: float, what: str = "") -> str:
    """A best file and its top-1 for the last line; or why the folder has none (a resume from
    another folder's checkpoint whose best no epoch here beat)."""
    if path.exists():
        return f"{path.name} ({what}best Acc@1 {acc1:.3f})"
    return (f"no {path.name} ({what}no epoch of this run beat the best Acc@1 {acc1:.3f} of "
            "the checkpoint it resumed, whose folder has that file)")
