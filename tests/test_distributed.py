"""Distributed building blocks: launch planning (pure functions) and DDP maths with real processes.

The maths tests start two real processes on gloo (``helpers.start_ranks``) that drive
imagenet.training.engine.train_one_epoch and imagenet.evaluation.validate.evaluate with
imagenet.data.folder's samplers, and compare them with one process doing the same work on the
same data order in this process.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
from helpers import StripedImages, gloo_rank_saving, start_ranks, tiny_engine, tiny_net
from torch import nn
from torch.utils.data import DataLoader

from imagenet.errors import UsageError
from imagenet.launching.process_group import interface_to, set_socket_interface
from imagenet.settings.choices import first_slurm_host
from imagenet.settings.flags import parse_config
from imagenet.settings.launch import (
    Launch,
    auto_workers,
    check_sync_bn,
    choose_backend,
    per_process_batch,
    per_process_workers,
    plan_launch,
    resolve_ranks,
)
from imagenet.settings.plan import Rendezvous, choose_device, free_port, rendezvous


def cfg_of(*argv: str):
    return parse_config(["data", *argv])


# ---------------------------------------------------------------- plan_launch / resolve_ranks

def test_no_flags_on_cpu_is_one_process():
    launch = plan_launch(cfg_of(), {}, accel=0)
    assert launch.mode == "single"
    assert resolve_ranks(launch, 0, cfg_of(), {}) == (0, 0, 1, 1)


def test_multiprocessing_distributed_ranks_count_nodes_times_processes():
    cfg = cfg_of("--multiprocessing-distributed", "--nproc-per-node", "2", "--world-size", "3",
                 "--rank", "1")
    launch = plan_launch(cfg, {}, accel=0)
    assert (launch.mode, launch.nprocs, launch.nnodes, launch.node_rank) == ("spawn", 2, 3, 1)
    # global rank = node rank x processes per node + local index; world = nodes x processes
    assert resolve_ranks(launch, 0, cfg, {}) == (2, 0, 6, 2)
    assert resolve_ranks(launch, 1, cfg, {}) == (3, 1, 6, 2)


def test_multiprocessing_distributed_defaults():
    cfg = cfg_of("--multiprocessing-distributed")
    assert plan_launch(cfg, {}, accel=0).nprocs == 1  # CPU: one process unless told
    gpu = plan_launch(cfg, {}, accel=4)
    assert (gpu.nprocs, gpu.nnodes, gpu.node_rank) == (4, 1, 0)
    assert plan_launch(cfg_of("--multiprocessing-distributed", "--no-accel"), {}, 4).nprocs == 1


def test_multiprocessing_distributed_reads_classic_env_for_nodes():
    env = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    launch = plan_launch(cfg_of("--multiprocessing-distributed", "--nproc-per-node", "2"), env, 0)
    assert (launch.nnodes, launch.node_rank) == (2, 1)
    # flags win over the environment
    cfg = cfg_of("--multiprocessing-distributed", "--world-size", "3", "--rank", "2")
    assert (plan_launch(cfg, env, 0).nnodes, plan_launch(cfg, env, 0).node_rank) == (3, 2)


@pytest.mark.parametrize("argv, env, cuda, words", [
    (["--world-size", "2"], {}, 0, "give each node its --rank"),
    (["--world-size", "2", "--rank", "2"], {}, 0, "--rank 2 is not a node of --world-size 2"),
    (["--nproc-per-node", "8"], {}, 4, "more than the 4 visible GPU(s)"),
    ([], {"LOCAL_RANK": "0"}, 0, "do not also start main.py with torchrun"),
    (["--local_rank=1"], {}, 0, "do not also start main.py with torchrun"),
])
def test_multiprocessing_distributed_bad_combinations(argv, env, cuda, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        plan_launch(cfg_of("--multiprocessing-distributed", *argv), env, cuda)


def test_torchrun_environment():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}
    launch = plan_launch(cfg_of(), env, accel=4)
    assert launch.mode == "env"
    assert resolve_ranks(launch, 0, cfg_of(), env) == (5, 1, 8, 4)


def test_torch_distributed_launch_local_rank_argument():
    # torch.distributed.launch without --use_env passes --local-rank=N (older: --local_rank=N).
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for flag in ("--local_rank=1", "--local-rank=1"):
        cfg = cfg_of(flag)
        assert cfg.local_rank == 1
        launch = plan_launch(cfg, env, accel=0)
        assert launch.mode == "env"
        assert resolve_ranks(launch, 0, cfg, env) == (1, 1, 2, 2)


def test_slurm_task_variables():
    env = {"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0",
           "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[03-04]"}
    launch = plan_launch(cfg_of(), env, accel=4)
    assert launch.mode == "env"
    assert resolve_ranks(launch, 0, cfg_of(), env) == (6, 2, 8, 4)
    # one task (e.g. the batch script itself) is not a distributed job step
    assert plan_launch(cfg_of(), {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, 0).mode == "single"


def test_manual_processes():
    cfg = cfg_of("--world-size", "3", "--rank", "2", "--dist-url", "tcp://h:1")
    launch = plan_launch(cfg, {}, accel=0)
    assert launch.mode == "manual"
    assert resolve_ranks(launch, 0, cfg, {}) == (2, 0, 3, 1)
    with pytest.raises(UsageError, match="needs --rank"):
        plan_launch(cfg_of("--world-size", "3"), {}, 0)
    with pytest.raises(UsageError, match="--rank 3 is outside --world-size 3"):
        plan_launch(cfg_of("--world-size", "3", "--rank", "3"), {}, 0)


def test_several_gpus_and_no_flag_spawn_ddp():
    launch = plan_launch(cfg_of(), {}, accel=4)
    assert (launch.mode, launch.nprocs, launch.nnodes) == ("spawn", 4, 1)
    assert resolve_ranks(launch, 3, cfg_of(), {}) == (3, 3, 4, 4)
    assert plan_launch(cfg_of("--gpu", "1"), {}, accel=4).mode == "single"
    assert plan_launch(cfg_of(), {}, accel=1).mode == "single"
    assert plan_launch(cfg_of("--nproc-per-node", "2"), {}, accel=0).nprocs == 2


@pytest.mark.parametrize("nodelist, host", [
    ("gpu[03-05,7],cpu1", "gpu03"), ("node7", "node7"), ("a-1,b-2", "a-1"),
    ("gpu[12,3-4]", "gpu12"), ("127.0.0.1", "127.0.0.1"),
])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_choose_backend():
    assert choose_backend(None, "cpu") == "gloo"
    assert choose_backend(None, "cuda") == "nccl"
    assert choose_backend("gloo", "cuda") == "gloo"
    with pytest.raises(UsageError, match="--dist-backend nccl needs CUDA"):
        choose_backend("nccl", "cpu")
    with pytest.raises(UsageError, match="--sync-bn needs CUDA"):
        check_sync_bn(True, "cpu")
    check_sync_bn(True, "cuda")
    check_sync_bn(False, "cpu")


def test_choose_device():
    spawn = Launch("spawn", 4)
    assert choose_device(cfg_of(), spawn, 3, accel=0) == torch.device("cpu")
    assert choose_device(cfg_of(), spawn, 3, accel=4) == torch.device("cuda", 3)
    assert choose_device(cfg_of("--no-accel"), spawn, 3, 4) == torch.device("cpu")
    with pytest.raises(UsageError, match="local rank 4 has no cuda device"):
        choose_device(cfg_of(), spawn, 4, accel=4)
    # srun --gpus-per-task: each task sees one GPU whatever its local rank
    assert choose_device(cfg_of(), Launch("env"), 3, accel=1) == torch.device("cuda", 0)
    assert choose_device(cfg_of("--gpu", "1"), Launch("single"), 0, 2) == torch.device("cuda", 1)
    with pytest.raises(UsageError, match="--gpu 2: only 2 cuda device"):
        choose_device(cfg_of("--gpu", "2"), Launch("single"), 0, 2)


def test_per_process_batch_and_workers():
    assert per_process_batch(256, 4) == 64
    assert per_process_batch(10, 3) == 3
    with pytest.raises(UsageError, match="-b/--batch-size 3 is smaller than the 4 processes"):
        per_process_batch(3, 4)
    assert per_process_workers(4, 3) == 2
    assert per_process_workers(0, 2) == 0
    assert per_process_workers(8, 8) == 1
    # -j not given: the process's own cores less one, 1 to 16 (test_gpu_readiness: launchers)
    assert [auto_workers(c) for c in (1, 2, 4, 12, 16, 17, 64)] == [1, 1, 3, 11, 15, 16, 16]


def test_rendezvous_slurm_derives_master_from_nodelist_and_job_id():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[03-04]",
           "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0"}
    assert rendezvous(cfg_of(), Launch("env"), env) == Rendezvous("env://", "gpu03",
                                                                  15000 + 123456 % 20000)
    given = {**env, "MASTER_ADDR": "x", "MASTER_PORT": "7"}
    assert rendezvous(cfg_of(), Launch("env"), given) == Rendezvous("env://", "x", 7)
    assert "MASTER_ADDR" not in env  # the environment is read, never written


def test_rendezvous_other_modes():
    env: dict[str, str] = {}
    assert rendezvous(cfg_of("--dist-url", "tcp://h:5"), Launch("manual"), env) == \
        Rendezvous("tcp://h:5", "h", 5)
    assert rendezvous(cfg_of("--dist-url", "file:///shared/f"), Launch("manual"), env) == \
        Rendezvous("file:///shared/f", "", None)
    meet = rendezvous(cfg_of(), Launch("spawn", 2), env)  # one node: a free loopback port
    assert meet.host == "127.0.0.1" and meet.port > 0 and env == {}
    assert meet.variables() == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(meet.port)}
    with pytest.raises(UsageError, match="needs MASTER_ADDR and MASTER_PORT"):
        rendezvous(cfg_of(), Launch("spawn", 2, nnodes=2), {})
    with pytest.raises(UsageError, match="needs MASTER_ADDR and MASTER_PORT"):
        rendezvous(cfg_of(), Launch("manual"), {})
    with pytest.raises(UsageError, match="MASTER_PORT=29x is not a port"):
        rendezvous(cfg_of(), Launch("env"), {"MASTER_ADDR": "h", "MASTER_PORT": "29x"})
    # No group created here (one process, the caller's group): what the launcher said, if anything
    assert rendezvous(cfg_of(), Launch("single"), {}, creates_group=False) == \
        Rendezvous("env://", "", None)
    assert rendezvous(cfg_of(), Launch("env"), {"MASTER_ADDR": "h", "MASTER_PORT": "29x"},
                      creates_group=False) == Rendezvous("env://", "h", None)


def test_socket_interface_left_alone_for_loopback_and_when_given():
    assert interface_to("127.0.0.1") is None
    assert interface_to("localhost") is None
    assert interface_to("no-such-host.invalid") is None
    env = {"GLOO_SOCKET_IFNAME": "eth7"}
    assert set_socket_interface("10.1.2.3", env) is None
    assert env == {"GLOO_SOCKET_IFNAME": "eth7"}


def test_interface_to_a_local_address_names_its_interface():
    # This host's own non-loopback address routes through the interface that holds it.
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                             timeout=10).stdout
    except OSError:
        pytest.skip("the ip command is not available")
    found = [(f[1], f[3].split("/")[0]) for f in (ln.split() for ln in out.splitlines())
             if len(f) > 3 and f[2] == "inet" and not f[3].startswith("127.")]
    if not found:
        pytest.skip("no non-loopback IPv4 address on this host")
    iface, ip = found[0]
    assert interface_to(ip) == iface.split("@")[0]


# ---------------------------------------------------------------- DDP maths with real processes

IMAGE = 16  # px


def tiny_model(bn: bool = False) -> nn.Module:
    """conv (+ BatchNorm) + linear, the same initial weights in every process."""
    return tiny_net((6,), bn=bn, pool=IMAGE // 2)


def train_weights(rank: int, world: int, batch: int, accum: int, size: int = 48
                  ) -> dict[str, torch.Tensor]:
    """One epoch of engine.train_one_epoch on this rank's ResumableDistributedSampler shard."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from imagenet.data.samplers import ResumableDistributedSampler, SeededDataset
    from imagenet.training.engine import Step, train_one_epoch

    sampler = ResumableDistributedSampler(size, rank, world, seed=7)
    sampler.set_epoch(3)
    loader = DataLoader(SeededDataset(StripedImages(size, size=IMAGE), seed=5), batch_size=batch,
                        sampler=sampler)
    raw = tiny_model()
    model = DDP(raw) if world > 1 else raw
    engine = tiny_engine(model, "--lr", "0.2", "--grad-accum-steps", str(accum),
                         steps=len(loader) // accum, world=world, batch=batch)
    metrics = train_one_epoch(engine, loader, Step(epoch=3))
    assert metrics["images"] == size  # every rank's images
    return {k: v.detach().clone() for k, v in raw.state_dict().items()}


def evaluate_counts(rank: int, world: int, size: int, batch: int) -> dict[str, float]:
    """evaluation.validate.evaluate of a BatchNorm model over a ShardSampler shard (uneven
    batch counts)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from imagenet.data.samplers import ShardSampler
    from imagenet.evaluation.validate import evaluate

    raw = tiny_model(bn=True)
    raw.train()
    with torch.no_grad():  # non-trivial running statistics
        raw(torch.randn(8, 3, IMAGE, IMAGE) * 3 + 1)
    model = DDP(raw) if world > 1 else raw
    loader = DataLoader(StripedImages(size, size=IMAGE), batch_size=batch,
                        sampler=ShardSampler(size, rank, world))
    return evaluate(tiny_engine(model, steps=1), model, loader, size)


def train_and_evaluate(info) -> dict:
    """What one rank of the 2-process group trains and evaluates."""
    rank, world = info.rank, info.world_size
    return {"plain": train_weights(rank, world, batch=4, accum=1),
            "accum": train_weights(rank, world, batch=2, accum=2),
            "val31": evaluate_counts(rank, world, size=31, batch=3)}


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory) -> list[dict]:
    """What each of 2 real gloo processes trained and evaluated."""
    out = tmp_path_factory.mktemp("ddp")
    start_ranks(gloo_rank_saving, args=(2, free_port(), out, train_and_evaluate))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("run", ["plain", "accum"])
def test_two_processes_match_one_process_with_the_global_batch(ddp_results, run):
    # 2 processes x batch 4 (or x 2 micro-batches of 2) == 1 process x batch 8, same data order.
    reference = train_weights(0, 1, batch=8, accum=1)
    start = tiny_model().state_dict()
    for name, ref in reference.items():
        assert not torch.allclose(ref, start[name]), f"{name} did not train"
        torch.testing.assert_close(ddp_results[0][run][name], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["plain", "accum"])
def test_ranks_hold_bit_identical_weights(ddp_results, run):
    for name, value in ddp_results[0][run].items():
        assert torch.equal(value, ddp_results[1][run][name]), name


@pytest.mark.slow
def test_sharded_validation_counts_every_image_once(ddp_results):
    # 31 images on 2 ranks with batch 3: shards of 16 and 15 images, 6 and 5 batches.
    single = evaluate_counts(0, 1, size=31, batch=3)
    for result in ddp_results:
        val = result["val31"]
        assert val["count"] == 31
        for key in ("loss", "acc1", "acc5"):
            assert val[key] == pytest.approx(single[key], rel=1e-6), key


def test_training_sampler_shards_partition_each_epoch():
    from imagenet.data.samplers import ResumableDistributedSampler, ShardSampler

    for world in (2, 3):
        samplers = [ResumableDistributedSampler(31, r, world, seed=1) for r in range(world)]
        orders = []
        for epoch in (0, 1):
            for s in samplers:
                s.set_epoch(epoch)
            shards = [s.indices() for s in samplers]
            assert len({len(x) for x in shards}) == 1  # equal steps on every rank
            assert set().union(*shards) == set(range(31))
            orders.append(shards[0])
        assert orders[0] != orders[1]  # set_epoch reshuffles
        val = [list(ShardSampler(31, r, world)) for r in range(world)]
        assert sorted(i for shard in val for i in shard) == list(range(31))
