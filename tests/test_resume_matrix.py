"""A resumed run is the run its command line describes, from the checkpoint's point in training.

Real main.py processes on the CPU. Each chain below is one training run that is killed four
times and resumed with another layout each time: from a mid-epoch checkpoint (--save-every) and
from an epoch boundary, in the warm-up (epochs 0-1) and after it (epochs 2-3). The learning rate
of every step after every resume (TensorBoard's step/lr, -p 1) must equal the learning rate of a
fresh run with the resumed command line at the same point in training:

- at an epoch boundary exactly: the same scheduler step;
- mid-epoch after a change of the global batch, the images already trained are not always a whole
  number of the new steps; the resumed run continues at the step from which the rest of the
  epoch ends exactly on the boundary. Tolerance: that step is less than one step from
  images / global batch, and from there on every learning rate equals the fresh run's, exactly.

The chains cover world size 1 -> 2 and 2 -> 1 (--multiprocessing-distributed splitting -b over 2
processes; 2 -> 1 keeping the global batch, so the steps per epoch stay and only the layout
changes), -b and --grad-accum-steps, each resumed mid-epoch and at an epoch boundary, in the
warm-up and after it; a fifth chain extends --epochs mid-epoch and changes --lr at a boundary.
squeezenet1_1 keeps checkpoints small (5 MB) and steps fast: only the schedule is under test.
"""

from __future__ import annotations

import math
import multiprocessing
import re
import signal
import subprocess
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import (
    child_env,
    fault_at,
    load_checkpoint,
    prestarted_cmd,
)

IMAGES = 96
SCHEDULE = ["--epochs", "4", "--lr", "0.05", "--lr-scheduler", "cosine", "--lr-warmup-epochs", "2"]
BASE = ["--dummy", "--dummy-size", str(IMAGES), "--dummy-val-size", "8", "--dummy-classes", "3",
        "-a", "squeezenet1_1", "--train-crop-size", "32", "--val-crop-size", "32", "-j", "0",
        "-p", "1", "--seed", "0", "--wd", "0"]


@dataclass(frozen=True)
class Layout:
    """A way to run the same training: its flags, what they make of one step, and after how many
    steps its mid-epoch checkpoint is written (--save-every)."""

    flags: tuple[str, ...]
    global_batch: int
    save_every: int

    @property
    def steps(self) -> int:
        return math.ceil(IMAGES / self.global_batch)


W1 = Layout(("-b", "8"), 8, 5)  # 12 steps; mid-epoch checkpoints after 40 images
# One process with W2's global batch: W2 -> W1B16 is the classic job with -b per node requeued
# on fewer processes (same steps per epoch, another layout: the case 3).
W1B16 = Layout(("-b", "16"), 16, 2)
W2 = Layout(("-b", "16", "--multiprocessing-distributed", "--nproc-per-node", "2"), 16, 2)  # 6
B12 = Layout(("-b", "12"), 12, 3)  # 8 steps
K2 = Layout(("-b", "8", "--grad-accum-steps", "2"), 16, 2)  # 6 steps of 2 micro-batches
EPOCHS6 = ("--epochs", "6")
LR = ("--lr", "0.1")

# How each leg ends: SIGKILL in epoch E just after the checkpoint of a mid-epoch save ("mid": the
# run resumes from step save_every of E) or just after the boundary that starts E ("boundary");
# None = it runs to the end. 40 images are 2.5 steps of 16 and 3.33 of 12: the chains from W1
# resume between two steps of the new layout; 32 images (W2, K2) are 4 whole steps of 8.
STOPS = [("mid", 0), ("boundary", 1), ("mid", 2), ("boundary", 3), None]
CHAINS = {
    "world 1-2-1-2-1": [W1, W2, W1, W2, W1],
    "world 2-1-2-1-2, same batch": [W2, W1B16, W2, W1B16, W2],
    "-b 8-12-8-12-8": [W1, B12, W1, B12, W1],
    "accum 1-2-1-2-1": [W1, K2, W1, K2, W1],
}
# Same layout; --epochs 4 -> 6 mid-epoch (in the warm-up), then --lr 0.05 -> 0.1 at a boundary.
FLAG_CHAIN = [(W1, ()), (W1, EPOCHS6), (W1, EPOCHS6 + LR)]
FLAG_STOPS = [("mid", 1), ("boundary", 3), None]


