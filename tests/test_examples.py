"""Every file in examples/ runs: the Kubernetes manifests and the SkyPilot task are read from the
files, their launchers' variables made as the operator or SkyPilot makes them (loopback for the
hosts, 2 CPU processes in all), and their commands run as real processes; the Ray driver runs on
a local Ray with 2 CPU workers, one of which is killed mid-run.

The manifests' data and output are bucket URLs: here they become the test's folder (the
command's data argument) and --output-dir, and the tiny flags of test_launchers are appended
(argparse keeps the last value of a flag).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from helpers import MAIN, ROOT, child_env, descendants, load_checkpoint, run_parallel
from test_launchers import RUN, check_artifacts, data  # noqa: F401  (data: a fixture)

from imagenet.settings.plan import free_port

EXAMPLES = ROOT / "examples"
TINY_RUN = [*RUN, "-b", "4"]  # world 2: 4 images per process, 3 steps per epoch
BIN = str(Path(sys.executable).parent)  # torchrun and python, as in the container's PATH


def load(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args, from the container's environment."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def container_command(spec: dict, env: dict[str, str], folder: Path, out: Path) -> list[str]:
    """The container's command and args as Kubernetes runs them, on this test's data."""
    argv = [expand(str(a), env) for a in [*spec["command"], *spec.get("args", [])]]
    script = next(i for i, a in enumerate(argv) if a.endswith("main.py"))
    assert argv[script + 1].startswith("s3://"), argv  # the data argument follows main.py
    argv[script], argv[script + 1] = MAIN, str(folder)
    assert "--resume" in argv and argv[argv.index("--resume") + 1] == "auto"
    return [*argv, *TINY_RUN, "--output-dir", str(out)]


def pod_env(env: dict[str, str]) -> dict[str, str]:
    return child_env(**env, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def pytorchjob_pods(job: dict, cpu_procs: int = 1) -> list[tuple[dict, dict[str, str]]]:
    """(container, environment) of every pod, as the training operator makes them: the Master
    is RANK 0, then the Workers; WORLD_SIZE = pods x nprocPerNode (1 unless an integer). On
    these CPU pods nprocPerNode is ``cpu_procs``."""
    specs, port = job["spec"]["pytorchReplicaSpecs"], free_port()
    kinds = [k for k in ("Master", "Worker") for _ in range(specs.get(k, {}).get("replicas", 0))]
    nproc = str(job["spec"].get("nprocPerNode", "auto"))
    if nproc.isdigit():
        nproc = str(cpu_procs)
    per_pod = int(nproc) if nproc.isdigit() else 1
    pods = []
    for rank, kind in enumerate(kinds):
        (spec,) = [c for c in specs[kind]["template"]["spec"]["containers"]
                   if c["name"] == "pytorch"]
        pods.append((spec, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                            "WORLD_SIZE": str(len(kinds) * per_pod), "RANK": str(rank),
                            "PYTHONUNBUFFERED": "0", "PET_NPROC_PER_NODE": nproc,
                            "PET_NODE_RANK": str(rank), "PET_NNODES": str(len(kinds))}))
    return pods


def run_pods(pods, folder: Path, out: Path, logs: Path) -> list[subprocess.CompletedProcess]:
    cmds = [container_command(spec, env, folder, out) for spec, env in pods]
    return run_parallel(cmds, [pod_env(env) for _, env in pods], logs)


@pytest.mark.slow
def test_pytorchjob_original_contract_one_process_per_cpu_pod(data, tmp_path):  # noqa: F811
    job = load("pytorchjob.yaml")
    pods = pytorchjob_pods(job)
    assert [spec["command"] for spec, _ in pods] == [["python", "main.py"]] * 2  # no torchrun
    assert all("LOCAL_RANK" not in env for _, env in pods)
    out = tmp_path / "bucket"
    results = run_pods(pods, data, out, tmp_path / "logs")
    # RANK / WORLD_SIZE of a CPU pod: one process per pod, -b per process
    check_artifacts(out, world=2, per_process=4, steps=3, results=results)


@pytest.mark.slow
def test_pytorchjob_original_contract_spawns_per_pod(data, tmp_path):  # noqa: F811
    # One pod that starts 2 processes (as a 2-GPU pod would): RANK/WORLD_SIZE count pods, and
    # -b counts per pod.
    (spec, env), _ = pytorchjob_pods(load("pytorchjob.yaml"))
    env = {**env, "WORLD_SIZE": "1", "PET_NNODES": "1"}
    cmd = [*container_command(spec, env, data, tmp_path / "bucket"), "-b", "8",
           "--nproc-per-node", "2"]
    results = run_parallel([cmd], [pod_env(env)], tmp_path / "logs")
    check_artifacts(tmp_path / "bucket", world=2, per_process=4, steps=3, results=results)
    assert "one process per node, as Kubeflow's PyTorchJob starts them): 2 process(es) on " \
        "node 0 of 1" in results[0].stdout


@pytest.mark.slow
def test_pytorchjob_with_nproc_per_node_runs_torchrun_on_pet_variables(data, tmp_path):  # noqa: F811
    job = load("pytorchjob-torchrun.yaml")
    assert job["spec"]["nprocPerNode"] == "8"
    pods = pytorchjob_pods(job, cpu_procs=1)  # 2 CPU pods of 1 process
    assert [spec["command"] for spec, _ in pods] == [["torchrun"]] * 2
    out = tmp_path / "bucket"
    results = run_pods(pods, data, out, tmp_path / "logs")
    check_artifacts(out, world=2, per_process=4, steps=3, results=results)


@pytest.mark.slow
def test_trainjob_runs_bare_torchrun_on_pet_variables(data, tmp_path):  # noqa: F811
    trainer = load("trainjob.yaml")["spec"]["trainer"]
    assert trainer["command"][0] == "torchrun" and trainer["command"][1].endswith("main.py")
    nodes, port = trainer["numNodes"], free_port()
    # Trainer's torch runtime gives every node only PET_* (numProcPerNode is 1 on a CPU node).
    pods = [(trainer, {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": "1",
                       "PET_NODE_RANK": str(r), "PET_MASTER_ADDR": "127.0.0.1",
                       "PET_MASTER_PORT": str(port)}) for r in range(nodes)]
    out = tmp_path / "bucket"
    results = run_pods(pods, data, out, tmp_path / "logs")
    check_artifacts(out, world=nodes, per_process=4, steps=3, results=results)


def skypilot_nodes(task: dict, folder: Path, output_dir: Path, flags: list[str]):
    """The run section and each node's environment, as SkyPilot gives them (0 GPUs)."""
    envs = {**{k: str(v) for k, v in task["envs"].items()}, "DATA": str(folder),
            "OUTPUT_DIR": str(output_dir), "TRAIN_FLAGS": " ".join(flags),
            "MASTER_PORT": str(free_port()), "PYTHON": sys.executable}
    nodes = task["num_nodes"]
    sky = {"SKYPILOT_NODE_IPS": "\n".join(["127.0.0.1"] * nodes),
           "SKYPILOT_NUM_NODES": str(nodes), "SKYPILOT_NUM_GPUS_PER_NODE": "0"}
    cmds = [["bash", "-c", task["run"]]] * nodes
    return cmds, [pod_env({**envs, **sky, "SKYPILOT_NODE_RANK": str(r)}) for r in range(nodes)]


