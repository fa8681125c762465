"""Per-process memory of DDP and --fsdp training, and a memory cap that only FSDP fits under.

Each configuration starts WORLD real processes (gloo on loopback) that build the model, wrap it as
main.py does (imagenet.training.models.wrap) and train a few AdamW steps with our engine on
synthetic batches. Each reports its local model + gradient + optimizer state (bytes of its shards),
its peak RSS (CPU) or torch.cuda.max_memory_allocated (GPU). With --cap-gb every process runs under
RLIMIT_DATA (set before Python starts), so a configuration that needs more fails with torch's "can't
allocate memory". Run by hand (not a test); ViT-L/16 at 64 px needs ~13 GB for DDP x 2:

    python benchmarks/bench.py fsdp-memory [-a vit_l_16] [--image-size 64]
        [--configs ddp:1 ddp:2 fsdp:2 fsdp2:2 fsdp:4]
    python benchmarks/bench.py fsdp-memory --cap-gb 3.5 --configs ddp:1 fsdp:4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import time

from benchmarks import harness

ROOT = harness.ROOT
GB = 2**30
MODES = {"ddp": [], "fsdp": ["--fsdp"], "fsdp2": ["--fsdp", "--fsdp-zero", "2"],
         "offload": ["--fsdp", "--fsdp-cpu-offload"]}
TABLE = harness.Table(("config", "<10", ""), ("params", ">8", ".2f"), ("grads", ">8", ".2f"),
                      ("optim", ">8", ".2f"), ("state", ">8", ".2f"), ("of DDP", ">9", ""),
                      ("peak RSS", ">10", ".2f"), ("s/step", ">8", ".1f"))


def local_bytes(tensors) -> int:
    """Bytes this process holds of ``tensors`` (its shard of a DTensor)."""
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def worker(args: argparse.Namespace) -> None:
    """One process: build, wrap, train; print one RESULT line."""
    import torch
    import torch.distributed as dist
    import torchvision

    from imagenet.launching.process_group import DistInfo
    from imagenet.settings.flags import parse_config
    from imagenet.settings.launch import Layout
    from imagenet.training.engine import Step, train_one_epoch
    from imagenet.training.models import wrap
    from imagenet.training.optim import build_engine

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    result: dict = {"rank": rank}
    try:
        backend = None
        if world > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, rank=rank, world_size=world)
        info = DistInfo(rank, rank, world, world, device, backend)
        cfg = parse_config(["--dummy", "-a", args.arch, "--opt", "adamw", "--lr", "1e-4",
                            "-p", "1000000", *MODES[args.mode]])
        torch.manual_seed(0)
        size = {"image_size": args.image_size} if args.arch.startswith("vit") else {}
        raw = torchvision.models.get_model(args.arch, num_classes=1000, **size).to(device)
        model = wrap(raw, cfg, info)
        engine = build_engine(cfg, raw, model, device, Layout(world, args.batch_size, 1, 0),
                              args.steps, 1000)
        optimizer = engine.parts.optimizer
        grads: list[int] = []
        optimizer.register_step_pre_hook(lambda opt, *_: grads.append(local_bytes(
            p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None)))
        images = torch.randint(0, 256, (args.batch_size, 3, args.image_size, args.image_size),
                               dtype=torch.uint8)
        batch = (images, torch.randint(0, 1000, (args.batch_size,)))
        start = time.perf_counter()
        train_one_epoch(engine, [batch] * args.steps, Step())
        result.update(
            ok=True, step_s=(time.perf_counter() - start) / args.steps,
            params=local_bytes(raw.parameters()), grads=max(grads),
            optim=local_bytes(v for s in optimizer.state.values() for v in s.values()
                              if torch.is_tensor(v)),
            numel=sum(p.numel() for p in raw.parameters()))
        if device.type == "cuda":
            result["cuda_peak"] = torch.cuda.max_memory_allocated(device)
    except (RuntimeError, MemoryError) as exc:  # the cap: torch's "can't allocate memory"
        result.update(ok=False, error=str(exc).strip().splitlines()[0][:150])
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # no barrier: a rank that failed must not leave the others waiting


def launch(args: argparse.Namespace, mode: str, world: int) -> list[dict]:
    """Start ``world`` processes of configuration ``mode``; their RESULT lines."""
    from imagenet.settings.plan import free_port

    def cap() -> None:
        if args.cap_gb:
            limit = int(args.cap_gb * GB)
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", "BENCH_WORKER": "1",
           "PYTHONPATH": str(ROOT)}
    argv = harness.bench_command(*args.argv, "--mode", mode)
    procs = [subprocess.Popen(argv, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, preexec_fn=cap)
             for r in range(world)]
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:  # a peer died inside a collective
            for q in procs:
                q.kill()
            out = ""
        results += [json.loads(line[7:]) for line in out.splitlines()
                    if line.startswith("RESULT ")]
    return results


def report(mode: str, world: int, results: list[dict], ddp_state: float | None) -> float | None:
    """One line per configuration; returns its state bytes per process."""
    name = f"{mode.upper()} x{world}"
    if len(results) < world or not all(r.get("ok") for r in results):
        errors = sorted({r.get("error", "?") for r in results if not r.get("ok")}) or [
            "no report (killed or hung)"]
        print(f"{name:<10} FAILED: {errors[0]}", flush=True)
        return None
    worst = max(results, key=lambda r: r["peak_rss"])
    state = worst["params"] + worst["grads"] + worst["optim"]
    share = f"{state / ddp_state:6.1%}" if ddp_state else "     -"
    cuda = f"  cuda peak {worst['cuda_peak'] / GB:5.2f} GB" if "cuda_peak" in worst else ""
    TABLE.row(name, worst["params"] / GB, worst["grads"] / GB, worst["optim"] / GB, state / GB,
              share, worst["peak_rss"] / GB, worst["step_s"], end=cuda)
    return state


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's flags."""
    parser.add_argument("-a", "--arch", default="vit_l_16",
                        help="architecture (default: vit_l_16)")
    parser.add_argument("--image-size", type=int, default=64, help="pixels")
    parser.add_argument("-b", "--batch-size", type=int, default=2, help="images per process")
    parser.add_argument("--steps", type=int, default=2, help="AdamW steps")
    parser.add_argument("--configs", nargs="+", default=["ddp:1", "ddp:2", "fsdp:2", "fsdp2:2",
                                                         "fsdp:4"],
                        help="MODE:WORLD with MODE in " + ", ".join(MODES)
                             + " (fsdp = ZeRO-3, fsdp2 = --fsdp-zero 2)")
    parser.add_argument("--cap-gb", type=float, default=0.0,
                        help="RLIMIT_DATA per process, GiB (0: no cap)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per configuration")
    parser.add_argument("--mode", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> None:
    if os.environ.get("BENCH_WORKER"):
        return worker(args)
    cap = f", every process capped at RLIMIT_DATA {args.cap_gb:g} GiB" if args.cap_gb else ""
    print(f"{args.arch} at {args.image_size}px, AdamW, batch {args.batch_size} per process, "
          f"{args.steps} steps{cap}; per process (the largest), GiB:")
    TABLE.header()
    ddp_state = None
    for config in args.configs:
        mode, world = config.split(":")
        state = report(mode, int(world), launch(args, mode, int(world)), ddp_state)
        if mode == "ddp" and ddp_state is None:
            ddp_state = state
