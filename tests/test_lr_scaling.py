"""--lr-base: a learning rate stated at a reference global batch, scaled (linear or square root)
to the run's own global batch once, in the plan; printed at start, recorded in config.json, kept
by a resume at another world size. --lr alone keeps its classic meaning."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import ROOT, TINY18, child_env, run_main, write_image_folder

from imagenet.errors import UsageError
from imagenet.settings.flags import parse_config
from imagenet.settings.plan import make_plan
from imagenet.settings.recipe import read_toml

RECIPES = sorted((ROOT / "recipes").glob("*.toml"))


def plan_lr(*argv: str, world: int = 1) -> float:
    """The learning rate the plan resolves for ``argv`` in a group of ``world`` processes."""
    cfg = parse_config(["--dummy", *argv])
    return make_plan(cfg, {}, 0, group=(0, world)).cfg.lr


@pytest.mark.parametrize("argv, world, lr", [
    (["--lr", "0.1", "-b", "64"], 1, 0.1),  # --lr alone: as given, at any global batch
    (["--lr", "0.1", "-b", "64"], 8, 0.1),
    (["--lr-base", "0.1", "-b", "64"], 1, 0.1 * 64 / 256),
    (["--lr-base", "0.1", "-b", "64"], 8, 0.1 * 512 / 256),
    (["--lr-base", "0.1", "-b", "64", "--grad-accum-steps", "2"], 4, 0.1 * 512 / 256),
    (["--lr-base", "0.1", "--global-batch-size", "1024"], 2, 0.4),
    (["--lr-base", "0.1", "--global-batch-size", "1024"], 8, 0.4),
    (["--lr-base", "0.5", "--lr-base-size", "1024", "-b", "128"], 8, 0.5),
    (["--lr-base", "0.002", "--lr-base-scale", "sqrt", "-b", "64"], 16, 0.002 * 2),
    (["--lr-base", "0.002", "--lr-base-scale", "sqrt", "-b", "32"], 1, 0.002 / math.sqrt(8)),
])
def test_the_plan_scales_lr_base_to_the_global_batch(argv, world, lr):
    assert plan_lr(*argv, world=world) == pytest.approx(lr, rel=1e-12)


def test_lr_and_lr_base_are_one_or_the_other(tmp_path):
    with pytest.raises(UsageError, match="give either --lr .* or --lr-base"):
        parse_config(["--lr", "0.1", "--lr-base", "0.1"])
    both = tmp_path / "both.toml"
    both.write_text("lr = 0.1\nlr-base = 0.1\n")
    with pytest.raises(UsageError, match=f"--config {both}: sets both lr and lr-base"):
        parse_config(["--config", str(both)])
    file_lr = tmp_path / "lr.toml"
    file_lr.write_text("lr = 0.3\nlr-base-size = 512\n")
    cfg = parse_config(["--config", str(file_lr), "--lr-base", "0.2"])  # the command line wins
    assert (cfg.lr_base, cfg.lr_base_size) == (0.2, 512)
    file_base = tmp_path / "base.toml"
    file_base.write_text("lr-base = 0.2\n")
    cfg = parse_config(["--config", str(file_base), "--learning-rate", "0.05"])
    assert (cfg.lr, cfg.lr_base) == (0.05, None)
    assert plan_lr("--config", str(file_base), "--lr", "0.05", world=8) == 0.05


def test_a_linear_schedule_floor_above_the_scaled_lr_is_refused():
    cfg = parse_config(["--dummy", "--lr-base", "0.1", "-b", "8", "--lr-scheduler", "linear",
                        "--lr-min", "0.01"])
    with pytest.raises(UsageError, match="--lr-min .0.01. must not exceed the learning rate"):
        make_plan(cfg, {}, 0, group=(0, 1))  # 0.1 x 8 / 256 = 0.003125


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.stem != "demo"],
                         ids=lambda r: r.stem)
def test_each_recipe_states_its_reference_batch_and_gives_its_lr_there(recipe):
    keys = read_toml(recipe)
    assert "lr" not in keys and {"lr-base", "lr-base-size"} <= keys.keys()
    text = recipe.read_text()
    assert f"reference batch {keys['lr-base-size']}" in text  # said in words too
    cfg = parse_config(["--config", str(recipe), "--dummy"])
    power = 0.5 if keys.get("lr-base-scale") == "sqrt" else 1.0  # LAMB's recipes: sqrt
    assert make_plan(cfg, {}, 0, group=(0, 1)).cfg.lr == pytest.approx(
        keys["lr-base"] * (cfg.batch_size / keys["lr-base-size"]) ** power)


@pytest.mark.slow
def test_start_up_line_config_json_and_a_resume_at_another_world_size(tmp_path: Path):
    data = write_image_folder(tmp_path / "data", classes=2, train_per_class=8, val_per_class=2)
    out = tmp_path / "out"
    flags = [str(data), *TINY18[:-2], "--lr-base", "0.1", "--lr-base-size", "16",
             "--output-dir", str(out), "--resume", "auto", "--seed", "0"]
    proc = run_main(*flags, "--epochs", "1")  # one process of 8 images: 0.1 x 8 / 16
    assert proc.returncode == 0, proc.stderr
    assert "=> learning rate 0.05 = --lr-base 0.1 x global batch 8 / --lr-base-size 16 " \
           "(linear)" in proc.stdout, proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert (config["config"]["lr"], config["lr"]) == (0.05, 0.05)
    assert config["lr_rule"] == "--lr-base 0.1 x global batch 8 / --lr-base-size 16 (linear)"
    # Two processes of 8 images: global batch 16, the reference: 0.1
    proc = run_main(*flags, "--epochs", "2", "--multiprocessing-distributed", "--nproc-per-node",
                    "2", "-b", "16", env=child_env())
    assert proc.returncode == 0, proc.stderr
    assert "--lr 0.05 -> 0.1" in proc.stdout, proc.stdout
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["lr"]) for r in lines] == [(0, 0.05), (1, 0.1)]
    assert json.loads((out / "config.json").read_text())["lr"] == 0.1
