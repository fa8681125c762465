"""LAMB and LARS: optimizers whose step is scaled per layer by a trust ratio ||w|| / ||update||.

Both are ``torch.optim.Optimizer`` subclasses with the usual per-parameter state (momentum,
moments, step), so --resume, --fsdp (the state gathered and resharded like SGD's), gradient
accumulation, EMA and every learning-rate schedule treat them as they treat SGD and AdamW.

A parameter group with ``trust=False`` gets no layer-wise adaptation: ``build_optimizer`` puts
every one-dimensional parameter (biases, BatchNorm/LayerNorm scales and shifts) there, without
weight decay, as MLPerf's LARS and the ResNet Strikes Back LAMB recipe do. Whether a parameter
adapts is the group's flag, not "its weight decay is not zero" (timm's rule), so --wd 0 does not
silently turn LARS into SGD.

The numbers are timm's ``timm.optim.Lars`` and ``timm.optim.Lamb`` (tests/test_trust_optim.py
compares the steps); timm itself stays an optional extra. LAMB does not clip gradients inside
the step (timm's clips the global norm at 1.0 by default): --clip-grad-norm does that, before
the step, on the unscaled gradients.

Under --fsdp the parameters are DTensor shards: the elementwise math runs on each rank's local
shard, and each norm is the whole parameter's (the shards' squared sums all-reduced), so the
trust ratio is the one a single process would compute.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (a view: in-place ops change the DTensor); else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _norm(t: Tensor) -> Tensor:
    """The L2 norm of the whole tensor (a DTensor's: every shard's), as a plain 0-dim tensor."""
    norm = torch.linalg.vector_norm(t)
    full = getattr(norm, "full_tensor", None)
    return full() if callable(full) else norm


def _ratio(numerator: Tensor, w_norm: Tensor, g_norm: Tensor) -> Tensor:
    """``numerator`` where both norms are positive, else 1 (a fresh zero layer, a dead one)."""
    one = torch.ones_like(w_norm)
    return torch.where(w_norm > 0, torch.where(g_norm > 0, numerator, one), one)


class _LayerWise(torch.optim.Optimizer):
    """The step loop both optimizers share: ``update`` each parameter that has a gradient."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One step over every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(group, p)
        return loss

    def update(self, group: dict[str, Any], p: Tensor) -> None:
        raise NotImplementedError


class Lars(_LayerWise):
    """LARS (You, Gitman and Ginsburg 2017): SGD with momentum whose gradient plus weight decay
    is scaled per parameter by ``trust_coef * ||w|| / (||g|| + wd * ||w|| + eps)``.

    As torch's SGD, the learning rate multiplies the momentum buffer's output (not its input,
    as MLPerf's reference does): a schedule changes the step at once, as it does for SGD.
    """

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coef: float = 0.001, eps: float = 1e-8,
                 nesterov: bool = False) -> None:
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "trust_coef": trust_coef, "eps": eps, "nesterov": nesterov, "trust": True}
        super().__init__(params, defaults)

    def update(self, group: dict[str, Any], p: Tensor) -> None:
        """One LARS step of ``p``."""
        wd, momentum = group["weight_decay"], group["momentum"]
        grad, weights = _local(p.grad), _local(p)
        if group["trust"]:
            w_norm, g_norm = _norm(p), _norm(p.grad)
            trust = _ratio(group["trust_coef"] * w_norm / (g_norm + wd * w_norm + group["eps"]),
                           w_norm, g_norm)
            grad = grad.add(weights, alpha=wd).mul_(trust)  # p.grad left as it was
        elif wd != 0:
            grad = grad.add(weights, alpha=wd)
        if momentum != 0:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
                _local(state["momentum_buffer"]).copy_(grad)  # as SGD's first step
            else:
                _local(state["momentum_buffer"]).mul_(momentum).add_(grad)
            buf = _local(state["momentum_buffer"])
            grad = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
        weights.add_(grad, alpha=-group["lr"])


class Lamb(_LayerWise):
    """LAMB (You et al. 2020): Adam's bias-corrected update plus weight decay, scaled per
    parameter by ``||w|| / ||update||`` (the ResNet Strikes Back optimizer)."""

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "trust": True}
        super().__init__(params, defaults)

    def update(self, group: dict[str, Any], p: Tensor) -> None:
        """One LAMB step of ``p``."""
        (beta1, beta2), wd = group["betas"], group["weight_decay"]
        state = self.state[p]
        if not state:
            # a tensor, as torch's Adam keeps it: FSDP's state gathering expects one
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        step = float(state["step"])
        grad, weights = _local(p.grad), _local(p)
        exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(group["eps"])
        update = (exp_avg / (1 - beta1 ** step)).div_(denom)
        if wd != 0:
            update.add_(weights, alpha=wd)
        if group["trust"]:
            w_norm, u_norm = _norm(p), _whole_norm(update, p)
            update.mul_(_ratio(w_norm / u_norm, w_norm, u_norm))
        weights.add_(update, alpha=-group["lr"])


def _whole_norm(local: Tensor, like: Tensor) -> Tensor:
    """The L2 norm of a tensor held, like the (possibly DTensor) parameter ``like``, as this
    rank's shard ``local``: every rank's shard counted under --fsdp."""
    if local is like or not hasattr(like, "device_mesh"):
        return torch.linalg.vector_norm(local)
    from torch.distributed.tensor import DTensor

    whole = DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                               shape=like.shape, stride=like.stride())
    return _norm(whole)
