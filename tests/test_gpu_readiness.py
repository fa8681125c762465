"""What GPU nodes need, checked on the CPU: loader workers under every launcher (pure
functions of the environment), the master's address and interfaces, the order of the master
probe and the CUDA context, how a failing rank leaves its process group, room in /dev/shm, and
gpu_smoke.py without a GPU."""

from __future__ import annotations

import datetime
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, TINY, child_env, main_cmd

from imagenet.data.prefetch import shared_memory_error
from imagenet.errors import DistributedError
from imagenet.launching import process_group as distributed
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import Launch, plan_launch, plan_layout, resolve_ranks
from imagenet.settings.plan import free_port, make_plan, rendezvous

NODE = 96  # cores of the simulated 8-GPU node


def workers(argv: list[str], env: dict[str, str], affinity: int, machine: int = NODE,
            gpus: int = 8) -> int:
    """Loader workers per process that main.py would choose in ``env``."""
    cfg = parse_config(["data", *argv])
    launch = plan_launch(cfg, env, gpus)
    _, _, world, local_world = resolve_ranks(launch, 0, cfg, env)
    return plan_layout(cfg, launch, world, local_world, env, (affinity, machine)).workers


def srun_env(**extra: str) -> dict[str, str]:
    """A task of `srun --ntasks-per-node=8` on two nodes."""
    return {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "3",
            "SLURM_NTASKS": "16", "SLURM_TASKS_PER_NODE": "8(x2)",
            "SLURM_JOB_NODELIST": "gpu[01-02]", **extra}


def torchrun_env(**extra: str) -> dict[str, str]:
    """A worker of `torchrun --nproc-per-node 8` (two nodes)."""
    return {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", **extra}


def test_an_srun_task_keeps_its_own_cores():
    # --cpus-per-task=12, bound by srun: the task's 12 cores are its own (was 12 // 8 = 1).
    assert workers([], srun_env(SLURM_CPUS_PER_TASK="12"), affinity=12) == 11
    # --cpus-per-task=12 without binding (--cpu-bind=none): the node is visible, 12 are its share
    assert workers([], srun_env(SLURM_CPUS_PER_TASK="12"), affinity=NODE) == 11
    # neither: the node's cores divided among its 8 tasks
    assert workers([], srun_env(), affinity=NODE) == 11
    # bound without --cpus-per-task (e.g. SLURM_CPU_BIND=cores): its set is its own
    assert workers([], srun_env(), affinity=6) == 5


def test_processes_that_share_one_cpu_set_divide_it():
    assert workers([], torchrun_env(), affinity=NODE) == 11
    # torchrun as the one srun task of each node: its workers share the task's 96 cores
    assert workers([], {**srun_env(SLURM_CPUS_PER_TASK="96", SLURM_NTASKS="2",
                                   SLURM_TASKS_PER_NODE="1(x2)"), **torchrun_env()},
                   affinity=NODE) == 11
    # --multiprocessing-distributed, one srun task per node: 8 spawned processes share it
    spawn_env = srun_env(SLURM_CPUS_PER_TASK="96", SLURM_NTASKS="2", SLURM_PROCID="1",
                         SLURM_TASKS_PER_NODE="1(x2)")
    assert workers(["--multiprocessing-distributed"], spawn_env, affinity=NODE) == 11
    # mp.spawn on one node (8 GPUs, no launcher)
    assert workers([], {}, affinity=NODE) == 11


def test_worker_cap_and_small_machines():
    assert workers([], {}, affinity=64, machine=64, gpus=1) == 16  # one GPU, many cores: cap
    assert workers([], {}, affinity=2, machine=2, gpus=0) == 1
    assert workers([], torchrun_env(), affinity=8, machine=8) == 1  # 8 processes on 8 cores


def test_given_workers_are_per_process_except_with_spawn():
    assert workers(["-j", "6"], torchrun_env(), affinity=NODE) == 6
    assert workers(["-j", "6"], srun_env(SLURM_CPUS_PER_TASK="12"), affinity=12) == 6
    assert workers(["-j", "32", "--multiprocessing-distributed"], {}, affinity=NODE) == 4


def test_master_is_the_first_node_of_the_step():
    # An srun step on nodes 7-8 of a 6-node allocation: rank 0 runs on gpu07, not gpu03.
    env = srun_env(SLURM_JOB_NODELIST="gpu[03-08]", SLURM_STEP_NODELIST="gpu[07-08]")
    assert rendezvous(parse_config(["data"]), Launch("env"), env).host == "gpu07"
    env = srun_env(SLURM_JOB_NODELIST="gpu[03-08]")  # older SLURM: the job's list
    assert rendezvous(parse_config(["data"]), Launch("env"), env).host == "gpu03"


def test_only_gloo_is_pointed_at_the_masters_interface():
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                         timeout=10).stdout
    found = [(f[1], f[3].split("/")[0]) for f in (ln.split() for ln in out.splitlines())
             if len(f) > 3 and f[2] == "inet" and not f[3].startswith("127.")]
    assert found, "this test needs a non-loopback IPv4 address"
    iface, ip = found[0]
    env: dict[str, str] = {}
    assert distributed.set_socket_interface(ip, env) == iface.split("@")[0]
    assert env == {"GLOO_SOCKET_IFNAME": iface.split("@")[0]}  # NCCL chooses its own


