"""Which value wins: defaults < a recipe file < the command line, for every spelling argparse
accepts; switches a file turns on can be turned off; --demo fills only what was not given."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import ROOT

from imagenet.errors import UsageError
from imagenet.settings.flags import DEMO_DEFAULTS, Config, get_args_parser, parse_config

RECIPES = sorted((ROOT / "recipes").glob("*.toml"))


def _recipe(tmp_path: Path, text: str, name: str = "recipe.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.stem)
def test_global_batch_size_on_the_command_line_beats_a_recipes_batch_size(recipe):
    cfg = parse_config(["--config", str(recipe), "--global-batch-size", "64"])
    assert cfg.global_batch_size == 64
    assert cfg.batch_size == Config.batch_size  # the file's -b is set aside, not combined


def test_batch_size_on_the_command_line_beats_a_files_global_batch_size(tmp_path):
    path = _recipe(tmp_path, "global-batch-size = 1024\nepochs = 3\n")
    cfg = parse_config(["--config", path, "-b32"])
    assert (cfg.batch_size, cfg.global_batch_size, cfg.epochs) == (32, None, 3)
    assert parse_config(["--config", path]).global_batch_size == 1024


@pytest.mark.parametrize("argv", [["-b", "32", "--global-batch-size", "64"],
                                  ["-b32", "--global-batch-size", "64"],
                                  ["--batch=32", "--global-batch-size=64"],
                                  ["--batch-s", "32", "--global", "64"]])
def test_both_batch_flags_on_one_level_are_refused_in_any_spelling(argv):
    with pytest.raises(UsageError, match="give either -b/--batch-size"):
        parse_config(argv)


def test_both_batch_keys_in_one_file_are_refused(tmp_path):
    path = _recipe(tmp_path, "batch-size = 32\nglobal-batch-size = 64\n")
    with pytest.raises(UsageError, match=f"--config {path}: .*batch-size.*global-batch-size"):
        parse_config(["--config", path])


def test_every_switch_has_an_off_form_that_beats_a_file(tmp_path):
    switches = [a for a in get_args_parser()._actions if a.nargs == 0 and a.dest != "help"]
    assert len(switches) >= 15
    text = "".join(f"{a.dest} = true\n" for a in switches
                   if a.dest in ("tta_flip", "channels_last", "model_ema", "sync_bn", "compile",
                                 "no_accel", "pretrained"))
    path = _recipe(tmp_path, text + 'amp = "bf16"\nauto-augment = "ta_wide"\nclip-grad-norm = 1\n')
    on = parse_config(["--config", path])
    assert on.tta_flip and on.channels_last and on.model_ema and on.no_accel and on.pretrained
    assert (on.amp, on.auto_augment, on.clip_grad_norm) == ("bf16", "ta_wide", 1.0)
    off = parse_config(["--config", path, "--no-tta-flip", "--no-channels-last",
                        "--no-model-ema", "--no-sync-bn", "--no-compile", "--accel",
                        "--no-pretrained", "--amp", "off", "--auto-augment", "none",
                        "--clip-grad-norm", "none"])
    assert not (off.tta_flip or off.channels_last or off.model_ema or off.sync_bn
                or off.compile or off.no_accel or off.pretrained)
    assert (off.amp, off.auto_augment, off.clip_grad_norm) == (None, None, None)
    for action in switches:  # each switch can be said both ways on the command line
        on_names = [o for o in action.option_strings if o not in action.negatives]
        assert action.negatives, action.dest
        assert getattr(parse_config([on_names[-1], action.negatives[0]]), action.dest) is False


def test_a_file_cannot_use_the_off_spelling_as_a_key(tmp_path):
    with pytest.raises(UsageError, match="unknown key 'no-tta-flip'"):
        parse_config(["--config", _recipe(tmp_path, "no-tta-flip = true\n")])


@pytest.mark.parametrize("value, seconds", [("5400", "5400"), ("5400.5", "5400.5"),
                                            ('"01:30:00"', "01:30:00"), ('"slurm"', "slurm")])
def test_a_files_time_limit_may_be_a_number(tmp_path, value, seconds):
    cfg = parse_config(["--config", _recipe(tmp_path, f"time-limit = {value}\n")])
    assert cfg.time_limit == seconds


def test_a_files_bad_time_limit_is_one_line_naming_the_flag(tmp_path):
    with pytest.raises(UsageError, match="--time-limit '-3' is not a duration"):
        parse_config(["--config", _recipe(tmp_path, "time-limit = -3\n")])


@pytest.mark.parametrize("argv, field, value", [
    (["-b32"], "batch_size", 32),
    (["-j0"], "workers", 0),
    (["-p1"], "print_freq", 1),
    (["--epoch", "2"], "epochs", 2),
    (["--epoch=2"], "epochs", 2),
    (["--batch", "16"], "batch_size", 16),
    (["--learning-rate", "0.5"], "lr", 0.5),
    (["--learn", "0.5"], "lr", 0.5),
    (["--weight-d", "0"], "weight_decay", 0.0),
    (["--lr-sch", "step"], "lr_scheduler", "step"),
    (["--train-crop-si", "64"], "train_crop_size", 64),
])
def test_demo_never_overrides_a_flag_given_in_any_spelling(argv, field, value):
    cfg = parse_config(["--demo", *argv])
    assert getattr(cfg, field) == value
    others = {k: v for k, v in DEMO_DEFAULTS.items() if k != field}
    assert all(getattr(cfg, k) == v for k, v in others.items())  # the rest: the demo's


def test_demo_with_a_flag_given_at_its_default_keeps_it():
    cfg = parse_config(["--demo", "-b", "256", "--opt=sgd", "--lr", "0.1"])
    assert (cfg.batch_size, cfg.opt, cfg.lr) == (256, "sgd", 0.1)


# Two values of each flag (the sweep below), where the flag's type does not give them.
SAMPLES = {"time_limit": [5400, "01:00:00"], "log_to": ["none", "mlflow"], "data": ["/x", "/y"],
           "dist_url": ["tcp://h:1234", "file:///tmp/x"], "arch": ["resnet50", "resnet34"],
           "weights": ["IMAGENET1K_V1", "IMAGENET1K_V2"], "train_crop_start": [64, 96],
           "world_size": [2, 3], "rank": [0, 1], "train_crop_ramp": [[1, 3], [2, 4]],
           "lr_milestones": [[40, 50], [60]]}
FRACTIONS = {"class_balanced_loss", "random_erase", "label_smoothing", "train_crop_scale",
             "backbone_lr_scale", "lr_warmup_decay", "lr_gamma", "lr_min", "momentum",
             "model_ema_decay"}
NEEDS = {"fsdp_zero": ["--fsdp"], "fsdp_cpu_offload": ["--fsdp"], "fsdp_reduce_dtype": ["--fsdp"],
         "sharded_checkpoint": ["--fsdp"], "compile_mode": ["--compile"],
         "train_crop_start": ["--train-crop-ramp", "1", "2"],
         "train_crop_ramp": ["--train-crop-start", "64"], "weights": ["-a", "resnet50"],
         "bce_target_thresh": ["--bce-loss"],
         "distill_teacher_arch": ["--distill-teacher", "teacher.pth"]}
OFF_WORDS = ("off", "none")
SWEPT = [a for a in get_args_parser()._actions
         if a.dest not in ("help", "config", "local_rank", "env_check")]


def _words(value) -> list[str]:
    """A value as command-line words."""
    return [str(x) for x in value] if isinstance(value, list) else [str(value)]


def _values(action) -> list:
    if action.dest in SAMPLES:
        return SAMPLES[action.dest]
    if action.nargs == 0:
        return [True]
    if action.choices:
        return [c for c in action.choices if c != action.default and c not in OFF_WORDS][:2]
    if action.dest in FRACTIONS:
        return [0.5, 0.25]
    kind = getattr(action.type, "__name__", "str")
    return {"int": [64, 32], "float": [0.5, 0.25]}.get(kind, ["abc", "def"])


@pytest.mark.parametrize("action", SWEPT, ids=lambda a: a.dest)
def test_every_flag_reads_the_same_from_a_file_and_the_command_line_wins(action, tmp_path):
    import json

    first, *second = _values(action)
    longs = [o for o in action.option_strings
             if o.startswith("--") and o not in getattr(action, "negatives", ())]
    key, flag = (longs[0][2:], longs[0]) if longs else (action.dest, None)
    base = [] if action.dest in ("data", "demo") else ["/d"]
    extra = NEEDS.get(action.dest, [])
    path = _recipe(tmp_path, f"{key} = {json.dumps(first)}\n")
    from_file = parse_config([*base, "--config", path, *extra]).to_dict()
    said = [flag] if action.nargs == 0 else ([flag] if flag else []) + _words(first)
    from_line = parse_config([*base, *said, *extra]).to_dict()
    assert {**from_file, "config": None} == from_line
    if action.nargs == 0:
        over, want = [action.negatives[0]], False
    elif second:
        over, want = ([flag] if flag else []) + _words(second[0]), second[0]
    else:
        return
    got = getattr(parse_config([*base, "--config", path, *over, *extra]), action.dest)
    assert (list(got) if isinstance(got, tuple) else got) == want
