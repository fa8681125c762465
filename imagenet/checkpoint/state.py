"""What a run's checkpoint holds (``save``) and how a resume puts it back (``resume``).

``save`` is collective (it gathers every rank's RNG state); only rank 0 writes.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from imagenet import comm_hooks, fsdp
from imagenet.build import Run
from imagenet.checkpoint import files, guard, rng, sharded
from imagenet.distributed import barrier
from imagenet.engine import Engine, Step
from imagenet.launch import elastic_restart_count
from imagenet.models import unwrap

log = logging.getLogger(__name__)


def checkpoint_state(run: Run, epoch_done: bool, weights: bool = True) -> dict[str, Any]:
    """The full run state; classic keys first. Collective: every rank must call it.

    ``epoch_done``: the epoch is trained *and* validated, so a resume starts the next one.
    Otherwise (epoch, step_in_epoch) says where training continues; step_in_epoch equal to
    steps_per_epoch means only the epoch's validation is left (a signal at its last step).
    ``weights=False`` (--sharded-checkpoint, whose shards hold them): no model, optimizer or
    EMA tensors.
    """
    states = rng.gather_rng(run.dist.rank, run.dist.world_size)
    parts, step, layout = run.engine.parts, run.step, run.layout
    epoch, step_in_epoch = (step.epoch + 1, 0) if epoch_done else (step.epoch, step.step_in_epoch)
    ema = parts.ema
    return {
        # The classic's meaning: the epoch to start at. Mid-epoch it is the current epoch.
        "epoch": epoch,
        "step_in_epoch": step_in_epoch,
        "global_step": step.global_step,
        "arch": run.cfg.arch,
        "state_dict": model_state(run.raw_model) if weights else None,
        "best_acc1": float(run.best.acc1),
        "optimizer": optimizer_state(run.raw_model, parts.optimizer) if weights else None,
        "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict() if parts.scaler is not None else None,
        "ema": None if ema is None else ema_state(ema) if weights else
        {"n_averaged": ema.n_averaged.clone()},
        "best_ema_acc1": float(run.best_ema.acc1) if run.best_ema is not None else None,
        "num_classes": run.data.num_classes,
        "classes": run.data.classes,
        "aug_seed": run.aug_seed,
        "world_size": layout.world_size,
        "batch_size": layout.batch_size,
        "grad_accum_steps": layout.grad_accum_steps,
        "steps_per_epoch": run.engine.opts.steps_per_epoch,
        # Per rank, the samples of this epoch already trained on; the order is (seed, epoch).
        "sampler": {"seed": run.data.train.order_seed, "epoch": epoch,
                    "start": layout.samples_before(step_in_epoch)},
        "rng": states,  # python, numpy, torch CPU and CUDA states of every rank, by rank
        "comm_hook": comm_hooks.hook_state(parts.model),
        "config": run.cfg.to_dict(),
    }


# ---- the model, optimizer and EMA states: plain, DDP and FSDP alike (FSDP gathers to rank 0)

def model_state(model: nn.Module) -> dict[str, Any]:
    """The unwrapped model's state_dict; sharded, gathered to rank 0 ({} elsewhere; collective)."""
    model = unwrap(model)
    return fsdp.gathered_model_state(model) if fsdp.is_sharded(model) else model.state_dict()


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The classic ``optimizer.state_dict()`` (keyed by parameter index) for every mode;
    sharded, gathered to rank 0 ({} elsewhere; collective)."""
    if fsdp.is_sharded(model):
        return fsdp.gathered_optimizer_state(unwrap(model), optimizer)
    return optimizer.state_dict()


def ema_state(ema: AveragedModel) -> dict[str, Any]:
    """``ema.state_dict()``; sharded, gathered to rank 0 ({} elsewhere; collective)."""
    if not fsdp.is_sharded(ema):
        return ema.state_dict()
    weights = fsdp.gathered_model_state(ema.module)
    if not weights:
        return {}
    return {"n_averaged": ema.n_averaged.clone(), **{f"module.{k}": v for k, v in weights.items()}}


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict[str, Any]) -> None:
    """Load a classic optimizer state_dict into the (possibly sharded) optimizer."""
    if fsdp.is_sharded(model):
        fsdp.load_optimizer_state(unwrap(model), optimizer, state)
    else:
        optimizer.load_state_dict(state)


def load_ema_state(ema: AveragedModel, state: dict[str, Any]) -> None:
    """Load ``ema.state_dict()`` into the (possibly sharded) EMA."""
    if not fsdp.is_sharded(ema):
        ema.load_state_dict(state)
        return
    fsdp.load_model_state(ema.module, {k[len("module."):]: v for k, v in state.items()
                                       if k.startswith("module.")})
    ema.n_averaged.copy_(state["n_averaged"])


def ema_weights_state(run: Run, ema: dict[str, Any]) -> dict[str, Any]:
    """model_best_ema.pth.tar: the EMA weights (``ema``: the checkpoint's EMA state) as a plain
    model checkpoint (``-e --resume``)."""
    assert run.best_ema is not None
    return {"epoch": run.step.epoch + 1, "arch": run.cfg.arch,
            "state_dict": {k[len("module."):]: v for k, v in ema.items()
                           if k.startswith("module.")},
            "best_acc1": float(run.best_ema.acc1), "ema": True,
            "num_classes": run.data.num_classes, "classes": run.data.classes,
            "config": run.cfg.to_dict()}


def save(run: Run, is_best: bool, epoch_done: bool = False, is_best_ema: bool = False) -> None:
    """Write checkpoint.pth.tar on rank 0, atomically; the best files first when they improve.

    Best files are replaced before the checkpoint: a kill in between leaves a best file ahead of
    the checkpoint (``resumed_best`` adopts it), never a checkpoint whose best has no file.
    """
    if run.cfg.sharded_checkpoint:
        save_sharded(run, is_best, epoch_done, is_best_ema)
        return
    payload = checkpoint_state(run, epoch_done)
    guard.refuse_non_finite(payload, run.dist.is_main, run.output_dir, run.step.epoch,
                            run.step.step_in_epoch)
    if run.dist.is_main:
        if is_best_ema:
            files.atomic_save(ema_weights_state(run, payload["ema"]),
                              run.output_dir / files.BEST_EMA)
        best = [run.output_dir / files.BEST] if is_best else []
        files.atomic_save(payload, run.output_dir / files.CHECKPOINT, copies=best)
    # No rank moves on (or exits after a signal) before the file is in place: under mp.spawn the
    # first rank to exit makes the parent terminate the others, rank 0 included.
    barrier()


def save_sharded(run: Run, is_best: bool, epoch_done: bool, is_best_ema: bool) -> None:
    """``save`` for --sharded-checkpoint: directories of shards instead of files. Collective."""
    out = run.output_dir
    meta = checkpoint_state(run, epoch_done, weights=False)
    # Each rank checks the shards it is about to write; all stop if one holds NaN/inf.
    local = sharded.local_tensors(sharded.sharded_state(run))
    guard.refuse_non_finite({**meta, **local}, True, out, run.step.epoch, run.step.step_in_epoch)
    if is_best_ema:
        sharded.save_ema_weights(run, {**ema_weights_state(run, {}), "state_dict": None},
                                 out / files.dcp_name(files.BEST_EMA))
    best = (out / files.dcp_name(files.BEST),) if is_best else ()
    sharded.save(run, meta, out / files.dcp_name(files.CHECKPOINT), copies=best)


def load_weights(run: Run, ckpt: dict[str, Any], path: Path) -> None:
    """The checkpoint's model (checked: finite, these class names), optimizer and EMA into the
    (possibly sharded) run. Every rank reads and checks the same file: none fails alone."""
    files.load_model_state(run.raw_model, ckpt, path, run.cfg.arch)
    guard.check_resumable(ckpt, path, run.data.classes)
    parts = run.engine.parts
    if ckpt.get("optimizer"):
        load_optimizer_state(run.raw_model, parts.optimizer, ckpt["optimizer"])
    if parts.ema is not None and ckpt.get("ema"):
        load_ema_state(parts.ema, ckpt["ema"])


def resume(run: Run) -> Path | None:
    """Restore model, optimizer, schedule, position, best accuracy and RNG from a checkpoint;
    returns its path (None: a fresh start)."""
    restarted = elastic_restart_count() > 0
    path = files.resolve_resume(run.cfg.resume, run.output_dir, restarted,
                                run.cfg.sharded_checkpoint)
    if path is None:
        if run.cfg.resume == "auto" or restarted:
            log.info("=> no checkpoint in %s: starting fresh", run.output_dir)
        return None
    log.info("=> loading checkpoint '%s'", path)
    if path.is_dir():
        ckpt = sharded.load(run, path)  # resharded to this run; returns the trainer state
    else:
        ckpt = files.load_checkpoint(path)
        load_weights(run, ckpt, path)
    parts, steps_per_epoch = run.engine.parts, run.engine.opts.steps_per_epoch
    classic = "global_step" not in ckpt  # written by pytorch/examples' main.py
    # Our schedule counts optimizer steps: it only carries over with the same steps per epoch.
    same_schedule = not classic and ckpt.get("steps_per_epoch", steps_per_epoch) \
        == steps_per_epoch
    for key, obj in (("scheduler", parts.scheduler), ("scaler", parts.scaler)):
        if obj is not None and ckpt.get(key) and (same_schedule or key != "scheduler"):
            obj.load_state_dict(ckpt[key])
    comm_hooks.load_hook_state(parts.model, ckpt.get("comm_hook"))
    run.best.acc1 = resumed_best(ckpt, path, run.output_dir, best_file=run.best.path.name)
    if run.best_ema is not None:
        run.best_ema.acc1 = resumed_best(ckpt, path, run.output_dir, "best_ema_acc1",
                                         run.best_ema.path.name)
    run.step = resumed_step(run, ckpt, same_schedule, classic)
    run.aug_seed = int(ckpt.get("aug_seed", run.aug_seed))
    # The data order of the epoch being continued, and its augmentation.
    order_seed = int(ckpt["sampler"]["seed"]) if ckpt.get("sampler") else run.data.train.order_seed
    run.data.train.reseed(order_seed, run.aug_seed)
    saved_rng = rng.rng_for_rank(ckpt.get("rng"), run.dist.rank)
    if saved_rng is not None and same_layout(run, ckpt):
        rng.restore_rng(saved_rng)
    log.info("=> loaded checkpoint '%s' (epoch %d, step %d, best Acc@1 %.3f)", path,
             run.step.epoch, run.step.step_in_epoch, run.best.acc1)
    return path


def same_layout(run: Run, ckpt: dict[str, Any]) -> bool:
    """True when the checkpoint's world size, batch and accumulation match this run's."""
    layout = run.layout
    return (ckpt.get("world_size") == layout.world_size
            and ckpt.get("batch_size") == layout.batch_size
            and ckpt.get("grad_accum_steps", 1) == layout.grad_accum_steps)


def resumed_step(run: Run, ckpt: dict[str, Any], same_schedule: bool, classic: bool) -> Step:
    """Where training continues; brings the schedule there when it cannot be loaded."""
    steps_per_epoch = run.engine.opts.steps_per_epoch
    epoch, step_in_epoch = int(ckpt.get("epoch", 0)), int(ckpt.get("step_in_epoch", 0))
    global_step = int(ckpt.get("global_step", epoch * steps_per_epoch + step_in_epoch))
    if step_in_epoch >= ckpt.get("steps_per_epoch", steps_per_epoch):
        step_in_epoch = steps_per_epoch  # trained; only the validation is left
    elif step_in_epoch and not same_layout(run, ckpt):
        log.warning("checkpoint was written mid-epoch with another world size, batch size or "
                    "--grad-accum-steps; restarting epoch %d from its first step", epoch)
        step_in_epoch = 0
        global_step = epoch * steps_per_epoch
    if not same_schedule:
        if not classic:
            log.warning("checkpoint has %s steps per epoch, this run %d: the learning-rate "
                        "schedule is recomputed", ckpt.get("steps_per_epoch"), steps_per_epoch)
        fast_forward_schedule(run.engine, global_step if classic
                              else epoch * steps_per_epoch + step_in_epoch)
    return Step(epoch, step_in_epoch, global_step)


def resumed_best(ckpt: dict[str, Any], path: Path, output_dir: Path, key: str = "best_acc1",
                 best_file: str = files.BEST) -> float:
    """``key`` of the checkpoint, or of ``best_file`` next to it if that is higher.

    Best files are written before checkpoint.pth.tar; a kill in between leaves one ahead, and
    forgetting its accuracy would let a worse epoch overwrite it.
    """
    best = files.best_acc1_of(ckpt, key)
    if path.resolve().parent != output_dir.resolve():
        return best
    on_disk = files.best_acc1_on_disk(output_dir, best_file)
    if on_disk is not None and on_disk > best:
        log.info("=> %s records best Acc@1 %.3f (the checkpoint %.3f): keeping the higher",
                 best_file, on_disk, best)
        return on_disk
    return best


def fast_forward_schedule(engine: Engine, steps: int) -> None:
    """Bring our per-iteration schedule to ``steps`` (the classic stored a per-epoch StepLR)."""
    for group in engine.parts.optimizer.param_groups:
        group["lr"] = group.get("initial_lr", group["lr"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
        for _ in range(steps):
            engine.parts.scheduler.step()
