"""Recipe flags reach the right torch objects; AMP, accumulation, EMA, MixUp/CutMix, compile."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import TINY, run_main
from torch import nn

from imagenet.config import parse_config
from imagenet.engine import Step, TrainContext, train_one_epoch
from imagenet.models import unwrap
from imagenet.optim import build_criterion, build_ema, build_optimizer, build_scheduler
from imagenet.trainer import batch_transform


def _tiny_bn_free() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                         nn.Flatten(), nn.Linear(16, 3))


def _with_norm() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(3))


@pytest.mark.parametrize("opt, cls, nesterov", [("sgd", torch.optim.SGD, False),
                                                ("sgd_nesterov", torch.optim.SGD, True),
                                                ("adamw", torch.optim.AdamW, None),
                                                ("rmsprop", torch.optim.RMSprop, None)])
def test_optimizer_choice(opt, cls, nesterov):
    optimizer = build_optimizer(_tiny_bn_free(), parse_config(["--opt", opt, "--lr", "0.3"]))
    assert type(optimizer) is cls and optimizer.param_groups[0]["lr"] == 0.3
    if nesterov is not None:
        assert optimizer.param_groups[0]["nesterov"] is nesterov


def test_norm_and_bias_weight_decay_groups():
    model = _with_norm()
    model(torch.zeros(1, 3, 8, 8))  # materialise the lazy layer
    cfg = parse_config(["--wd", "0.05", "--norm-weight-decay", "0", "--bias-weight-decay", "0.01"])
    groups = build_optimizer(model, cfg).param_groups
    by_decay = {g["weight_decay"]: {id(p) for p in g["params"]} for g in groups}
    bn = model[1]
    assert by_decay[0.0] == {id(bn.weight), id(bn.bias)}
    assert by_decay[0.01] == {id(model[0].bias), id(model[3].bias)}
    assert by_decay[0.05] == {id(model[0].weight), id(model[3].weight)}


def _lrs(argv: list[str], iters: int, steps: int) -> list[float]:
    cfg = parse_config(argv)
    optimizer = build_optimizer(_tiny_bn_free(), cfg)
    scheduler = build_scheduler(optimizer, cfg, iters)
    values = []
    for _ in range(steps):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


def test_classic_step_schedule_per_iteration_matches_per_epoch():
    lrs = _lrs(["--lr", "0.1"], iters=4, steps=4 * 61)
    assert lrs[0] == lrs[4 * 30 - 1] == pytest.approx(0.1)
    assert lrs[4 * 30] == pytest.approx(0.01) and lrs[4 * 60] == pytest.approx(0.001)


def test_multistep_and_cosine_values():
    lrs = _lrs(["--lr-scheduler", "multistep", "--lr-milestones", "2", "5", "--lr", "1"],
               iters=10, steps=60)
    assert (lrs[19], lrs[20], lrs[49], lrs[50]) == pytest.approx((1, 0.1, 0.1, 0.01))
    lrs = _lrs(["--lr-scheduler", "cosine", "--epochs", "4", "--lr", "1", "--lr-min", "0.1"],
               iters=10, steps=41)
    assert lrs[0] == pytest.approx(1) and lrs[20] == pytest.approx(0.55)
    assert lrs[40] == pytest.approx(0.1)


@pytest.mark.parametrize("method", ["linear", "constant"])
def test_warmup_is_smooth_per_iteration(method):
    argv = ["--lr-scheduler", "cosine", "--epochs", "10", "--lr", "1", "--lr-warmup-epochs", "2",
            "--lr-warmup-method", method, "--lr-warmup-decay", "0.1"]
    lrs = _lrs(argv, iters=5, steps=12)
    assert lrs[0] == pytest.approx(0.1)
    if method == "linear":
        assert all(b > a for a, b in zip(lrs[:10], lrs[1:10]))
        assert lrs[5] == pytest.approx(0.1 + 0.9 * 5 / 10)
    else:
        assert lrs[:10] == pytest.approx([0.1] * 10)
    assert lrs[10] == pytest.approx(1.0)


def _batches(n: int, size: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (size, 3, 16, 16), dtype=torch.uint8, generator=g),
             torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def _context(model: nn.Module, argv: list[str], steps: int) -> TrainContext:
    cfg = parse_config(argv)
    optimizer = build_optimizer(model, cfg)
    return TrainContext(model=model, criterion=build_criterion(cfg), optimizer=optimizer,
                        scheduler=build_scheduler(optimizer, cfg, steps),
                        device=torch.device("cpu"), steps_per_epoch=steps,
                        grad_accum_steps=cfg.grad_accum_steps, print_freq=100,
                        clip_grad_norm=cfg.clip_grad_norm,
                        amp_dtype={"bf16": torch.bfloat16}.get(cfg.amp or ""),
                        batch_transform=batch_transform(cfg, 3),
                        ema=build_ema(model, cfg, 1, 4), ema_steps=cfg.model_ema_steps)


def test_grad_accumulation_equals_one_big_batch():
    big = _batches(2, 8)
    small = [(x[i:i + 4], y[i:i + 4]) for x, y in big for i in (0, 4)]
    ref, acc = _tiny_bn_free(), _tiny_bn_free()
    train_one_epoch(_context(ref, ["--lr", "0.5"], 2), big, Step())
    ctx = _context(acc, ["--lr", "0.5", "--grad-accum-steps", "2"], 2)
    train_one_epoch(ctx, small, Step())
    for p, q in zip(ref.parameters(), acc.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert not torch.equal(ref[0].weight, _tiny_bn_free()[0].weight)


def test_bf16_autocast_trains_on_cpu():
    model = _tiny_bn_free()
    ctx = _context(model, ["--amp", "bf16", "--lr", "0.05"], 20)
    data = _batches(1, 16) * 20
    first = train_one_epoch(ctx, data[:1], Step())["loss"]
    last = train_one_epoch(ctx, data, Step())
    assert model[0].weight.dtype == torch.float32  # autocast, not a bf16 model
    assert last["loss"] < first


def test_ema_differs_from_the_model_and_is_checkpointed(image_folder, tmp_path):
    model = _tiny_bn_free()
    ctx = _context(model, ["--model-ema", "--model-ema-steps", "1", "--model-ema-decay", "0.9",
                           "--epochs", "1", "--lr", "0.5"], 4)
    train_one_epoch(ctx, _batches(4, 4), Step())
    assert ctx.ema is not None and ctx.ema.n_averaged.item() == 4
    assert not torch.equal(ctx.ema.module[0].weight, model[0].weight)
    out = tmp_path / "out"
    proc = run_main(str(image_folder), *TINY, "--model-ema", "--model-ema-steps", "1",
                    "--epochs", "1", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    ckpt = torch.load(out / "checkpoint.pth.tar", weights_only=True)
    assert not torch.equal(ckpt["ema"]["module.conv1.weight"], ckpt["state_dict"]["conv1.weight"])
    # model and EMA are both evaluated, each on its own labelled line
    assert proc.stdout.count(" * Acc@1") == 1 and proc.stdout.count(" * EMA Acc@1") == 1
    record = json.loads((out / "metrics.jsonl").read_text())
    assert ckpt["best_ema_acc1"] == record["best_ema_acc1"] == record["ema_val_acc1"]
    # The EMA weights at their best, as a plain checkpoint that -e evaluates.
    best_ema = torch.load(out / "model_best_ema.pth.tar", weights_only=True)
    assert best_ema["best_acc1"] == record["ema_val_acc1"]
    assert torch.equal(best_ema["state_dict"]["conv1.weight"], ckpt["ema"]["module.conv1.weight"])
    proc = run_main(str(image_folder), *TINY, "-e", "--resume", str(out / "model_best_ema.pth.tar"),
                    "--output-dir", str(tmp_path / "eval"))
    assert proc.returncode == 0, proc.stderr
    assert f" * Acc@1 {record['ema_val_acc1']:.3f}" in proc.stdout


@pytest.mark.parametrize("argv", [["--mixup-alpha", "0.2"], ["--cutmix-alpha", "1.0"],
                                  ["--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
                                   "--label-smoothing", "0.1"]])
def test_mixup_cutmix_soft_targets_train(argv):
    cfg = parse_config(argv)
    transform = batch_transform(cfg, 3)
    images, target = torch.rand(8, 3, 16, 16), torch.randint(0, 3, (8,))
    mixed, soft = transform(images, target)
    assert soft.shape == (8, 3) and torch.allclose(soft.sum(1), torch.ones(8))
    assert build_criterion(cfg)(torch.randn(8, 3), soft).isfinite()
    model = _tiny_bn_free()
    metrics = train_one_epoch(_context(model, argv, 2), _batches(2, 8), Step())
    assert metrics["images"] == 16 and 0 <= metrics["acc1"] <= 100


def test_clip_grad_norm_limits_the_update():
    model = _tiny_bn_free()
    before = [p.detach().clone() for p in model.parameters()]
    ctx = _context(model, ["--clip-grad-norm", "1e-3", "--lr", "1", "--momentum", "0",
                           "--wd", "0"], 1)
    train_one_epoch(ctx, _batches(1, 8), Step())
    moved = torch.sqrt(sum(((p - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert 0 < moved.item() <= 1e-3 * 1.001


def test_compile_smoke():
    """--compile goes through ddp.wrap: a compiled tiny model trains; checkpoints stay plain."""
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile's CPU backend needs a C compiler (gcc/cc); none found")
    from imagenet import ddp
    from imagenet.distributed import DistInfo

    raw = _tiny_bn_free()
    compiled = ddp.wrap(raw, parse_config(["--compile"]), DistInfo())
    assert compiled is not raw and unwrap(compiled) is raw
    ctx = _context(raw, ["--lr", "0.1"], 3)
    ctx.model = compiled
    metrics = train_one_epoch(ctx, _batches(3, 4), Step())
    assert metrics["images"] == 12
    assert not any("_orig_mod" in k for k in raw.state_dict())
    x = torch.rand(2, 3, 16, 16)
    torch.testing.assert_close(compiled(x), raw(x))
