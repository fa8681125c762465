"""The package's layout holds: a folder per stage, imports running one way (no circle, type-only
imports included), only the orchestrator knowing ``Run``, no module grown past ~500 lines but the
flag table. Read from the source with ``ast``, as docs/code-map.md describes it."""

from __future__ import annotations

import ast

import pytest
from helpers import ROOT

PACKAGE = ROOT / "imagenet"
# From the top down: a module may import its own package and any package below its own.
ORDER = ["cli", "api", "run", "evaluation", "checkpoint", "training", "data", "launching",
         "reporting", "settings", "errors"]
TOOLS_USERS = {"cli", "run"}  # tools/ stand apart: only the entry point and the demo data use them
LONGEST = 500  # lines
LONG_ALLOWED = {"imagenet/settings/flags.py"}  # the flag table


def modules() -> dict[str, set[str]]:
    """Every module of the package -> the package modules it imports (anywhere in the file)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("imagenet"):
                deps.add(node.module)
                deps.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("imagenet"))
        found[name] = deps
    return {name: {d for d in deps if d in found and d != name} for name, deps in found.items()}


def stage(module: str) -> str:
    """The top-level entry of the package a module belongs to: 'run', 'cli', 'errors', ..."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "imagenet"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``, each once (depth-first search)."""
    state: dict[str, int] = {}
    found = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                found.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_circle_between_modules():
    assert cycles(modules()) == []


def test_imports_run_down_the_stages():
    wrong = []
    for module, deps in modules().items():
        own = stage(module)
        for dep in deps:
            theirs = stage(dep)
            if own == theirs or own in ("imagenet", "tools"):
                continue
            if theirs == "tools":
                if own not in TOOLS_USERS:
                    wrong.append(f"{module} -> {dep}")
            elif ORDER.index(theirs) <= ORDER.index(own):
                wrong.append(f"{module} -> {dep}")
    assert wrong == []


def test_only_the_orchestrator_knows_the_run():
    knows = sorted(m for m, deps in modules().items()
                   if "imagenet.run.build.Run" in deps or "imagenet.run.build" in deps)
    assert all(stage(m) == "run" for m in knows), knows


def test_a_handful_of_entries_and_no_module_too_long():
    entries = [p for p in PACKAGE.iterdir()
               if (p.suffix == ".py" and p.name != "__init__.py")
               or (p.is_dir() and p.name != "__pycache__")]
    assert len(entries) <= 12, sorted(p.name for p in entries)
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > LONGEST}
    assert set(long) <= LONG_ALLOWED, long


def test_the_layout_test_sees_a_circle_and_a_wrong_way_import():
    # Guards for the checks above: a made-up graph with a circle and an upward import.
    graph = {"imagenet.data.a": {"imagenet.run.b"}, "imagenet.run.b": {"imagenet.data.a"}}
    assert cycles(graph) == [["imagenet.data.a", "imagenet.run.b", "imagenet.data.a"]]
    assert ORDER.index(stage("imagenet.run.b")) <= ORDER.index(stage("imagenet.data.a"))


@pytest.mark.slow
def test_a_folder_run_imports_no_feature_it_does_not_use():
    """Each process that trains imports the trainer (each mp.spawn rank, each torchrun worker):
    tar shards and Parquet, torch.distributed.checkpoint (--sharded-checkpoint, --fsdp's state),
    the device decode path and every feature below are imported only when a run uses them
    (issue 42: ``benchmarks/bench.py start-path`` counts the modules a run enters)."""
    import subprocess
    import sys

    from helpers import child_env

    code = ("import sys, imagenet.cli, imagenet.run.trainer, imagenet.run.build; "
            "print(sorted(m for m in sys.modules if m.startswith(('imagenet.data.shards', "
            "'torch.distributed.checkpoint', 'imagenet.data.device', "
            "'imagenet.checkpoint.dcpread', 'imagenet.checkpoint.sharded', "
            "'imagenet.checkpoint.dcpfiles', 'imagenet.checkpoint.weights', "
            "'imagenet.checkpoint.storage', 'imagenet.data.objectstore', "
            "'imagenet.training.fsdp', 'imagenet.training.comm_hooks', "
            "'imagenet.training.compile_cache', 'imagenet.training.finetune', "
            "'imagenet.reporting.trackers', 'imagenet.launching.timelimit', "
            "'imagenet.settings.recipe', 'imagenet.reporting.results'))))")
    ran = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=child_env(), timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "[]"
