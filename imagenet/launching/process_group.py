"""The process group: joining it, with errors that say what to check.

Who joins - ranks, device, backend - and where they meet (--dist-url or MASTER_ADDR/PORT) are
the plan's (``settings.plan``); this module only acts on them.

The ranks together: who this process is (``DistInfo``), one rank's error raised on every rank
(also a check only rank 0 makes), rank 0's value on every rank, every rank's value, a barrier.
Each works without a process group too (one process).
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import logging
import os
import select
import signal
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from imagenet.errors import DistributedError, RunError, TrainerError, on_every_rank
from imagenet.reporting.logger import notice_after
from imagenet.settings import devices
from imagenet.settings.plan import Plan

log = logging.getLogger(__name__)

PROBE_GRACE = 5.0  # seconds past --dist-timeout before a silent master store counts as hung


def interface_to(host: str) -> str | None:
    """Name of the local interface that routes to ``host``; None for loopback or unknown."""
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return None
    if ipaddress.ip_address(ip).is_loopback:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))  # UDP connect sends nothing; it only asks the routing table
            local_ip = s.getsockname()[0]
        except OSError:
            return None
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == local_ip:
                return name
    return None


def set_socket_interface(host: str, env: dict[str, str]) -> str | None:
    """Point gloo at the interface that reaches ``host`` (it takes the address its own host name
    resolves to, often loopback: 127.0.1.1 in Debian's /etc/hosts).

    NCCL is left to choose its own: InfiniBand/RoCE first, then a non-loopback, non-docker
    interface; the interface that routes to the master is often the management network, which
    would carry all of NCCL's traffic whenever NCCL falls back to sockets. Clusters that need a
    choice set NCCL_SOCKET_IFNAME themselves (their documentation says which).
    """
    if env.get("GLOO_SOCKET_IFNAME"):
        return None
    name = interface_to(host)
    if name:
        env["GLOO_SOCKET_IFNAME"] = name
    return name


_created_group = False  # this process called init_process_group (so cleanup may destroy it)


def init_distributed(plan: Plan, local_index: int = 0) -> DistInfo:
    """Join the process group (if any) and return who this process is (node process
    ``local_index`` under mp.spawn).

    A group that already exists (Ray Train creates it before the training function runs) is
    used as it is: never a second init, and ``cleanup`` leaves it to its creator.
    """
    cfg, launch = plan.cfg, plan.launch
    if dist.is_available() and dist.is_initialized():
        return join_existing_group(plan)
    rank, local_rank, world, local_world = astuple(plan.ranks(local_index))
    device = plan.device(local_index)
    if launch.mode == "single":
        set_device(device)
        return DistInfo(device=device)
    backend = plan.backend
    assert backend is not None  # the plan's for a group of its own
    init_method, host, port = plan.meet.init_method, plan.meet.host, plan.meet.port
    ifname = set_socket_interface(host, os.environ)
    if ifname and rank == 0:
        log.info("=> master %s is not on loopback: gloo uses interface %s (set "
                 "GLOO_SOCKET_IFNAME to choose another)", host, ifname)
    where = f"{host}:{port} as rank {rank} of world size {world}"
    timeout = datetime.timedelta(seconds=cfg.dist_timeout)
    try:
        if rank != 0 and port is not None and not plan.agent_store:
            # Before set_device: the probe forks, and a fork must not copy a CUDA context (CUDA
            # 12's cudaSetDevice creates one).
            probe_master_store(host, port, timeout, where,  # type: ignore[arg-type]
                               cfg.dist_timeout, say=local_rank == 0)
        set_device(device)
        store = elastic_store(plan, host, port, world, timeout)  # type: ignore[arg-type]
        if store is None and port is not None:
            store = gather(host, port, rank, world, timeout, where)  # type: ignore[arg-type]
        dist.init_process_group(backend, init_method=None if store else init_method, store=store,
                                rank=rank, world_size=world, timeout=timeout,
                                device_id=None if backend == "gloo" else device)
        global _created_group
        _created_group = True
        # One barrier so a missing peer fails here, named, not in the first all-reduce.
        dist.barrier()
    except DistributedError:
        raise
    except Exception as exc:  # torch raises several types (DistNetworkError, RuntimeError, ...)
        cleanup(failed=True)
        raise DistributedError(_explain(exc, where, cfg.dist_timeout)) from exc
    return DistInfo(rank, local_rank, world, local_world, device, backend)


def join_existing_group(plan: Plan) -> DistInfo:
    """Who this process is in the caller's process group; its device from its local rank."""
    rank, local, world, local_world = astuple(plan.ranks())
    device = plan.device()
    backend = str(dist.get_backend())
    if "nccl" in backend and device.type != "cuda":
        raise DistributedError(f"the process group this process joined uses {backend}, which "
                               "needs CUDA GPUs, but this process trains on the CPU; give the "
                               "workers GPUs or create the group with gloo")
    devices.set_current(device)
    if rank == 0:
        log.info("=> using the caller's process group (%s, world size %d); not creating one",
                 backend, world)
    return DistInfo(rank, local, world, local_world, device, backend)


def owns_group() -> bool:
    """True when this process created the process group (``init_distributed``)."""
    return _created_group and dist.is_available() and dist.is_initialized()


def set_device(device: torch.device) -> None:
    """Make ``device`` this process's current device (for CUDA: creates its context)."""
    devices.set_current(device)


def elastic_store(plan: Plan, host: str, port: int | None, world: int,
                  timeout: datetime.timedelta) -> dist.Store | None:
    """This attempt's view of torchrun's shared store; None when torchrun does not share it.

    torchrun's c10d rendezvous lets the workers use its own TCPStore, which outlives a restart
    and keeps every key of the previous attempt: gloo/NCCL then read the dead workers' addresses
    and never connect (pytorch/pytorch#135712). Keys prefixed with the restart count fix that on
    one node, and across nodes whenever every node restarts once per failure (torchrun's static
    rendezvous, as in run_multinode.sh: the surviving nodes' workers fail on the broken peer and
    restart too). Each agent counts its own restarts; where counts can drift apart (c10d
    rendezvous), TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives every attempt a fresh store instead
    and turns this off (README, "Fault tolerance").
    """
    if not plan.agent_store or port is None:
        return None
    shared = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"imagenet/attempt_{plan.restarts}", shared)


