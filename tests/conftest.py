"""Fixtures; the helpers they use are in helpers.py."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

# A process a test starts without helpers.child_env computes on one thread too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from helpers import ROOT, write_image_folder  # noqa: E402

# The suite's own tooling, run by hand (tools/cpu_per_test.py is a plugin whose name ends in
# _test.py): not test modules.
collect_ignore = ["tools"]

# The tests that compute in the test process do it on one thread, as every run they start does
# (OMP_NUM_THREADS=1, helpers.child_env). Three xdist workers and their runs share two cores:
# an OpenMP team of two threads whose partner waits for a core spins, and burned ~3x the CPU
# (test_recipe_files beside two busy loops: 79 CPU-s with two threads, 26 with one).
torch.set_num_threads(1)


def untracked(root: Path) -> set[str]:
    """The files in the checkout that git does not track, ignored ones too (caches aside)."""
    listed = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
                            cwd=root, capture_output=True, text=True, check=True).stdout
    return {line[3:] for line in listed.splitlines()
            if line[:2] in ("??", "!!") and "__pycache__" not in line
            and not line[3:].startswith((".pytest_cache", ".ruff_cache", ".venv"))}


@pytest.fixture(scope="session", autouse=True)
def the_checkout_is_left_as_it_was():
    """No test writes into the repository: a run left with the default ``--output-dir .`` put
    its reports and tb/ there once (and checkpoints, which .gitignore hides)."""
    if not (ROOT / ".git").exists():
        yield
        return
    before = untracked(ROOT)
    yield
    new = sorted(untracked(ROOT) - before)
    assert not new, f"the tests wrote into the checkout {ROOT}: {new[:10]}"


@pytest.fixture(scope="module", autouse=True)
def module_folders_are_removed_if_it_passed(request, tmp_path_factory):
    """The folders a module's fixtures made with ``tmp_path_factory.mktemp`` go when its last test
    ends without a failure; a failing module keeps them to look at.

    Checkpoints make a test's folder hundreds of MB: kept all at once the suite needed ~15 GB
    and a CI machine with less free disk failed two thirds of the way through. (Each test's
    own ``tmp_path`` goes when it passes: ``tmp_path_retention_policy`` in pyproject.toml.)
    """
    base = tmp_path_factory.getbasetemp()
    before, failed = set(base.iterdir()), request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        for folder in set(base.iterdir()) - before:
            shutil.rmtree(folder, ignore_errors=True)


def _restore_environment():
    before = dict(os.environ)
    yield
    now = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    kept = {k: v for k, v in before.items() if k != "PYTEST_CURRENT_TEST"}
    if now != kept:
        for name in now.keys() - kept.keys():
            del os.environ[name]
        os.environ.update(kept)


@pytest.fixture(autouse=True)
def the_environment_is_left_as_it_was():
    """A test leaves os.environ as it found it. Code run in the test process sets variables
    (inductor sets TORCHINDUCTOR_CACHE_DIR when it compiles, scikit-learn KMP_DUPLICATE_LIB_OK
    when MLflow or W&B import it), and every later test's runs inherited them: they differed
    from the environment the prestart server was started with, so they started plainly
    (issue 40)."""
    yield from _restore_environment()


@pytest.fixture(scope="module", autouse=True)
def the_environment_is_left_as_the_module_found_it():
    """The same for a module's fixtures (set up before, and ended after, its tests')."""
    yield from _restore_environment()


@pytest.fixture(autouse=True)
def the_logging_is_left_as_it_was():
    """A test leaves the root logger's handlers as it found them. ``main()`` run in the test
    process points the root logger at the sys.stdout of that moment (``setup_logging``); when
    that was a test's capture (capsys), closed at its end, a later test's log record (e.g.
    TensorBoard's reader on the events a resume purged) printed "--- Logging error ---" and a
    traceback into that test's output."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """A 3-class JPEG ImageFolder: 24 train and 9 val images."""
    return write_image_folder(tmp_path / "data")


# The files that take longest, run first (measured per file, all processes counted:
# tests/tools/cpu_per_test.py, docs/testing.md): with the suite on three workers (pytest-xdist, a
# file's tests on one worker, --no-loadscope-reorder) no worker is left with a long file at the
# end while the others idle, and test_hang's waits (stopped ranks, hang timeouts) start beside the
# compile cache's busy compiles. A serial run's time does not depend on the order.
LONGEST_FIRST = ("test_compile_cache.py", "test_examples.py", "test_hang.py", "test_fail_fast.py",
                 "test_launchers.py", "test_fault_tolerance.py", "test_shards_train.py",
                 "test_chaos.py", "test_netns.py", "test_async_save.py", "test_training_state.py",
                 "test_demo.py", "test_resume_matrix.py", "test_fsdp_checkpoints.py",
                 "test_decoders.py", "test_every_rank.py", "test_trackers.py", "test_fsdp.py",
                 "test_recipe_files.py", "test_object_storage.py", "test_prestart.py",
                 "test_checkpoint_safety.py", "test_training_controls_runs.py", "test_cli.py",
                 "test_finetune.py", "test_sharded_dirs.py", "test_compile.py",
                 "test_launch_conditions.py", "test_run_folder.py", "test_folder_index.py",
                 "test_lamb_lars_distill_runs.py", "test_comm_hooks.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
