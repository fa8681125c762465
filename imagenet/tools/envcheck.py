"""``--env-check``: report the installation and local devices, then prove the ranks can train.

The report (versions, environment, devices, backends) is printed as is; the checks run for real in
``nproc`` ranks on loopback (imagenet/envprobe.py): all-reduce and broadcast correctness, all-reduce
bandwidth for a tensor the size of the model's gradients, and a short forward/backward per device.
Run as ``python main.py --env-check`` or ``python -m imagenet.tools.envcheck`` with main.py's flags.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from imagenet.errors import INTERRUPTED_EXIT_CODE, TrainerError, UsageError, report
from imagenet.settings import devices, images
from imagenet.settings.flags import Config, parse_config
from imagenet.settings.launch import choose_backend, device_type_of
from imagenet.tools.envprobe import FB_BATCH, RANDOM_NUMEL, STARTUP_S, Plan, run_probes

CPU_PROCS = 2  # ranks on the CPU without --nproc-per-node: the least that exercises gloo
MAX_TIMEOUT_S = 60.0  # cap on --dist-timeout here: a check must answer, not wait 10 minutes


@dataclass(frozen=True)
class Check:
    """One line of the verdict."""

    status: str  # PASS | FAIL | SKIP
    name: str
    detail: str

    def line(self) -> str:
        """The printed line."""
        return f"  {self.status} {self.name}: {self.detail}"


def _say(text: str = "") -> None:
    print(text, flush=True)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def environment_lines() -> tuple[list[str], list[str]]:
    """(report lines, warnings) about OS, Python, the environment and where torch comes from."""
    warnings = []
    prefix = Path(sys.prefix).resolve()
    if sys.prefix != sys.base_prefix:
        kind = f"virtualenv {sys.prefix}"
    elif (prefix / "conda-meta").is_dir():
        kind = f"conda env '{os.environ.get('CONDA_DEFAULT_ENV', prefix.name)}' {sys.prefix}"
    else:
        kind = f"system Python {sys.prefix} (no virtualenv or conda)"
    active = os.environ.get("VIRTUAL_ENV")
    if active and Path(active).resolve() != prefix:
        warnings.append(f"VIRTUAL_ENV={active} is activated but Python runs from {sys.prefix}: "
                        "call that environment's python (or re-activate)")
    torch_dir = Path(torch.__file__).resolve().parent
    inside = torch_dir.is_relative_to(prefix) or Path(torch.__file__).is_relative_to(sys.prefix)
    where = "inside the environment" if inside else "OUTSIDE the environment"
    if not inside:
        warnings.append(f"torch is imported from {torch_dir}, outside {sys.prefix} (user site, "
                        "PYTHONPATH or a source build?): check `pip show torch` in the env you "
                        "mean to use")
    lines = [f"OS          {platform.platform()}",
             f"Python      {platform.python_version()} ({sys.executable})",
             f"Environment {kind}",
             f"torch       {torch.__version__} from {torch_dir} ({where})"]
    return lines, warnings


def library_lines(cfg: Config) -> list[str]:
    """torchvision, CUDA, cuDNN and NCCL versions, the accelerator and the JPEG decoder."""
    import torchvision

    decoding = images.choose_decoding(cfg)

    cuda = torch.version.cuda or "none (CPU-only build)"
    if torch.version.hip:
        cuda = f"ROCm/HIP {torch.version.hip}"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # CPU-only builds have no NCCL at all
        nccl = "none"
    return [f"torchvision {torchvision.__version__}",
            f"CUDA        {cuda} (build); torch.cuda.is_available() = "
            f"{torch.cuda.is_available()}",
            f"cuDNN       {cudnn or 'none'}",
            f"NCCL        {nccl}",
            f"Accelerator {devices.detect().describe()} (torch.accelerator)",
            f"Decoder     {decoding.name} ({decoding.why}); TorchCodec "
            f"{'installed' if images.torchcodec_installed() else 'not installed'}",
            f"Parquet     pyarrow {installed('pyarrow')} (--data-format parquet); Hugging Face Hub "
            f"client {installed('huggingface_hub')} (hf:// data)"]


def installed(module: str) -> str:
    """"pyarrow 25.0.1" when ``module`` can be imported (its version), else "not installed"."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        return f"{importlib.metadata.version(module)}"
    except importlib.metadata.PackageNotFoundError:
        return "installed"


def device_lines() -> list[str]:
    """One line per accelerator device, or the CPU's cores."""
    accel = devices.detect()
    if accel and accel.type != "cuda":
        return [f"Device      {accel.type}:{i}" for i in range(accel.count)]
    if torch.cuda.is_available():
        lines = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"Device      cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, "
                         f"capability {p.major}.{p.minor}, {p.multi_processor_count} SMs")
        return lines
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [f"Devices     CPU: {os.cpu_count()} cores ({usable} usable by this process), "
            f"{torch.get_num_threads()} torch threads"]


