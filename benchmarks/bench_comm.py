"""--ddp-comm-hook over a slow link: two "hosts" (network namespaces joined by a veth pair), one
training process in each, gloo between them. Run by hand, as root (not a test):

    python benchmarks/bench_comm.py steptime [--rate 10mbit] [--hooks none bf16 powersgd:4]
        [fsdp fsdp-zero2]
    python benchmarks/bench_comm.py top1 [--rate none] [--hooks none powersgd] [--epochs 6]

steptime: ResNet-18 (1000 classes), the same batch on both hosts, seconds per optimizer step
through imagenet.training.models.wrap (the trainer's DDP and hooks) for each hook, after warm-up
steps.
PowerSGD runs with --powersgd-start-iter 0 so every step is compressed; ``powersgd:R`` sets
its rank (default 4); ``fsdp`` and ``fsdp-zero2`` are no hooks but --fsdp (ZeRO-3, ZeRO-2)
instead of DDP, for comparison. All models are built (DDP broadcasts the weights) before the link is
throttled: only training steps cross the slow link. Also printed: the compute-only step time
(DDP's no_sync, nothing sent).
top1: ``main.py --demo`` on both hosts for each hook; top-1 (last and best epoch) from
metrics.jsonl and the wall time.

The link: ``tc qdisc add dev IF root tbf rate RATE burst 32kbit latency 400ms`` on both veth
ends (each direction). Namespaces bcomm<pid>a/b, addresses 10.201.0.1/2; removed on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MASTER, PEER = "10.201.0.1", "10.201.0.2"
PORT = 29631
# --hooks also takes these: the model sharded with --fsdp (ZeRO-3 / ZeRO-2) instead of DDP.
FSDP = {"fsdp": ["--fsdp"], "fsdp-zero2": ["--fsdp", "--fsdp-zero", "2"]}


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS``."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@contextlib.contextmanager
def two_hosts(rate: str | None) -> Iterator[tuple[list[str], list[str]]]:
    """(namespaces, veth ends) joined by a veth pair, each end shaped to ``rate`` if given."""
    tag = str(os.getpid())[-6:]
    names, ends = [f"bcomm{tag}a", f"bcomm{tag}b"], [f"vbc{tag}a", f"vbc{tag}b"]
    try:
        ip("netns", "add", names[0])
        ip("netns", "add", names[1])
        ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for name, end, addr in zip(names, ends, (MASTER, PEER)):
            ip("link", "set", end, "netns", name)
            ip("-n", name, "addr", "add", f"{addr}/24", "dev", end)
            ip("-n", name, "link", "set", end, "up")
            ip("-n", name, "link", "set", "lo", "up")
        if rate:
            throttle(names, ends, rate)
        yield names, ends
    finally:
        for name in names:
            ip("netns", "delete", name, check=False)
        ip("link", "delete", ends[0], check=False)


def throttle(names: list[str], ends: list[str], rate: str) -> None:
    """Token-bucket limit on the egress of both veth ends (netem is not available here)."""
    for name, end in zip(names, ends):
        subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "replace", "dev", end, "root",
                        "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"], check=True)


def start(names: list[str], argvs: list[list[str]], workdir: Path) -> list[subprocess.Popen]:
    """Start ``argvs[i]`` (python arguments) in namespace ``names[i]``; logs under ``workdir``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = []
    for rank, (name, argv) in enumerate(zip(names, argvs)):
        out = open(workdir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(["ip", "netns", "exec", name, sys.executable, *argv],
                                      stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    return procs


def wait(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for all; on timeout or failure kill the rest and raise."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            if p.wait(timeout=max(deadline - time.monotonic(), 1)) != 0:
                raise RuntimeError(f"{p.args} exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# ---------------------------------------------------------------- step time


def steptime(args: argparse.Namespace) -> None:
    """Seconds per step of each hook over the throttled link."""
    with two_hosts(None) as (names, ends), tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        argv = [__file__, "worker", "--hooks", *args.hooks, "--batch", str(args.batch),
                "--image-size", str(args.image_size), "--warmup", str(args.warmup),
                "--steps", str(args.steps), "--go", str(work / "go")]
        procs = start(names, [argv + ["--rank", str(r)] for r in range(2)], work)
        while not all((work / f"ready{r}").exists() for r in range(2)):
            if any(p.poll() is not None for p in procs):
                raise RuntimeError((work / "rank0.log").read_text())
            time.sleep(0.5)
        throttle(names, ends, args.rate)
        (work / "go").touch()
        wait(procs, args.timeout)
        log0 = (work / "rank0.log").read_text()
    for line in log0.splitlines():
        if "gradient payload" in line:
            print(line)
    rows = [json.loads(line) for line in log0.splitlines() if line.startswith("{")]
    compute = next(r for r in rows if r["hook"] == "compute-only")
    rows.remove(compute)
    print(f"\nResNet-18, 2 hosts x 1 process, gloo over veth with tbf {args.rate}; batch "
          f"{args.batch} x {args.image_size}px per host; median of {args.steps} steps after "
          f"{args.warmup} warm-up")
    print(f"{'hook':>9} {'s/step':>8} {'all steps':>28} {'speed-up':>9}")
    base = next((r["median"] for r in rows if r["hook"] == "none"), None)
    for r in rows:
        speedup = f"{base / r['median']:.1f}x" if base else "-"
        times = ", ".join(f"{t:.2f}" for t in r["times"])
        print(f"{r['hook']:>9} {r['median']:>8.2f} {times:>28} {speedup:>9}")
    print(f"compute alone (no_sync, nothing sent): {compute['median']:.2f} s/step")


def worker(args: argparse.Namespace) -> None:
    """One host: build a DDP ResNet-18 per hook, wait for the throttled link, time steps."""
    import torch
    import torch.distributed as dist
    import torchvision

    from imagenet.launching.process_group import DistInfo, set_socket_interface
    from imagenet.settings.flags import parse_config
    from imagenet.training.models import wrap

    logging.basicConfig(level=logging.INFO if args.rank == 0 else logging.WARNING,
                        format="%(message)s", stream=sys.stdout)
    torch.set_num_threads(1)
    set_socket_interface(MASTER, os.environ)  # the veth end, not the (absent) host address
    dist.init_process_group("gloo", init_method=f"tcp://{MASTER}:{PORT}", rank=args.rank,
                            world_size=2)
    info = DistInfo(args.rank, 0, 2, 1, torch.device("cpu"), "gloo")
    runs = {}
    for hook in args.hooks:  # "powersgd:R" chooses the PowerSGD rank (default 4)
        torch.manual_seed(0)
        raw = torchvision.models.resnet18(num_classes=1000)
        name, _, rank = hook.partition(":")
        if name in FSDP:  # not a hook: --fsdp instead of DDP, for comparison
            cfg = parse_config(["data", *FSDP[name]])
        else:
            cfg = parse_config(["data", "--ddp-comm-hook", name, "--powersgd-start-iter", "0",
                                "--powersgd-rank", rank or "4"])
        runs[hook] = (wrap(raw, cfg, info), torch.optim.SGD(raw.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(args.rank)
    images = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=generator)
    labels = torch.randint(0, 1000, (args.batch,), generator=generator)
    Path(args.go).with_name(f"ready{args.rank}").touch()
    while not Path(args.go).exists():
        time.sleep(0.2)

    def step(model, opt, sync: bool = True) -> float:
        start = time.perf_counter()
        with contextlib.nullcontext() if sync else model.no_sync():
            torch.nn.functional.cross_entropy(model(images), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    model, opt = runs[args.hooks[0]]
    report("compute-only", [step(model, opt, sync=False) for _ in range(3)][1:], args.rank)
    for hook, (model, opt) in runs.items():
        # PowerSGD steps are cheap: time more of them, after two warm-up steps (the first has
        # one bucket; after DDP's rebuild the P/Q memory is allocated again).
        cheap = hook.startswith("powersgd")
        dist.barrier()
        for _ in range(max(args.warmup, 2) if cheap else args.warmup):
            step(model, opt)
        timed = max(args.steps, 5) if cheap else args.steps
        report(hook, [step(model, opt) for _ in range(timed)], args.rank)
    dist.destroy_process_group()


def report(hook: str, times: list[float], rank: int) -> None:
    """One JSON line (rank 0)."""
    if rank == 0:
        print(json.dumps({"hook": hook, "median": statistics.median(times), "times": times}),
              flush=True)


# ---------------------------------------------------------------- top-1 on the demo data


def top1(args: argparse.Namespace) -> None:
    """main.py --demo on both hosts per hook: top-1 and wall time."""
    results = []
    for hook in args.hooks:
        with two_hosts(args.rate) as (names, _), tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            argv = [str(ROOT / "main.py"), "--demo", "--seed", "0", "--epochs", str(args.epochs),
                    "--ddp-comm-hook", hook, "--multiprocessing-distributed",
                    "--nproc-per-node", "1", "--world-size", "2",
                    "--dist-url", f"tcp://{MASTER}:{PORT}", *args.extra]
            began = time.perf_counter()
            procs = start(names, [argv + ["--rank", str(r), "--output-dir", str(work / f"out{r}")]
                                  for r in range(2)], work)
            wait(procs, args.timeout)
            seconds = time.perf_counter() - began
            epochs = [json.loads(line) for line in
                      (work / "out0" / "metrics.jsonl").read_text().splitlines()]
        results.append((hook, epochs[-1]["val_acc1"], epochs[-1]["best_acc1"], seconds))
    print(f"\nmain.py --demo, 2 hosts x 1 process, link {args.rate or 'unthrottled veth'}, "
          f"{args.epochs} epochs, --seed 0 {' '.join(args.extra)}")
    print(f"{'hook':>9} {'top-1 last':>10} {'top-1 best':>10} {'wall s':>7}")
    for hook, last, best, seconds in results:
        print(f"{hook:>9} {last:>10.2f} {best:>10.2f} {seconds:>7.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, help="what to measure")
    p = sub.add_parser("steptime", help="seconds per training step for each hook")
    p.add_argument("--rate", default="10mbit", help="tbf rate of each direction")
    p.add_argument("--hooks", nargs="+", default=["none", "bf16", "powersgd"],
                   help="hooks to time: none, fp16, bf16, powersgd or powersgd:RANK, and fsdp "
                        "or fsdp-zero2 for comparison (default: none bf16 powersgd)")
    p.add_argument("--batch", type=int, default=32, help="images per host and step")
    p.add_argument("--image-size", type=int, default=56, help="pixels")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per hook")
    p.add_argument("--steps", type=int, default=2, help="timed steps per hook")
    p.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    p = sub.add_parser("top1", help="main.py --demo on both hosts: top-1 and wall time per hook")
    p.add_argument("--rate", default=None, help="tbf rate (default: unthrottled)")
    p.add_argument("--hooks", nargs="+", default=["none", "powersgd"],
                   help="hooks to train with, as for steptime (default: none powersgd)")
    p.add_argument("--epochs", type=int, default=6, help="demo epochs per run (default: 6)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("extra", nargs="*", help="more main.py flags (after --)")
    p = sub.add_parser("worker", help="one host of steptime (steptime starts it; not by hand)")
    p.add_argument("--rank", type=int, required=True, help="0 or 1: which host this is")
    for name, kind in (("--batch", int), ("--image-size", int), ("--warmup", int),
                       ("--steps", int)):
        p.add_argument(name, type=kind, required=True, help="as given to steptime")
    p.add_argument("--go", type=str, required=True,
                   help="file whose appearance starts the timed steps (after the link is shaped)")
    p.add_argument("--hooks", nargs="+", required=True, help="as given to steptime")
    args = parser.parse_args()
    if args.command != "worker" and os.geteuid() != 0:
        parser.error("network namespaces need root")
    {"steptime": steptime, "top1": top1, "worker": worker}[args.command](args)


if __name__ == "__main__":
    main()
