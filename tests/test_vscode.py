""".vscode/launch.json: plain JSON, and every program, module and flag it names really exists."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, child_env

from imagenet.settings.flags import get_args_parser, parse_config

LAUNCH = ROOT / ".vscode" / "launch.json"


@pytest.fixture(scope="module")
def launch() -> dict:
    """launch.json parsed with the strict JSON parser (VS Code would also accept comments)."""
    return json.loads(LAUNCH.read_text())


def _resolve(value: str, launch: dict) -> str:
    """Substitute ${workspaceFolder} and ${input:ID} (its default) as VS Code would."""
    defaults = {i["id"]: i["default"] for i in launch.get("inputs", [])}
    value = value.replace("${workspaceFolder}", str(ROOT))
    for name in re.findall(r"\$\{input:([^}]+)\}", value):
        assert name in defaults, f"${{input:{name}}} has no entry in 'inputs'"
        value = value.replace(f"${{input:{name}}}", defaults[name])
    assert "${" not in value, f"unsupported variable in {value!r}"
    return value


def _args(config: dict, launch: dict) -> list[str]:
    return [_resolve(a, launch) for a in config.get("args", [])]


def _check_main_args(args: list[str]) -> None:
    """Every option exists in main.py's parser, and the whole list parses and validates."""
    options = get_args_parser()._option_string_actions
    unknown = [a for a in args if a.startswith("-") and a.split("=")[0] not in options]
    assert not unknown, f"main.py has no flag {unknown}"
    parse_config(args)


@pytest.fixture(scope="module")
def torchrun_flags() -> set[str]:
    """The option strings in the usage block of `python -m torch.distributed.run --help`."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"],
                         capture_output=True, text=True, timeout=120, env=child_env()).stdout
    usage = out.split("\n\n")[0]
    flags = set(re.findall(r"\[(--?[A-Za-z][\w-]*)", usage))
    assert "--nproc-per-node" in flags, usage  # the parsing above still fits torchrun's help
    return flags


def test_launch_json_has_the_promised_configurations(launch):
    configs = launch["configurations"]
    programs = [c for c in configs if c.get("program", "").endswith("main.py")]
    single = [c for c in programs if "--demo" in c["args"] and not any(
        a in c["args"] for a in ("--multiprocessing-distributed", "--world-size"))]
    assert single and single[0]["args"][:2] == ["--demo", "--output-dir"]
    torchrun = [c for c in configs if c.get("module") == "torch.distributed.run"]
    assert torchrun and all(c.get("subProcess") is True for c in torchrun)
    spawn = [c for c in programs if "--multiprocessing-distributed" in c["args"]]
    assert spawn and all(c.get("subProcess") is True for c in spawn)
    attach = [c for c in configs if c["request"] == "attach"]
    assert len(attach) == 1 and attach[0]["connect"]["port"].startswith("${input:")
    assert len({c["name"] for c in configs}) == len(configs), "configuration names must differ"


def test_main_py_configurations_use_real_flags(launch):
    for config in launch["configurations"]:
        if "program" not in config:
            continue
        program = Path(_resolve(config["program"], launch))
        assert program == ROOT / "main.py", config["name"]
        _check_main_args(_args(config, launch))


@pytest.mark.slow
def test_torchrun_configurations_use_real_torchrun_flags(launch, torchrun_flags):
    for config in launch["configurations"]:
        if "module" not in config:
            continue
        assert importlib.util.find_spec(config["module"]) is not None, config["module"]
        args = _args(config, launch)
        script = next(i for i, a in enumerate(args) if a.endswith(".py"))
        launcher_flags = [a for a in args[:script] if a.startswith("-")]
        assert set(launcher_flags) <= torchrun_flags, set(launcher_flags) - torchrun_flags
        cwd = Path(_resolve(config.get("cwd", "${workspaceFolder}"), launch))
        assert (cwd / args[script]).resolve() == ROOT / "main.py"
        _check_main_args(args[script + 1:])


def test_attach_configuration_prompts_for_a_numeric_port(launch):
    attach = next(c for c in launch["configurations"] if c["request"] == "attach")
    assert attach["type"] == "debugpy"
    port = _resolve(attach["connect"]["port"], launch)
    assert port.isdigit() and 1024 < int(port) < 65536
