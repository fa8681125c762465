"""--opt lamb / lars (layer-wise trust ratios) and --bce-loss, on the trainer's own builders.

The optimizers' steps are checked by hand on one-tensor cases, and against timm's Lamb and
Lars (the well-kept implementations they follow) over several steps of a small net; the BCE
loss against timm's BinaryCrossEntropy. Whole-run behaviour (a bitwise mid-epoch resume of
each optimizer) is in test_lamb_lars_distill_runs.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_engine, tiny_net, uint8_batches
from torch import nn

from imagenet.errors import UsageError
from imagenet.settings.flags import parse_config
from imagenet.training.engine import Step, train_one_epoch, weighted
from imagenet.training.optim import BinaryCrossEntropy, build_criterion, build_optimizer
from imagenet.training.trust import Lamb, Lars


def optimizer_for(model: nn.Module, *flags: str) -> torch.optim.Optimizer:
    return build_optimizer(model, parse_config(["data", *flags]))


def groups_by_param(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """Each parameter's name -> its group's settings."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    return {name: group_of[id(p)] for name, p in model.named_parameters()}


@pytest.mark.parametrize("opt", ["lamb", "lars"])
def test_biases_and_batchnorm_neither_adapt_nor_decay(opt):
    model = tiny_net(widths=(4,), bn=True)  # conv (weight, bias), BatchNorm, linear
    groups = groups_by_param(model, optimizer_for(model, "--opt", opt, "--wd", "0.05"))
    for name, group in groups.items():
        weight = name.endswith("weight") and name != "1.weight"  # 1: the BatchNorm
        assert group["trust"] is weight, name
        assert group["weight_decay"] == (0.05 if weight else 0.0), name
    # --wd 0 does not switch the adaptation off (timm's rule would: trust only where wd != 0)
    groups = groups_by_param(model, optimizer_for(model, "--opt", opt, "--wd", "0"))
    assert groups["0.weight"]["trust"] and not groups["0.bias"]["trust"]


def one_step(optimizer_cls, w: list[float], g: list[float], trust: bool, **kwargs) -> torch.Tensor:
    """One step of ``optimizer_cls`` on one parameter ``w`` with gradient ``g``; the new w."""
    p = nn.Parameter(torch.tensor(w, dtype=torch.float64))
    p.grad = torch.tensor(g, dtype=torch.float64)
    optimizer_cls([{"params": [p], "trust": trust}], **kwargs).step()
    return p.detach()


def test_lars_trust_ratio_on_a_tiny_case():
    # ||w|| = 5, ||g|| = 1: trust = 0.001 x 5 / (1 + 0.1 x 5 + 1e-8) = 1/300
    w, g = [3.0, 4.0], [0.6, 0.8]
    new = one_step(Lars, w, g, True, lr=0.5, momentum=0.9, weight_decay=0.1, trust_coef=0.001)
    trust = 0.001 * 5 / (1 + 0.5 + 1e-8)
    expected = [wi - 0.5 * trust * (gi + 0.1 * wi) for wi, gi in zip(w, g)]
    assert torch.allclose(new, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-15)
    # an excluded parameter: plain SGD, no trust ratio (and no decay: its group has wd 0)
    new = one_step(Lars, w, g, False, lr=0.5, momentum=0.9, weight_decay=0.0)
    assert new.tolist() == [3.0 - 0.5 * 0.6, 4.0 - 0.5 * 0.8]


def test_lamb_first_step_on_a_tiny_case():
    # First step: the bias-corrected moments are g and g^2, so the Adam direction is
    # g / (|g| + eps); with decay, + wd x w; the step is lr x ||w|| / ||update|| x update.
    w, g = [3.0, 4.0], [0.6, -0.8]
    new = one_step(Lamb, w, g, True, lr=0.01, weight_decay=0.1)
    update = torch.tensor([gi / (abs(gi) + 1e-6) + 0.1 * wi for wi, gi in zip(w, g)],
                          dtype=torch.float64)
    expected = torch.tensor(w, dtype=torch.float64) - 0.01 * 5 / update.norm() * update
    assert torch.allclose(new, expected, rtol=0, atol=1e-14)
    new = one_step(Lamb, w, g, False, lr=0.01, weight_decay=0.0)  # excluded: Adam's step
    assert torch.allclose(new, torch.tensor([3.0 - 0.01, 4.0 + 0.01], dtype=torch.float64),
                          rtol=0, atol=1e-7)


