"""DDP gradient compression for slow links (--ddp-comm-hook), its checkpoint state and traffic.

--ddp-comm-hook uses torch's built-in hooks. fp16/bf16 halve the all-reduce payload; PowerSGD
sends a rank-r factorisation of each weight matrix (with error feedback and warm start). Three
things are added around torch's ``powerSGD_hook``, explained in ``PowerSGDHook``: on gloo each
bucket's hook waits for the previous bucket's (torch's hook alone aborts gloo runs with several
buckets); its per-bucket memory follows DDP's bucket layout, so a bucket rebuild or a resume
never pairs a bucket with another bucket's memory; and a step whose gradients were not finite
(an fp16 overflow, which GradScaler skips) does not leave inf/NaN in that memory.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from imagenet.settings.flags import Config

log = logging.getLogger(__name__)

# torch's PowerSGDState default: a matrix is compressed only if that divides its size by > 2.
MIN_COMPRESSION_RATE = 2


def register_comm_hook(model: DDP, raw: nn.Module, cfg: Config, backend: str) -> None:
    """Gradient compression with torch's built-in DDP hooks (--ddp-comm-hook); ``raw`` is the
    unwrapped model (for parameter names)."""
    if cfg.ddp_comm_hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif cfg.ddp_comm_hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif cfg.ddp_comm_hook == "powersgd":
        hook = PowerSGDHook(raw, cfg.powersgd_rank, cfg.powersgd_start_iter,
                            serialise=backend != "nccl")
        model.register_comm_hook(hook, powersgd_hook)
        model._imagenet_hook_state = hook  # type: ignore[attr-defined]


class PowerSGDHook:
    """torch's PowerSGDState plus what makes its hook safe on gloo and across bucket changes.

    Why gloo aborts with torch's hook alone ("Received data size doesn't match expected size ...
    collective mismatch"): per bucket it issues three all-reduces - the uncompressed 1-D
    tensors, then P, then Q - and the last two are issued from ``.then`` callbacks. A gloo future
    completes on gloo's worker thread, so those callbacks run there, while the autograd thread
    goes on and issues the *next* bucket's first all-reduce. Gloo pairs the collectives of the
    ranks by the order they are issued in, and that order now depends on thread timing: one rank
    issues bucket 0's Q before bucket 1's first all-reduce, the other the reverse, and each rank
    receives a tensor of the wrong size. One bucket hides this (nothing else is in flight), so
    the fix is ordering, not bucket size: each bucket's hook first waits for the previous
    bucket's future, so every rank issues all of bucket k's collectives before any of bucket
    k+1's. Bucket k still communicates while autograd computes the gradients of bucket k+1, and
    on a link slow enough to need PowerSGD the wire is busy anyway. NCCL completes a future when
    the kernel is enqueued, so its callbacks run in order on the issuing thread and need no
    wait (waiting there would also stall the backward stream).

    Per-bucket memory (error feedback, warm-start P and Q) is keyed by bucket index in torch.
    DDP rebuilds its buckets after the first step of every process (one bucket before, several
    after), which torch avoids by requiring two uncompressed steps, and a resume is a new
    process whose first step compresses again. Here each bucket index remembers which
    parameters it held; when that changes, the index's error feedback is dropped (one step's
    residual) and its P/Q are put aside under the old parameter list and reused when a bucket
    with that list comes back (from a checkpoint, too).
    """

    def __init__(self, raw: nn.Module, rank: int, start_iter: int, serialise: bool) -> None:
        # Quiet torch's per-bucket "allocating ..." INFO lines; log_payload states what matters.
        if not log.isEnabledFor(logging.DEBUG):
            logging.getLogger(powersgd.__name__).setLevel(logging.WARNING)
        self.state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank,
            start_powerSGD_iter=max(start_iter, 2), min_compression_rate=MIN_COMPRESSION_RATE,
            use_error_feedback=True, warm_start=True)
        # torch refuses start < 2 only because of the bucket rebuild, which this class handles.
        self.state.start_powerSGD_iter = start_iter
        self.serialise = serialise
        self.previous: torch.futures.Future | None = None
        self.names = {id(p): name for name, p in raw.named_parameters()}
        self.layouts: dict[int, tuple[str, ...]] = {}  # bucket index -> its parameter names
        self.set_aside: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.finite: list[torch.Tensor] = []  # per bucket of the last step: its result was finite
        self.step_done = False  # the last bucket of a step has reported since the last check

    def forget_overflowed_step(self) -> None:
        """After a step whose gradients were not finite, drop the memory that step wrote.

        With --amp fp16 an overflow is routine: GradScaler skips that step and lowers the scale.
        But the step's inf/NaN has already gone into PowerSGD's error feedback and its warm-start
        Q, and from then on every gradient would be NaN and every step skipped, silently. So the
        first bucket of the next step checks the previous step's results (all-reduced: every
        rank decides the same; one host sync per step, and fp16's GradScaler makes one anyway):
        if any was not finite, the error feedback restarts at zero and P/Q at a new random start
        - what a resume does, and one step's compression error.
        """
        if not self.step_done:  # a later bucket of the step whose flags are being collected
            return
        self.step_done = False
        flags, self.finite = self.finite, []
        if all(bool(flag) for flag in flags):
            return
        log.debug("PowerSGD: a step with non-finite gradients; error feedback and warm start "
                  "restart")
        state = self.state
        for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
            memory.clear()
        self.layouts.clear()

    def record_finite(self, last: bool, future: torch.futures.Future) -> torch.Tensor:
        """``.then`` callback: note whether this bucket's averaged gradient is finite."""
        result = future.value()
        self.finite.append(torch.isfinite(result).all())
        self.step_done = self.step_done or last
        return result

    def follow_layout(self, bucket: torch_dist.GradBucket) -> None:
        """Give bucket ``index`` the memory of its parameters, never another bucket's."""
        index, state = bucket.index(), self.state
        layout = tuple(self.names[id(p)] for p in bucket.parameters())
        old = self.layouts.get(index)
        if old == layout:
            return
        state.error_dict.pop(index, None)
        if index in state.p_memory_dict:
            memory = state.p_memory_dict.pop(index), state.q_memory_dict.pop(index)
            if old is not None:
                self.set_aside[old] = memory
        if layout in self.set_aside:
            state.p_memory_dict[index], state.q_memory_dict[index] = self.set_aside.pop(layout)
        self.layouts[index] = layout