@pytest.mark.slow
def test_skypilot_task_runs_on_every_node_and_resumes_from_the_bucket(data, tmp_path):  # noqa: F811
    task = load("skypilot.yaml")
    mount = next(iter(task["file_mounts"]))
    assert task["envs"]["OUTPUT_DIR"].startswith(mount + "/")  # the checkpoints: in the bucket
    out = tmp_path / "bucket" / "r50"
    results = run_parallel(*skypilot_nodes(task, data, out, TINY_RUN), tmp_path / "logs1")
    check_artifacts(out, world=2, per_process=4, steps=3, results=results)
    # A managed job re-runs the whole section after a preemption: it continues the run.
    results = run_parallel(*skypilot_nodes(task, data, out, [*TINY_RUN, "--epochs", "2"]),
                           tmp_path / "logs2")
    assert all(r.returncode == 0 for r in results), results
    assert "(epoch 1, step 0," in results[0].stdout, results[0].stdout
    epochs = [json.loads(ln)["epoch"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [0, 1] and not (out / "previous").exists()
    assert load_checkpoint(out / "checkpoint.pth.tar")["epoch"] == 2


# ---------------------------------------------------------------- Ray Train


def training_workers(driver: int) -> list[int]:
    """The driver's Ray Train worker processes (their title starts with ray::RayTrainWorker)."""
    pids = []
    for pid in descendants(driver):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if title.startswith(b"ray::RayTrainWorker"):
            pids.append(pid)
    return pids


def rays_checkpoints(run: Path) -> dict:
    """What Ray's controller has registered for the run (its own snapshot file); {} before."""
    try:
        return json.loads((run / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return {}


def wait_for_rays_checkpoint(run: Path, proc: subprocess.Popen, log: Path) -> None:
    """Until Ray's controller has registered a checkpoint (a report alone may still be lost)."""
    deadline = time.monotonic() + 400
    while not rays_checkpoints(run).get("latest_checkpoint_result"):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


@pytest.fixture(scope="module")
def ray_run(data, tmp_path_factory):  # noqa: F811
    """examples/ray_train.py on a local Ray (2 CPUs, 2 workers, 4 epochs) with --fsdp
    --sharded-checkpoint (checkpoint.dcp directories: the example copies a directory with the
    ``link_or_copy`` a single file goes through); once Ray holds the first checkpoint, one training
    worker is SIGKILLed. One driver run for every Ray test: a run costs ~45 s of CPU (Ray's
    daemons, four workers importing torch). The trainer's own file checkpoints through
    ``imagenet.train(on_checkpoint=, resume_from=)`` are test_contracts.py's."""
    return ray_driver_run(tmp_path_factory.mktemp("ray"), data, "--epochs", "4", "--fsdp",
                          "--sharded-checkpoint")


def ray_driver_run(base: Path, data: Path, *flags: str) -> dict:  # noqa: F811
    """examples/ray_train.py with main.py's ``flags``; one worker SIGKILLed once Ray holds a
    checkpoint; the driver's exit code, log, and folders."""
    storage, out, log = base / "storage", base / "out", base / "driver.log"
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths
    cmd = [sys.executable, str(EXAMPLES / "ray_train.py"), "--num-workers", "2", "--num-cpus",
           "2", "--storage-path", str(storage), "--max-failures", "2", "--", str(data),
           *TINY_RUN, *flags, "--output-dir", str(out)]
    # Health checks every 0.5 s (default 2 s): Ray registers a reported checkpoint sooner.
    env = child_env(RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=ray_tmp, RAY_DEDUP_LOGS="0",
                    RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.5")
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    try:
        wait_for_rays_checkpoint(storage / "imagenet", proc, log)
        workers = training_workers(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        code = proc.wait(timeout=600)
    finally:
        for pid in [proc.pid, *descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return {"code": code, "log": log.read_text(errors="replace"), "out": out,
            "storage": storage / "imagenet", "killed": workers[-1]}


@pytest.mark.slow
def test_ray_driver_restarts_the_killed_group_from_rays_checkpoint(ray_run):
    log = ray_run["log"]
    assert ray_run["code"] == 0, log
    assert "using the caller's process group (gloo, world size 2)" in log
    assert "(the caller's checkpoint of this run)" in log, log  # the restarted group resumed
    # Ray's copy of the directory (a trained epoch is saved before its validation too:
    # "epoch E, step 3" can come first)
    assert re.search(r"=> loaded checkpoint '.*checkpoint\.dcp' \(epoch ([1-3], step 0|[0-3], "
                     r"step 3),", log), log
    out = ray_run["out"]
    epochs = [json.loads(ln)["epoch"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [0, 1, 2, 3], epochs  # each epoch once: one record, continued
    assert not (out / "previous").exists()


@pytest.mark.slow
def test_ray_keeps_the_newest_checkpoints_and_they_load(ray_run):
    state = rays_checkpoints(ray_run["storage"])
    kept = [r["checkpoint_dir_name"] for r in state["checkpoint_results"]]
    assert len(kept) == 2, kept  # --num-to-keep 2 (default)
    newest = ray_run["storage"] / state["latest_checkpoint_result"]["checkpoint_dir_name"]
    assert sorted(p.name for p in newest.iterdir()) == ["checkpoint.dcp"]  # the directory alone
    ckpt = load_checkpoint(newest / "checkpoint.dcp" / "trainer_state.pth.tar")
    assert ckpt["epoch"] == 4 and ckpt["world_size"] == 2
    assert state["latest_checkpoint_result"]["metrics"]["epoch"] == 4
    assert f"newest checkpoint {newest}" in ray_run["log"]
    own = load_checkpoint(ray_run["out"] / "checkpoint.dcp" / "trainer_state.pth.tar")
    assert own["global_step"] == ckpt["global_step"] == 12  # 4 epochs of 3 steps