def backend_line() -> str:
    """Which process-group backends this torch build has."""
    flags = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
             "mpi": dist.is_mpi_available(), "ucc": getattr(dist, "is_ucc_available", bool)()}
    return "  ".join(f"{k}: {'yes' if v else 'no'}" for k, v in flags.items())


def count_parameters(arch: str) -> int:
    """Parameters of ``arch`` with 1000 classes, built on the meta device (no memory, fast)."""
    import torchvision

    with torch.device("meta"):
        model = torchvision.models.get_model(arch, weights=None, num_classes=1000)
    return sum(p.numel() for p in model.parameters())



def plan_checks(cfg: Config, numel: int) -> tuple[Plan, Check]:
    """The rank count, device and backend, and the verdict on the backend."""
    accel = devices.detect()
    use_cuda = bool(accel) and not cfg.no_accel  # any accelerator
    count = accel.count if use_cuda else 0
    device_type = device_type_of(cfg, accel)
    nprocs = cfg.nproc_per_node or (count if use_cuda else CPU_PROCS)
    plan = Plan(nprocs, device_type, None, numel, cfg.arch, min(cfg.dist_timeout, MAX_TIMEOUT_S),
                fsdp=cfg.fsdp)
    try:
        backend = choose_backend(cfg.dist_backend, device_type)
    except UsageError as exc:
        hint = ""
        if torch.version.cuda is None:
            hint = " (this torch is a CPU-only build: install a CUDA build of torch for NCCL)"
        elif not torch.cuda.is_available():
            hint = (" (torch is a CUDA build but sees no GPU: check nvidia-smi, the driver and "
                    "CUDA_VISIBLE_DEVICES)")
        return plan, Check("FAIL", f"backend {cfg.dist_backend}", f"{exc}{hint}")
    if use_cuda and nprocs > count:
        return plan, Check("FAIL", f"backend {backend}",
                           f"--nproc-per-node {nprocs} but only {count} {device_type} "
                           "device(s) visible: one rank per device (or --no-accel to check gloo "
                           "on the CPU)")
    return replace(plan, backend=backend), Check("PASS", f"backend {backend}",
                                                 f"available for {device_type} tensors")


# (check name, report key) in the order the ranks run them.
STAGES = (("process group", "joined_s"), ("all-reduce sum", "sum_ok"),
          ("all-reduce random", "random_ok"), ("broadcast", "bcast_ok"),
          ("all-reduce bandwidth", "bw_ok"))
JOIN_HINT = ("check that TCP on 127.0.0.1 works (firewall, container network) and "
             "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME if you set them; rerun with "
             "TORCH_DISTRIBUTED_DEBUG=DETAIL NCCL_DEBUG=INFO")
WRONG_HINT = ("the backend returned wrong data: driver or NCCL problem (try NCCL_P2P_DISABLE=1, "
              "NCCL_DEBUG=INFO) or a broken torch build")
STALL_HINT = ("a rank failed or stopped answering mid-collective; rerun with "
              "TORCH_DISTRIBUTED_DEBUG=DETAIL NCCL_DEBUG=INFO, see docs/debugging.md")
MEMORY_HINT = ("a model-sized all-reduce failed: memory, or shared memory in containers "
               "(/dev/shm size, NCCL_SHM_DISABLE=1)")
FB_HINT = "check free device memory and that the torch and torchvision versions match"
FSDP_STAGE = ("FSDP step", "fsdp_ok")  # with --fsdp


def stages(plan: Plan) -> tuple[tuple[str, str], ...]:
    """The checks the ranks run, in order."""
    return STAGES + (FSDP_STAGE,) if plan.fsdp else STAGES


def _stage_detail(name: str, reports: dict[int, dict[str, Any]], plan: Plan) -> str:
    """What a passed check measured."""
    world, first = plan.nprocs, reports[0]
    if name == "process group":
        took = max(r["joined_s"] for r in reports.values())
        return (f"{world} ranks joined at 127.0.0.1:{first['port']} in {took:.2f} s "
                f"({plan.backend} on {plan.device_type})")
    if name == "all-reduce sum":
        return f"each rank contributed rank+1: sum {first['sum']:g} on every rank (exact)"
    if name == "all-reduce random":
        return f"{RANDOM_NUMEL:,} random integer-valued floats: sum exact on every rank"
    if name == "broadcast":
        return f"{RANDOM_NUMEL:,} floats from rank 0 identical on every rank"
    if name == FSDP_STAGE[0]:
        return (f"a small ViT in {first['fsdp_units']} units over {world} rank(s): one sharded "
                f"SGD step equals the unsharded one (max diff {first['fsdp_diff']:.1e})")
    nbytes = 4 * plan.numel
    if world == 1:
        return f"one rank: nothing to exchange, {_mb(nbytes)} bandwidth not measured"
    algbw = nbytes / first["bw_s"] / 1e9
    busbw = algbw * 2 * (world - 1) / world  # what each link carries in a ring (nccl-tests)
    return (f"{plan.numel / 1e6:.1f}M floats ({_mb(nbytes)}, the gradients of {plan.arch}): "
            f"{1000 * first['bw_s']:.1f} ms per all-reduce, {algbw:.2f} GB/s "
            f"(bus {busbw:.2f} GB/s)")


