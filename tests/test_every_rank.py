"""Every rank agrees: on the checkpoint it resumes, on a NaN, on the EMA it validates; a failure on
one rank stops all of them within seconds with the same message. Real processes on gloo."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY18,
    child_env,
    gloo_rank_saving,
    load_checkpoint,
    prestarted_cmd,
    run_parallel,
    save_edited,
    start_ranks,
    tiny_engine,
    tiny_net,
    write_image_folder,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from imagenet.settings.plan import fixed_plan, free_port

pytestmark = pytest.mark.slow

DUMMY = ["--dummy", "--dummy-size", "24", "--dummy-val-size", "6", "--dummy-classes", "3"]
RUN = [*DUMMY, *TINY18, "-b", "4", "--seed", "0", "--dist-timeout", "30"]


def manual_ranks(world: int, outs: list[Path], *args: str, data: list[list[str]] | None = None
                 ) -> list[list[str]]:
    """main.py command lines of ``world`` manual ranks (shared --dist-url), each with its own
    --output-dir, as on nodes with local disks."""
    url = f"tcp://127.0.0.1:{free_port()}"
    return [prestarted_cmd(*(data[r] if data else RUN), *args, "--dist-url", url, "--world-size",
                     str(world), "--rank", str(r), "--output-dir", str(outs[r]))
            for r in range(world)]


def error_lines(result) -> list[str]:
    return [ln for ln in result.stderr.splitlines() if "error: " in ln]


# ---------------------------------------------------------------- 6: who decides the resume


def in_folder(cmd: list[str], folder: Path) -> list[str]:
    """``cmd`` run from ``folder`` (a node whose disk holds the relative --output-dir)."""
    folder.mkdir(parents=True, exist_ok=True)
    return ["sh", "-c", 'cd "$0" && exec "$@"', str(folder), *cmd]


def test_node_local_folders_resume_every_rank_from_rank_0s_checkpoint(tmp_path):
    # A 1-process run leaves a checkpoint; 3 ranks resume it with --resume auto and the same
    # --output-dir, which is on each node's own disk: node 1 has no checkpoint there and node 2
    # a stale one from another run. Both must take rank 0's, and end bitwise where 3 ranks
    # sharing one folder end.
    first = tmp_path / "first"
    (result,) = run_parallel([prestarted_cmd(*RUN, "--epochs", "1", "--output-dir", str(first))],
                             [child_env()], tmp_path / "logs0")
    assert result.returncode == 0, result.stderr
    nodes = [tmp_path / f"node{r}" for r in range(3)]
    shutil.copytree(first, nodes[0] / "out")
    stale = load_checkpoint(first / "checkpoint.pth.tar")
    stale.update(epoch=0, global_step=0)
    stale["state_dict"] = {k: v + 1 if v.is_floating_point() else v
                           for k, v in stale["state_dict"].items()}
    (nodes[2] / "out").mkdir(parents=True)
    save_edited(stale, nodes[2] / "out" / "checkpoint.pth.tar")
    shared = tmp_path / "shared"
    shutil.copytree(first, shared / "out")
    args = ("--epochs", "2", "--resume", "auto")
    local = [in_folder(cmd, node) for cmd, node in
             zip(manual_ranks(3, [Path("out")] * 3, *args), nodes)]
    together = [in_folder(cmd, shared) for cmd in manual_ranks(3, [Path("out")] * 3, *args)]
    start = time.monotonic()
    results = run_parallel(local + together, [child_env()] * 6, tmp_path / "logs", timeout=240)
    for r in results:
        assert r.returncode == 0, f"{r.args}\n{r.stdout}\n{r.stderr}"
    print(f"two 3-rank resumes in {time.monotonic() - start:.0f} s")
    assert "cannot use out/checkpoint.pth.tar on rank 1" in results[1].stderr
    assert "out/checkpoint.pth.tar on rank 2 is not the file rank 0 resumes from" \
        in results[2].stderr
    got = load_checkpoint(nodes[0] / "out" / "checkpoint.pth.tar")
    want = load_checkpoint(shared / "out" / "checkpoint.pth.tar")
    assert (got["epoch"], got["global_step"]) == (want["epoch"], want["global_step"]) == (2, 8)
    for key in ("state_dict", "optimizer"):
        want_flat = torch.nn.utils.parameters_to_vector(
            [v.float() for v in _tensors(want[key])])
        got_flat = torch.nn.utils.parameters_to_vector([v.float() for v in _tensors(got[key])])
        assert torch.equal(got_flat, want_flat), key
    assert not (nodes[1] / "out" / "checkpoint.pth.tar").exists()  # only rank 0 writes


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a nested checkpoint value, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj.reshape(-1)]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []


def test_rank_0s_damaged_checkpoint_stops_every_rank_with_its_message(tmp_path):
    outs = [tmp_path / "node0", tmp_path / "node1"]
    outs[0].mkdir()
    damaged = outs[0] / "checkpoint.pth.tar"
    damaged.write_bytes(b"")
    start = time.monotonic()
    results = run_parallel(manual_ranks(2, outs, "--epochs", "1", "--resume", "auto"),
                           [child_env()] * 2, tmp_path / "logs", timeout=120)
    assert time.monotonic() - start < 60
    for result in results:
        assert result.returncode == 1, result.stderr
        (line,) = error_lines(result)
        assert f"error: {damaged} is empty (truncated); use an older copy or start without " \
            f"--resume; no intact checkpoint to fall back to in {outs[0]}" in line, result.stderr
        assert "Traceback" not in result.stderr
    assert damaged.read_bytes() == b""  # left as it was


def test_ranks_started_with_different_flags_stop_at_once_with_one_message(tmp_path):
    # Two nodes whose scripts disagree on --epochs would train different schedules and hang
    # when the shorter one finishes.
    outs = [tmp_path / "node0", tmp_path / "node1"]
    data = [[*RUN, "--epochs", "1"], [*RUN, "--epochs", "2"]]
    start = time.monotonic()
    results = run_parallel(manual_ranks(2, outs, data=data), [child_env()] * 2,
                           tmp_path / "logs", timeout=120)
    assert time.monotonic() - start < 60
    for result in results:
        assert result.returncode == 2, result.stderr
        (line,) = error_lines(result)
        assert line.endswith("error: rank 1 was started with --epochs 2 and rank 0 with "
                             "--epochs 1: every rank needs the same flags"), line
    assert not (outs[0] / "checkpoint.pth.tar").exists()


# ---------------------------------------------------------------- one rank fails: all stop


def test_a_rank_that_fails_stops_the_others_within_seconds_with_its_message(tmp_path):
    # Manual ranks have no common parent to stop them: rank 1's data folder is missing on its
    # node; rank 0 would otherwise wait in its first collective until --dist-timeout.
    missing = tmp_path / "no-such-data"
    data = [RUN, [str(missing), *TINY18, "-b", "4", "--dist-timeout", "30"]]
    outs = [tmp_path / "node0", tmp_path / "node1"]
    start = time.monotonic()
    results = run_parallel(manual_ranks(2, outs, "--epochs", "1", data=data),
                           [child_env()] * 2, tmp_path / "logs", timeout=120)
    elapsed = time.monotonic() - start
    (own,) = error_lines(results[1])
    message = own.split("error: ", 1)[1]
    assert message.startswith(f"data folder '{missing}' does not exist"), own
    assert error_lines(results[0]) == [f"error: rank 1 failed: {message}"], results[0].stderr
    assert [r.returncode for r in results] == [2, 2]  # a usage error: the same code on both
    assert "Traceback" not in results[0].stderr + results[1].stderr
    assert elapsed < 60, elapsed


# ---------------------------------------------------------------- 10: NaN on one rank


def nan_on_rank_1(info) -> dict:
    """Two DDP ranks; rank 1's images drive a huge conv weight to inf (a NaN loss), rank 0's
    stay finite. Each rank returns the error it stopped with."""
    from imagenet.errors import NonFiniteLossError
    from imagenet.training.engine import Step, train_one_epoch

    raw = tiny_net((4,))
    with torch.no_grad():
        raw[0].weight.fill_(1e38)  # white pixels -> +inf -> NaN logits; black ones -> ReLU 0
        raw[0].bias.zero_()
    engine = tiny_engine(DDP(raw), "-p", "1", steps=4, world=2, batch=2)
    value = 255 if info.rank == 1 else 0
    batches = [(torch.full((2, 3, 8, 8), value, dtype=torch.uint8), torch.tensor([0, 1]))] * 4
    step = Step()
    try:
        train_one_epoch(engine, batches, step)
    except NonFiniteLossError as exc:
        return {"error": str(exc), "step": step.step_in_epoch}
    return {"error": None, "step": step.step_in_epoch}


def test_a_nan_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    start_ranks(gloo_rank_saving, args=(2, free_port(), tmp_path, nan_on_rank_1))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert results[0] == results[1], results
    assert results[0]["step"] == 1
    assert results[0]["error"].startswith("the loss became NaN/infinite at epoch 0, step 0")


# ---------------------------------------------------------------- 11: the EMA every rank saves


def ema_after_an_epoch(info, data: Path, out: Path) -> dict:
    """One epoch through the trainer with an EMA that follows the model closely."""
    from imagenet.checkpoint.resume_from import Decided
    from imagenet.reporting.logger import RunLogger
    from imagenet.run.build import build_run
    from imagenet.run.checkpointing import resume
    from imagenet.run.trainer import train
    from imagenet.settings.flags import parse_config
    from imagenet.settings.launch import Layout

    cfg = parse_config([str(data), *TINY18, "-b", "4", "--epochs", "1", "--seed", "0",
                        "--model-ema", "--model-ema-steps", "1", "--model-ema-decay", "0.5",
                        "--output-dir", str(out)])
    run = build_run(fixed_plan(cfg, Layout(info.world_size, 4, 1, 0)), info, Decided(None))
    resume(run)
    logger = RunLogger(out, info.is_main)
    record = train(run, logger)
    logger.close()
    ema = run.engine.parts.ema
    return {"ema": {k: v.clone() for k, v in ema.state_dict().items()},
            "ema_val_loss": record["ema_val_loss"]}


def _ema_rank(rank: int, world: int, port: int, out: Path, data: Path) -> None:
    from functools import partial

    gloo_rank_saving(rank, world, port, out,
                     partial(ema_after_an_epoch, data=data, out=out / "run"))


def test_every_rank_validates_and_saves_the_same_ema(tmp_path):
    data = write_image_folder(tmp_path / "data")
    start_ranks(_ema_rank, args=(2, free_port(), tmp_path, data))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    saved = load_checkpoint(tmp_path / "run" / "checkpoint.pth.tar")["ema"]
    for key, value in saved.items():
        for rank in ranks:  # BatchNorm statistics too: every rank holds rank 0's
            assert torch.equal(rank["ema"][key], value), key
    assert ranks[0]["ema_val_loss"] == ranks[1]["ema_val_loss"]


# ---------------------------------------------------------------- 12: tiny validation sets


def test_fewer_validation_images_than_ranks_does_not_hang(tmp_path):
    # Rank 1 has no validation batch; the other rank's model must not wait for it in a
    # collective (DDP's forward broadcasts buffers), in training and with -e.
    out = tmp_path / "out"
    common = [*DUMMY, "--dummy-val-size", "1", *TINY18, "-b", "8", "--dist-timeout", "30",
              "--multiprocessing-distributed", "--nproc-per-node", "2", "--output-dir", str(out)]
    (train,) = run_parallel([prestarted_cmd(*common, "--epochs", "1")], [child_env()],
                            tmp_path / "logs", timeout=120)
    assert train.returncode == 0, train.stderr
    assert "(1 images)" in train.stdout
    (evaluate,) = run_parallel([prestarted_cmd(*common, "-e", "--resume", "auto")], [child_env()],
                               tmp_path / "logs-e", timeout=120)
    assert evaluate.returncode == 0, evaluate.stderr
    assert "(1 images)" in evaluate.stdout
