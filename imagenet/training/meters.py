"""The meters: top-k hits and running sums kept on the device until read (one sync), for the
training step (``training.engine``) and the validation loop (``evaluation.validate``) alike."""

from __future__ import annotations

import torch
import torch.distributed as dist

# loss x weight, top-1 / top-5 hits, images, weight: the images' total weight in the loss's mean
# (their count, but with --class-balanced-loss the sum of their classes' weights)
SUMS = ("loss", "correct1", "correct5", "count", "weight")


def mean_loss(sums: dict[str, float]) -> float:
    """The loss of every image summed so far, as the criterion's own mean: by weight."""
    return sums["loss"] / sums["weight"] if sums["weight"] > 0 else 0.0


def topk_correct(output: torch.Tensor, target: torch.Tensor, ks: tuple[int, ...] = (1, 5)
                 ) -> torch.Tensor:
    """Number of samples whose target is in the top-k, for each k (a device tensor)."""
    if target.ndim == 2:  # soft targets from MixUp/CutMix: score against the dominant class
        target = target.argmax(dim=1)
    maxk = min(max(ks), output.shape[1])
    pred = output.topk(maxk, dim=1).indices
    hit = pred.eq(target.unsqueeze(1))
    return torch.stack([hit[:, :min(k, maxk)].any(dim=1).sum() for k in ks])


class DeviceSums:
    """Running sums of named quantities kept on the device; read back only on request."""

    def __init__(self, names: tuple[str, ...], device: torch.device) -> None:
        self.names = names
        self.values = torch.zeros(len(names), dtype=torch.float64, device=device)

    def add(self, *values: torch.Tensor | float) -> None:
        """Add one value per name without a host-device sync.

        Device tensors stay where they are; Python numbers go to the kernel as scalar
        arguments (``torch.as_tensor(n, device=cuda)`` would be a blocking host-to-device copy).
        """
        for slot, value in zip(self.values, values):
            slot.add_(value)

    def summed(self) -> dict[str, float]:
        """Every rank's sums added up, as a dict; this rank's stay as they are (collective)."""
        values = self.values.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(values)
        return dict(zip(self.names, values.tolist()))

    def all_reduce(self) -> None:
        """Sum across ranks, once."""
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.values)

    def read(self) -> dict[str, float]:
        """Copy to the host (one sync) as a dict."""
        return dict(zip(self.names, self.values.tolist()))
