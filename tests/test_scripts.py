"""The shell scripts, the command lines of README.md and docs/, and the benchmarks' --help: they
parse, and every flag they show exists."""

from __future__ import annotations

import argparse
import importlib
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, child_env, private_mount_prefix

from imagenet.settings.flags import get_args_parser, parse_config

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


def test_install_on_a_disk_too_small_says_so_before_pip_starts(tmp_path):
    """A CI machine with ~2 GB free ended install.sh half way, in pip's "[Errno 28] No space
    left on device" after a screen of warnings. With the environment on a 50 MB disk it now
    stops at once with one line naming the venv and what it needs, and creates nothing."""
    prefix = private_mount_prefix()
    if prefix is None:
        pytest.skip("cannot mount a tmpfs here (needs root or user namespaces)")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (f'mount -t tmpfs -o size=50m tmpfs "{disk}" && '
              f'VENV="{disk}/venv" exec bash "{ROOT / "install.sh"}" --dev')
    result = subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("install.sh: "), result.stderr
    assert f"MB free on the disk of {disk}/venv" in lines[0] and "need ~7 GB" in lines[0]
    assert "Traceback" not in result.stderr and "pip" not in result.stdout


@pytest.mark.slow
def test_run_single_passes_flags_through_to_main(tmp_path):
    env = {**child_env(), "PYTHON": sys.executable, "OUTPUT_DIR": str(tmp_path / "out")}
    result = subprocess.run(["bash", str(ROOT / "run_single.sh"), "--help"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: main.py" in result.stdout


DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def command_lines(path: Path) -> list[str]:
    """The shell lines of a markdown file: its code blocks (continuations joined, comments
    dropped) and the commands in backticks."""
    text = path.read_text()
    blocks = re.findall(r"```(?:bash)?\n(.*?)```", text, flags=re.S)
    inline = re.findall(r"`([^`\n]+)`", text)
    lines = [*"\n".join(blocks).replace("\\\n", " ").splitlines(), *inline]
    return [line.split("#", 1)[0] for line in lines]


def doc_commands() -> list[tuple[str, str, list[str]]]:
    """(file, program, arguments) of every main.py and ``python -m imagenet.tools.*`` command
    in README.md and docs/ (``[-a NAME]``-style optional parts count as given)."""
    found = []
    for path in DOC_FILES:
        for line in command_lines(path):
            try:
                tokens = [t.strip("[]") for t in shlex.split(line)]
            except ValueError:  # prose in backticks, not a command
                continue
            for i, token in enumerate(tokens):
                if token.endswith("main.py"):
                    found.append((path.name, "main.py", tokens[i + 1:]))
                    break
                if token.startswith("imagenet.tools.") and tokens[i - 1:i] == ["-m"]:
                    found.append((path.name, token, tokens[i + 1:]))
                    break
    return found


def unknown_flags(args: list[str], parser) -> list[str]:
    """The arguments that look like flags and are not flags of ``parser``."""
    options = parser._option_string_actions
    return [a for a in args if a.startswith("-") and a != "-" and a.split("=")[0] not in options]


def test_every_main_py_command_in_the_docs_parses():
    commands = [(name, args) for name, program, args in doc_commands() if program == "main.py"]
    # The extraction still finds the examples, in the README and in the pages.
    assert len(commands) >= 40, commands
    assert {"README.md", "distributed.md", "shards.md", "fsdp.md", "debugging.md"} <= {
        name for name, _ in commands}
    for name, args in commands:
        unknown = unknown_flags(args, get_args_parser())
        assert not unknown, f"{name} shows main.py {' '.join(args)}: no flag {unknown}"
        if not {"--env-check", "--help"} & set(args):
            parse_config([PLACEHOLDERS.get(a, a) for a in args])


def tool_parser(module: str):
    """The argument parser of ``python -m MODULE``; envcheck takes main.py's flags."""
    tool = importlib.import_module(module)
    return tool.get_args_parser() if hasattr(tool, "get_args_parser") else get_args_parser()


def test_every_tool_command_in_the_docs_parses():
    commands = [c for c in doc_commands() if c[1] != "main.py"]
    assert {"imagenet.tools.prepare", "imagenet.tools.unshard"} <= {c[1] for c in commands}
    for name, module, args in commands:
        parser = tool_parser(module)
        unknown = unknown_flags(args, parser)
        assert not unknown, f"{name} shows python -m {module} {' '.join(args)}: no flag {unknown}"
        if args and "--help" not in args:
            try:
                parser.parse_args([PLACEHOLDERS.get(a, a) for a in args])
            except SystemExit:
                pytest.fail(f"{name} shows python -m {module} {' '.join(args)}: it does not parse")


BENCHMARKS = sorted((ROOT / "benchmarks").glob("bench_*.py"))


def parsers_of(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and its subcommands' parsers."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser, *[p for sub in subs for p in sub.choices.values()]]


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_help_speaks_to_a_user(script, monkeypatch, capsys):
    """``python benchmarks/X.py --help`` (run in this process: the modules are imported already)
    exits 0, says what it measures without internal references, and explains every flag."""
    seen: list[argparse.ArgumentParser] = []
    parse = argparse.ArgumentParser.parse_known_args

    def recording(self, *args, **kwargs):
        seen.append(self)
        return parse(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", recording)
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage:") and len(text.split("\n\n", 2)[1]) > 40, text
    assert not re.search(r"\bissue\s*#?\d|#\d+\b", text, flags=re.I), text
    for parser in parsers_of(seen[0]):
        for action in parser._actions:
            name = action.option_strings or action.dest
            assert action.help, f"{script.name} {parser.prog}: {name} has no help text"
