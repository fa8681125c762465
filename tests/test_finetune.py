"""--finetune, --freeze-backbone, --backbone-lr-scale, --class-balanced-loss, and the per-image and
per-class results of -e and of the last epoch.

The start checkpoints are written here (a seeded resnet18 with BatchNorm statistics that are not
the defaults, so a reset or an update shows) in each format people bring; the runs are real
main.py processes: DDP and --fsdp at world size 2, and one process resumed.
"""

from __future__ import annotations

import csv
import io
import re
import shutil
from pathlib import Path

import pytest
import torch
import torchvision
from helpers import (
    TINY18,
    child_env,
    load_checkpoint,
    prestarted_cmd,
    run_parallel,
    write_image_folder,
)
from torch import nn

from imagenet.checkpoint.weights import read_weights
from imagenet.errors import CheckpointError
from imagenet.reporting import results as reports
from imagenet.settings.flags import parse_config
from imagenet.training.finetune import (
    BackboneInEval,
    classifier_names,
    fit_state,
    freeze_backbone,
    head_rows,
)
from imagenet.training.optim import build_optimizer, class_weights, rebuild_schedule

SPAWN2 = ["--multiprocessing-distributed", "--nproc-per-node", "2"]
ACC1 = re.compile(r" \* Acc@1 (\d+\.\d+) ")


