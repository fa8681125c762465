"""A fixed slice of the chaos matrix (tests/chaos.py; docs/chaos.md says what it checks).

Three scenarios that cover what the issue found broken: a SIGTERM to the whole process group
(loader workers included) during the EMA's validation; a SIGKILL to every process of a
--multiprocessing-distributed job while it writes a checkpoint, resumed on one process from the
checkpoint's path; a SIGTERM to torchrun's agent in a tar-shard run, resumed with more epochs.
The first two share their reference run (the same final command line).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from chaos import References, Scenario, Setup, run_scenario

EMA = Setup(launcher="single", world=1, batch=8, epochs=2, scheduler="cosine", warmup=1,
            ema=True, workers=1)
SPAWN = replace(EMA, launcher="spawn", world=2, save_every=2)
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
