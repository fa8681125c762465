"""--fsdp (torch FSDP2 fully_shard) against DDP, with real processes on gloo.

Two gloo ranks train the same tiny models on the same data once with DDP and once sharded,
through the trainer's own wrap / build_engine / train_one_epoch / evaluate and the checkpoint
layer's state functions; the block rule and the flag checks need no processes. The end-to-end
checkpoint round trips (main.py) are in test_fsdp_checkpoints.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision
from helpers import StripedImages, gloo_rank_saving, start_ranks, uint8_batches
from torch import nn
from torch.utils.data import DataLoader

from imagenet.errors import UsageError
from imagenet.settings.flags import parse_config
from imagenet.settings.plan import free_port
from imagenet.training.fsdp import by_index, by_name, repeated_blocks

# 32 px: at 16 px ResNet's last stage sees 1x1 maps, where torch 2.14's CPU bf16 convolution
# backward can return garbage weight gradients after another batch size ran (DDP as FSDP).
IMAGE, BATCH, STEPS, CLASSES = 32, 4, 3, 3  # px, images per rank and micro-batch, steps
# fp32: FSDP reduce-scatters the same sums DDP all-reduces; measured bitwise equal on gloo.
FP32 = {"rtol": 1e-6, "atol": 1e-6}
# bf16/fp16: FSDP computes with bf16/fp16 weights (MixedPrecisionPolicy), DDP with autocast
# (measured: bf16 ResNet bitwise equal, fp16 ViT 2e-5).
LOW = {"bf16": {"rtol": 0.0, "atol": 1e-3}, "fp16": {"rtol": 0.0, "atol": 1e-3}}


def tiny_vit() -> nn.Module:
    """A 2-block ViT: repeated EncoderBlocks and a class token whose shard is empty on rank 1."""
    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(image_size=IMAGE, patch_size=4, num_layers=2,
                                                num_heads=2, hidden_dim=32, mlp_dim=64,
                                                num_classes=CLASSES)


def tiny_resnet() -> nn.Module:
    """ResNet with one BasicBlock per stage: blocks and BatchNorm."""
    torch.manual_seed(0)
    from torchvision.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=CLASSES)


MODELS = {"vit": tiny_vit, "resnet": tiny_resnet}
# name: (model, flags of both runs, flags of the FSDP run only)
RUNS = {
    "vit": ("vit", [], []),
    "resnet": ("resnet", [], []),
    "accum": ("resnet", ["--grad-accum-steps", "2"], []),
    "adamw+clip+ema": ("vit", ["--opt", "adamw", "--lr", "0.01", "--clip-grad-norm", "0.5",
                               "--model-ema", "--model-ema-steps", "1"], []),
    "zero2+offload+ema": ("resnet", ["--model-ema", "--model-ema-steps", "1"],
                          ["--fsdp-zero", "2", "--fsdp-cpu-offload"]),
    "bf16": ("resnet", ["--amp", "bf16"], []),
    "fp16": ("vit", ["--amp", "fp16", "--grad-accum-steps", "2"], []),
}


def train(info, name: str, mode: str) -> dict:
    """``STEPS`` optimizer steps of run ``name`` under DDP or FSDP; the gathered states."""
    from imagenet.checkpoint.states import ema_state, model_state, optimizer_state
    from imagenet.data.samplers import ShardSampler
    from imagenet.evaluation.validate import evaluate
    from imagenet.settings.launch import Layout
    from imagenet.training.engine import Step, train_one_epoch
    from imagenet.training.fsdp import broadcast_buffers
    from imagenet.training.models import wrap
    from imagenet.training.optim import build_ema, build_engine

    arch, flags, fsdp_flags = RUNS[name]
    cfg = parse_config(["data", "--lr", "0.02", "--train-crop-size", str(IMAGE), *flags,
                        *(["--fsdp", *fsdp_flags] if mode == "fsdp" else [])])
    layout = Layout(info.world_size, BATCH, cfg.grad_accum_steps, 0)
    raw = MODELS[arch]()
    ema = build_ema(raw, cfg, layout)
    model = wrap(raw, cfg, info, ema)
    engine = build_engine(cfg, raw, model, info.device, layout, STEPS, CLASSES, ema)
    batches = uint8_batches(STEPS * cfg.grad_accum_steps * info.world_size, BATCH, size=IMAGE)
    metrics = train_one_epoch(engine, batches[info.rank::info.world_size], Step())
    val = DataLoader(StripedImages(31, size=IMAGE, seed=3), batch_size=3,
                     sampler=ShardSampler(31, info.rank, info.world_size))
    result = {"loss": metrics["loss"], "val": evaluate(engine, model, val, 31),
              "model": model_state(raw), "optimizer": optimizer_state(raw, engine.parts.optimizer)}
    if ema is not None:
        # DDP leaves each rank's EMA with its own BatchNorm statistics; FSDP evaluates rank 0's
        # (as DDP does for the model). Compare like with like.
        broadcast_buffers(ema)
        result["ema_val"] = evaluate(engine, ema, val, 31)
        result["ema"] = ema_state(ema)
    return result


def train_every_run(info) -> dict:
    """What one rank computes: every run, DDP then FSDP."""
    return {(name, mode): train(info, name, mode) for name in RUNS for mode in ("ddp", "fsdp")}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Each rank's results (rank 0's hold the gathered states)."""
    out = tmp_path_factory.mktemp("fsdp")
    start_ranks(gloo_rank_saving, args=(2, free_port(), out, train_every_run))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def tolerance(name: str) -> dict:
    flags = RUNS[name][1]
    return LOW[flags[flags.index("--amp") + 1]] if "--amp" in flags else FP32


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_fsdp_trains_like_ddp(results, name):
    ddp, fsdp = results[0][(name, "ddp")], results[0][(name, "fsdp")]
    start = MODELS[RUNS[name][0]]().state_dict()
    assert list(fsdp["model"]) == list(start)  # plain keys, the plain model's order
    for key, value in ddp["model"].items():
        if value.is_floating_point() and "running" not in key:
            assert not torch.equal(value, start[key]), f"{key} did not train"
        torch.testing.assert_close(fsdp["model"][key], value, **tolerance(name), msg=key)
    for rank in (0, 1):  # each rank's own loss over its own batches
        loss = results[rank][(name, "ddp")]["loss"], results[rank][(name, "fsdp")]["loss"]
        assert loss[1] == pytest.approx(loss[0], abs=tolerance(name)["atol"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet", "adamw+clip+ema", "zero2+offload+ema"])
def test_gathered_optimizer_and_ema_states_are_the_classic_ones(results, name):
    ddp, fsdp = results[0][(name, "ddp")], results[0][(name, "fsdp")]
    # Keyed by parameter index like optimizer.state_dict(), whatever the mode.
    assert list(fsdp["optimizer"]["state"]) == list(ddp["optimizer"]["state"])
    assert fsdp["optimizer"]["param_groups"] == ddp["optimizer"]["param_groups"]
    for index, state in ddp["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(fsdp["optimizer"]["state"][index][key], value, **FP32)
    if "ema" in ddp:
        assert list(fsdp["ema"]) == list(ddp["ema"])  # AveragedModel.state_dict() keys
        for key, value in ddp["ema"].items():
            torch.testing.assert_close(fsdp["ema"][key], value, **FP32, msg=key)
    for rank in (0, 1):  # the states are gathered to rank 0 only
        if rank:
            assert results[rank][(name, "fsdp")]["model"] == {}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_sharded_validation_counts_every_image_once(results, name):
    # 31 images, batch 3: 6 batches on rank 0, 5 on rank 1, which joins rank 0's sixth forward
    # (its weights are gathered) without counting anything.
    for rank in (0, 1):
        got = results[rank][(name, "fsdp")]
        for key in ("val", "ema_val") if "ema_val" in got else ("val",):
            want = results[rank][(name, "ddp")][key]
            assert got[key]["count"] == want["count"] == 31
            for metric in ("acc1", "acc5", "loss"):
                assert got[key][metric] == pytest.approx(want[metric], abs=1e-3 if
                                                         "--amp" in RUNS[name][1] else 1e-5)


# ---------------------------------------------------------------- no processes

@pytest.mark.slow
def test_block_rule_finds_each_family_s_repeated_blocks():
    def units(arch: str) -> tuple[dict[str, int], float]:
        try:
            with torch.device("meta"):  # no memory, no initialisation
                model = torchvision.models.get_model(arch, num_classes=10)
        except NotImplementedError:  # RegNet reads tensor values while it builds
            model = torchvision.models.get_model(arch, num_classes=10)
        found = repeated_blocks(model)
        names: dict[str, int] = {}
        for unit in found:
            names[type(unit).__name__] = names.get(type(unit).__name__, 0) + 1
        params = [p for u in found for p in u.parameters()]
        assert len({id(p) for p in params}) == len(params), f"{arch}: units overlap"
        return names, sum(p.numel() for p in params) / sum(
            p.numel() for p in model.parameters())

    assert units("resnet18")[0] == {"BasicBlock": 8}
    assert units("resnet50")[0] == {"Bottleneck": 16}
    assert units("vit_b_16")[0] == {"EncoderBlock": 12}
    assert units("convnext_tiny")[0] == {"CNBlock": 18}
    assert units("swin_t")[0] == {"SwinTransformerBlock": 12, "PatchMerging": 3}
    assert units("regnet_y_400mf")[0] == {"ResBottleneckBlock": 16}
    assert units("efficientnet_b0")[0] == {"MBConv": 16}
    # Rule 2: MaxViT's last two stages hold too much each: their layers become the units (and
    # in the last stage, each layer's two attention layers).
    assert units("maxvit_t")[0] == {"MaxVitBlock": 2, "MaxVitLayer": 5,
                                    "PartitionAttentionLayer": 4}
    # Rule 3: VGG is plain layers: its layers of 1M parameters or more become units.
    names, share = units("vgg11")
    assert names == {"Conv2d": 4, "Linear": 2} and share > 0.95
    for arch in ("resnet50", "vit_b_16", "swin_t", "convnext_tiny", "regnet_y_400mf"):
        assert units(arch)[1] > 0.9, arch


def test_optimizer_state_by_name_and_back():
    names = ["conv.weight", "fc.weight", "fc.bias"]
    classic = {"state": {0: {"momentum_buffer": torch.ones(2)}, 2: {"momentum_buffer": 3}},
               "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}]}
    named = by_name(classic, names)
    assert list(named["state"]) == ["conv.weight", "fc.bias"]
    assert named["param_groups"][1] == {"lr": 0.2, "params": ["fc.bias"]}
    assert by_index(named, names) == classic


@pytest.mark.parametrize("argv, words", [
    (["--fsdp", "--ddp-comm-hook", "powersgd"], "--ddp-comm-hook powersgd compresses DDP's"),
    (["--fsdp-zero", "2"], "--fsdp-zero applies to fully sharded training: add --fsdp"),
    (["--fsdp-cpu-offload"], "--fsdp-cpu-offload applies to fully sharded training"),
    (["--fsdp-reduce-dtype", "bf16"], "--fsdp-reduce-dtype applies"),
    (["--sharded-checkpoint"], "--sharded-checkpoint applies to fully sharded training"),
])
def test_refused_combinations(argv, words):
    with pytest.raises(UsageError, match=words):
        parse_config(["data", *argv])


def test_sharded_checkpoint_directory_is_found_even_when_killed_while_it_was_replaced(tmp_path):
    from test_sharded_dirs import tiny_dcp

    from imagenet.checkpoint import files, sharded

    def finished(name: str) -> Path:
        return tiny_dcp(tmp_path / name, mark=name)

    assert files.resolve_resume("auto", tmp_path, False, sharded=True) is None
    files.replace_dir(finished(".checkpoint.dcp.tmp"), tmp_path / "checkpoint.dcp")
    assert files.resolve_resume("auto", tmp_path, False, sharded=True) == \
        tmp_path / "checkpoint.dcp"
    # A kill between replace_dir's two renames leaves the previous directory aside, only.
    (tmp_path / "checkpoint.dcp").rename(tmp_path / ".checkpoint.dcp.old")
    assert files.resolve_resume(None, tmp_path, True, sharded=True) == \
        tmp_path / ".checkpoint.dcp.old"
    # The next save keeps it until the new one is in place, then cleans up.
    files.replace_dir(finished(".checkpoint.dcp.tmp"), tmp_path / "checkpoint.dcp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.dcp"]
    assert sharded.load_meta(tmp_path / "checkpoint.dcp")["mark"] == ".checkpoint.dcp.tmp"
    # An explicit --resume accepts a directory; the classic file name is not looked for.
    assert files.resolve_resume(str(tmp_path / "checkpoint.dcp"), tmp_path, False) == \
        tmp_path / "checkpoint.dcp"
    with pytest.raises(UsageError, match="no checkpoint at"):
        files.resolve_resume(str(tmp_path / "missing.dcp"), tmp_path, False, sharded=True)


@pytest.mark.slow
def test_env_check_with_fsdp_trains_one_sharded_step():
    from helpers import run_main

    proc = run_main("--env-check", "--fsdp", "-a", "resnet18", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS FSDP step: a small ViT in 3 units over 2 rank(s): one sharded SGD step equals " \
           "the unsharded one" in proc.stdout, proc.stdout
