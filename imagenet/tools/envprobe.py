"""The multi-process half of ``--env-check``: real ranks on loopback, guarded by a deadline.

Each rank joins a process group, checks all-reduce and broadcast results exactly, times a
model-sized all-reduce and a few forward/backward steps, and sends its report to the parent at
every stage, so a rank that hangs is reported with the stage it hangs in.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from imagenet.settings import devices
from imagenet.settings.plan import free_port

FB_BATCH, FB_PIXELS = 8, 64  # forward/backward probe: small, so the check takes seconds
FB_SECONDS = 0.5  # measure forward/backward steps for about this long (at least 2)
RANDOM_NUMEL = 1 << 20  # integer-valued floats: their sum is exact in fp32 in any order
BW_ITERS = 3  # timed all-reduces after one warm-up
STARTUP_S = 30.0  # allowance for starting the ranks and importing torch on a busy machine
GRACE_S = 5.0  # after one rank fails, wait this long for the others' reports, then stop them


@dataclass(frozen=True)
class Plan:
    """What the ranks run."""

    nprocs: int
    device_type: str  # cpu | cuda | xpu | ...
    backend: str | None  # None: no usable backend, nothing runs
    numel: int  # all-reduce bandwidth tensor = parameters of -a
    arch: str
    timeout: float  # seconds a collective may wait for its peers
    fsdp: bool = False  # --fsdp: also one sharded training step


def _sync(device: torch.device) -> None:
    devices.synchronize(device)


def _random_ints(rank: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234 + rank)
    return torch.randint(-1024, 1024, (RANDOM_NUMEL,), generator=gen).float().to(device)


def _collectives(world: int, numel: int, device: torch.device, out: dict[str, Any],
                 enter: Callable[[str], None]) -> None:
    """All-reduce/broadcast correctness and all-reduce bandwidth; results into ``out``."""
    rank = dist.get_rank()
    expected = world * (world + 1) / 2
    enter("all-reduce sum")
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    out.update(sum=t[0].item(), sum_ok=bool((t == expected).all().item()))
    enter("all-reduce random")
    t = _random_ints(rank, device)
    dist.all_reduce(t)
    want = sum(_random_ints(r, torch.device("cpu")) for r in range(world))
    out["random_ok"] = torch.equal(t.cpu(), want)
    enter("broadcast")
    t = _random_ints(0, device) if rank == 0 else torch.zeros(RANDOM_NUMEL, device=device)
    dist.broadcast(t, src=0)
    out["bcast_ok"] = torch.equal(t.cpu(), _random_ints(0, torch.device("cpu")))
    enter("all-reduce bandwidth")
    t = torch.full((numel,), float(rank + 1), device=device)
    dist.all_reduce(t)  # warm-up; also checks a large, chunked reduction
    out["bw_ok"] = bool((t == expected).all().item())
    _sync(device)
    start = time.perf_counter()
    for _ in range(BW_ITERS):
        dist.all_reduce(t)
    _sync(device)
    # The slowest rank sets the step time, as in DDP.
    took = torch.tensor([(time.perf_counter() - start) / BW_ITERS], device=device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    out["bw_s"] = took.item()


def _fsdp_step(device: torch.device, out: dict[str, Any],
               enter: Callable[[str], None]) -> None:
    """--fsdp: the trainer's sharding of a small ViT, one SGD step on the same batch on every
    rank, against the same step unsharded (all-gather, reduce-scatter, the block rule)."""
    import copy

    import torchvision

    import imagenet.training.fsdp as fsdp
    from imagenet.settings.flags import parse_config

    enter("FSDP step")
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(image_size=16, patch_size=4, num_layers=2,
                                                 num_heads=2, hidden_dim=32, mlp_dim=64,
                                                 num_classes=10).to(device)
    reference = copy.deepcopy(model)
    out["fsdp_units"] = len(fsdp.repeated_blocks(model)) + 1
    fsdp.shard(model, parse_config(["--fsdp"]), device)
    images, target = torch.randn(4, 3, 16, 16, device=device), torch.arange(4, device=device)
    for m in (model, reference):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5)
        torch.nn.functional.cross_entropy(m(images), target).backward()
        optimizer.step()
    diff = max((p.full_tensor() - r).abs().max().item()
               for p, r in zip(model.parameters(), reference.parameters()))
    out.update(fsdp_diff=diff, fsdp_ok=diff < 1e-5)


def _forward_backward(arch: str, device: torch.device, out: dict[str, Any],
                      enter: Callable[[str], None]) -> None:
    """Training-step throughput of ``arch`` on this rank's device (no communication)."""
    import torchvision

    enter("forward/backward")
    meta = torchvision.models.get_model_weights(arch).DEFAULT.meta
    pixels = max(FB_PIXELS, *meta.get("min_size", (1, 1)))  # e.g. ViT needs 224
    model = torchvision.models.get_model(arch, weights=None, num_classes=1000).to(device)
    images = torch.randn(FB_BATCH, 3, pixels, pixels, device=device)
    target = torch.randint(0, 1000, (FB_BATCH,), device=device)

    def step() -> float:
        output = model(images)
        logits = getattr(output, "logits", output)  # inception/googlenet return named tuples
        loss = torch.nn.functional.cross_entropy(logits, target)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    step()  # warm-up: allocator, cudnn autotuning
    steps, loss, start = 0, 0.0, time.perf_counter()
    while steps < 2 or (time.perf_counter() - start < FB_SECONDS and steps < 50):
        loss = step()
        steps += 1
    elapsed = time.perf_counter() - start
    out.update(fb_ok=bool(torch.isfinite(torch.tensor(loss))), fb_pixels=pixels,
               fb_img_s=FB_BATCH * steps / elapsed, fb_ms=1000 * elapsed / steps)


