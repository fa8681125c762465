"""The shell scripts and the README's command lines: they parse, and every flag they show exists."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from helpers import ROOT, child_env

from imagenet.config import get_args_parser, parse_config

SCRIPTS = ["install.sh", "run_single.sh", "run_multinode.sh", ".ci/run"]
# The README's placeholders, as a user would fill them in.
PLACEHOLDERS = {"DIR": "/data", "tcp://HOST:PORT": "tcp://127.0.0.1:29500", "W": "2", "R": "0"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_shell_script_parses(script):
    result = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_run_multinode_without_master_addr_says_what_to_set():
    env = {**child_env(), "PYTHON": sys.executable}
    env.pop("MASTER_ADDR", None)
    result = subprocess.run(["bash", str(ROOT / "run_multinode.sh"), "DIR"], capture_output=True,
                            text=True, env=env, timeout=60)
    assert result.returncode != 0
    assert "set MASTER_ADDR to the address of node 0" in result.stderr


def test_run_single_passes_flags_through_to_main(tmp_path):
    env = {**child_env(), "PYTHON": sys.executable, "OUTPUT_DIR": str(tmp_path / "out")}
    result = subprocess.run(["bash", str(ROOT / "run_single.sh"), "--help"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: main.py" in result.stdout


def readme_main_commands() -> list[list[str]]:
    """The main.py arguments of every command line in README.md's code blocks."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash)?\n(.*?)```", text, flags=re.S)
    # Table cells show commands in backticks too.
    inline = [m for m in re.findall(r"`([^`\n]*main\.py[^`\n]*)`", text)]
    commands = []
    for line in [*"\n".join(blocks).replace("\\\n", " ").splitlines(), *inline]:
        line = line.split("#", 1)[0]
        if "main.py" not in line or line.lstrip().startswith("["):
            continue
        tokens = shlex.split(line)
        args = tokens[tokens.index(next(t for t in tokens if t.endswith("main.py"))) + 1:]
        commands.append(args)
    return commands


def test_readme_main_py_command_lines_parse():
    commands = readme_main_commands()
    assert len(commands) >= 10, commands  # the extraction still finds the README's examples
    options = get_args_parser()._option_string_actions
    for args in commands:
        unknown = [a for a in args if a.startswith("-") and a.split("=")[0] not in options]
        assert not unknown, f"README shows main.py {' '.join(args)}: no flag {unknown}"
        if not {"--env-check", "--help"} & set(args):
            parse_config([PLACEHOLDERS.get(a, a) for a in args])