# No annotations: DDP checks a hook's annotations against its own classes, and postponed
# annotations (``from __future__ import annotations``) are strings.
def powersgd_hook(hook, bucket):
    """torch's powerSGD_hook, one bucket at a time on gloo (see ``PowerSGDHook``)."""
    if hook.previous is not None:
        hook.previous.wait()  # a no-op once done, e.g. for the first bucket of a step
    hook.forget_overflowed_step()
    hook.follow_layout(bucket)
    future = powersgd.powerSGD_hook(hook.state, bucket).then(
        partial(hook.record_finite, bucket.is_last()))
    if hook.serialise:
        hook.previous = future
    return future


def hook_state(model: nn.Module) -> dict[str, Any] | None:
    """Checkpointable PowerSGD state: tensors and plain containers (weights_only loads it).

    Saved: the step counter, the RNG that seeds new Q matrices (the same on every rank), and the
    warm-start P/Q of each bucket by its parameter names (all-reduced, so equal on every rank).
    Not saved: the error-feedback residuals. They are per rank and as large as the model, so
    saving them would gather world-size model copies to rank 0 over the slow link at every
    checkpoint; after a resume they restart at zero, which drops one step's compression error.
    """
    hook = getattr(model, "_imagenet_hook_state", None)
    if hook is None:
        return None
    state = hook.state
    kind, keys, pos, has_gauss, gauss = state.rng.get_state()
    memory = dict(hook.set_aside)
    memory.update({hook.layouts[i]: (state.p_memory_dict[i], state.q_memory_dict[i])
                   for i in state.p_memory_dict})
    warm = [{"params": list(layout), "p": p.detach().cpu().clone(), "q": q.detach().cpu().clone()}
            for layout, (p, q) in memory.items()]
    return {"hook": "powersgd", "iter": int(state.iter),
            "rank": int(state.matrix_approximation_rank),
            "min_compression_rate": float(state.min_compression_rate),
            "rng": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                    float(gauss)],
            "warm_start": warm}


