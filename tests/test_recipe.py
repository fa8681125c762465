"""Recipe flags reach the right torch objects; AMP, accumulation, EMA, MixUp/CutMix, compile."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY18,
    load_checkpoint,
    run_main,
    tiny_engine,
    tiny_net,
    uint8_batches,
)
from torch import nn
from torchvision.transforms import v2

from imagenet.checkpoint.resume_from import Decided
from imagenet.data import transforms as T
from imagenet.errors import UsageError
from imagenet.evaluation.validate import evaluate
from imagenet.launching.process_group import DistInfo
from imagenet.run.build import Run, build_run
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import Layout
from imagenet.settings.plan import fixed_plan
from imagenet.training.engine import Step, train_one_epoch
from imagenet.training.models import unwrap, wrap
from imagenet.training.optim import build_criterion, build_optimizer, build_scheduler

# torchvision 0.29 deprecates its decoders in favour of TorchCodec (not installed here).
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


def _tiny_bn_free() -> nn.Module:
    """No BatchNorm: micro-batches and one big batch have the same gradient."""
    return tiny_net((4,), pool=2)


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
    model = tiny_net((4,), bn=True)
    cfg = parse_config(["--wd", "0.05", "--norm-weight-decay", "0", "--bias-weight-decay", "0.01"])
    groups = build_optimizer(model, cfg).param_groups
    by_decay = {g["weight_decay"]: {id(p) for p in g["params"]} for g in groups}
    bn = model[1]
    assert by_decay[0.0] == {id(bn.weight), id(bn.bias)}
    assert by_decay[0.01] == {id(model[0].bias), id(model[5].bias)}
    assert by_decay[0.05] == {id(model[0].weight), id(model[5].weight)}


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


def test_linear_schedule_falls_to_lr_min_at_the_last_step_after_warmup():
    """FFCV's schedule: up from ~0 over 2 epochs, then straight down to --lr-min."""
    argv = ["--lr-scheduler", "linear", "--epochs", "6", "--lr", "1", "--lr-min", "0.2",
            "--lr-warmup-epochs", "2", "--lr-warmup-decay", "0.0001"]
    lrs = _lrs(argv, iters=10, steps=61)
    assert lrs[0] == pytest.approx(0.0001) and lrs[20] == pytest.approx(1.0)
    assert lrs[40] == pytest.approx(0.6) and lrs[60] == pytest.approx(0.2)
    steps = [b - a for a, b in zip(lrs[20:60], lrs[21:61])]
    assert steps == pytest.approx([-0.02] * 40)  # a straight line
    with pytest.raises(UsageError, match="--lr-min .0.2. must not exceed --lr .0.1."):
        parse_config(["--lr-scheduler", "linear", "--lr", "0.1", "--lr-min", "0.2"])


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


