"""The model weights of any file people start from: this trainer's checkpoints (also EMA and best
files, and --fsdp's, single files or --sharded-checkpoint directories), the classic script's
(``module.`` keys), a plain state dict, a torchvision ``.pth``, a ``.safetensors`` file
(--finetune, and ``tools.export``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from imagenet.checkpoint import dcpfiles, files
from imagenet.errors import CheckpointError, TrainerError, UsageError
from imagenet.launching.process_group import raise_agreed
from imagenet.training.finetune import Weights

WEIGHT_KEYS = ("state_dict", "model")  # ours and the classic's; torchvision/DeiT references'


def read_weights(path: Path, flag: str = "--finetune") -> Weights:
    """The model weights in ``path``, whatever wrote it (see the module docstring); errors
    name ``flag``."""
    if path.is_dir():
        if not files.is_checkpoint_dir(path):
            raise UsageError(f"{flag} {path} is a folder but not a --sharded-checkpoint "
                             f"directory (no {files.SHARDED_META} in it); give a file")
        meta = files.load_checkpoint(path / files.SHARDED_META)
        bad = dcpfiles.damaged_file(path, meta.get(dcpfiles.SHARD_SUMS))
        if bad:
            raise CheckpointError(f"{path} is damaged: {bad}; give another checkpoint")
        return _weights(_dcp_model_state(path), meta, path, flag)
    if not path.is_file():
        raise UsageError(f"{flag}: no file at {path}")
    if path.suffix == ".safetensors":
        return _weights(_safetensors(path, flag), {}, path, flag)
    ckpt = files.load_file(path, advice="give another file")
    if isinstance(ckpt, dict) and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        return _weights(ckpt, {}, path, flag)  # a plain state dict (torchvision's .pth files)
    state = next((ckpt[k] for k in WEIGHT_KEYS if isinstance(ckpt, dict)
                  and isinstance(ckpt.get(k), dict)), None)
    if state is None:
        keys = ", ".join(sorted(map(str, ckpt))[:8]) if isinstance(ckpt, dict) else \
            type(ckpt).__name__
        raise CheckpointError(f"{flag} {path}: no model weights in it (no 'state_dict' or "
                              f"'model' entry; it holds {keys})")
    return _weights(state, ckpt, path, flag)


def _weights(state: dict, meta: dict, path: Path, flag: str) -> Weights:
    """``Weights`` with wrapper prefixes stripped; every value must be a tensor."""
    odd = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if odd:
        raise CheckpointError(f"{flag} {path}: '{odd[0]}' is not a tensor; the weights must "
                              "be a state dict")
    classes, config = meta.get("classes"), meta.get("config")
    return Weights(files.strip_wrapper_prefixes(state),
                   list(classes) if classes is not None else None, meta.get("arch"),
                   config if isinstance(config, dict) else {})


def _dcp_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The model weights of a --sharded-checkpoint directory, read in this process alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from imagenet.checkpoint import dcpread
    from imagenet.checkpoint.sharded import single_process_is_meant

    saved = dcpread.read_metadata(path).state_dict_metadata
    state = {key.split(".", 1)[1]: torch.empty(m.size, dtype=m.properties.dtype)
             for key, m in saved.items()
             if key.startswith("state_dict.") and isinstance(m, TensorStorageMetadata)}
    with single_process_is_meant():
        dcpread.load({"state_dict": state}, path, no_dist=True)
    return state


def _safetensors(path: Path, flag: str) -> dict[str, torch.Tensor]:
    """A .safetensors file (timm's and Hugging Face's weights)."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise UsageError(f"{flag} {path}: reading .safetensors needs the safetensors "
                         "package: pip install safetensors") from None
    try:
        return load_file(str(path))
    except Exception as exc:  # its errors for damaged files vary
        raise CheckpointError(f"{flag} {path}: cannot read it ({exc})") from None


def read_agreed(path: Path, flag: str = "--finetune") -> Weights:
    """``read_weights`` on every rank (each reads its own copy); all ranks raise the first
    rank's error, or none does. Collective."""
    error, weights = None, None
    try:
        weights = read_weights(path, flag)
    except TrainerError as exc:
        error = exc
    raise_agreed(error)
    assert weights is not None
    return weights