@pytest.mark.parametrize("opt", ["lamb", "lars"])
def test_steps_equal_timms_and_the_state_resumes_exactly(opt):
    timm_optim = pytest.importorskip("timm.optim")
    flags = ["--opt", opt, "--wd", "0.05", "--lr", "0.02" if opt == "lamb" else "0.5"]
    x, y = torch.randn(6, 3, 16, 16, generator=torch.Generator().manual_seed(1)), \
        torch.tensor([0, 1, 2, 0, 1, 2])

    def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
        for _ in range(steps):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

    ours, theirs = tiny_net(widths=(4,), bn=True), tiny_net(widths=(4,), bn=True)
    optimizer = optimizer_for(ours, *flags)
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]}
              for g in optimizer_for(theirs, *flags).param_groups]
    reference = timm_optim.Lamb(groups, lr=0.02, max_grad_norm=None) if opt == "lamb" else \
        timm_optim.Lars(groups, lr=0.5, momentum=0.9, trust_coeff=0.001)
    train(ours, optimizer, 2)
    train(theirs, reference, 4)
    # a "resume": a fresh model and optimizer loaded with the saved states, two more steps
    saved = ({k: v.clone() for k, v in ours.state_dict().items()}, optimizer.state_dict())
    resumed = tiny_net(widths=(4,), bn=True)
    resumed.load_state_dict(saved[0])
    again = optimizer_for(resumed, *flags)
    again.load_state_dict(saved[1])
    train(resumed, again, 2)
    for (name, a), b in zip(resumed.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------------ --bce-loss

def test_bce_smooths_one_hot_targets_as_timm():
    timm_loss = pytest.importorskip("timm.loss")
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    target = torch.tensor([0, 3, 1, 1, 2])
    ours = build_criterion(parse_config(["data", "--bce-loss", "--label-smoothing", "0.1"]))
    want = timm_loss.BinaryCrossEntropy(smoothing=0.1)(logits, target)
    assert torch.allclose(ours(logits, target), want, rtol=1e-6)
    # by hand: on = 1 - 0.1 + 0.1 / 4, off = 0.1 / 4
    dense = torch.full((5, 4), 0.025).scatter_(1, target.view(-1, 1), 0.925)
    assert torch.allclose(ours(logits, target),
                          nn.functional.binary_cross_entropy_with_logits(logits, dense))


def test_bce_on_mixed_targets_with_a_threshold():
    logits = torch.randn(8, 3, 32, 32)[:, :, 0, 0] * 3
    flags = ["--bce-loss", "--bce-target-thresh", "0.2", "--mixup-alpha", "0.4",
             "--label-smoothing", "0.1"]
    cfg = parse_config(["data", *flags])
    engine = tiny_engine(tiny_net(), *flags, steps=1)
    torch.manual_seed(3)
    images = torch.zeros(8, 3, 8, 8)
    _, mixed = engine.parts.batch_transform(images, torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))
    assert mixed.shape == (8, 3) and ((mixed > 0) & (mixed < 1)).any()  # really mixed
    # smoothed (x 0.9 + 0.1 / 3), then 1 above the threshold and 0 elsewhere
    binary = (mixed * 0.9 + 0.1 / 3 > 0.2).float()
    assert ((binary.sum(1) >= 1) & (binary.sum(1) <= 2)).all()  # each image's one or two classes
    loss = build_criterion(cfg)(logits, mixed)
    assert torch.equal(loss, nn.functional.binary_cross_entropy_with_logits(logits, binary))
    # without the threshold the smoothed mixed targets are the targets
    soft = build_criterion(parse_config(["data", "--bce-loss", *flags[3:]]))(logits, mixed)
    assert torch.allclose(soft, nn.functional.binary_cross_entropy_with_logits(
        logits, mixed * 0.9 + 0.1 / 3))


def test_bce_with_class_weights_trains_and_adds_up_by_image():
    flags = ["--bce-loss", "--mixup-alpha", "0.2", "--opt", "lamb", "--lr", "0.01"]
    cfg = parse_config(["data", *flags, "--class-balanced-loss", "0.99"])
    criterion = build_criterion(cfg, [10, 5, 1])
    assert isinstance(criterion, BinaryCrossEntropy)
    weight = criterion.class_weight
    assert weight[2] > weight[1] > weight[0]  # the rare class weighs most
    logits, target = torch.zeros(4, 3), torch.tensor([0, 1, 2, 2])
    # each class's column scaled by its weight; mean over images and classes: a batch's loss x
    # its images adds up whatever the batch (validation's hard targets included)
    per_class = nn.functional.binary_cross_entropy_with_logits(
        logits, nn.functional.one_hot(target, 3).float(), reduction="none").mean(0)
    assert torch.allclose(criterion(logits, target), (per_class * weight).mean())
    assert weighted(criterion, criterion(logits, target), target, 4)[1] == 4
    model = tiny_net()
    engine = tiny_engine(model, *flags, steps=3)
    engine.parts.criterion = criterion
    before = [p.detach().clone() for p in model.parameters()]
    metrics = train_one_epoch(engine, uint8_batches(3, 8), Step())
    assert metrics["images"] == 24 and 0 < metrics["loss"] < 1
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("flags, message", [
    (["--bce-target-thresh", "0.2"], "--bce-target-thresh 0.2 applies to --bce-loss"),
    (["--bce-loss", "--bce-target-thresh", "1.5"], "--bce-target-thresh must be in [0, 1)"),
    (["--opt", "lars", "--lars-trust-coef", "0"], "--lars-trust-coef must be positive"),
    (["--distill-alpha", "1.5"], "--distill-alpha must be in [0, 1]"),
    (["--distill-temperature", "0"], "--distill-temperature must be positive"),
    (["--distill-teacher-arch", "resnet18"], "--distill-teacher-arch names the architecture"),
])
def test_bad_values_name_their_flag(flags, message):
    with pytest.raises(UsageError, match=None) as err:
        parse_config(["data", *flags])
    assert message in str(err.value)