def _batches(n: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return uint8_batches(n, size)


def _engine(model: nn.Module, argv: list[str], steps: int):
    return tiny_engine(model, "-p", "100", *argv, steps=steps, batch=4)


def test_grad_accumulation_equals_one_big_batch():
    big = _batches(2, 8)
    small = [(x[i:i + 4], y[i:i + 4]) for x, y in big for i in (0, 4)]
    ref, acc = _tiny_bn_free(), _tiny_bn_free()
    train_one_epoch(_engine(ref, ["--lr", "0.5"], 2), big, Step())
    engine = _engine(acc, ["--lr", "0.5", "--grad-accum-steps", "2"], 2)
    train_one_epoch(engine, small, Step())
    for p, q in zip(ref.parameters(), acc.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert not torch.equal(ref[0].weight, _tiny_bn_free()[0].weight)


def _record_output_dtypes(model: nn.Module) -> tuple[dict[str, set[torch.dtype]], list]:
    """Forward hooks on every conv/linear layer: {layer name: dtypes of its outputs}."""
    seen: dict[str, set[torch.dtype]] = {}

    def hook(name: str):
        return lambda module, args, out: seen.setdefault(name, set()).add(out.dtype)

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()
               if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert handles, "the model has no conv/linear layer to watch"
    return seen, handles


@pytest.mark.parametrize("amp, expected", [("bf16", torch.bfloat16), (None, torch.float32)])
@pytest.mark.slow
def test_bf16_autocast_trains_on_cpu(amp, expected):
    model = _tiny_bn_free()
    engine = _engine(model, (["--amp", amp] if amp else []) + ["--lr", "0.05"], 20)
    data = _batches(1, 16) * 20
    first = train_one_epoch(engine, data[:1], Step())["loss"]
    seen, handles = _record_output_dtypes(model)
    last = train_one_epoch(engine, data, Step())
    # The trainer's autocast really runs conv and linear in bf16 (fp32 without --amp).
    assert seen == {"0": {expected}, "4": {expected}}
    seen.clear()
    evaluate(engine, model, data[:1], 16)
    assert seen == {"0": {expected}, "4": {expected}}
    for h in handles:
        h.remove()
    assert model[0].weight.dtype == torch.float32  # autocast, not a bf16 model
    assert last["loss"] < first


@pytest.mark.slow
def test_ema_differs_from_the_model_and_is_checkpointed(image_folder, tmp_path):
    model = _tiny_bn_free()
    engine = _engine(model, ["--model-ema", "--model-ema-steps", "1", "--model-ema-decay", "0.9",
                             "--epochs", "1", "--lr", "0.5"], 4)
    train_one_epoch(engine, _batches(4, 4), Step())
    ema = engine.parts.ema
    assert ema is not None and ema.n_averaged.item() == 4
    assert not torch.equal(ema.module[0].weight, model[0].weight)
    out = tmp_path / "out"
    proc = run_main(str(image_folder), *TINY18, "--model-ema", "--model-ema-steps", "1",
                    "--epochs", "1", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert not torch.equal(ckpt["ema"]["module.conv1.weight"], ckpt["state_dict"]["conv1.weight"])
    # model and EMA are both evaluated, each on its own labelled line
    assert proc.stdout.count(" * Acc@1") == 1 and proc.stdout.count(" * EMA Acc@1") == 1
    record = json.loads((out / "metrics.jsonl").read_text())
    assert ckpt["best_ema_acc1"] == record["best_ema_acc1"] == record["ema_val_acc1"]
    # The EMA weights at their best, as a plain checkpoint that -e evaluates.
    best_ema = load_checkpoint(out / "model_best_ema.pth.tar")
    assert best_ema["best_acc1"] == record["ema_val_acc1"]
    assert torch.equal(best_ema["state_dict"]["conv1.weight"], ckpt["ema"]["module.conv1.weight"])
    proc = run_main(str(image_folder), *TINY18, "-e", "--resume",
                    str(out / "model_best_ema.pth.tar"), "--output-dir", str(tmp_path / "eval"))
    assert proc.returncode == 0, proc.stderr
    assert f" * Acc@1 {record['ema_val_acc1']:.3f}" in proc.stdout


@pytest.mark.parametrize("argv", [["--mixup-alpha", "0.2"], ["--cutmix-alpha", "1.0"],
                                  ["--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
                                   "--label-smoothing", "0.1"]])
def test_mixup_cutmix_soft_targets_train(argv):
    cfg = parse_config(argv)
    transform = T.batch_transform(cfg.mixup_alpha, cfg.cutmix_alpha, 3)
    images, target = torch.rand(8, 3, 16, 16), torch.randint(0, 3, (8,))
    mixed, soft = transform(images, target)
    assert soft.shape == (8, 3) and torch.allclose(soft.sum(1), torch.ones(8))
    assert build_criterion(cfg)(torch.randn(8, 3), soft).isfinite()
    model = _tiny_bn_free()
    metrics = train_one_epoch(_engine(model, argv, 2), _batches(2, 8), Step())
    assert metrics["images"] == 16 and 0 <= metrics["acc1"] <= 100


def test_clip_grad_norm_limits_the_update():
    model = _tiny_bn_free()
    before = [p.detach().clone() for p in model.parameters()]
    engine = _engine(model, ["--clip-grad-norm", "1e-3", "--lr", "1", "--momentum", "0",
                             "--wd", "0"], 1)
    train_one_epoch(engine, _batches(1, 8), Step())
    moved = torch.sqrt(sum(((p - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert 0 < moved.item() <= 1e-3 * 1.001


# --- flags reach their torch objects through the trainer's own builder (build_run) ----------

def _built(image_folder: Path, tmp_path: Path, *flags: str, batch_size: int = 8) -> Run:
    """The run main.py would build for ``flags`` on the tiny ImageFolder (one CPU process)."""
    cfg = parse_config([str(image_folder), *TINY18, "--output-dir", str(tmp_path / "out"), *flags])
    return build_run(fixed_plan(cfg, Layout(1, batch_size, cfg.grad_accum_steps, 0)), DistInfo(),
                     Decided(None))  # a fresh run


def _train_steps(run: Run) -> list:
    """The per-sample training transform's steps."""
    return run.data.train_loader.dataset.dataset.transform.transforms


@pytest.mark.parametrize("flags, smoothing", [([], 0.0), (["--label-smoothing", "0.1"], 0.1)])
def test_label_smoothing_reaches_the_criterion(image_folder, tmp_path, flags, smoothing):
    criterion = _built(image_folder, tmp_path, *flags).engine.parts.criterion
    assert isinstance(criterion, nn.CrossEntropyLoss)
    assert criterion.label_smoothing == pytest.approx(smoothing)
    # A confident right answer still costs smoothing x mean(-log p) over all classes.
    logits, target = torch.tensor([[30.0, 0.0, 0.0]]), torch.tensor([0])
    assert criterion(logits, target).item() == pytest.approx(smoothing * 2 / 3 * 30, abs=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("amp, dtype", [(None, torch.float32), ("bf16", torch.bfloat16),
                                        ("fp16", torch.float16)])
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_amp_flag_sets_autocast_dtype_and_scaler(image_folder, tmp_path, amp, dtype):
    run = _built(image_folder, tmp_path, *(["--amp", amp] if amp else []), batch_size=4)
    scaler = run.engine.parts.scaler
    if amp == "fp16":  # fp16 gradients underflow without loss scaling; bf16 has fp32's range
        assert isinstance(scaler, torch.amp.GradScaler)
        assert scaler.is_enabled() and scaler.get_scale() == 2.0**16
    else:
        assert scaler is None
    assert run.engine.opts.amp_dtype == (None if amp is None else dtype)
    # A real step of the built run on its first batch: every conv/linear output has the dtype.
    seen, handles = _record_output_dtypes(run.raw_model)
    before = run.raw_model.fc.weight.detach().clone()
    metrics = train_one_epoch(run.engine, [next(iter(run.data.train_loader))], run.step)
    for h in handles:
        h.remove()
    assert set().union(*seen.values()) == {dtype}
    assert metrics["images"] == 4 and torch.isfinite(torch.tensor(metrics["loss"]))
    moved = not torch.equal(run.raw_model.fc.weight, before)
    if amp == "fp16":
        # The scaler is in the loop: it stepped, or skipped steps whose scaled fp16 gradients
        # overflowed and halved its scale (typical at the start with the 2**16 initial scale).
        assert moved or scaler.get_scale() < 2.0**16
    else:
        assert moved


def _resizes(steps: list) -> list:
    """The steps of a pipeline that resize (and so interpolate)."""
    kinds = (T.RandomResizedCropFlip, v2.RandomResizedCrop, v2.Resize)
    return [s for s in steps if isinstance(s, kinds)]


@pytest.mark.parametrize("backend", T.BACKENDS)
@pytest.mark.parametrize("name", list(T.INTERPOLATIONS))
def test_interpolation_reaches_train_and_val_resizes(image_folder, tmp_path, backend, name):
    run = _built(image_folder, tmp_path, "--interpolation", name, "--image-backend", backend)
    train = _resizes(_train_steps(run))
    val = _resizes(run.data.val_loader.dataset.transform.transforms)
    assert len(train) == 1 and len(val) == 1
    expected = T.INTERPOLATIONS[name]
    assert train[0].interpolation == expected and val[0].interpolation == expected
    assert val[0].antialias is True


POLICIES = (v2.RandAugment, v2.TrivialAugmentWide, v2.AugMix, v2.AutoAugment)


def _policy_cases() -> list:
    """(policy, class, extra flags, expected attributes, backend) for every backend."""
    cases = [("ra", v2.RandAugment, ["--ra-magnitude", "13"], {"magnitude": 13}),
             ("ta_wide", v2.TrivialAugmentWide, [], {}),
             ("augmix", v2.AugMix, ["--augmix-severity", "5"], {"severity": 5}),
             ("imagenet", v2.AutoAugment, [], {"policy": v2.AutoAugmentPolicy.IMAGENET})]
    return [pytest.param(*case, backend, id=f"{case[0]}-{backend}")
            for case in cases for backend in T.BACKENDS]


@pytest.mark.parametrize("policy, cls, flags, attrs, backend", _policy_cases())
def test_auto_augment_policy_reaches_the_train_transform(image_folder, tmp_path, policy, cls,
                                                         flags, attrs, backend):
    run = _built(image_folder, tmp_path, "--auto-augment", policy, "--image-backend", backend,
                 "--interpolation", "bicubic", *flags)
    chosen = [s for s in _train_steps(run) if isinstance(s, POLICIES)]
    assert [type(s) for s in chosen] == [cls]
    for key, value in attrs.items():
        assert getattr(chosen[0], key) == value
    # Rotations/shears on tensors support nearest and bilinear only, and AugMix works on
    # tensors even with the PIL backend (transforms.train_transform).
    expected = v2.InterpolationMode.BICUBIC if backend == "pil" and policy != "augmix" else \
        v2.InterpolationMode.BILINEAR
    assert chosen[0].interpolation == expected
    for epoch in range(8):  # several draws of the policy's random ops, through the real dataset
        image, _ = run.data.train_loader.dataset[(epoch, 0)]
        assert image.shape == (3, 32, 32) and image.dtype == torch.uint8
    # Without the flag there is no policy at all (the classic's augmentation).
    plain = _built(image_folder, tmp_path, "--image-backend", backend)
    assert not [s for s in _train_steps(plain) if isinstance(s, POLICIES)]


@pytest.mark.parametrize("flags, alpha", [
    # alpha = (1 - decay) x images per EMA update / epochs, as torchvision's references
    (["--model-ema-decay", "0.99", "--model-ema-steps", "4", "--epochs", "10"], 0.01 * 32 / 10),
    (["--model-ema-decay", "0.999", "--model-ema-steps", "1", "--epochs", "8"], 0.001),
    (["--model-ema-decay", "0.99", "--model-ema-steps", "4", "--epochs", "10",
      "--grad-accum-steps", "2"], 0.01 * 64 / 10),
    (["--model-ema-decay", "0.9", "--model-ema-steps", "10", "--epochs", "1"], 1.0),  # clamped
])
def test_model_ema_decay_gives_the_effective_decay(image_folder, tmp_path, flags, alpha):
    run = _built(image_folder, tmp_path, "--model-ema", *flags)
    ema, model = run.engine.parts.ema, run.raw_model
    assert isinstance(ema, torch.optim.swa_utils.AveragedModel)
    ema.update_parameters(model)  # the first update copies the weights
    old = ema.module.fc.weight.detach().clone()
    with torch.no_grad():
        model.fc.weight.add_(1.0)
    ema.update_parameters(model)
    # new = decay x old + (1 - decay) x (old + 1): the step is exactly 1 - decay
    step = ema.module.fc.weight.detach() - old
    torch.testing.assert_close(step, torch.full_like(step, alpha), rtol=1e-4, atol=1e-6)


def _compile_toolchain_missing() -> str | None:
    """Why torch.compile's CPU backend (inductor: C++ kernels) cannot work here, or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()  # the compiler inductor itself would use (CXX / config.cpp.cxx)
    except ImportError:
        if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            return "torch.compile's CPU backend needs a C++ compiler (g++/clang++); none found"
    except Exception as exc:  # InvalidCxxCompiler and the like
        return f"torch.compile's CPU backend needs a C++ compiler: {exc}"
    include = Path(sysconfig.get_path("include"))
    if not (include / "Python.h").exists():
        return f"torch.compile's CPU backend needs the Python headers (no Python.h in {include})"
    return None


def test_compile_wraps_lazily_and_unwraps_to_the_plain_model():
    """--compile wraps the model without compiling (nothing compiles until the first call).
    The end-to-end --compile run (trains, validates, a plain torchvision checkpoint) is
    test_compile_cache.py's requeue test, which runs it cold once for this file and its own."""
    reason = _compile_toolchain_missing()
    if reason:
        pytest.skip(reason)
    raw = _tiny_bn_free()
    compiled = wrap(raw, parse_config(["--compile"]), DistInfo())
    assert compiled is not raw and unwrap(compiled) is raw
