"""-a timm/NAME: timm models train, checkpoint, evaluate, shard and export like torchvision's;
names are checked with suggestions; --pretrained uses timm's weights, offline one clear line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from helpers import ROOT, TINY18, child_env, load_checkpoint, write_image_folder

from imagenet.cli import main
from imagenet.errors import UsageError
from imagenet.settings.flags import parse_config

ARCH = "timm/test_resnet"  # timm's tiny ResNet (~0.1 M parameters), made for tests


@pytest.fixture(scope="module")
def timm_run(tmp_path_factory) -> tuple[Path, Path]:
    """One epoch of timm's test_resnet with EMA and channels-last, through main()."""
    base = tmp_path_factory.mktemp("timm")
    data = write_image_folder(base / "data")
    out = base / "out"
    code = main([str(data), *TINY18, "-a", ARCH, "--model-ema", "--model-ema-steps", "1",
                 "--channels-last", "--epochs", "1", "--seed", "0", "--output-dir", str(out)])
    assert code == 0
    return data, out


def test_a_timm_model_trains_and_checkpoints_like_a_torchvision_one(timm_run):
    _, out = timm_run
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert ckpt["arch"] == ARCH and ckpt["num_classes"] == 3
    assert ckpt["classes"] == ["class0", "class1", "class2"]
    assert ckpt["state_dict"]["fc.weight"].shape[0] == 3  # the data set's classes
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in ckpt["state_dict"])
    ema = load_checkpoint(out / "model_best_ema.pth.tar")
    assert ema["arch"] == ARCH and ema["state_dict"].keys() == ckpt["state_dict"].keys()


def test_evaluate_resumes_the_timm_checkpoint(timm_run, capsys):
    data, out = timm_run
    best = load_checkpoint(out / "model_best.pth.tar")
    code = main([str(data), *TINY18, "-a", ARCH, "-e", "--resume", str(out / "model_best.pth.tar"),
                 "--output-dir", str(out / "eval")])
    assert code == 0
    top1 = re.search(r" \* Acc@1 ([\d.]+)", capsys.readouterr().out)
    assert top1 and float(top1.group(1)) == pytest.approx(best["best_acc1"], abs=1e-3)
    capsys.readouterr()
    code = main([str(data), *TINY18, "-e", "--resume", str(out / "model_best.pth.tar"),
                 "--output-dir", str(out / "eval")])  # -a resnet18: not what was trained
    assert code == 1
    assert f"was saved for -a {ARCH}, but this run uses -a resnet18" in capsys.readouterr().err


def test_torch_export_of_the_trained_timm_model(timm_run):
    """Nothing in the model path (build, checkpoint) keeps a timm model from torch.export."""
    from imagenet.training.models import build_model

    _, out = timm_run
    model = build_model(ARCH, 3)
    model.load_state_dict(load_checkpoint(out / "model_best.pth.tar")["state_dict"])
    model.eval()
    x = torch.randn(2, 3, 32, 32)
    exported = torch.export.export(model, (x,))
    with torch.no_grad():
        assert torch.allclose(exported.module()(x), model(x), atol=1e-5)


@pytest.mark.parametrize("name, blocks", [("test_resnet", {"BasicBlock"}),
                                          ("test_vit", {"Block"}),
                                          ("test_convnext", {"ConvNeXtBlock"})])
def test_fsdp_units_are_timms_repeated_blocks(name, blocks):
    from imagenet.training.fsdp import repeated_blocks

    model = timm.create_model(name, num_classes=3)
    units = repeated_blocks(model)
    found = {type(u).__name__ for u in units}
    assert blocks <= found, found
    share = sum(p.numel() for u in units for p in u.parameters()) / \
        sum(p.numel() for p in model.parameters())
    assert share > 0.5  # most of the weights are sharded in blocks, not kept by the root


@pytest.mark.parametrize("argv, words", [
    (["-a", "timm/resnet19"], "-a/--arch: timm has no model 'resnet19'; did you mean "
                              "timm/resnet18"),
    (["-a", "timm/resnet18.nosuchtag"], "timm has no weights tagged 'nosuchtag' for resnet18; it "
                                        "has resnet18.a1_in1k"),
    (["-a", "timm/resnet18", "--weights", "IMAGENET1K_V1"],
     "for timm's, put the tag in the name and add --pretrained: -a timm/resnet18.TAG"),
    (["-a", "timm/botnet50ts_256", "--pretrained"], "timm has no pretrained weights for "
                                                    "botnet50ts_256 (drop --pretrained"),
])
def test_bad_timm_names_are_one_error_with_suggestions(argv, words):
    with pytest.raises(UsageError) as err:
        parse_config(argv)
    assert words in str(err.value)


def test_a_tagged_timm_name_parses():
    assert parse_config(["-a", "timm/resnet18.a1_in1k", "--pretrained"]).arch == \
        "timm/resnet18.a1_in1k"


OFFLINE_THEN_CACHED = """
import sys
from pathlib import Path
import timm, torch
from safetensors.torch import save_file
from imagenet.errors import RunError
from imagenet.training.models import build_model

try:
    build_model("timm/test_resnet", 3, pretrained=True)
    sys.exit("loaded weights that are nowhere")
except RunError as exc:
    print(exc)
reference = timm.create_model("test_resnet")  # what the hub would have given
repo = Path(sys.argv[1]) / "hub" / "models--timm--test_resnet.r160_in1k"
snapshot = repo / "snapshots" / ("0" * 40)
snapshot.mkdir(parents=True)
(repo / "refs").mkdir()
(repo / "refs" / "main").write_text("0" * 40)
save_file(reference.state_dict(), snapshot / "model.safetensors")
model = build_model("timm/test_resnet", 3, pretrained=True)
assert torch.equal(model.conv1[0].weight, reference.conv1[0].weight)
assert model.fc.weight.shape[0] == 3
print("loaded from the cache")
"""


@pytest.mark.slow
def test_pretrained_uses_timms_weights_and_offline_says_where_to_put_them(tmp_path):
    env = child_env(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run([sys.executable, "-c", OFFLINE_THEN_CACHED, str(tmp_path / "hf")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()[:2]
    assert first.startswith("cannot load pretrained weights test_resnet.r160_in1k for "
                            "timm/test_resnet (")
    assert f"Offline? Put them in the Hugging Face cache {tmp_path / 'hf' / 'hub'}" in first
    assert "`hf download timm/test_resnet.r160_in1k`" in first
    assert second == "loaded from the cache"
