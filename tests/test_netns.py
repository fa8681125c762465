"""A real two-host run: two network namespaces joined by a veth pair, one node in each, started
by run_multinode.sh in both of its styles (torchrun, and the classic shared --dist-url); and the
link between them lost mid-step and mid-save.

Neither process gets GLOO_SOCKET_IFNAME: gloo would advertise this machine's hostname address,
which does not exist inside the namespaces, so the run only works because
imagenet.launching.process_group picks the interface that routes to the master (10.200.0.1) by
itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import (
    MASTER,
    ROOT,
    TINY,
    TwoHosts,
    Unavailable,
    child_env,
    fault_at,
    ip,
    load_checkpoint,
    run_parallel,
    write_image_folder,
)

from imagenet.launching.failures import is_stopped

RUN_MULTINODE = ROOT / "run_multinode.sh"


@pytest.fixture
def two_hosts() -> Iterator[tuple[list[str], list[str]]]:
    """Namespaces (names, veth ends) with 10.200.0.1/24 and 10.200.0.2/24; removed afterwards."""
    try:
        with TwoHosts() as hosts:
            if shutil.which("ping"):
                ping = subprocess.run(["ip", "netns", "exec", hosts.names[1], "ping", "-c", "1",
                                       "-W", "5", MASTER], capture_output=True, text=True,
                                      timeout=30)
                assert ping.returncode == 0, f"the veth link carries no traffic: {ping.stdout}"
            yield hosts.names, hosts.ends
    except Unavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
@pytest.mark.parametrize("style", ["dist-url", "torchrun"])
def test_run_multinode_on_two_hosts_without_socket_ifname(two_hosts, tmp_path: Path, style):
    """run_multinode.sh once per host, as its header says, in both of its styles."""
    names, ends = two_hosts
    data = write_image_folder(tmp_path / "data")
    outs = [tmp_path / "host0", tmp_path / "host1"]
    env = child_env()
    assert "GLOO_SOCKET_IFNAME" not in env and "NCCL_SOCKET_IFNAME" not in env
    envs = [{**env, "STYLE": style, "NNODES": "2", "NODE_RANK": str(r), "MASTER_ADDR": MASTER,
             "MASTER_PORT": "29500", "NPROC_PER_NODE": "1", "PYTHON": sys.executable}
            for r in range(2)]
    cmds = [["ip", "netns", "exec", names[r], "bash", str(RUN_MULTINODE), str(data), *TINY,
             "--epochs", "1", "-b", "4", "-p", "1", "--seed", "0", "--dist-timeout", "60",
             "--output-dir", str(outs[r])] for r in range(2)]
    results = run_parallel(cmds, envs, tmp_path / "logs", timeout=240)
    for r in results:
        assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    # rank 0 chose its veth end (the one holding 10.200.0.1) and said so
    assert f"gloo uses interface {ends[0]}" in results[0].stdout + results[0].stderr
    ckpt = load_checkpoint(outs[0] / "checkpoint.pth.tar")
    assert ckpt["world_size"] == 2 and ckpt["epoch"] == 1
    record = json.loads((outs[0] / "metrics.jsonl").read_text())
    assert record["val_count"] == 9
    assert json.loads((outs[0] / "config.json").read_text())["world_size"] == 2
    assert not outs[1].exists(), "the second host (rank 1) wrote files"


# ---------------------------------------------------------------- a lost link

HANG = 8  # --hang-timeout of the lost-link runs, seconds (as test_hang.py and the chaos matrix)
LIMIT = HANG + 60  # every process gone within this much of the link going down (the issue's)


def _host_cmd(names: list[str], rank: int, data: Path, out: Path, port: int,
              *extra: str) -> list[str]:
    """main.py as rank ``rank`` inside its namespace, under a host name of its own (two
    machines to the run: neither may signal the other's processes); both ranks share ``out``
    (one file system, as on a cluster)."""
    own_name = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', f"host{rank}"]
    return ["ip", "netns", "exec", names[rank], *own_name, sys.executable, str(ROOT / "main.py"),
            str(data),
            *TINY, "-b", "4", "-j", "1", "-p", "1", "--seed", "0", "--epochs", "2",
            "--save-every", "2", "--hang-timeout", str(HANG), "--dist-timeout", "300",
            "--dist-url", f"tcp://{MASTER}:{port}", "--world-size", "2", "--rank", str(rank),
            "--output-dir", str(out), *extra]


def _both(names: list[str], data: Path, out: Path, port: int, *extra: str, **env: str):
    from test_fault_tolerance import Live

    return [Live(_host_cmd(names, r, data, out, port, *extra), timeout=600, **env)
            for r in range(2)]


def _stopped(pid: int, within: float = 120) -> bool:
    """Wait until ``pid`` has stopped itself (SIGSTOP at a failpoint)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if is_stopped(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def lost_link_data(tmp_path_factory) -> tuple[Path, Path]:
    """The lost-link tests' data, and the uninterrupted two-host run on it (in namespaces of its
    own, gone before each test makes its own) that both tests' resumed runs must end as."""
    base = tmp_path_factory.mktemp("lost-link")
    data = write_image_folder(base / "data", classes=2, train_per_class=24, val_per_class=2)
    try:
        with TwoHosts() as hosts:
            for live in _both(hosts.names, data, base / "whole", 29510):
                assert live.finish() == 0, live.output
    except Unavailable as exc:
        pytest.skip(str(exc))
    return data, base / "whole"


@pytest.mark.slow
@pytest.mark.parametrize("when", ["mid-step", "mid-save"])
def test_a_lost_link_ends_both_hosts_and_the_resume_matches(lost_link_data, two_hosts,
                                                            tmp_path: Path, when):
    """The veth link taken down in the middle of epoch 1 (mid-step), or while rank 0 writes a
    checkpoint (mid-save: rank 0 stopped, SIGSTOP, while its writer's temp file is open):
    each host's --hang-timeout watch ends its rank with one line and the requeue code within
    the timeout + 60 s, the checkpoint on disk is whole, and --resume auto on the link brought
    back up ends exactly as an uninterrupted run."""
    names, ends = two_hosts
    data, whole = lost_link_data
    out = tmp_path / "out"
    # Mid-save: rank 0 stops itself (SIGSTOP, a failpoint) as it writes epoch 1's first
    # checkpoint (after steps 2 and 4 of epoch 0, its validation and its end).
    faults = fault_at("save.write@0", 5, "sigstop") if when == "mid-save" else ""
    ranks = _both(names, data, out, 29511, IMAGENET_FAILPOINTS=faults)
    ranks[0].wait_for("Epoch: [1][")
    if when == "mid-save":
        # ip, unshare and sh exec python itself: the pid is rank 0's
        assert _stopped(ranks[0].proc.pid), "rank 0 never stopped in a checkpoint write"
        assert [p for p in out.iterdir() if p.name.startswith(".checkpoint.pth.tar.tmp-")]
    assert ip("-n", names[1], "link", "set", ends[1], "down").returncode == 0
    lost = time.monotonic()
    if when == "mid-save":
        os.kill(ranks[0].proc.pid, signal.SIGCONT)
    codes = [live.finish() for live in ranks]
    took = time.monotonic() - lost
    assert took < LIMIT, f"the hosts took {took:.0f} s, more than --hang-timeout + 60 s:\n" + \
        "\n".join(f"rank {r}: exit {c}\n{live.output[-3000:]}" for r, (live, c) in
                  enumerate(zip(ranks, codes)))
    for rank, (live, code) in enumerate(zip(ranks, codes)):
        assert code == 143, f"rank {rank}: exit {code}\n{live.output[-3000:]}"
        errors = [x for x in live.output.splitlines() if "error:" in x]
        assert len(errors) == 1 and "hang: rank" in errors[0], live.output[-3000:]
        assert "Traceback" not in live.output, live.output[-3000:]
    assert "rank 1 stopped answering" in ranks[0].output  # rank 0 names the silent peer
    report = json.loads((out / "hang" / "report.json").read_text())
    assert report["silent"] is True and report["rank"] in (0, 1)
    # Nothing half written in place; the checkpoint there is whole (its checksum is checked).
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
    load_checkpoint(out / "checkpoint.pth.tar")
    assert ip("-n", names[1], "link", "set", ends[1], "up").returncode == 0
    for live in _both(names, data, out, 29512, "--resume", "auto"):
        assert live.finish() == 0, live.output
    a, b = (load_checkpoint(d / "checkpoint.pth.tar") for d in (whole, out))
    assert a["epoch"] == b["epoch"] == 2
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