def _stage_failure(name: str, key: str, reports: dict[int, dict[str, Any]],
                   why: dict[int, str]) -> str:
    """Why ``name`` did not pass (errors, wrong results, unfinished ranks) and what to check."""
    ranked = sorted(reports.items())
    errors = [f"rank {r}: {rep['error']}" for r, rep in ranked if "error" in rep]
    wrong = [f"rank {r}: wrong result" for r, rep in ranked if rep.get(key) is False]
    stopped = [f"rank {r}: {text}" for r, text in why.items()]
    if wrong:
        hint = WRONG_HINT
    elif name == "process group":
        hint = JOIN_HINT
    elif name == "all-reduce bandwidth" and errors:
        hint = MEMORY_HINT
    else:
        hint = STALL_HINT
    return f"{'; '.join(errors + wrong + stopped)} -> {hint}"


def verdict(plan: Plan, reports: dict[int, dict[str, Any]], why: dict[int, str]) -> list[Check]:
    """Checks from the ranks' reports: the first broken stage fails, later ones are skipped."""
    checks: list[Check] = []
    broken = False
    for name, key in stages(plan):
        if broken:
            checks.append(Check("SKIP", name, "not reached: an earlier check failed"))
        elif all(reports.get(r, {}).get(key) not in (None, False) for r in range(plan.nprocs)):
            checks.append(Check("PASS", name, _stage_detail(name, reports, plan)))
        else:
            checks.append(Check("FAIL", name, _stage_failure(name, key, reports, why)))
            broken = True
    for rank in range(plan.nprocs):
        checks.append(_fb_check(rank, reports.get(rank, {}), why.get(rank), plan, broken))
    return checks


def _fb_check(rank: int, report: dict[str, Any], why: str | None, plan: Plan,
              broken: bool) -> Check:
    """The forward/backward verdict of one rank."""
    name = f"forward/backward rank {rank}"
    if report.get("fb_ok"):
        return Check("PASS", name, f"{plan.arch}, batch {FB_BATCH} at {report['fb_pixels']} px "
                                   f"on {report['device']}: {report['fb_img_s']:.1f} img/s "
                                   f"({report['fb_ms']:.0f} ms/step)")
    if broken and report.get("stage") != "forward/backward":
        return Check("SKIP", name, "not reached: an earlier check failed")
    problem = report.get("error") or why or (
        "the loss is not finite" if "fb_ok" in report else "no report from this rank")
    return Check("FAIL", name, f"{problem} -> {FB_HINT}")


def skipped(plan: Plan) -> list[Check]:
    """The multi-process checks, all skipped (no usable backend)."""
    names = [name for name, _ in stages(plan)]
    names += [f"forward/backward rank {r}" for r in range(plan.nprocs)]
    return [Check("SKIP", n, "not run: no usable backend") for n in names]


def summary(checks: Sequence[Check], warnings: Sequence[str]) -> str:
    """The one verdict line."""
    passed = sum(c.status == "PASS" for c in checks)
    warned = f", {len(warnings)} warning(s)" if warnings else ""
    if passed == len(checks):
        return f"env-check: PASS ({passed}/{len(checks)} checks{warned})"
    failed = ", ".join(c.name for c in checks if c.status == "FAIL")
    return f"env-check: FAIL ({passed}/{len(checks)} checks passed{warned}; failed: {failed})"


def report_lines(cfg: Config) -> tuple[list[str], list[str], int]:
    """(installation report, warnings, parameters of -a)."""
    lines, warnings = environment_lines()
    numel = count_parameters(cfg.arch)
    lines += library_lines(cfg) + device_lines()
    lines += [f"Backends    {backend_line()}",
              f"Model       {cfg.arch}: {numel:,} parameters ({_mb(4 * numel)} fp32)"]
    return lines, warnings, numel


def run_env_check(cfg: Config) -> int:
    """Print the report and run the checks; 0 only when every check passed."""
    lines, warnings, numel = report_lines(cfg)
    _say("env-check: installation")
    for line in lines:
        _say(f"  {line}")
    for warning in warnings:
        _say(f"  WARN {warning}")
    plan, backend_check = plan_checks(cfg, numel)
    _say(f"env-check: {plan.nprocs} rank(s) on {plan.device_type} over loopback; collectives "
         f"time out after {plan.timeout:g} s, the whole check after "
         f"{plan.timeout + STARTUP_S:g} s")
    _say(backend_check.line())
    checks = [backend_check]
    if plan.backend:
        checks += verdict(plan, *run_probes(plan))
    else:
        checks += skipped(plan)
    for check in checks[1:]:
        _say(check.line())
    _say(summary(checks, warnings))
    return 0 if all(c.status == "PASS" for c in checks) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m imagenet.tools.envcheck [flags]``: main.py's flags, the env check only."""
    try:
        return run_env_check(parse_config(argv))
    except TrainerError as exc:
        return report(exc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