ARRIVED, EVERYONE = "imagenet/arrived", "imagenet/everyone"
GATHER_POLL = 0.2  # seconds between looks at who has arrived (a Ctrl-C waits no longer)
GATHER_REMIND = 60.0  # seconds between the lines of a long wait (the first after notice_after)


def gather(host: str, port: int, rank: int, world: int, timeout: datetime.timedelta,
           where: str) -> dist.Store:
    """Rank 0's store, once every rank has arrived at it; the store the process group uses.

    torch's own rendezvous waits for the missing ranks inside C++, deaf to Ctrl-C until
    --dist-timeout ends (600 s by default); here the waiting is Python's, in short steps, so an
    interrupt stops it at once, and a timeout names the ranks that never came.
    """
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    store.set(f"{ARRIVED}/{rank}", "1")
    store.add(ARRIVED, 1)
    seconds = timeout.total_seconds()
    start = time.monotonic()
    deadline, say_at = start + seconds, start + notice_after()

    def missing() -> list[int]:
        return [r for r in range(world) if not store.check([f"{ARRIVED}/{r}"])]

    while not (store.add(ARRIVED, 0) >= world if rank == 0 else store.check([EVERYONE])):
        now = time.monotonic()
        if now >= say_at and rank == 0:  # a start-up that seems to hang says why
            absent = missing()
            log.info("=> waiting at %s:%s for %s (%d of %d processes arrived; --dist-timeout "
                     "%gs, %.0f s left)", host, port, _ranks(absent), world - len(absent), world,
                     seconds, deadline - now)
            say_at = now + GATHER_REMIND
        if now > deadline:
            absent = missing()
            raise DistributedError(
                f"could not form the process group at {where} within --dist-timeout "
                f"{seconds:g}s: {world - len(absent)} of {world} processes arrived ("
                f"{_ranks(absent)} did not). Check that every rank started, that the address "
                "is reachable from every host, and that --world-size matches the number of "
                "processes")
        time.sleep(GATHER_POLL)
    if rank == 0:
        store.set(EVERYONE, "1")
    return store


