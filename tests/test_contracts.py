"""What each launcher's contract makes of a process (pure decisions), and imagenet.train(argv):
the training run as a function, in a process group its caller created (as Ray Train does)."""

from __future__ import annotations

import datetime
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import TINY18, load_checkpoint, start_ranks, write_image_folder

import imagenet
from imagenet.errors import UsageError
from imagenet.settings import devices
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import Launch, plan_launch, plan_layout, resolve_ranks
from imagenet.settings.plan import free_port, make_plan

RUN = [*TINY18, "-j", "0"]


def pod_env(rank: int, pods: int, **extra: str) -> dict[str, str]:
    """What Kubeflow's PyTorchJob (original contract) gives pod ``rank``: no LOCAL_RANK."""
    return {"MASTER_ADDR": "imagenet-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": str(pods),
            "RANK": str(rank), "PYTHONUNBUFFERED": "0", **extra}


# ---------------------------------------------------------------- PyTorchJob, original contract

def test_pytorchjob_pod_with_several_gpus_starts_one_process_per_gpu():
    cfg = parse_config(["data", "-b", "256"])
    launch = plan_launch(cfg, pod_env(1, 3), accel=8)
    # WORLD_SIZE and RANK count pods, as in the classic script: 3 pods x 8 GPUs.
    assert (launch.mode, launch.nprocs, launch.nnodes, launch.node_rank) == ("spawn", 8, 3, 1)
    assert "one process per node" in launch.reason
    assert resolve_ranks(launch, 2, cfg, {}) == (10, 2, 24, 8)
    assert plan_layout(cfg, launch, 24, 8).batch_size == 32  # -b counts per pod, as spawned


@pytest.mark.parametrize("argv, cuda", [([], 1), ([], 0), (["--gpu", "0"], 8)])
def test_pytorchjob_pod_with_one_device_is_one_process(argv, cuda):
    cfg = parse_config(["data", *argv])
    launch = plan_launch(cfg, pod_env(1, 3), accel=cuda)
    assert launch.mode == "env"
    assert resolve_ranks(launch, 0, cfg, pod_env(1, 3)) == (1, 0, 3, 3)


def test_pytorchjob_cpu_pod_spawns_what_nproc_per_node_asks():
    cfg = parse_config(["data", "--nproc-per-node", "2"])
    launch = plan_launch(cfg, pod_env(0, 2), accel=0)
    assert (launch.mode, launch.nprocs, launch.nnodes, launch.node_rank) == ("spawn", 2, 2, 0)


