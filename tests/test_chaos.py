"""A fixed slice of the chaos matrix (tests/chaos.py; docs/chaos.md says what it checks).

Three scenarios that cover what the issue found broken: a SIGTERM to the whole process group
(loader workers included) during the EMA's validation; a SIGKILL to every process of a
--multiprocessing-distributed job while it writes a checkpoint, resumed on one process from the
checkpoint's path; a SIGTERM to torchrun's agent in a tar-shard run, resumed with more epochs.
And two of the faults: a loader worker stopped (a hang, at one process); the disk full under
--multiprocessing-distributed, resumed on one process. The others have tests of their own that
run the same scenario (issue 40 folded the slice's copies): a damaged checkpoint after a SIGKILL,
test_checkpoint_safety.py::test_resume_auto_falls_back_to_the_newest_intact_checkpoint; slow
storage and a SIGKILL during its write,
test_async_save.py::test_a_sigkill_during_a_slow_write_keeps_the_previous_checkpoint; the lost
link, test_netns.py. All but the torchrun one share their reference run (the same final command
line, the flags a reference leaves out aside).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from chaos import References, Scenario, Setup, run_scenario

EMA = Setup(launcher="single", world=1, batch=8, epochs=2, scheduler="cosine", warmup=1,
            ema=True, workers=1)
SPAWN = replace(EMA, launcher="spawn", world=2, save_every=2)
HANG = replace(EMA, hang_timeout=8)
TORCHRUN = Setup(launcher="torchrun", world=2, batch=4, epochs=2, scheduler="step",
                 shards=True)
SLICE = {
    "SIGTERM to the group in the EMA validation": Scenario(
        "ci:0", EMA, EMA, "none", "term", "group", 0.3, "ema-validation", 0.0, "auto"),
    "SIGKILL to the group during a save, 2 processes -> 1": Scenario(
        "ci:1", SPAWN, EMA, "spawnx2->singlex1", "kill-save", "group", 0.2, "train", 0.0,
        "path"),
    "SIGTERM to torchrun's agent, shards, more epochs": Scenario(
        "ci:2", TORCHRUN, replace(TORCHRUN, epochs=3), "--epochs 2->3", "term", "main", 0.5,
        "train", 0.1, "auto"),
    "hang: the loader worker stopped": Scenario(
        "ci:3", HANG, HANG, "none", "stop", "the loader worker of rank 0", 0.3, "train", 0.0,
        "auto", fault="hang"),
    "full disk under 2 processes -> 1": Scenario(
        "ci:4", SPAWN, EMA, "spawnx2->singlex1", "fill", "disk", 0.4, "train", 0.0, "auto",
        fault="full-disk", detail="2 MB left"),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("chaos")


@pytest.fixture(scope="module")
def references(workdir) -> References:
    return References(workdir / "refs")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLICE))
def test_an_interrupted_run_ends_as_the_run_of_its_final_command_line(name, workdir,
                                                                      references):
    outcome = run_scenario(SLICE[name], workdir, references)
    assert not outcome.missed and not outcome.deviations, outcome.line()