def load_hook_state(model: nn.Module, saved: dict[str, Any] | None) -> None:
    """Restore what ``hook_state`` saved; P/Q only if --powersgd-rank is unchanged."""
    hook = getattr(model, "_imagenet_hook_state", None)
    if hook is None or not saved:
        return
    state = hook.state
    state.iter = int(saved["iter"])
    kind, keys, pos, has_gauss, gauss = saved["rng"]
    state.rng.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    same_shapes = (saved["rank"] == state.matrix_approximation_rank
                   and saved["min_compression_rate"] == state.min_compression_rate)
    if same_shapes:
        device = next(model.parameters()).device
        for entry in saved["warm_start"]:
            hook.set_aside[tuple(entry["params"])] = (entry["p"].to(device),
                                                      entry["q"].to(device))
    log.info("=> PowerSGD state restored at step %d (%s); error feedback restarts at zero",
             state.iter, f"warm start of {len(saved['warm_start'])} bucket(s)" if same_shapes
             else "new warm start: --powersgd-rank changed")


# ---------------------------------------------------------------- traffic estimate


def powersgd_numel(shape: torch.Size, rank: int) -> int:
    """Elements PowerSGD all-reduces for one gradient: P and Q, or the tensor itself.

    Like torch's hook: the gradient is viewed as shape[0] x rest, and compressed only if
    r * (n + m) is less than half of n * m (so biases and BatchNorm go uncompressed).
    """
    n = shape[0] if len(shape) else 1
    m = int(torch.Size(shape).numel()) // max(n, 1)
    r = min(n, m, rank)
    return r * (n + m) if r * (n + m) * MIN_COMPRESSION_RATE < n * m else n * m


def payload_bytes(model: nn.Module, hook: str, rank: int = 2) -> tuple[int, int]:
    """(without a hook, with ``hook``): gradient bytes one rank all-reduces per optimizer step."""
    params = [p for p in model.parameters() if p.requires_grad]
    plain = sum(p.numel() * p.element_size() for p in params)
    if hook in ("fp16", "bf16"):
        return plain, sum(p.numel() * 2 for p in params)
    if hook == "powersgd":
        return plain, sum(powersgd_numel(p.shape, rank) * p.element_size() for p in params)
    return plain, plain


def log_payload(raw: nn.Module, cfg: Config, world_size: int) -> None:
    """Start-up line: what each step sends per rank, with and without the hook."""
    plain, hooked = payload_bytes(raw, cfg.ddp_comm_hook, cfg.powersgd_rank)
    hook = cfg.ddp_comm_hook
    if hook == "none":
        with_hook = "no hook"
    else:
        name = f"powersgd rank {cfg.powersgd_rank}" if hook == "powersgd" else hook
        with_hook = f"{hooked / 2**20:.2f} MiB with {name} ({plain / max(hooked, 1):.1f}x less)"
        if hook == "powersgd":
            with_hook += f" after {cfg.powersgd_start_iter} uncompressed step(s)"
    log.info("=> DDP gradient payload per step and rank (an estimate from the parameter shapes):"
             " %.2f MiB uncompressed, %s; a ring all-reduce puts about 2(w-1)/w = %.2f x the "
             "payload on each rank's link; DDP buckets of %g MB", plain / 2**20, with_hook,
             2 * (world_size - 1) / world_size, cfg.bucket_cap_mb)
