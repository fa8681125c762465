"""recipes/*.toml: each states its targets, source, hardware and command, parses, and trains two
steps on tiny data; config.json records the file; a resume with an edited recipe says what
changed."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torchvision
from helpers import ROOT, SMALL_ARCH, TINY, load_checkpoint, write_image_folder

from imagenet.cli import main
from imagenet.settings.flags import parse_config
from imagenet.settings.recipe import read_toml

RECIPES = sorted((ROOT / "recipes").glob("*.toml"))
# Shrunk for a CPU: 32 px, batch 8, one epoch of 16 images = two steps.
TWO_STEPS = ["-b", "8", "-j", "0", "-p", "1", "--epochs", "1", "--train-crop-size", "32",
             "--val-resize-size", "36", "--val-crop-size", "32"]
# Full-size values of some recipes that a 32 px, one-epoch run cannot use, and their stand-ins.
SHRUNK = {"train-crop-start": ["32"], "train-crop-ramp": ["0", "1"],
          "train-crop-multiple": ["16"]}


@pytest.fixture(scope="module")
def sixteen_images(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("recipes") / "data", classes=2,
                              train_per_class=8, val_per_class=2)


def test_the_promised_recipes_are_there():
    assert {r.name for r in RECIPES} == {"resnet50-classic.toml", "resnet50-torchvision-v2.toml",
                                        "resnet50-ffcv.toml", "resnet18-ffcv.toml", "demo.toml",
                                        "resnet50-rsb-a3.toml", "resnet50-lars-mlperf.toml",
                                        "resnet18-distill.toml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.stem)
def test_each_recipe_states_its_targets_source_hardware_and_command(recipe):
    header = {}
    for line in recipe.read_text().splitlines():
        if not line.startswith("#"):
            break
        field = line[1:].strip().split(":", 1)[0]
        header.setdefault(field, line)
    assert {"Targets", "Source", "Hardware", "Run"} <= header.keys(), recipe.name
    assert "%" in header["Targets"]
    assert "https://" in header["Source"] or "measured for this project" in header["Source"]
    assert f"--config recipes/{recipe.name}" in header["Run"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.stem != "demo"], ids=lambda r: r.stem)
def test_each_recipe_parses_and_trains_two_steps(recipe, sixteen_images, tmp_path):
    keys = read_toml(recipe)
    shrunk = [a for key, values in SHRUNK.items() if key in keys for a in (f"--{key}", *values)]
    if "distill-teacher" in keys:  # a small teacher of the test data's 2 classes, as a file
        teacher = tmp_path / "teacher.pth"
        torch.save(torchvision.models.get_model(SMALL_ARCH, num_classes=2).state_dict(), teacher)
        shrunk += ["--distill-teacher", str(teacher), "--distill-teacher-arch", SMALL_ARCH]
    out = tmp_path / "out"
    assert main([str(sixteen_images), "--config", str(recipe), *TWO_STEPS, *shrunk,
                 "--output-dir", str(out)]) == 0
    assert load_checkpoint(out / "checkpoint.pth.tar")["global_step"] == 2
    record = json.loads((out / "config.json").read_text())
    assert record["config_file"]["path"] == str(recipe)
    assert record["config"]["arch"] == keys["arch"] and record["config"]["batch_size"] == 8
    assert record["config_file"]["values"]["batch_size"] == keys["batch-size"]


@pytest.mark.slow
def test_the_demo_recipe_is_the_demo_and_trains_two_steps(tmp_path, monkeypatch):
    recipe = ROOT / "recipes" / "demo.toml"
    as_file = parse_config(["--config", str(recipe)]).to_dict()
    assert {**as_file, "config": None} == parse_config(["--demo"]).to_dict()
    # The real generator, at the size of the demo tests (10 classes x 3 images of 32 px), for
    # two steps of 15 images instead of the full demo's 1,000 images.
    from imagenet.tools import demo

    small = functools.partial(demo.make_demo_dataset, train_per_class=3, val_per_class=1,
                              image_size=32)
    monkeypatch.setattr(demo, "make_demo_dataset", small)
    out = tmp_path / "out"
    assert main(["--config", str(recipe), *TWO_STEPS, "-b", "15", "--output-dir", str(out)]) == 0
    assert load_checkpoint(out / "checkpoint.pth.tar")["global_step"] == 2


@pytest.mark.slow
def test_an_edited_recipe_on_resume_is_a_changed_flag(image_folder, tmp_path, capsys):
    """A resume with --config is any resume: the file's values are its flags."""
    recipe = tmp_path / "mine.toml"
    recipe.write_text("epochs = 1\nlr = 0.01\nlabel-smoothing = 0.1\n")
    argv = [str(image_folder), *TINY[:-2], "--config", str(recipe), "--output-dir",
            str(tmp_path / "out")]
    assert main(argv) == 0
    recipe.write_text("epochs = 2\nlr = 0.02\nlabel-smoothing = 0.1\n")
    capsys.readouterr()
    assert main([*argv, "--resume", "auto"]) == 0
    changed = [ln for ln in capsys.readouterr().out.splitlines() if "changed since" in ln]
    assert changed == ["=> changed since the checkpoint: --epochs 1 -> 2",
                       "=> changed since the checkpoint: --lr 0.01 -> 0.02"]
    record = json.loads((tmp_path / "out" / "config.json").read_text())
    assert record["config"]["lr"] == 0.02 and record["config"]["label_smoothing"] == 0.1
    assert record["config_file"] == {"path": str(recipe), "values": {
        "epochs": 2, "lr": 0.02, "label_smoothing": 0.1}}
