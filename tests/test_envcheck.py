"""--env-check: real gloo ranks on this CPU pass; an impossible NCCL request fails clearly."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers import ROOT, child_env, run_main

from imagenet.tools.envcheck import WRONG_HINT, summary, verdict
from imagenet.tools.envprobe import Plan


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


@pytest.mark.slow
def test_env_check_passes_with_two_gloo_ranks_on_cpu():
    proc = run_main("--env-check", "-a", "resnet18", "--nproc-per-node", "2", timeout=150)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert re.fullmatch(r"env-check: PASS \((\d+)/\1 checks\)", _last_line(out)), out
    assert "Devices     CPU:" in out and "Backends    gloo: yes" in out
    import huggingface_hub
    import pyarrow
    assert (f"Parquet     pyarrow {pyarrow.__version__} (--data-format parquet); Hugging Face "
            f"Hub client {huggingface_hub.__version__} (hf:// data)") in out, out
    assert "resnet18: 11,689,512 parameters" in out
    assert "PASS process group: 2 ranks joined" in out
    # 1 + 2 contributed by the two ranks, checked exactly on every rank.
    assert "PASS all-reduce sum: each rank contributed rank+1: sum 3 on every rank" in out
    assert "PASS all-reduce random:" in out and "PASS broadcast:" in out
    assert re.search(r"PASS all-reduce bandwidth: 11\.7M floats \(46\.8 MB, the gradients of "
                     r"resnet18\): [\d.]+ ms per all-reduce, [\d.]+ GB/s", out), out
    for rank in (0, 1):
        assert re.search(rf"PASS forward/backward rank {rank}: resnet18, batch 8 at 64 px on cpu: "
                         r"[\d.]+ img/s", out), out
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_nccl_without_cuda_fails_clearly_without_starting_ranks():
    proc = run_main("--env-check", "--dist-backend", "nccl", timeout=120)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    fail = [line for line in out.splitlines() if line.startswith("  FAIL")]
    assert len(fail) == 1 and fail[0].startswith("  FAIL backend nccl:"), out
    assert "--dist-backend gloo" in fail[0] and "CUDA" in fail[0]
    assert "SKIP all-reduce sum: not run" in out and "PASS" not in out
    assert re.fullmatch(r"env-check: FAIL \(0/\d+ checks passed; failed: backend nccl\)",
                        _last_line(out)), out
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_module_entry_point_takes_main_flags():
    proc = subprocess.run([sys.executable, "-m", "imagenet.tools.envcheck", "--dist-backend",
                           "nccl", "--nproc-per-node", "3"], capture_output=True, text=True,
                          timeout=120, env=child_env(), cwd=ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "env-check: 3 rank(s) on cpu" in proc.stdout
    assert "SKIP forward/backward rank 2" in proc.stdout
    assert _last_line(proc.stdout).startswith("env-check: FAIL")


PLAN = Plan(nprocs=2, device_type="cpu", backend="gloo", numel=1000, arch="resnet18",
            timeout=60.0)


def _report(rank: int, **changes) -> dict:
    """A finished rank's report, as the probe sends it."""
    report = {"rank": rank, "port": 1234, "device": "cpu", "stage": "forward/backward",
              "joined_s": 0.1, "sum": 3.0, "sum_ok": True, "random_ok": True, "bcast_ok": True,
              "bw_ok": True, "bw_s": 0.01, "fb_ok": True, "fb_pixels": 64, "fb_img_s": 10.0,
              "fb_ms": 800.0, "done": True}
    report.update(changes)
    return report


def test_verdict_names_the_first_broken_stage_and_skips_the_rest():
    reports = {0: _report(0), 1: _report(1, stage="broadcast", bcast_ok=False, bw_ok=None,
                                         fb_ok=None)}
    checks = verdict(PLAN, reports, {})
    status = {c.name: c.status for c in checks}
    assert status == {"process group": "PASS", "all-reduce sum": "PASS",
                      "all-reduce random": "PASS", "broadcast": "FAIL",
                      "all-reduce bandwidth": "SKIP", "forward/backward rank 0": "PASS",
                      "forward/backward rank 1": "SKIP"}
    broadcast = next(c for c in checks if c.name == "broadcast")
    assert "rank 1: wrong result" in broadcast.detail and WRONG_HINT in broadcast.detail
    assert summary(checks, []) == "env-check: FAIL (4/7 checks passed; failed: broadcast)"


def test_verdict_reports_a_hung_rank_with_the_stage_it_was_in():
    stuck = {k: v for k, v in _report(1).items() if k in ("rank", "port", "device", "joined_s")}
    stuck["stage"] = "all-reduce sum"
    failed = dict(stuck, rank=0, error="RuntimeError: Timed out")  # as the probe sends it
    reports = {0: failed, 1: stuck}
    why = {1: "unfinished (last seen in 'all-reduce sum'); stopped after rank 0 failed"}
    checks = verdict(PLAN, reports, why)
    fails = [c for c in checks if c.status == "FAIL"]
    assert [c.name for c in fails] == ["all-reduce sum"]
    assert "rank 0: RuntimeError: Timed out" in fails[0].detail
    assert "rank 1: unfinished (last seen in 'all-reduce sum')" in fails[0].detail
    assert summary(checks, ["torch outside the env"]).startswith(
        "env-check: FAIL (1/7 checks passed, 1 warning(s); failed: all-reduce sum")
