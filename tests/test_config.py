"""The command line: classic flags, aliases, defaults, grouping and usage errors."""

from __future__ import annotations

import pytest

from imagenet.errors import UsageError
from imagenet.settings.flags import Config, get_args_parser, parse_config

CLASSIC_LINE = ["-a", "resnet50", "-j", "8", "--epochs", "100", "--start-epoch", "3",
                "-b", "512", "--lr", "0.2", "--momentum", "0.8", "--wd", "5e-5", "-p", "50",
                "--resume", "ck.pth", "-e", "--pretrained", "--world-size", "2", "--rank", "1",
                "--dist-url", "tcp://10.1.1.20:23456", "--dist-backend", "gloo", "--seed", "7",
                "--gpu", "0", "--no-accel", "--multiprocessing-distributed", "--dummy", "/data/in"]


def test_classic_command_line_parses_with_same_meaning():
    cfg = parse_config(CLASSIC_LINE)
    assert (cfg.arch, cfg.workers, cfg.epochs, cfg.start_epoch) == ("resnet50", 8, 100, 3)
    assert (cfg.batch_size, cfg.lr, cfg.momentum, cfg.weight_decay) == (512, 0.2, 0.8, 5e-5)
    assert (cfg.print_freq, cfg.resume, cfg.evaluate, cfg.pretrained) == (50, "ck.pth", True, True)
    assert (cfg.world_size, cfg.rank, cfg.dist_url) == (2, 1, "tcp://10.1.1.20:23456")
    assert (cfg.dist_backend, cfg.seed, cfg.gpu, cfg.no_accel) == ("gloo", 7, 0, True)
    assert cfg.multiprocessing_distributed and cfg.dummy and cfg.data == "/data/in"


def test_long_aliases_and_local_rank_spellings():
    cfg = parse_config(["--learning-rate", "0.3", "--weight-decay", "0.01", "--arch", "vgg11",
                        "--workers", "2", "--batch-size", "16", "--print-freq", "3",
                        "--evaluate", "--local_rank=1"])
    assert (cfg.lr, cfg.weight_decay, cfg.arch, cfg.workers) == (0.3, 0.01, "vgg11", 2)
    assert (cfg.batch_size, cfg.print_freq, cfg.evaluate, cfg.local_rank) == (16, 3, True, 1)
    assert parse_config(["--local-rank", "3"]).local_rank == 3


def test_classic_defaults_except_the_hanging_dist_url():
    cfg = parse_config([])
    assert (cfg.data, cfg.arch, cfg.epochs, cfg.batch_size) == ("imagenet", "resnet18", 90, 256)
    assert cfg.workers is None  # auto: see distributed.auto_workers (the classic's was 4)
    assert (cfg.lr, cfg.momentum, cfg.weight_decay, cfg.print_freq) == (0.1, 0.9, 1e-4, 10)
    assert (cfg.world_size, cfg.rank, cfg.output_dir) == (-1, -1, ".")
    assert cfg.dist_url == "env://"  # the classic's multicast default hangs
    assert (cfg.train_crop_size, cfg.val_resize_size, cfg.val_crop_size) == (224, 256, 224)
    assert (cfg.opt, cfg.lr_scheduler, cfg.lr_step_size, cfg.lr_gamma) == ("sgd", "step", 30, 0.1)


def test_config_is_frozen_and_a_plain_dict():
    cfg = parse_config(["--lr-milestones", "5", "9"])
    with pytest.raises(AttributeError):
        cfg.lr = 1.0  # type: ignore[misc]
    d = cfg.to_dict()
    assert d["lr_milestones"] == [5, 9]
    assert all(isinstance(v, (int, float, str, bool, list, type(None))) for v in d.values())
    assert Config(**{**d, "lr_milestones": tuple(d["lr_milestones"])}) == cfg


def test_help_is_grouped_and_states_defaults(capsys):
    with pytest.raises(SystemExit):
        get_args_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    for group in ("data:", "model:", "optimisation:", "distributed:", "checkpointing:",
                  "logging:"):
        assert group in text
    for action in get_args_parser()._actions:
        if action.dest != "help" and action.help:
            assert "default" in action.help or action.const is True or \
                "set by" in action.help, action.dest


def test_demo_sets_small_defaults_but_respects_given_flags():
    cfg = parse_config(["--demo", "--epochs", "2", "--lr=0.01"])
    assert cfg.epochs == 2 and cfg.lr == 0.01
    assert cfg.train_crop_size < 224 and cfg.batch_size < 256 and cfg.opt == "adamw"
    assert parse_config([]).opt == "sgd"  # without --demo: the classic's
    assert parse_config(["--demo", "--output-dir", "runs/d"]).data == "runs/d/demo-data"
    with pytest.raises(UsageError, match="--demo trains on the built-in data"):
        parse_config(["/data/imagenet", "--demo"])


@pytest.mark.parametrize("argv, flag", [
    (["-b", "0"], "-b/--batch-size"),
    (["--lr", "-0.1"], "--lr"),
    (["--epochs", "3", "--start-epoch", "5"], "--epochs"),
    (["-a", "resnet_18"], "-a/--arch"),
    (["-a", "get_model"], "-a/--arch"),
    (["--random-erase", "1.5"], "--random-erase"),
    (["--pretrained", "--weights", "IMAGENET1K_V1"], "--pretrained"),
    (["--lr-scheduler", "multistep", "--lr-milestones", "2", "8", "--lr-warmup-epochs", "3"],
     "--lr-milestones"),
])
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(UsageError, match=flag.replace("/", ".")):
        parse_config(argv)


def test_unknown_arch_suggests_a_close_name():
    with pytest.raises(UsageError, match="did you mean resnet18"):
        parse_config(["-a", "resnet_18"])
