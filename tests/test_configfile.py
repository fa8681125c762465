"""Recipe files (--config FILE.toml): precedence over defaults, under the command line; key
spellings; --demo; one clear error for every bad file; Python without tomllib."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from imagenet.errors import UsageError
from imagenet.settings.flags import DEMO_DEFAULTS, parse_config


def _recipe(tmp_path: Path, text: str, name: str = "recipe.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_file_values_replace_defaults_and_the_command_line_replaces_both(tmp_path):
    path = _recipe(tmp_path, 'data = "/data/in"\narch = "resnet50"\nepochs = 600\nlr = 1\n'
                             'lr-scheduler = "cosine"\nmodel-ema = true\n'
                             'lr_milestones = [5, 9]\nweight-decay = 2e-5\n')
    cfg = parse_config(["--config", path])
    assert (cfg.data, cfg.arch, cfg.epochs, cfg.lr) == ("/data/in", "resnet50", 600, 1.0)
    assert isinstance(cfg.lr, float) and cfg.lr_scheduler == "cosine" and cfg.model_ema
    assert (cfg.lr_milestones, cfg.weight_decay, cfg.config) == ((5, 9), 2e-5, path)
    assert cfg.batch_size == 256  # not in the file: the flag's default
    cfg = parse_config(["/other", "--config", path, "--epochs=2", "-a", "resnet18",
                        "--lr-milestones", "3", "--wd", "0.1"])
    assert (cfg.data, cfg.epochs, cfg.arch, cfg.lr) == ("/other", 2, "resnet18", 1.0)
    assert (cfg.lr_milestones, cfg.weight_decay) == ((3,), 0.1)
    # The order on the command line does not matter: the file never beats a flag.
    assert parse_config(["--epochs", "2", "--config", path]).epochs == 2


def test_demo_defaults_fill_only_what_neither_file_nor_command_line_gives(tmp_path):
    path = _recipe(tmp_path, "epochs = 3\nbatch-size = 16\n")
    cfg = parse_config(["--demo", "--config", path, "-b", "32"])
    assert (cfg.epochs, cfg.batch_size) == (3, 32)
    assert (cfg.opt, cfg.lr) == (DEMO_DEFAULTS["opt"], DEMO_DEFAULTS["lr"])  # demo's defaults
    cfg = parse_config(["--config", _recipe(tmp_path, "demo = true\nlr = 0.5\n", "d.toml")])
    assert cfg.demo and cfg.lr == 0.5 and cfg.epochs == DEMO_DEFAULTS["epochs"]


@pytest.mark.parametrize("text, words", [
    ("epoch = 3", "unknown key 'epoch'; did you mean 'epochs' (--epochs)?"),
    ("train_crop_sise = 3", "unknown key 'train_crop_sise'; did you mean 'train-crop-size'"),
    ("zzqqx = 1", "unknown key 'zzqqx' (keys are the long flag names of main.py --help"),
    ("config = 'other.toml'", "unknown key 'config' (a recipe file cannot name another one)"),
    ("[optimisation]\nlr = 0.1", "unknown key 'optimisation'"),
    ("lr = '0.1'", "'lr' must be a number (the value of --lr), got \"0.1\" (a string)"),
    ("epochs = 2.5", "'epochs' must be an integer (the value of --epochs), got 2.5"),
    ("workers = true", "'workers' must be an integer (the value of --workers), got true"),
    ("pretrained = 1", "'pretrained' must be true or false (the value of --pretrained), got 1"),
    ("arch = 50", "'arch' must be a string (the value of --arch), got 50"),
    ("lr-milestones = 30", "'lr-milestones' must be a list, e.g. [30, 60]"),
    ("lr-milestones = [30, 'x']", "'lr-milestones' must be an integer"),
    ("opt = 'adam'", "'opt' must be one of \"sgd\", \"sgd_nesterov\", \"adamw\", \"rmsprop\""),
    ("fsdp-zero = 4", "'fsdp-zero' must be one of 2, 3 (as --fsdp-zero), got 4"),
    ("log-to = 'mlfow'", "'log-to' (--log-to): unknown tracker 'mlfow'"),
    ("wd = 0.1\nweight-decay = 0.2", "'wd' and 'weight-decay' both set --wd; keep one"),
    ("epochs = ", "is not valid TOML: Invalid value (at end of document)"),
    ("epochs = -3", "--epochs must be positive, got -3"),  # checked as on the command line
])
def test_a_bad_file_is_one_error_naming_the_file_and_key(tmp_path, text, words):
    path = _recipe(tmp_path, text)
    with pytest.raises(UsageError) as err:
        parse_config(["--config", path])
    message = str(err.value)
    assert words in message, message
    if "must be positive" not in words:
        assert message.startswith(f"--config {path}"), message


def test_a_missing_or_unreadable_file(tmp_path):
    with pytest.raises(UsageError, match="nope.toml: no such file"):
        parse_config(["--config", str(tmp_path / "nope.toml")])
    with pytest.raises(UsageError, match="cannot read it"):
        parse_config(["--config", str(tmp_path)])
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UsageError, match="is not a TOML file"):
        parse_config(["--config", str(tmp_path / "bin.toml")])


def test_log_to_takes_a_list_or_a_comma_separated_string(tmp_path):
    cfg = parse_config(["--config", _recipe(tmp_path, "log-to = ['wandb', 'tensorboard']")])
    assert cfg.log_to == "wandb,tensorboard"
    assert parse_config(["--log-to", "MLflow, tensorboard,mlflow"]).log_to == "mlflow,tensorboard"
    assert parse_config(["--log-to", "none"]).log_to == "none"
    assert parse_config([]).log_to == "tensorboard"


def test_python_without_tomllib_says_what_to_install(tmp_path, monkeypatch):
    """Python 3.10 has no tomllib: tomli (the same parser) if installed, else one line."""
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(UsageError, match="needs Python 3.11 or newer .tomllib.; on Python "
                                         "3.10: pip install tomli"):
        parse_config(["--config", _recipe(tmp_path, "epochs = 3")])