def start_model(classes: int = 3) -> nn.Module:
    """A seeded resnet18 whose BatchNorm statistics and counters are not the defaults."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=classes)
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            m.num_batches_tracked.fill_(7)
    return model


def backbone(state: dict, prefix: str = "") -> dict:
    return {k[len(prefix):]: v for k, v in state.items()
            if k.startswith(prefix) and not k[len(prefix):].startswith("fc.")}


def assert_bitwise(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    changed = [k for k in want if not torch.equal(got[k], want[k])]
    assert not changed, changed


def rename_classes(root: Path, names: dict[str, str]) -> Path:
    for split in ("train", "val"):
        for old, new in names.items():
            (root / split / old).rename(root / split / new)
    return root


def last_acc1(output: str) -> float:
    return float(ACC1.findall(output)[-1])


def read_csv(path: Path) -> list[dict]:
    return list(csv.DictReader(io.StringIO(path.read_text())))


# ---------------------------------------------------------------- in-process units

@pytest.mark.parametrize("arch, head", [("resnet18", "fc"), ("mobilenet_v3_small", "classifier.3"),
                                        ("squeezenet1_1", "classifier.1"),
                                        ("vit_b_16", "heads.head")])
def test_the_classifier_is_found_in_torchvision_models(arch, head):
    assert classifier_names(torchvision.models.get_model(arch, num_classes=7), 7) == (head,)


@pytest.mark.slow
def test_timm_classifiers_one_head_or_two():
    """timm models name their classifier (``get_classifier``); distilled ones have two, and
    a linear probe trains both."""
    import timm

    assert classifier_names(timm.create_model("convnext_atto", num_classes=7), 7) == ("head.fc",)
    model = timm.create_model("deit_tiny_distilled_patch16_224", num_classes=7, img_size=32)
    assert classifier_names(model, 7) == ("head", "head_dist")
    freeze_backbone(model, ("head", "head_dist"))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == \
        {"head.weight", "head.bias", "head_dist.weight", "head_dist.bias"}
    model.train()
    assert model.training and model.head.training and not model.blocks[0].training


@pytest.mark.slow
def test_every_file_format_gives_the_same_weights(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    state = start_model().state_dict()
    ours = {"state_dict": state, "arch": "resnet18", "classes": ["a", "b", "c"], "epoch": 3}
    classic = {"epoch": 90, "arch": "resnet18", "best_acc1": torch.tensor(69.7),
               "state_dict": {f"module.{k}": v for k, v in state.items()}}
    files = {"ours.pth.tar": ours, "classic.pth.tar": classic, "plain.pth": state,
             "refs.pth": {"model": state, "epoch": 5}}
    for name, obj in files.items():
        torch.save(obj, tmp_path / name)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "w.safetensors")
    dcp.save({"state_dict": dict(state)}, checkpoint_id=tmp_path / "best.dcp", no_dist=True)
    torch.save({**ours, "state_dict": None},  # as --sharded-checkpoint writes it
               tmp_path / "best.dcp" / "trainer_state.pth.tar")
    for name in [*files, "w.safetensors", "best.dcp"]:
        weights = read_weights(tmp_path / name)
        assert_bitwise(weights.state, state)
        assert weights.classes == (["a", "b", "c"] if name in ("ours.pth.tar", "best.dcp")
                                   else None), name


def test_fit_state_reinitialises_a_classifier_of_another_class_count():
    saved, own = start_model(1000).state_dict(), start_model(5).state_dict()
    fit = fit_state(own, saved, ("fc",), head_rows(None, list("abcde")))
    assert list(fit.reinit) == ["fc.weight", "fc.bias"]
    assert fit.describe(5) == ("re-initialised fc.weight ((1000, 512) in the file, (5, 512) "
                               "here), fc.bias ((1000,) in the file, (5,) here)")
    assert_bitwise(backbone(fit.state), backbone(saved))
    assert fit.state["fc.weight"] is own["fc.weight"]


def test_fit_state_matches_classifier_rows_by_class_name():
    saved, own = start_model(3).state_dict(), start_model(3).state_dict()
    own = {k: (torch.zeros_like(v) if k.startswith("fc.") else v) for k, v in own.items()}
    # A subset in another order, plus a class the file does not know.
    fit = fit_state(own, saved, ("fc",), head_rows(["cat", "dog", "fox"], ["fox", "cat", "owl"]))
    assert torch.equal(fit.state["fc.weight"][0], saved["fc.weight"][2])
    assert torch.equal(fit.state["fc.weight"][1], saved["fc.weight"][0])
    assert torch.equal(fit.state["fc.weight"][2], own["fc.weight"][2])  # owl: its own init
    assert fit.rows_kept == 2 and not fit.reinit
    none_common = fit_state(own, saved, ("fc",), head_rows(["cat", "dog", "fox"], ["x", "y", "z"]))
    assert set(none_common.reinit) == {"fc.weight", "fc.bias"}
    assert none_common.reinit["fc.weight"] == "other class names"


def test_fit_state_names_keys_that_do_not_fit():
    own = start_model().state_dict()
    saved = {k: v for k, v in own.items() if k != "layer1.0.conv1.weight"}
    saved["projector.weight"] = torch.zeros(2)
    with pytest.raises(CheckpointError, match="missing layer1.0.conv1.weight; unexpected "
                                              "projector.weight"):
        fit_state(own, saved, ("fc",), None)
    # Files older than BatchNorm's counter load; the classifier may be absent (re-initialised).
    old = {k: v for k, v in own.items() if "num_batches_tracked" not in k and
           not k.startswith("fc.")}
    fit = fit_state(own, old, ("fc",), None)
    assert list(fit.reinit) == ["fc.weight", "fc.bias"]


def test_frozen_backbone_stays_in_eval_mode_through_wrappers():
    model = torchvision.models.mobilenet_v3_small(num_classes=4)
    freeze_backbone(model, ("classifier.3",))
    ema = torch.optim.swa_utils.AveragedModel(model)  # a deep copy keeps the behaviour
    for m in (model, ema.module):
        m.train()
        modes = {name: sub.training for name, sub in m.named_modules()}
        assert modes[""] and modes["classifier"] and modes["classifier.3"]
        assert not modes["features.0.1"] and not modes["classifier.2"]  # BatchNorm, Dropout
        assert isinstance(m, BackboneInEval)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained == ["classifier.3.weight", "classifier.3.bias"]
    assert build_optimizer(model, parse_config(["d"])).param_groups[0]["params"] == \
        [model.classifier[3].weight, model.classifier[3].bias]


def test_backbone_lr_scale_survives_the_schedule_and_its_rebuild():
    cfg = parse_config(["d", "--lr", "0.4", "--backbone-lr-scale", "0.1", "--lr-scheduler",
                        "cosine", "--lr-warmup-epochs", "1", "--epochs", "4", "--wd", "0.01",
                        "--norm-weight-decay", "0"])
    from imagenet.training.optim import build_scheduler

    def lrs(optimizer):
        return [g["lr"] for g in optimizer.param_groups]

    model = start_model()
    optimizer = build_optimizer(model, cfg, head=("fc",))
    assert [g["lr_scale"] for g in optimizer.param_groups] == [1.0, 0.1, 0.1]
    assert optimizer.param_groups[0]["params"] == [model.fc.weight, model.fc.bias]
    scheduler = build_scheduler(optimizer, cfg, 5)
    seen = []
    for _ in range(13):
        optimizer.step()
        scheduler.step()
        seen.append(lrs(optimizer))
    # A resume rebuilds the schedule from the flags at step 7: every group continues as it was.
    resumed = build_optimizer(model, cfg, head=("fc",))
    rebuild_schedule(resumed, cfg, 5, 7).step()
    assert lrs(resumed) == pytest.approx(seen[7], rel=1e-12)
    assert seen[7][1] == pytest.approx(0.1 * seen[7][0], rel=1e-12)


def test_class_weights_effective_number_and_inverse_frequency():
    counts = [100, 10, 1]
    inverse = class_weights(counts, 1.0)
    assert inverse.tolist() == pytest.approx([3 * w / sum([0.01, 0.1, 1]) for w in
                                              (0.01, 0.1, 1)])
    assert class_weights(counts, 0.0).tolist() == pytest.approx([1, 1, 1])
    beta = 0.9
    effective = [(1 - beta) / (1 - beta ** n) for n in counts]
    assert class_weights(counts, beta).tolist() == pytest.approx(
        [3 * e / sum(effective) for e in effective])


# ---------------------------------------------------------------- real runs

@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The start files and data, then five runs: a linear probe under DDP (EMA, channels-last,
    --tta-flip, --predictions) and under --fsdp, a full fine-tune with --backbone-lr-scale and
    --class-balanced-loss resumed for a second epoch, and -e of its checkpoint on another
    folder at world size 2."""
    base = tmp_path_factory.mktemp("finetune")
    state = start_model().state_dict()
    torch.save({"state_dict": state, "arch": "resnet18", "classes": ["class0", "class1",
                                                                     "class2"]},
               base / "ours.pth.tar")
    torch.save({"epoch": 90, "arch": "resnet18", "best_acc1": torch.tensor(50.0),
                "state_dict": {f"module.{k}": v for k, v in state.items()}},
               base / "classic.pth.tar")
    torch.save(state, base / "plain.pth")
    fruit = rename_classes(write_image_folder(base / "fruit", classes=2, val_per_class=3),
                           {"class0": "apple", "class1": "pear"})
    shapes = write_image_folder(base / "shapes", classes=3)
    for name in ("img0", "img1", "img2", "img3", "img4"):  # an imbalanced class: 3 of 8 left
        (shapes / "train" / "class0" / f"{name}.jpg").unlink()
    other = base / "other"  # two of the three classes (another order of labels), 7 images
    shutil.copytree(shapes / "val" / "class2", other / "class2")
    shutil.copytree(shapes / "val" / "class0", other / "class0")
    shutil.copy(shapes / "train" / "class0" / "img5.jpg", other / "class0" / "extra.jpg")
    common = [*TINY18, "--seed", "0", "--epochs", "1"]
    lr = ["--lr-scheduler", "step", "--lr-step-size", "1", "--lr-gamma", "0.5"]
    cmds = {
        "probe": prestarted_cmd(str(fruit), *common, *SPAWN2, "--finetune",
                                str(base / "ours.pth.tar"), "--freeze-backbone", "--model-ema",
                                "--model-ema-steps", "1000", "--channels-last", "--tta-flip",
                                "--predictions", str(base / "probe.csv"), "--output-dir",
                                str(base / "probe")),
        "fsdp": prestarted_cmd(str(shapes), *common, *SPAWN2, "--fsdp", "--finetune",
                               str(base / "classic.pth.tar"), "--freeze-backbone", "--output-dir",
                               str(base / "fsdp")),
        "full": prestarted_cmd(str(shapes), *common, *lr, "--finetune", str(base / "plain.pth"),
                               "--backbone-lr-scale", "0.25", "--class-balanced-loss", "0.9",
                               "--output-dir", str(base / "full")),
    }
    cmds["resumed"] = [*cmds["full"], "--epochs", "2", "--resume", "auto"]
    cmds["eval"] = prestarted_cmd(*TINY18, *SPAWN2, "-b", "2", "-e", "--resume",
                                  str(base / "full" / "checkpoint.pth.tar"), "--val-data",
                                  str(other), "--tta-flip", "--predictions",
                                  str(base / "eval.csv"), "--output-dir", str(base / "eval"))
    outputs = {}
    for name, cmd in cmds.items():
        done = run_parallel([cmd], [child_env()], base / f"log-{name}", timeout=600)[0]
        assert done.returncode == 0, f"{name}:\n{done.stdout}\n{done.stderr}"
        outputs[name] = done.stdout
        if name == "full":
            shutil.copy(base / "full" / "checkpoint.pth.tar", base / "full-epoch1.pth.tar")
    return {"base": base, "state": state, "out": outputs, "other": other}


