"""Launches that used to go wrong quietly: srun with --multiprocessing-distributed, main.py in an
sbatch script, fewer GPUs per process after a restart, bf16 on a CPU without bf16 instructions,
and what -b means under each launcher."""

from __future__ import annotations

import json
import time

import pytest
import torch
from helpers import TINY18, child_env, load_checkpoint, main_cmd, run_main, run_parallel

from imagenet.checkpoint.states import cuda_state_to_restore
from imagenet.errors import UsageError
from imagenet.settings.choices import unlaunched_slurm_tasks
from imagenet.settings.devices import cpu_flags, native_bf16, slow_bf16_warning
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import plan_launch, resolve_ranks
from imagenet.settings.plan import free_port

DUMMY = ["--dummy", "--dummy-size", "16", "--dummy-val-size", "4", "--dummy-classes", "3"]


def srun_env(rank: int, tasks: int, per_node: int, **extra: str) -> dict[str, str]:
    """The variables srun gives task ``rank`` (one job step)."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % per_node), "SLURM_NTASKS": str(tasks),
            "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_NODEID": str(rank // per_node),
            "SLURM_TASKS_PER_NODE": f"{per_node}(x{tasks // per_node})",
            "SLURM_JOB_NODELIST": "localhost", **extra}


# ---------------------------------------------------------------- 7: srun + spawn


def test_srun_one_task_per_node_with_spawn_is_one_job_of_all_nodes():
    cfg = parse_config(["--multiprocessing-distributed", "--nproc-per-node", "4"])
    launch = plan_launch(cfg, srun_env(rank=2, tasks=3, per_node=1), accel=4)
    assert (launch.mode, launch.nnodes, launch.node_rank, launch.nprocs) == ("spawn", 3, 2, 4)
    assert resolve_ranks(launch, 1, cfg, {}) == (9, 1, 12, 4)
    # Explicit flags still win.
    given = parse_config(["--multiprocessing-distributed", "--world-size", "3", "--rank", "0"])
    assert plan_launch(given, srun_env(2, 3, 1), 1).node_rank == 0


def test_srun_several_tasks_per_node_with_spawn_is_refused():
    cfg = parse_config(["--multiprocessing-distributed"])
    with pytest.raises(UsageError, match=r"srun started 4 tasks, 2 per node.*--ntasks-per-node=1"):
        plan_launch(cfg, srun_env(rank=1, tasks=4, per_node=2), accel=2)


@pytest.mark.slow
def test_srun_tasks_with_spawn_train_as_one_job(tmp_path):
    # Two srun tasks ("nodes") each spawning one process: one job of world size 2, not two
    # independent jobs writing the same checkpoint.
    out = tmp_path / "out"
    port = free_port()
    cmd = main_cmd(*DUMMY, *TINY18, "-b", "4", "--epochs", "1", "--seed", "0",
                   "--multiprocessing-distributed", "--nproc-per-node", "1", "--dist-timeout",
                   "30", "--output-dir", str(out))
    envs = [child_env(**srun_env(r, 2, 1), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            for r in range(2)]
    results = run_parallel([cmd, cmd], envs, tmp_path / "logs", timeout=180)
    for r in results:
        assert r.returncode == 0, r.stdout + r.stderr
    ckpt = load_checkpoint(out / "checkpoint.pth.tar")
    assert ckpt["world_size"] == 2 and ckpt["global_step"] == 2  # 16 images, 2 x 4 per step
    assert "process(es) on node 1 of 2" in results[1].stdout
    assert json.loads((out / "config.json").read_text())["world_size"] == 2


# ---------------------------------------------------------------- 8: sbatch without srun


def test_an_sbatch_script_without_srun_is_not_a_job_step():
    batch = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
             "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "n1"}
    assert plan_launch(parse_config([]), batch, accel=0).mode == "single"
    assert plan_launch(parse_config([]), batch, accel=4).mode == "spawn"  # the node's GPUs
    note = unlaunched_slurm_tasks(batch)
    assert note and "srun python main.py" in note and "4 tasks" in note
    assert unlaunched_slurm_tasks(srun_env(0, 4, 4)) is None
    assert unlaunched_slurm_tasks({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "1"}) is None


@pytest.mark.slow
def test_main_in_an_sbatch_script_trains_instead_of_waiting_for_peers(tmp_path):
    out = tmp_path / "out"
    env = child_env(SLURM_JOB_ID="4242", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="4",
                    SLURM_TASKS_PER_NODE="4", SLURM_JOB_NODELIST="localhost")
    start = time.monotonic()
    proc = run_main(*DUMMY, *TINY18, "--epochs", "1", "--dist-timeout", "60", "--output-dir",
                    str(out), env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - start < 60
    assert "srun did not start this process" in proc.stdout + proc.stderr
    assert load_checkpoint(out / "checkpoint.pth.tar")["world_size"] == 1


# ---------------------------------------------------------------- 9: CUDA RNG and fewer GPUs


def test_cuda_rng_is_restored_for_this_process_device_only():
    one = torch.arange(16, dtype=torch.uint8)
    # New checkpoints hold this process's device only: it applies whatever is visible now.
    assert torch.equal(cuda_state_to_restore({"cuda_device": one}, 0, 1), one)
    # Older ones hold every visible device's state: 8 GPUs per process (torchrun), restarted
    # with 1 per process (srun --gpus-per-task=1) -> only device 0's entry can apply.
    every = [one + i for i in range(8)]
    assert torch.equal(cuda_state_to_restore({"cuda": every}, 0, 1), every[0])
    assert cuda_state_to_restore({"cuda": every}, 3, 2) is None  # not an IndexError
    assert cuda_state_to_restore({}, 0, 1) is None


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_a_checkpoint_from_8_visible_gpus_resumes_with_one(tmp_path):
    import subprocess
    import sys

    code = ("import torch; from imagenet.checkpoint.states import capture_rng, restore_rng;"
            "torch.cuda.set_device(1); torch.zeros(1, device='cuda');"
            f"torch.save(capture_rng(), r'{tmp_path / 'rng.pt'}')")
    subprocess.run([sys.executable, "-c", code], check=True, env=child_env())
    code = ("import torch; from imagenet.checkpoint.states import restore_rng;"
            "torch.zeros(1, device='cuda');"
            f"restore_rng(torch.load(r'{tmp_path / 'rng.pt'}', weights_only=False))")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env=child_env(CUDA_VISIBLE_DEVICES="1"))


# ---------------------------------------------------------------- bf16 on the CPU


def test_bf16_support_is_read_from_the_cpu_flags():
    assert cpu_flags("processor : 0\nflags : fpu avx512f avx512_bf16\n") == \
        {"fpu", "avx512f", "avx512_bf16"}
    assert cpu_flags("Features : fp asimd bf16 i8mm\n") == {"fp", "asimd", "bf16", "i8mm"}
    assert native_bf16("x86_64", {"avx2", "avx512f"}) is False
    assert native_bf16("x86_64", {"avx512_bf16"}) is True
    assert native_bf16("x86_64", {"amx_bf16", "amx_tile"}) is True
    assert native_bf16("aarch64", {"fp", "asimd"}) is False
    assert native_bf16("aarch64", {"asimd", "bf16"}) is True
    assert native_bf16("riscv64", {"rv64"}) is None
    assert native_bf16() in (True, False, None)  # this machine, whatever it has


def test_the_bf16_warning_is_one_line_for_cpu_training_without_bf16():
    line = slow_bf16_warning("bf16", "cpu", native=False)
    assert line and "\n" not in line and "drop --amp" in line
    assert slow_bf16_warning("bf16", "cpu", native=True) is None
    assert slow_bf16_warning("bf16", "cpu", native=None) is None  # unknown: no guess
    assert slow_bf16_warning("bf16", "cuda", native=False) is None
    assert slow_bf16_warning(None, "cpu", native=False) is None


@pytest.mark.slow
def test_bf16_run_warns_only_where_the_cpu_lacks_bf16(tmp_path):
    proc = run_main(*DUMMY, *TINY18, "--epochs", "1", "--amp", "bf16", "--output-dir",
                    str(tmp_path), timeout=180)
    assert proc.returncode == 0, proc.stderr
    warned = "--amp bf16: this CPU has no bf16 instructions" in proc.stdout + proc.stderr
    assert warned == (native_bf16() is False)


# ---------------------------------------------------------------- what -b means


def test_help_and_readme_say_where_b_is_per_node_and_where_per_process():
    from helpers import ROOT

    from imagenet.settings.flags import get_args_parser

    action = get_args_parser()._option_string_actions["--batch-size"]
    help_text = action.help
    assert "per node with --multiprocessing-distributed" in help_text
    assert "per process under torchrun, srun and manual --rank" in help_text

    def table(page: str, header: str) -> list[str]:
        text = (ROOT / page).read_text()
        rows = text[text.index(header):]
        return rows[:rows.index("\n\n")].splitlines()

    # The full table (docs/distributed.md) and the README's short one.
    for page, header, rows in (
            ("docs/distributed.md", "| launcher |", (
                ("one node, all GPUs (classic)", "per node"), ("torchrun", "per process"),
                ("SLURM, one task per GPU", "per process"),
                ("SLURM, one task per node", "per node"), ("manual, per process", "per process"))),
            ("README.md", "| where |", (
                ("one node, all its GPUs", "per node"), ("one node, torchrun", "per process"),
                ("SLURM, one task per GPU", "per process"),
                ("SLURM, one task per node", "per node")))):
        lines = table(page, header)
        for row, meaning in rows:
            line = next(ln for ln in lines if row in ln)
            assert line.rstrip(" |").endswith(meaning) or f"| {meaning}" in line, (page, line)


# ---------------------------------------------------------------- RANK / WORLD_SIZE from outside


def test_launcher_variables_are_checked_and_its_numbers_win_over_the_flags():
    from imagenet.settings.launch import overridden_flags

    cfg = parse_config(["data"])
    for env, words in (({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 from the environment is "
                        "outside WORLD_SIZE=2 (ranks 0..1)"),
                       ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 from the environment "
                        "must be at least 1"),
                       ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' and WORLD_SIZE='2' from "
                        "the environment must be whole numbers")):
        with pytest.raises(UsageError, match=words.replace("(", ".").replace(")", ".")):
            plan_launch(cfg, env, accel=0)
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    launch = plan_launch(cfg, torchrun, accel=0)
    assert overridden_flags(parse_config(["data", "--world-size", "2", "--nproc-per-node",
                                          "2"]), launch, torchrun) is None  # they agree
    assert overridden_flags(parse_config(["data", "--rank", "0"]), launch, torchrun) == (
        "torchrun's numbers win: --rank 0 is ignored (torchrun gives each process its rank); "
        "drop them from main.py's command line")
    srun = srun_env(rank=1, tasks=4, per_node=2)
    assert overridden_flags(parse_config(["data", "--world-size", "2"]),
                            plan_launch(cfg, srun, accel=0), srun) == (
        "srun's numbers win: --world-size 2 is ignored (srun started 4 processes); drop them "
        "from main.py's command line")


def test_a_rank_outside_the_world_size_is_one_line_at_once(tmp_path, monkeypatch, capsys):
    from imagenet.cli import main

    for name, value in (("RANK", "3"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    code = main(["--dummy", *TINY18, "--dist-timeout", "600", "--output-dir", str(tmp_path)])
    assert code == 2 and time.monotonic() - start < 60  # not the --dist-timeout wait for peers
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: RANK=3 from the environment is outside WORLD_SIZE=2 (ranks 0..1): fix the "
        "variables your launcher or script sets (or unset both for one process)"]