def _ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 1, 2, 5', or the first few of many."""
    shown = ", ".join(map(str, ranks[:8])) + (f", ... ({len(ranks)} in all)"
                                              if len(ranks) > 8 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


def probe_master_store(host: str, port: int, timeout: datetime.timedelta, where: str,
                       seconds: float, say: bool = False) -> None:
    """Connect to rank 0's store as a client, in a forked child we can stop waiting for.

    torch's TCPStore client waits without limit when the address accepts the connection but
    never answers (another program listening there, a stuck process); --dist-timeout bounds it
    here. A store that is not up yet is retried by torch until the timeout, as usual. A child
    process, not a thread: a thread stuck inside torch cannot be stopped, and makes the exit
    abort.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: connect, write torch's error (if any), leave without cleanup
        try:  # a Ctrl-C to the group is the parent's to answer, never this copy's
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            os.close(read_end)
            message = b""
            try:
                dist.TCPStore(host, port, is_master=False, timeout=timeout,
                              wait_for_workers=False)
            except Exception as exc:  # torch raises several types; reported in its words
                message = (str(exc) or type(exc).__name__).encode()[:4096]
            os.write(write_end, message)
        finally:
            os._exit(0)
    os.close(write_end)
    answered = False
    try:
        first = min(notice_after(), seconds + PROBE_GRACE)
        answered = bool(select.select([read_end], [], [], first)[0])
        if not answered:  # rank 0 not up yet: one line from each node, not one per process
            if say:
                log.warning("waiting for rank 0's rendezvous store at %s:%s (--dist-timeout "
                            "%gs); is rank 0 started?", host, port, seconds)
            answered = bool(select.select([read_end], [], [],
                                          seconds + PROBE_GRACE - first)[0])
        message = os.read(read_end, 4096).decode(errors="replace") if answered else None
    finally:
        os.close(read_end)
        if not answered:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if message is None and accepts_connections(host, port):
        raise DistributedError(
            f"could not form the process group at {where}: the address accepts connections "
            f"but did not answer as a rendezvous store within --dist-timeout {seconds:g}s (is "
            "another program listening on that port, or rank 0 stuck?); check --dist-url / "
            "MASTER_ADDR:MASTER_PORT and that rank 0 runs this trainer")
    if message is None:
        message = f"no answer from {host}:{port}"
    if message:
        raise DistributedError(_explain(RuntimeError(message), where, seconds))


def accepts_connections(host: str, port: int) -> bool:
    """True when a TCP connection to ``host:port`` is accepted (by the kernel at least)."""
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def _explain(exc: Exception, where: str, timeout: float) -> str:
    """Turn torch's rendezvous errors into one actionable line."""
    text = str(exc).splitlines()[0].rstrip(". ") if str(exc) else type(exc).__name__
    if "address already in use" in str(exc).lower() or "EADDRINUSE" in str(exc):
        return (f"cannot start the rendezvous at {where}: the port is already in use "
                "(another job?); choose another port in --dist-url / MASTER_PORT")
    return (f"could not form the process group at {where} within --dist-timeout {timeout:g}s: "
            f"{text}. Check that every rank started, that the address is reachable from this "
            "host, and that --world-size matches the number of processes")


def cleanup(failed: bool = False) -> None:
    """Leave the process group if this process created it (safe to call twice); a group the
    caller created (Ray Train) is the caller's to destroy. ``failed``: on an error path.

    A rank that fails under NCCL aborts its communicators instead: ``destroy_process_group``
    waits for their pending work, which a peer that is gone never completes, so the rank would
    sit there until the watchdog's --dist-timeout (srun without --kill-on-bad-exit waits that
    long to end the job). gloo's destroy returns at once on every path.
    """
    global _created_group
    if not owns_group():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch >= 2.3
    if teardown(dist.get_backend(), failed) == "abort" and abort is not None:
        abort()
    else:
        dist.destroy_process_group()
    _created_group = False


def teardown(backend: str, failed: bool) -> str:
    """How to leave a process group: "abort" for NCCL on an error path, else "destroy"."""
    return "abort" if failed and backend == "nccl" else "destroy"


# ---------------------------------------- the ranks together: DistInfo and the small agreements

Result = TypeVar("Result")


@dataclass(frozen=True)
class DistInfo:
    """Who this process is; passed around instead of writing into the config."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: no process group

    @property
    def distributed(self) -> bool:
        """True when a process group exists (DDP is used)."""
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        """Global rank 0: the only writer of files and progress."""
        return self.rank == 0


def raise_agreed(error: Exception | None) -> None:
    """Every rank raises the error of the lowest rank that has one, or none does. Collective.

    For checks that one rank (or each rank on its share) makes before the ranks go on together:
    a rank that stopped alone would leave the others waiting in their next collective.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Exception | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, error)
        first = next((i for i, e in enumerate(gathered) if e is not None), None)
        if first is not None and first != dist.get_rank():
            error = gathered[first]  # a copy; this rank's own error keeps its traceback
    if isinstance(error, TrainerError):
        on_every_rank(error)  # no rank has to tell the others (failures)
    if error is not None:
        raise error


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (``value`` without a process group). Collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def share() -> tuple[int, int]:
    """This rank and the world size ((0, 1) without a process group): a part of some work."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gathered(value: Any) -> list[Any]:
    """Every rank's ``value``, by rank (``[value]`` without a process group). Collective."""
    rank, world_size = share()
    if world_size == 1:
        return [value]
    values: list[Any] = [None] * world_size
    dist.all_gather_object(values, value)
    return values


def barrier() -> None:
    """Wait for all ranks (no-op without a process group)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def on_rank0(info: DistInfo, check: Callable[[], Result]) -> Result | None:
    """``check()`` on rank 0; its TrainerError is raised on every rank. Collective."""
    error, result = None, None
    if info.is_main:
        try:
            result = check()
        except TrainerError as exc:
            error = exc
        except Exception as exc:
            # A bug: the other ranks must not wait for rank 0 forever; rank 0 keeps the cause.
            error = RunError(f"rank 0 failed its start-up checks ({type(exc).__name__}: {exc})")
            error.__cause__ = exc
    raise_agreed(error)
    return result