@pytest.mark.slow
def test_linear_probe_under_ddp_leaves_every_backbone_tensor_bitwise_unchanged(runs):
    out, base, state = runs["out"]["probe"], runs["base"], runs["state"]
    assert ("re-initialised fc.weight (other class names), fc.bias (other class names)" in
            out), out
    assert "only fc trains (1026 of 11177538 parameters)" in out, out
    ckpt = load_checkpoint(base / "probe" / "checkpoint.pth.tar")
    assert_bitwise(backbone(ckpt["state_dict"]), backbone(state))  # BatchNorm buffers too
    assert not torch.equal(ckpt["state_dict"]["fc.bias"], torch.zeros(2))
    # The EMA copy was made from the loaded weights (no update ran: --model-ema-steps 1000).
    assert_bitwise(backbone(ckpt["ema"], "module."), backbone(state))
    groups = ckpt["optimizer"]["param_groups"]
    assert [len(g["params"]) for g in groups] == [2]  # the classifier's weight and bias alone


@pytest.mark.slow
def test_linear_probe_under_fsdp_from_the_classic_file(runs):
    out, base, state = runs["out"]["fsdp"], runs["base"], runs["state"]
    assert "=> FSDP over 2 processes" in out, out
    assert "122 of 122 tensors from the file; every tensor loaded" in out, out
    ckpt = load_checkpoint(base / "fsdp" / "checkpoint.pth.tar")
    assert_bitwise(backbone(ckpt["state_dict"]), backbone(state))
    assert not torch.equal(ckpt["state_dict"]["fc.weight"], state["fc.weight"])


