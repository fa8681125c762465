"""A real two-host run: two network namespaces joined by a veth pair, one node in each, started
by run_multinode.sh in both of its styles (torchrun, and the classic shared --dist-url).

Neither process gets GLOO_SOCKET_IFNAME: gloo would advertise this machine's hostname address,
which does not exist inside the namespaces, so the run only works because
imagenet.launching.rendezvous picks the interface that routes to the master (10.200.0.1) by itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, TINY, child_env, load_checkpoint, run_parallel, write_image_folder

MASTER, PEER = "10.200.0.1", "10.200.0.2"
RUN_MULTINODE = ROOT / "run_multinode.sh"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts(request) -> tuple[list[str], list[str]]:
    """Namespaces (names, veth ends) with 10.200.0.1/24 and 10.200.0.2/24; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None or _ip("netns", "list").returncode != 0:
        pytest.skip("`ip netns` (iproute2) is not available")
    tag = str(os.getpid())[-6:]
    names, ends = [f"imgnt{tag}a", f"imgnt{tag}b"], [f"vimg{tag}a", f"vimg{tag}b"]

    def cleanup() -> None:
        for name in names:
            _ip("netns", "delete", name)  # deletes the veth end inside it too
        _ip("link", "delete", ends[0])  # in case it never moved into its namespace

    request.addfinalizer(cleanup)
    steps = [("netns", "add", names[0]), ("netns", "add", names[1]),
             ("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])]
    for name, end, addr in zip(names, ends, (MASTER, PEER)):
        steps += [("link", "set", end, "netns", name),
                  ("-n", name, "addr", "add", f"{addr}/24", "dev", end),
                  ("-n", name, "link", "set", end, "up"),
                  ("-n", name, "link", "set", "lo", "up")]
    for step in steps:
        result = _ip(*step)
        if result.returncode != 0:
            pytest.skip(f"cannot build the namespaces (ip {' '.join(step)}): "
                        f"{result.stderr.strip()}")
    if shutil.which("ping"):
        ping = subprocess.run(["ip", "netns", "exec", names[1], "ping", "-c", "1", "-W", "5",
                               MASTER], capture_output=True, text=True, timeout=30)
        assert ping.returncode == 0, f"the veth link carries no traffic: {ping.stdout}"
    return names, ends


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
