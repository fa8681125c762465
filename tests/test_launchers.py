"""Every launcher trains end to end with real processes on gloo; failures end with one message.

Each run trains 1 epoch of resnet18 at 32 px on 24 training and 31 validation JPEGs (31 is odd on
purpose: a padded validation sampler would count an image twice).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    MAIN,
    TINY,
    child_env,
    load_checkpoint,
    main_cmd,
    run_parallel,
    write_image_folder,
)

from imagenet.cli import main
from imagenet.settings.plan import free_port

VAL_IMAGES = 31
TRAIN_IMAGES = 24
RUN = [*TINY, "--epochs", "1", "-p", "1", "--seed", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """3 classes, 24 training and 31 validation images."""
    root = write_image_folder(tmp_path_factory.mktemp("launch") / "data", train_per_class=8,
                              val_per_class=11)
    for extra in sorted((root / "val").glob("*/img10.jpg"))[:2]:
        extra.unlink()
    assert len(list((root / "val").glob("*/*.jpg"))) == VAL_IMAGES
    return root


def ok(results) -> None:
    """Every process of the job exited 0 (show all output otherwise)."""
    for r in results:
        assert r.returncode == 0, f"{r.args}\nexit {r.returncode}\n{r.stdout}\n{r.stderr}"


def check_artifacts(out: Path, world: int, per_process: int, steps: int, results) -> None:
    """Rank 0 wrote one checkpoint, one metrics line and config.json; only it printed progress."""
    ok(results)
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    for key in ("epoch", "arch", "state_dict", "best_acc1", "optimizer", "scheduler", "config",
                "world_size", "rng"):
        assert key in ckpt, key
    assert ckpt["epoch"] == 1 and ckpt["world_size"] == world
    assert not any(k.startswith("module.") for k in ckpt["state_dict"])
    assert len(ckpt["rng"]) == world  # every rank's RNG state, gathered to rank 0
    # --seed: one seed for model init, then a per-rank stream (seed + rank) for the step
    assert not torch.equal(ckpt["rng"][0]["torch"], ckpt["rng"][1]["torch"])
    assert not list(out.glob(".*tmp*")), "temp files left behind"
    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1, "metrics.jsonl written by more than one rank"
    assert records[0]["val_count"] == VAL_IMAGES
    # The training meters are every rank's, summed (a rank's own sums would say 1/world).
    assert records[0]["train_images"] == TRAIN_IMAGES
    config = json.loads((out / "config.json").read_text())
    assert config["world_size"] == world and config["backend"] == "gloo"
    assert config["batch_per_process"] == per_process
    assert config["global_batch"] == per_process * world
    assert config["train_images"] == TRAIN_IMAGES and config["val_images"] == VAL_IMAGES
    stdout = "".join(r.stdout for r in results)
    stderr = "".join(r.stderr for r in results)
    assert f"global batch {per_process * world} = {world} process(es) x {per_process} images" \
        in stdout
    progress = re.findall(r"^Epoch: \[0\]\[\s*\d+/\d+\]", stdout, flags=re.M)
    assert len(progress) == steps, stdout  # one rank's lines, not world x steps
    assert stdout.count(" * Acc@1") == 1
    assert "Epoch: [" not in stderr and "Test: [" not in stderr
    # Other ranks log warnings and errors only.
    tagged = re.findall(r"\[rank \d+\] (\w+):", stdout + stderr)
    assert set(tagged) <= {"WARNING", "ERROR"}, tagged


@pytest.mark.slow
def test_multiprocessing_distributed_splits_the_node_batch(data, tmp_path):
    out = tmp_path / "out"
    results = run_parallel([main_cmd(str(data), *RUN, "--multiprocessing-distributed",
                                     "--nproc-per-node", "2", "-b", "8", "--output-dir",
                                     str(out))], [child_env()], tmp_path / "logs")
    check_artifacts(out, world=2, per_process=4, steps=3, results=results)
    assert "-b 8 per node -> 4 per process" in results[0].stdout


@pytest.mark.slow
def test_torchrun(data, tmp_path):
    out = tmp_path / "out"
    # Flags that disagree with torchrun's own numbers: torchrun's win, said once.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), MAIN, str(data),
           *RUN, "-b", "4", "--output-dir", str(out), "--world-size", "4", "--nproc-per-node",
           "3"]
    results = run_parallel([cmd], [child_env()], tmp_path / "logs")
    check_artifacts(out, world=2, per_process=4, steps=3, results=results)
    warning = ("torchrun's numbers win: --world-size 4 is ignored (torchrun started 2 "
               "processes); --nproc-per-node 3 is ignored (torchrun started 2 on this node); "
               "drop them from main.py's command line")
    assert (results[0].stdout + results[0].stderr).count(warning) == 1, results[0]


@pytest.mark.slow
def test_deprecated_torch_distributed_launch(data, tmp_path):
    # torch 2.14 still ships torch.distributed.launch; without --use_env it passes
    # --local-rank=N to the script.
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", MAIN, str(data), *RUN,
           "-b", "4", "--output-dir", str(out)]
    results = run_parallel([cmd], [child_env()], tmp_path / "logs")
    check_artifacts(out, world=2, per_process=4, steps=3, results=results)


def slurm_job_id() -> tuple[str, int]:
    """A SLURM_JOB_ID whose derived port (15000 + id % 20000) is free now."""
    for port in range(free_port() % 20000 + 15000, 35000):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return str(port - 15000 + 20000 * 7), port
    pytest.skip("no free port in 15000-34999 for the SLURM job id")


@pytest.mark.slow
def test_slurm_srun_variables(data, tmp_path):
    # Two "tasks" as srun starts them: no MASTER_*; master from the node list, port from job id.
    out = tmp_path / "out"
    job_id, port = slurm_job_id()
    envs = [child_env(SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS="2",
                      SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost",
                      SLURM_JOB_ID=job_id, SLURM_STEP_ID="0") for r in range(2)]
    cmd = main_cmd(str(data), *RUN, "-b", "4", "--output-dir", str(out))
    results = run_parallel([cmd, cmd], envs, tmp_path / "logs")
    check_artifacts(out, world=2, per_process=4, steps=3, results=results)


@pytest.mark.slow
def test_two_nodes_of_two_processes(data, tmp_path):
    # Two main.py invocations ("nodes") with a shared --dist-url; each node has its own disk,
    # and node 1 (ranks 2 and 3) must write nothing.
    url = f"tcp://127.0.0.1:{free_port()}"
    outs = [tmp_path / "node0", tmp_path / "node1"]
    cmds = [main_cmd(str(data), *RUN, "--multiprocessing-distributed", "--nproc-per-node", "2",
                     "--world-size", "2", "--rank", str(r), "--dist-url", url, "-b", "8",
                     "--output-dir", str(outs[r])) for r in range(2)]
    results = run_parallel(cmds, [child_env(), child_env()], tmp_path / "logs")
    check_artifacts(outs[0], world=4, per_process=4, steps=2, results=results)
    assert not outs[1].exists()
    assert "Epoch: [" not in results[1].stdout and "Acc@1" not in results[1].stdout


@pytest.mark.slow
def test_manual_processes_three_ranks(data, tmp_path):
    # --dist-url tcp:// --world-size 3 --rank R: 31 validation images on 3 ranks are 11/10/10
    # images, 6/5/5 batches of 2, and still counted exactly once.
    url = f"tcp://127.0.0.1:{free_port()}"
    outs = [tmp_path / f"rank{r}" for r in range(3)]
    cmds = [main_cmd(str(data), *RUN, "--dist-url", url, "--world-size", "3", "--rank", str(r),
                     "-b", "2", "--output-dir", str(outs[r])) for r in range(3)]
    results = run_parallel(cmds, [child_env()] * 3, tmp_path / "logs")
    check_artifacts(outs[0], world=3, per_process=2, steps=4, results=results)
    assert not outs[1].exists() and not outs[2].exists()


# ---------------------------------------------------------------- failures end, with a message

def one_error(result) -> str:
    """The single 'error:' line of a failed process (no traceback)."""
    lines = [ln for ln in result.stderr.splitlines() if "error: " in ln]
    assert lines, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    return lines[0]


@pytest.mark.slow
def test_missing_peer_ends_within_the_timeout(data, tmp_path):
    # Node 1 of 2 never starts: both spawned ranks of node 0 give up after --dist-timeout.
    port = free_port()
    cmd = main_cmd(str(data), *RUN, "--multiprocessing-distributed", "--nproc-per-node", "2",
                   "--world-size", "2", "--rank", "0", "--dist-url", f"tcp://127.0.0.1:{port}",
                   "--dist-timeout", "10", "--output-dir", str(tmp_path / "out"))
    (result,) = run_parallel([cmd], [child_env()], tmp_path / "logs", timeout=120)
    assert result.returncode == 1, result.stderr
    # Both ranks time out together; the first to exit ends the job, and the other may be
    # stopped before it prints its own line (the node's parent says so).
    errors = [ln for ln in result.stderr.splitlines() if "error: " in ln]
    assert 1 <= len(errors) <= 2, result.stderr
    for line in errors:
        assert re.search(r"as rank [01] of world size 4", line), line
        assert f"127.0.0.1:{port}" in line and "--dist-timeout 10s" in line
    assert len(errors) == 2 or "stopped the others" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.slow
def test_a_rank_failing_mid_run_stops_the_job(data, tmp_path):
    # Validation image 1 is rank 1's first (ShardSampler: odd indices on rank 1 of 2). When it
    # fails, rank 0 (waiting in the all-reduce) must not hang: the whole job ends, code 1.
    # Its JPEG start and end markers pass the check before training; its decoding fails.
    broken = tmp_path / "data"
    shutil.copytree(data, broken)
    first = sorted((broken / "val" / "class0").glob("*.jpg"))[1]
    first.write_bytes(b"\xff\xd8\xff not a jpeg \xff\xd9")
    out = tmp_path / "out"
    cmd = main_cmd(str(broken), *RUN, "--multiprocessing-distributed", "--nproc-per-node", "2",
                   "-b", "8", "--output-dir", str(out))
    (result,) = run_parallel([cmd], [child_env()], tmp_path / "logs", timeout=180)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"[rank 1] error: cannot read image {first}" in result.stderr
    # Rank 0, waiting for rank 1 in a collective, must not be the one reported (it used to die
    # first of gloo's "Connection closed by peer", with a traceback, now and then).
    assert "training process 1 of this node exited with code 1; stopped the others" \
        in result.stderr
    assert "Traceback" not in result.stderr
    # The trained epoch was saved before its validation failed: a resume only validates.
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (0, ckpt["steps_per_epoch"])


@pytest.mark.slow
def test_unreachable_master(data, tmp_path):
    port = free_port()  # nothing listens there
    cmd = main_cmd(str(data), *RUN, "--world-size", "2", "--rank", "1", "--dist-url",
                   f"tcp://127.0.0.1:{port}", "--dist-timeout", "3")
    (result,) = run_parallel([cmd], [child_env()], tmp_path / "logs", timeout=120)
    assert result.returncode == 1
    line = one_error(result)
    assert f"127.0.0.1:{port} as rank 1 of world size 2" in line
    assert "reachable" in line


@pytest.mark.slow
def test_port_already_in_use(data, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = main_cmd(str(data), *RUN, "--world-size", "2", "--rank", "0", "--dist-url",
                       f"tcp://127.0.0.1:{port}", "--dist-timeout", "20")
        (result,) = run_parallel([cmd], [child_env()], tmp_path / "logs", timeout=120)
    assert result.returncode == 1
    line = one_error(result)
    assert "port is already in use" in line and f"127.0.0.1:{port}" in line


@pytest.mark.parametrize("argv, words", [
    (["--dist-backend", "nccl", "--multiprocessing-distributed", "--nproc-per-node", "2"],
     "--dist-backend nccl needs CUDA GPUs"),
    (["--dist-backend", "nccl", "--world-size", "2", "--rank", "0"],
     "--dist-backend nccl needs CUDA GPUs"),
    (["--sync-bn", "--multiprocessing-distributed", "--nproc-per-node", "2"],
     "--sync-bn needs CUDA GPUs"),
])
def test_impossible_requests_on_the_cpu_fail_before_starting(capsys, data, tmp_path, argv,
                                                             words):
    code = main([str(data), *RUN, *argv, "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and words in lines[0], err
    assert not (tmp_path / "out").exists()