@pytest.mark.parametrize("extra", [{"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}, {}])
def test_launchers_that_start_every_process_keep_their_ranks(extra):
    # torchrun / Ray set LOCAL_RANK; a --local-rank argument (torch.distributed.launch) too.
    argv = [] if extra else ["--local-rank", "3"]
    cfg = parse_config(["data", *argv])
    env = pod_env(11, 16, **extra)
    launch = plan_launch(cfg, env, accel=8)
    assert launch.mode == "env"
    assert resolve_ranks(launch, 0, cfg, env)[:3] == (11, 3, 16)


# ---------------------------------------------------------------- the PET_* contract needs torchrun

@pytest.mark.parametrize("env", [
    pod_env(0, 16, PET_NPROC_PER_NODE="8", PET_NNODES="2", PET_NODE_RANK="0"),  # PyTorchJob
    {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1",  # TrainJob
     "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"},
])
def test_pet_variables_without_torchrun_are_one_error_naming_torchrun(env):
    with pytest.raises(UsageError, match="torchrun main.py"):
        plan_launch(parse_config(["data"]), env, accel=8)


def test_pet_variables_under_torchrun_or_by_default_are_fine():
    torchrun_worker = {"PET_NPROC_PER_NODE": "8", "PET_NNODES": "2", "LOCAL_RANK": "1",
                       "RANK": "9", "WORLD_SIZE": "16", "TORCHELASTIC_RUN_ID": "x"}
    assert plan_launch(parse_config(["data"]), torchrun_worker, 8).mode == "env"
    # PyTorchJob 1.7+ sets PET_NPROC_PER_NODE=auto and PET_NNODES = pods on every job
    original = pod_env(0, 2, PET_NPROC_PER_NODE="auto", PET_NNODES="2")
    assert plan_launch(parse_config(["data"]), original, 1).mode == "env"


# ---------------------------------------------------------------- imagenet.train(argv)

@pytest.mark.parametrize("argv, words", [
    (["data", "--bogus"], "unrecognized arguments: --bogus"),
    (["data", "-a", "nosuchnet"], "unknown architecture .nosuchnet."),
    (["data", "--multiprocessing-distributed"], "starts no others"),
    (["data", "--nproc-per-node", "2"], "starts no others"),
    ("data -a resnet18", "a list of flags"),
])
def test_train_raises_usage_errors_instead_of_exiting(argv, words):
    with pytest.raises(UsageError, match=words):
        imagenet.train(argv)


def test_train_makes_main_py_s_start_checks(tmp_path, capsys):
    """imagenet.train checks what main.py checks before any data is read (one start check,
    ``training.models.check_start``): crops too small for the model (the data folder does not even
    exist here), and it says the plan's notes (srun tasks that SLURM did not launch)."""
    missing = str(tmp_path / "no-data")
    with pytest.raises(UsageError, match="too small for -a alexnet, which needs crops of at "
                                         "least 63 px"):
        imagenet.train([missing, "-a", "alexnet", "--train-crop-size", "32",
                        "--val-crop-size", "32"])
    env = {"SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        with pytest.raises(UsageError, match="too small"):
            imagenet.train([missing, "-a", "alexnet", "--train-crop-size", "32",
                            "--val-crop-size", "32"])
    notes = make_plan(parse_config([missing]), env, devices.detect()).notes
    assert notes and notes[0] in capsys.readouterr().out


def test_sync_bn_is_checked_in_a_callers_process_group_too():
    """--sync-bn on the CPU is refused for every job of several processes, the group a caller
    (Ray) made included; a single process has no SyncBatchNorm to run (main.py and
    imagenet.train alike)."""
    cfg = parse_config(["data", "--sync-bn"])
    ray = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # what Ray Train sets
    with pytest.raises(UsageError, match="--sync-bn needs CUDA"):
        make_plan(cfg, ray, devices.Accelerator("cpu", 0), Launch("env", reason="a group"),
                  (0, 2))
    assert make_plan(cfg, {}, devices.Accelerator("cpu", 0)).launch.mode == "single"


@pytest.mark.slow
def test_train_returns_metrics_and_resumes_a_callers_checkpoint_as_its_own(tmp_path):
    data = write_image_folder(tmp_path / "data")
    out, kept = tmp_path / "out", tmp_path / "kept"
    seen = []
    first = imagenet.train([str(data), *RUN, "--epochs", "1", "--save-every", "1",
                            "--output-dir", str(out)], on_checkpoint=seen.append)
    assert first["val_count"] == 9 and first["epoch"] == 0 and "best_acc1" in first
    # 3 steps: saves after steps 1 and 2, the trained epoch's before its validation, then the
    # validated epoch's (after its metrics line)
    assert [(s.epoch, s.step_in_epoch, s.epoch_done) for s in seen] == \
        [(0, 1, False), (0, 2, False), (0, 3, False), (1, 0, True)]
    assert {s.path for s in seen} == {out / "checkpoint.pth.tar"}
    # The caller keeps the checkpoint (Ray's storage); the folder's own copy is gone (a node
    # that did not see it): without resume_from the run would start over.
    kept.mkdir()
    shutil.move(out / "checkpoint.pth.tar", kept / "checkpoint.pth.tar")
    second = imagenet.train([str(data), *RUN, "--epochs", "2", "--output-dir", str(out)],
                            resume_from=kept / "checkpoint.pth.tar")
    assert second["epoch"] == 1
    lines = (out / "metrics.jsonl").read_text().splitlines()
    epochs = [json.loads(line)["epoch"] for line in lines]
    assert epochs == [0, 1]  # one record continued, not moved to previous/
    assert not (out / "previous").exists()
    assert load_checkpoint(out / "checkpoint.pth.tar")["epoch"] == 2


def _train_in_callers_group(rank: int, world: int, port: int, data: str, out: str) -> None:
    """A rank (start_ranks): a caller that creates the group and runs train() in a thread (Ray)."""
    import os

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    result: dict = {}

    def body() -> None:
        seen = []
        result["metrics"] = imagenet.train([data, *RUN, "-b", "4", "--epochs", "1",
                                            "--output-dir", out], on_checkpoint=seen.append)
        result["saves"] = len(seen)

    thread = threading.Thread(target=body)  # not the main thread: no signal handlers there
    thread.start()
    thread.join()
    assert "metrics" in result, "train() failed in the thread"
    # The caller's group is still there and works; train() did not destroy it.
    assert dist.is_initialized()
    total = torch.tensor([float(result["saves"])])
    dist.all_reduce(total)
    torch.save({"metrics": result["metrics"], "saves": result["saves"],
                "all_saves": total.item()}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_train_uses_the_callers_process_group_and_leaves_it_alive(tmp_path):
    data = write_image_folder(tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    start_ranks(_train_in_callers_group, args=(2, free_port(), str(data), str(out)))
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    # every rank sees the same saves: the trained epoch's (before validation), the epoch's
    assert [r["saves"] for r in ranks] == [2, 2] and ranks[0]["all_saves"] == 4
    assert ranks[0]["metrics"]["val_count"] == ranks[1]["metrics"]["val_count"] == 9
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert ckpt["world_size"] == 2 and ckpt["epoch"] == 1
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == 2 and config["batch_per_process"] == 4


@pytest.mark.slow
def test_train_counts_the_time_limit_from_its_call(tmp_path, capsys):
    """A notebook calls imagenet.train long after Python started: --time-limit is the call's."""
    import re
    import time

    from imagenet.settings.plan import process_start

    time.sleep(max(0.0, 20 - (time.time() - process_start())))  # this process: 20 s old or more
    imagenet.train(["--dummy", "--dummy-size", "8", "--dummy-val-size", "4", "--dummy-classes",
                    "2", "-a", "resnet18", "--train-crop-size", "32", "--val-resize-size", "36",
                    "--val-crop-size", "32", "-b", "8", "-j", "0", "--epochs", "1", "--log-to",
                    "none", "--time-limit", "600", "--output-dir", str(tmp_path)])
    left = re.search(r"--time-limit 600 at .* \((\d+) min (\d+) s from now\)",
                     capsys.readouterr().out)
    assert left, "no time-limit line"
    assert int(left[1]) * 60 + int(left[2]) >= 590  # not 600 less this process's age
