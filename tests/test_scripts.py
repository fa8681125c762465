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


sys.path.insert(0, str(ROOT))
from benchmarks import bench  # noqa: E402

# The benchmark tool's subcommands, each as a user asks for its help, and the two scripts that
# stay apart (network namespaces as root; a GPU node).
BENCHMARKS = [("bench.py", []), *[("bench.py", [name]) for name in bench.CASES],
              ("bench_comm.py", []), ("gpu_smoke.py", [])]


def parsers_of(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and its subcommands' parsers, theirs included."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [parser, *[q for sub in subs for p in sub.choices.values() for q in parsers_of(p)]]


def test_benchmarks_holds_few_entry_points():
    """benchmarks/: the tool, the two scripts that need a setup of their own, and the tool's
    library (the harness, the cases): nothing else a user runs."""
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    assert scripts == {"bench.py", "harness.py", "bench_comm.py", "gpu_smoke.py"}, scripts
    cases = {p.stem.replace("_", "-") for p in (ROOT / "benchmarks" / "cases").glob("*.py")}
    assert cases == set(bench.CASES)
    for path in (ROOT / "benchmarks" / "cases").glob("*.py"):
        assert 'if __name__ == "__main__"' not in path.read_text(), f"{path.name}: a script"


@pytest.mark.parametrize("script, argv", BENCHMARKS,
                         ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_benchmark_help_speaks_to_a_user(script, argv, monkeypatch, capsys):
    """``python benchmarks/SCRIPT [SUBCOMMAND] --help`` (run in this process: the modules are
    imported already) exits 0, says what it measures without internal references, and explains
    every flag."""
    seen: list[argparse.ArgumentParser] = []
    parse = argparse.ArgumentParser.parse_known_args

    def recording(self, *args, **kwargs):
        seen.append(self)
        return parse(self, *args, **kwargs)

    path = ROOT / "benchmarks" / script
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", recording)
    monkeypatch.setattr(sys, "argv", [str(path), *argv, "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(path), run_name="__main__")
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage:") and len(text.split("\n\n", 2)[1]) > 40, text
    assert not re.search(r"\bissue\s*#?\d|#\d+\b", text, flags=re.I), text
    for parser in parsers_of(seen[0]):
        for action in parser._actions:
            name = action.option_strings or action.dest
            assert action.help, f"{script} {parser.prog}: {name} has no help text"


def benchmark_commands() -> list[tuple[str, list[str]]]:
    """(file, arguments) of every ``benchmarks/bench.py`` command in README.md and docs/."""
    found = []
    for path in DOC_FILES:
        for line in command_lines(path):
            try:
                tokens = [t.strip("[]") for t in shlex.split(line)]
            except ValueError:
                continue
            found += [(path.name, tokens[i + 1:]) for i, token in enumerate(tokens)
                      if token.endswith("benchmarks/bench.py")][:1]
    return found


def test_every_benchmark_command_in_the_docs_parses():
    """A number in the docs keeps the command that reproduces it: each ``bench.py`` line names a
    subcommand and flags it has, and no page or comment names a benchmark file that is gone."""
    commands = benchmark_commands()
    assert {"benchmarks.md", "hardware.md", "fsdp.md"} <= {name for name, _ in commands}
    wrong = []
    for name, args in commands:
        if args[:1] in ([], ["SUBCOMMAND"]):  # the tool itself, not a measurement
            continue
        parser = bench.get_parser(bench.selected_case(args))
        try:
            parsed, rest = parser.parse_known_args(args)
        except SystemExit:
            wrong.append(f"{name} shows bench.py {' '.join(args)}: it does not parse")
            continue
        if rest and not getattr(bench.case_module(parsed.case), "PASSES_FLAGS_TO_MAIN", False):
            wrong.append(f"{name} shows bench.py {' '.join(args)}: no flag {rest}")
    assert not wrong, "\n".join(wrong)
    sources = [*DOC_FILES, *sorted((ROOT / "imagenet").rglob("*.py")),
               *sorted((ROOT / "tests").glob("*.py")), *sorted((ROOT / "benchmarks").rglob("*.py"))]
    for path in sources:
        for named in re.findall(r"benchmarks/[\w/]+\.py", path.read_text()):
            assert (ROOT / named).is_file(), f"{path.relative_to(ROOT)} names {named}: no such file"