def test_the_master_probe_forks_before_any_cuda_context(monkeypatch):
    """A rank on a GPU probes the master store (a fork) before set_device creates its CUDA
    context. Recorded on the CPU by standing in for the two CUDA calls."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append("set_device"))

    def probe(*args, **kwargs) -> None:
        calls.append("probe")
        raise DistributedError("stop here")

    monkeypatch.setattr(distributed, "probe_master_store", probe)
    cfg = parse_config(["data", "--dist-url", f"tcp://127.0.0.1:{free_port()}",
                        "--world-size", "2", "--rank", "1", "--gpu", "1"])
    with pytest.raises(DistributedError, match="stop here"):
        distributed.init_distributed(make_plan(cfg, {}, 2))
    assert calls == ["probe"]


def test_a_failing_rank_aborts_nccl_and_destroys_gloo(monkeypatch):
    assert distributed.teardown("nccl", failed=True) == "abort"
    assert distributed.teardown("nccl", failed=False) == "destroy"
    assert distributed.teardown("gloo", failed=True) == "destroy"
    # The gloo path on a real group: left at once, and a new group can be formed after it.
    for _ in range(2):
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True,
                              timeout=datetime.timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        monkeypatch.setattr(distributed, "_created_group", True)  # as init_distributed marks it
        dist.all_reduce(torch.ones(1))
        distributed.cleanup(failed=True)
        assert not dist.is_initialized()


# ---------------------------------------------------------------- /dev/shm


def test_shared_memory_need_against_free_space():
    mb = 2**20
    # Docker's 64 MB, 8 GPUs x 11 workers, one pinned batch of 256 x 224 px each in flight
    error = shared_memory_error(64 * mb, 8, 11, 1, 256 * 3 * 224 * 224)
    assert error is not None
    assert "/dev/shm has 64.0 MB free" in error and "8 process(es) x 11 loader" in error
    assert "--shm-size=7g" in error and "-j 0" in error
    assert shared_memory_error(16 * 2**30, 8, 11, 1, 256 * 3 * 224 * 224) is None
    assert shared_memory_error(64 * mb, 1, 2, 4, 8 * mb) is None  # 64 MB: just fits
    assert shared_memory_error(64 * mb - 1, 1, 2, 4, 8 * mb) is not None
    assert shared_memory_error(0, 8, 0, 4, mb) is None  # -j 0: no shared memory used


@pytest.mark.slow
def test_a_small_dev_shm_is_one_clear_line(image_folder, tmp_path):
    """main.py in a mount namespace whose /dev/shm is a real 128 KB tmpfs: 2 workers x 4
    prefetched batches of 8 x 32 x 32 x 3 bytes need 192 KB. (Without the check this run
    hangs: its workers fail to allocate shared memory, measured with torch 2.14.)"""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting a tmpfs on /dev/shm needs root and unshare")
    command = " ".join(shlex.quote(a) for a in main_cmd(
        str(image_folder), *TINY, "-j", "2", "--epochs", "1", "--output-dir", str(tmp_path)))
    proc = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=128k tmpfs "
                           f"/dev/shm && exec {command}"], capture_output=True, text=True,
                          env=child_env(), timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: /dev/shm has 0.1 MB free"), lines[-3:]
    assert "x up to 4 batch(es) of 0.0 MB" in lines[-1] and "--shm-size" in lines[-1]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_gpu_smoke_without_a_gpu_says_so_in_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_smoke.py")],
                          capture_output=True, text=True, timeout=120,
                          env=child_env(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "gpu_smoke: no CUDA device here (torch.cuda.is_available() is False); nothing to check"]


def test_gpu_smoke_reads_a_run_s_epoch_boundary_and_steady_rate(tmp_path):
    """gpu_smoke's numbers from a run's progress lines and metrics.jsonl: the steady step rate
    (the median window), the epoch boundary (the first window's wait beyond the usual one)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_smoke

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(
        '{"epoch": 0, "train_images_per_sec": 400.0, "compiled_graphs": 3}\n'
        '{"epoch": 1, "train_images_per_sec": 5000.0, "train_data_wait": 0.04, '
        '"compiled_graphs": 0, "train_max_mem_gb": 21.5}\n')
    lines = [f"Epoch: [1][{s:>3}/100]  Time  {t:.3f}  Data  {d:.3f}  Loss 1.0e+00"
             for s, t, d in ((20, 0.090, 0.050), (40, 0.040, 0.001), (60, 0.040, 0.001),
                             (80, 0.041, 0.002), (100, 0.040, 0.001))]
    ran = gpu_smoke.Ran(0, "\n".join(["Epoch: [0][ 20/100]  Time  1.000  Data  0.900", *lines]),
                        "", 60.0, {}, {})
    speed = gpu_smoke.speed_of(ran, out, gpus=1)
    assert speed.images_per_sec == 5000 and speed.wait == 0.04 and speed.graphs == 0
    assert speed.steady == pytest.approx(256 / 0.040)
    assert speed.boundary == pytest.approx(20 * 0.050 - 20 * 0.001)  # 0.98 s more than usual
    assert speed.memory == 21.5