def command(out: Path, layout: Layout, extra: tuple[str, ...] = (), resume: bool = False
            ) -> list[str]:
    return prestarted_cmd(*BASE, *SCHEDULE, *layout.flags, "--save-every",
                          str(layout.save_every), *extra, "--output-dir", str(out),
                          *(["--resume", "auto"] if resume else []))


def start_step(ckpt: dict | None, layout: Layout) -> tuple[int, int]:
    """(epoch, step) of ``layout`` at which a run resumed from ``ckpt`` goes on (None: a fresh
    run): mid-epoch, the step from which the rest of the epoch ends on its boundary."""
    if ckpt is None:
        return 0, 0
    images = ckpt["sampler"].get("images", ckpt["sampler"]["start"] * ckpt["world_size"]) \
        if ckpt["step_in_epoch"] else 0
    return ckpt["epoch"], layout.steps - math.ceil((IMAGES - images) / layout.global_batch)


def saves_until(start: tuple[int, int], layout: Layout, stop: tuple[str, int]) -> int:
    """How many checkpoints a leg starting at ``start`` writes up to the one it is killed after
    (STOPS): every ``save_every`` steps, before each validation, at each epoch's end."""
    kind, epoch = stop
    target = (epoch, layout.save_every) if kind == "mid" else (epoch, 0)
    count, (e, first) = 0, start
    while True:
        mid = [(e, j) for j in range(first + 1, layout.steps) if j % layout.save_every == 0]
        for position in [*mid, (e, layout.steps), (e + 1, 0)]:
            count += 1
            if position == target:
                return count
        e, first = e + 1, 0


def run_leg(cmd: list[str], saves: int | None, log: Path) -> str:
    """Run ``cmd``; with ``saves``, the run SIGKILLs its whole process group (a failpoint in
    its checkpoint writer) once its ``saves``-th checkpoint is on disk."""
    faults = fault_at("save.done", saves, "sigkill(group)") if saves else ""
    # A session of its own: the kill is to the run's whole group, never to this process's.
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=child_env(IMAGENET_FAILPOINTS=faults), timeout=300,
                          start_new_session=True)
    log.write_text(proc.stdout)
    assert proc.returncode == (-signal.SIGKILL if saves else 0), proc.stdout
    return proc.stdout


@dataclass
class Leg:
    """A resumed leg: its layout and flags, and where its checkpoint left training."""

    layout: Layout
    extra: tuple[str, ...]
    epoch: int
    images: int  # of that epoch already trained
    global_step: int  # steps the run had taken (the TensorBoard step of the checkpoint)
    output: str


def run_chain(out: Path, legs: list[tuple[Layout, tuple[str, ...]]], stops: list) -> list[Leg]:
    """Run the legs one after the other in ``out``; the resumed ones, described."""
    resumed = []
    for i, ((layout, extra), stop) in enumerate(zip(legs, stops)):
        ckpt = load_checkpoint(out / "checkpoint.pth.tar") if i else None
        saves = None if stop is None else saves_until(start_step(ckpt, layout), layout, stop)
        output = run_leg(command(out, layout, extra, resume=i > 0), saves, out / f"leg{i}.log")
        if ckpt is not None:
            sampler = ckpt["sampler"]
            images = sampler.get("images", sampler["start"] * ckpt["world_size"]) \
                if ckpt["step_in_epoch"] else 0
            resumed.append(Leg(layout, extra, ckpt["epoch"], images, ckpt["global_step"],
                               output))
    return resumed


