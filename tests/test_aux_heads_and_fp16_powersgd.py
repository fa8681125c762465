"""GoogLeNet and Inception-v3 train from scratch; --amp fp16 with PowerSGD keeps learning after
an fp16 overflow (real gloo processes and the real DDP hook)."""

from __future__ import annotations

import pytest
import torch
import torchvision
from helpers import (
    TINY18,
    gloo_rank_saving,
    load_checkpoint,
    run_main,
    start_ranks,
    tiny_engine,
    tiny_net,
    uint8_batches,
)

from imagenet.settings.plan import free_port
from imagenet.training.models import build_model, drop_aux_heads

# ---------------------------------------------------------------- 5: aux classifiers


@pytest.mark.slow
@pytest.mark.parametrize("arch, size", [("googlenet", "32"), ("inception_v3", "75")])
def test_archs_with_aux_classifiers_train_from_scratch(tmp_path, arch, size):
    # Inception-v3 needs 75 px at least (its stem); 75 px is far below what its aux head needs.
    proc = run_main("--dummy", "--dummy-size", "8", "--dummy-val-size", "2", "--dummy-classes",
                    "3", *TINY18, "-a", arch, "-b", "4", "--train-crop-size", size,
                    "--val-crop-size", size, "--epochs", "1", "--output-dir", str(tmp_path),
                    timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    state = load_checkpoint(tmp_path / "checkpoint.pth.tar")["state_dict"]
    assert not [k for k in state if k.startswith(("aux1.", "aux2.", "AuxLogits."))]


@pytest.mark.slow
def test_aux_heads_are_dropped_as_for_torchvisions_pretrained_weights():
    # What --pretrained gives for inception_v3 (torchvision keeps its aux head), without the
    # download: train mode then returns plain logits.
    model = torchvision.models.inception_v3(weights=None, aux_logits=True, init_weights=False,
                                            num_classes=3)
    drop_aux_heads(model).train()
    assert isinstance(model(torch.randn(2, 3, 75, 75)), torch.Tensor)
    assert model.AuxLogits is None
    scratch = build_model("googlenet", 3).train()
    assert isinstance(scratch(torch.randn(2, 3, 32, 32)), torch.Tensor)
    assert scratch.aux1 is None and scratch.aux2 is None


# ---------------------------------------------------------------- 4: fp16 + PowerSGD

STEPS = 12


def fp16_powersgd(info) -> dict:
    """Steps of fp16 + PowerSGD from a loss scale so high that the first steps overflow."""
    from imagenet.settings.flags import parse_config
    from imagenet.training.engine import Hooks, Step, train_one_epoch
    from imagenet.training.models import wrap

    flags = ["--amp", "fp16", "--ddp-comm-hook", "powersgd", "--powersgd-rank", "1",
             "--powersgd-start-iter", "0", "--lr", "0.05", "-p", "1000"]
    raw = tiny_net((8,), classes=3)
    model = wrap(raw, parse_config(["data", *flags]), info)
    engine = tiny_engine(model, *flags, steps=STEPS, world=2, batch=4)
    engine.parts.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22)
    scales, weights = [], []

    def after_step(step: Step, check) -> bool:
        scales.append(engine.parts.scaler.get_scale())
        weights.append(torch.nn.utils.parameters_to_vector(raw.parameters()).detach().clone())
        return False

    batches = uint8_batches(STEPS, 4, size=16, seed=info.rank)
    train_one_epoch(engine, batches, Step(), Hooks(after_step=after_step))
    hook = model._imagenet_hook_state
    memory = [*hook.state.error_dict.values(), *hook.state.q_memory_dict.values()]
    return {"scales": scales, "weights": torch.stack(weights),
            "memory_finite": all(bool(torch.isfinite(t).all()) for t in memory)}


@pytest.mark.slow
def test_fp16_powersgd_keeps_learning_after_an_overflow(tmp_path):
    start_ranks(gloo_rank_saving, args=(2, free_port(), tmp_path, fp16_powersgd))
    result = torch.load(tmp_path / "rank0.pt", weights_only=True)
    scales, weights = result["scales"], result["weights"]
    overflows = [i for i in range(1, STEPS) if scales[i] < scales[i - 1]]
    assert scales[0] < 2.0 ** 22 and overflows, scales  # GradScaler skipped steps
    last = max([0, *overflows])
    assert last < STEPS - 3, scales
    # After the last skipped step the weights move at every step: training goes on.
    for i in range(last + 1, STEPS):
        assert not torch.equal(weights[i], weights[i - 1]), (i, scales)
    assert torch.isfinite(weights[-1]).all() and result["memory_finite"]
    other = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert torch.equal(other["weights"], weights)  # the ranks agree