@pytest.mark.slow
def test_predictions_of_the_last_epoch_match_the_printed_top1(runs):
    out, base = runs["out"]["probe"], runs["base"]
    rows = read_csv(base / "probe.csv")
    val = sorted(str(p) for p in (base / "fruit" / "val").rglob("*.jpg"))
    assert sorted(r["path"] for r in rows) == val  # every image exactly once, 2 ranks
    assert [r["target"] for r in rows] == [Path(r["path"]).parent.name for r in rows]
    correct = sum(r["pred"] == r["target"] for r in rows)
    assert 100 * correct / len(rows) == pytest.approx(last_acc1(out), abs=5e-4)
    per_class = read_csv(base / "probe" / "per_class.csv")
    assert [(r["class"], r["train_images"], r["val_images"]) for r in per_class] == \
        [("apple", "8", "3"), ("pear", "8", "3")]
    assert " * per class: mean Acc@1 " in out


@pytest.mark.slow
def test_full_finetune_keeps_the_backbone_lr_scale_through_a_resume(runs):
    out, base = runs["out"], runs["base"]
    assert "class-balanced loss (BETA 0.9): class weights" in out["full"], out["full"]
    assert "122 of 122 tensors from the file; every tensor loaded" in out["full"]
    # --lr 0.01, StepLR x0.5 after each epoch (3 steps: 19 images / -b 8): a fresh run's values.
    for path, epoch, lr in ((base / "full-epoch1.pth.tar", 1, 0.005),
                            (base / "full" / "checkpoint.pth.tar", 2, 0.0025)):
        ckpt = load_checkpoint(path)
        assert ckpt["epoch"] == epoch and ckpt["train_class_counts"] == [3, 8, 8]
        head, rest = ckpt["optimizer"]["param_groups"]
        assert (len(head["params"]), head["lr_scale"], rest["lr_scale"]) == (2, 1.0, 0.25)
        assert (head["lr"], rest["lr"]) == pytest.approx((lr, 0.25 * lr), rel=1e-12)