def scalars(out: Path, tag: str) -> dict[int, float]:
    """TensorBoard scalar ``tag`` by step, as a resumed run leaves it (purged, then continued)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every chain and every fresh reference, two at a time."""
    base = tmp_path_factory.mktemp("matrix")
    fresh = {"w1": (W1, ()), "w2": (W2, ()), "w1 b16": (W1B16, ()), "b12": (B12, ()),
             "k2": (K2, ()),
             "w1 epochs 6": (W1, EPOCHS6), "w1 epochs 6 lr 0.1": (W1, EPOCHS6 + LR)}
    jobs = {name: (run_chain, base / name, [(x, ()) for x in legs], STOPS)
            for name, legs in CHAINS.items()}
    jobs["flags"] = (run_chain, base / "flags", FLAG_CHAIN, FLAG_STOPS)
    for name, (layout, extra) in fresh.items():
        jobs[f"fresh {name}"] = (run_leg, command(base / f"fresh {name}", layout, extra), None,
                                 base / f"fresh {name}.log")
    # Two at a time: the two cores busy.
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("fork")) \
            as pool:
        futures = {name: pool.submit(*job) for name, job in jobs.items()}
        results = {name: f.result() for name, f in futures.items()}
    refs = {(layout, extra): scalars(base / f"fresh {name}", "step/lr")
            for name, (layout, extra) in fresh.items()}
    return {"base": base, "results": results, "fresh": refs}


def check_leg(leg: Leg, lrs: dict[int, float], epochs: dict[int, float],
              fresh: dict[int, float], end: int) -> None:
    """Every learning rate of ``leg`` (TensorBoard steps after its checkpoint up to ``end``)
    equals the fresh run's at the same point; mid-epoch, within the stated tolerance."""
    steps, batch = leg.layout.steps, leg.layout.global_batch
    step = steps - math.ceil((IMAGES - leg.images) / batch)  # where the rest ends on time
    assert abs(step - leg.images / batch) < 1, (leg.images, batch, step)
    assert step == leg.images / batch or f"=> approximated: epoch {leg.epoch} was left after " \
        f"{leg.images} of its {IMAGES} images" in leg.output, leg.output
    at = leg.epoch * steps + step  # scheduler steps of the fresh run at the resumed point
    got = [lrs[g] for g in range(leg.global_step + 1, end + 1)]
    want = [fresh[at + k] for k in range(1, len(got) + 1)]
    assert len(got) >= min(steps - step, 1), "the resumed leg trained nothing"
    assert got == want, (leg, got, want)
    # The resumed epoch ends after the steps that remained, on the fresh run's boundary.
    first_end = leg.global_step + steps - step
    if first_end <= end:
        assert epochs[first_end] == leg.epoch, sorted(epochs.items())


@pytest.mark.slow
@pytest.mark.parametrize("chain", [*CHAINS, "flags"])
def test_every_step_after_a_resume_has_the_fresh_runs_learning_rate(runs, chain):
    out = runs["base"] / chain
    legs = runs["results"][chain]
    lrs, epochs = scalars(out, "step/lr"), scalars(out, "epoch/epoch")
    assert len(legs) == (4 if chain in CHAINS else 2)
    ends = [leg.global_step for leg in legs[1:]] + [max(lrs)]
    for leg, end in zip(legs, ends):
        check_leg(leg, lrs, epochs, runs["fresh"][(leg.layout, leg.extra)], end)
    final = load_checkpoint(out / "checkpoint.pth.tar")
    assert final["epoch"] == (4 if chain in CHAINS else 6)


@pytest.mark.slow
def test_the_chains_resume_where_the_matrix_says(runs):
    # Mid-epoch stops really were mid-epoch, boundary ones at a boundary, in and after warm-up.
    for name, layouts in CHAINS.items():
        legs = runs["results"][name]
        points = [(leg.epoch, leg.images) for leg in legs]
        mid = layouts[0].save_every * layouts[0].global_batch
        assert points == [(0, mid), (1, 0), (2, mid), (3, 0)], (name, points)
        # From W1's 40 images every other layout resumes between two of its steps.
        approximated = ["=> approximated:" in leg.output for leg in legs]
        assert approximated == [layouts[0] is W1, False, layouts[0] is W1, False], name
    flags = [(leg.epoch, leg.images) for leg in runs["results"]["flags"]]
    assert flags == [(1, 40), (3, 0)]