def _probe(rank: int, plan: Plan, port: int, threads: int | None, results: Any) -> None:
    """One rank: join the group, run the collectives and the steps; report at every stage."""
    out: dict[str, Any] = {"rank": rank, "port": port}

    def enter(stage: str) -> None:
        out["stage"] = stage
        results.put(dict(out))

    try:
        enter("process group")
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(rank)
        device = torch.device("cpu") if plan.device_type == "cpu" \
            else torch.device(plan.device_type, rank)
        devices.set_current(device)
        out["device"] = str(device)
        start = time.perf_counter()
        dist.init_process_group(plan.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=plan.nprocs,
                                timeout=datetime.timedelta(seconds=plan.timeout),
                                device_id=None if plan.backend == "gloo" else device)
        dist.barrier()
        out["joined_s"] = time.perf_counter() - start
        results.put(dict(out))
        _collectives(plan.nprocs, plan.numel, device, out, enter)
        if plan.fsdp:
            _fsdp_step(device, out, enter)
        dist.barrier()  # everyone finished communicating before the compute-only probe
        _forward_backward(plan.arch, device, out, enter)
        out["done"] = True
    except Exception as exc:  # any failure becomes text: the parent prints it as a FAIL line
        text = str(exc).strip().splitlines()
        out["error"] = f"{type(exc).__name__}: {text[0] if text else ''}"
    finally:
        results.put(dict(out))
        if dist.is_initialized():
            dist.destroy_process_group()


def _threads_per_rank(nprocs: int, device_type: str) -> int | None:
    """CPU threads per rank so the ranks do not oversubscribe the cores (None: leave as is)."""
    if device_type != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (usable or 1) // nprocs)


def run_probes(plan: Plan) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """Run the ranks; (last report of each rank, why each unfinished rank stopped). Never hangs."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    threads = _threads_per_rank(plan.nprocs, plan.device_type)
    args = (plan, free_port(), threads, results)
    procs = [ctx.Process(target=_probe, args=(r, *args), daemon=True) for r in range(plan.nprocs)]
    for p in procs:
        p.start()
    reports: dict[int, dict[str, Any]] = {}
    try:
        _collect(procs, results, reports, plan)
        codes = [p.exitcode for p in procs]  # before _stop: None = still running
    finally:
        _stop(procs)  # also on Ctrl-C: never leave ranks behind
    failed = next((r for r, rep in sorted(reports.items()) if "error" in rep), None)
    why = {}
    for rank in range(plan.nprocs):
        report = reports.get(rank, {})
        if "done" in report or "error" in report:
            continue
        where = f"in '{report['stage']}'" if "stage" in report else "before reporting"
        if codes[rank] is not None:
            why[rank] = f"exited with code {codes[rank]} {where} (killed? out of memory?)"
        elif failed is not None:
            why[rank] = f"unfinished (last seen {where}); stopped after rank {failed} failed"
        else:
            why[rank] = (f"still {where} after {plan.timeout + STARTUP_S:g} s (hung?); "
                         "stopped it")
    return reports, why


def _collect(procs: list[Any], results: Any, reports: dict[int, dict[str, Any]],
             plan: Plan) -> None:
    """Gather reports until every rank finished, all exited, or the deadline passed."""
    deadline = time.monotonic() + plan.timeout + STARTUP_S
    while time.monotonic() < deadline:
        if len(reports) == plan.nprocs and all("done" in r or "error" in r
                                               for r in reports.values()):
            return
        try:
            report = results.get(timeout=min(max(deadline - time.monotonic(), 0.01), 1.0))
        except queue_mod.Empty:
            if all(p.exitcode is not None for p in procs):
                return  # every child is gone; the silent ones died hard (killed, out of memory)
            if any(p.exitcode not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + GRACE_S)
            continue
        reports[report["rank"]] = report
        if "error" in report:  # its peers now wait in a collective until the timeout
            deadline = min(deadline, time.monotonic() + GRACE_S)


def _stop(procs: list[Any]) -> None:
    """Join the children briefly, then terminate (and kill) any that are left."""
    # Every rank has reported or is given up on; a finished rank only has to tear down (which
    # can take seconds on a busy machine, and nothing is lost by cutting it short).
    end = time.monotonic() + 1.5
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