@pytest.mark.slow
def test_eval_on_another_folder_at_world_size_2(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, base = runs["out"]["eval"], runs["base"]
    assert "7 images of 2 of the 3 classes (none of class1)" in out, out
    rows = read_csv(base / "eval.csv")
    assert sorted(r["path"] for r in rows) == sorted(str(p) for p in
                                                     runs["other"].rglob("*.jpg"))
    assert 100 * sum(r["pred"] == r["target"] for r in rows) / 7 == \
        pytest.approx(last_acc1(out), abs=5e-4)
    per_class = read_csv(base / "eval" / "per_class.csv")
    assert [(r["class"], r["train_images"], r["val_images"]) for r in per_class] == \
        [("class0", "3", "4"), ("class1", "8", "0"), ("class2", "8", "3")]
    assert per_class[1]["acc1"] == ""
    classes = ["class0", "class1", "class2"]
    index = {c: i for i, c in enumerate(classes)}
    confusion = reports.confusion_matrix(torch.tensor([index[r["target"]] for r in rows]),
                                         torch.tensor([index[r["pred"]] for r in rows]), 3)
    events = EventAccumulator(str(base / "eval" / "tb"), size_guidance={"images": 0})
    events.Reload()
    (image,) = events.Images("eval/confusion_matrix")
    from torchvision.io import decode_png

    png = decode_png(torch.frombuffer(bytearray(image.encoded_image_string), dtype=torch.uint8))
    assert torch.equal(png, reports.confusion_image(confusion))


@pytest.mark.slow
def test_tta_flip_averages_the_softmax_of_each_image_and_its_mirror(runs):
    from imagenet.data import transforms as T

    model = torchvision.models.resnet18(num_classes=3).eval()
    model.load_state_dict(load_checkpoint(runs["base"] / "full" / "checkpoint.pth.tar")
                          ["state_dict"])
    row = read_csv(runs["base"] / "eval.csv")[0]
    image = T.val_transform(36, 32, "bilinear", backend="tensor")(
        T.load_image(row["path"], "tensor"))
    x = T.normalize(image.unsqueeze(0))
    with torch.no_grad():
        mean = (model(x).softmax(1) + model(x.flip(3)).softmax(1)) / 2
    assert row["pred"] == f"class{int(mean.argmax())}"
    assert float(row["confidence"]) == pytest.approx(float(mean.max()), abs=2e-6)
    top5 = [float(p) for p in row["top5_confidence"].split("|")]
    assert top5 == pytest.approx(sorted(mean[0].tolist(), reverse=True), abs=2e-6)


@pytest.mark.parametrize("arch", ["googlenet", "inception_v3"])
@pytest.mark.slow
def test_torchvision_files_with_aux_heads_finetune_and_evaluate(arch, tmp_path):
    """torchvision's GoogLeNet and Inception-v3 .pth files hold the aux classifiers, which the
    trainer's models drop: their keys are not used, and say so; the rest loads."""
    from imagenet.checkpoint.files import load_model_state
    from imagenet.training.finetune import prepare_model
    from imagenet.training.models import build_model

    torch.manual_seed(0)
    published = torchvision.models.get_model(arch, weights=None, aux_logits=True,
                                             init_weights=False, num_classes=10).state_dict()
    assert any(k.startswith(("aux1.", "AuxLogits.")) for k in published)
    path = tmp_path / f"{arch}.pth"
    torch.save(published, path)
    model = build_model(arch, 3, False, None)
    cfg = parse_config(["d", "-a", arch, "--finetune", str(path)])
    prepare_model(model, cfg, ["a", "b", "c"], read_weights(path))
    state = model.state_dict()
    assert_bitwise({k: v for k, v in state.items() if not k.startswith("fc.")},
                   {k: v for k, v in published.items() if k in state and not k.startswith("fc.")})
    # -e --resume of the same file at its own class count
    model = build_model(arch, 10, False, None)
    load_model_state(model, {"state_dict": published}, path, arch)
    assert torch.equal(model.state_dict()["fc.weight"], published["fc.weight"])