def changed(output: str) -> list[str]:
    """The flags a resumed run says changed since its checkpoint."""
    return re.findall(r"^=> changed since the checkpoint: (\S+) ", output, flags=re.M)


@pytest.mark.slow
def test_changed_flags_and_layout_are_printed_at_start(runs):
    world = runs["results"]["world 1-2-1-2-1"][0].output
    assert "=> layout changed since the checkpoint: 1 process(es) x 8 images x 1 accumulation " \
        "step(s) = global batch 8, 12 steps per epoch -> 2 process(es) x 8 images x 1 " \
        "accumulation step(s) = global batch 16, 6 steps per epoch" in world
    assert "=> changed since the checkpoint: -b/--batch-size 8 -> 16" in world
    assert changed(world) == ["-b/--batch-size"]  # not --multiprocessing-distributed: operational
    accum = runs["results"]["accum 1-2-1-2-1"][0].output
    assert "=> changed since the checkpoint: --grad-accum-steps 1 -> 2" in accum
    assert changed(accum) == ["--grad-accum-steps"]
    epochs, lr = (leg.output for leg in runs["results"]["flags"])
    assert "=> changed since the checkpoint: --epochs 4 -> 6" in epochs
    assert "=> changed since the checkpoint: --lr 0.05 -> 0.1" in lr
    assert (changed(epochs), changed(lr)) == (["--epochs"], ["--lr"])
    assert "layout changed" not in epochs + lr and "approximated" not in epochs


@pytest.mark.slow
def test_shards_start_an_epoch_over_when_another_layout_resumes_it(tmp_path):
    # Tar shards give each rank a contiguous stretch of the epoch: another layout cannot go on
    # with the rest, so the epoch starts over - data and schedule together, as a fresh run's.
    from helpers import write_image_folder
    from test_shards import prepare_shards

    from imagenet.settings.flags import parse_config
    from imagenet.training.optim import build_optimizer, build_scheduler

    folder = write_image_folder(tmp_path / "folder", classes=3, train_per_class=16)
    assert prepare_shards(folder, tmp_path / "shards", "--shard-max-images", "20").returncode == 0
    flags = ["-a", "squeezenet1_1", "--train-crop-size", "32", "--val-resize-size", "36",
             "--val-crop-size", "32", "-j", "0", "-p", "1", "--seed", "0", *SCHEDULE]
    out = tmp_path / "out"
    run_leg(prestarted_cmd(str(tmp_path / "shards"), *flags, "-b", "8", "--save-every", "3",
                           "--output-dir", str(out)), 1, tmp_path / "leg0.log")
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step_in_epoch"], ckpt["sampler"]["images"]) == (0, 3, 24)
    output = run_leg(prestarted_cmd(str(tmp_path / "shards"), *flags, "-b", "12",
                                    "--output-dir", str(out), "--resume", "auto"),
                     None, tmp_path / "leg1.log")
    assert "=> approximated: epoch 0 was left after 2.00 steps of this layout's global batch " \
        "12; tar shards can only continue an epoch in the layout that began it" in output
    assert re.search(r"^Epoch: \[0\]\[1/4\]", output, flags=re.M), output
    cfg = parse_config(["data", *flags])
    optimizer = build_optimizer(torch.nn.Linear(1, 1), cfg)
    scheduler = build_scheduler(optimizer, cfg, 4)
    fresh = []
    for _ in range(16):
        optimizer.step()
        scheduler.step()
        fresh.append(optimizer.param_groups[0]["lr"])
    lrs = scalars(out, "step/lr")
    got = [lrs[g] for g in range(ckpt["global_step"] + 1, max(lrs) + 1)]
    assert got == pytest.approx(fresh, rel=1e-6) and len(got) == 16
