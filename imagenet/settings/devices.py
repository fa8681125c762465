"""Which accelerator this machine has, asked once through ``torch.accelerator``, and what each
device type can do: its process-group backend, SyncBatchNorm, its memory statistics, its streams,
its random-number state, its name.

Every call of ``torch.cuda`` the trainer makes is in this module (and in tools/envcheck.py, which
reports CUDA's and NCCL's versions): the rest of the package asks here, so a new accelerator is a
change in one place. Streams and events are torch's device-generic ``torch.Stream`` and
``torch.Event``.

pytorch/examples' ``imagenet/main.py`` picks its device through ``torch.accelerator`` (CUDA and
ROCm, Apple MPS, Intel XPU, Gaudi HPU and the other backends torch registers), with
``--no-accel`` to stay on the CPU; a command written for it runs here unchanged. ``--gpu N`` is
the index of a device of whatever accelerator is present.

Whether this CPU computes bf16 natively: --amp bf16 on one that does not is much slower.

Without AVX512-BF16 / AMX (x86) or the BF16 extension (ARM), bf16 is emulated: every operand
is converted to fp32 and back. Measured with benchmarks/bench.py train-step (resnet18, 112 px,
batch 16, 1 thread; bf16 vs fp32 steps per second, same run), on an AVX512-BF16 CPU with oneDNN
capped by ONEDNN_MAX_CPU_ISA: natively bf16 is 1.34x faster; with AVX-512 but no BF16 it is
about 2x slower (0.47x-0.63x), with AVX2 only about 10x slower (0.09x-0.13x). Detected from the
CPU's feature flags, not guessed from a model or host name.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

# SyncBatchNorm's own check (torch/nn/modules/batchnorm.py): the device types it has kernels for.
SYNC_BN = ("cuda", "hpu", "xpu", "privateuseone")


@dataclass(frozen=True)
class Accelerator:
    """The machine's accelerator: its device type ("cuda", "xpu", "mps", ...) and how many devices
    this process sees; ``Accelerator("cpu", 0)`` when there is none."""

    type: str = "cpu"
    count: int = 0

    def __bool__(self) -> bool:
        return self.count > 0

    def describe(self) -> str:
        return f"{self.count} {self.type} device(s)" if self else "no accelerator"


def detect() -> Accelerator:
    """This machine's accelerator, through ``torch.accelerator`` (one call per process: CUDA's is
    answered without creating a context)."""
    if not torch.accelerator.is_available():
        return Accelerator()
    found = torch.accelerator.current_accelerator()
    if found is None:
        return Accelerator()
    return Accelerator(found.type, torch.accelerator.device_count())


def of_cuda(count: int) -> Accelerator:
    """The accelerator of a machine with ``count`` CUDA devices (none when 0)."""
    return Accelerator("cuda", count) if count else Accelerator()


def default_backend(device_type: str) -> str | None:
    """The process-group backend torch registers for ``device_type`` (nccl for cuda, xccl for
    xpu, hccl for hpu, gloo for cpu), or None when it has none (mps)."""
    if device_type == "cpu":
        return "gloo"
    backend = dist.Backend.default_device_backend_map.get(device_type)
    # torch's "fake" backend (for tracing, registered for hpu by torch's own imports) holds a
    # device's place until its real backend (hccl) registers: no backend to train with.
    return None if backend == "fake" else backend


def set_current(device: torch.device) -> None:
    """Make ``device`` this process's current accelerator device (for CUDA: creates its
    context); nothing for the CPU."""
    if device.type == "cpu":
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.index is not None:
        torch.accelerator.set_device_index(device.index)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def has_memory_stats(device: torch.device) -> bool:
    """True where torch keeps peak-memory statistics for ``device``'s type."""
    if device.type == "cuda":
        return True
    return device.type != "cpu" and hasattr(torch.accelerator, "max_memory_allocated")


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif has_memory_stats(device):
        torch.accelerator.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float:
    """The peak memory allocated on ``device`` since its last reset, in GiB (0 without stats)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    if has_memory_stats(device):
        return torch.accelerator.max_memory_allocated(device) / 2**30
    return 0.0


def side_stream(device: torch.device) -> torch.Stream | None:
    """A stream of its own on ``device`` for work that overlaps the training step (the next
    batch's copy and decode), or None where that work is done in turn: on the CPU, and on the
    accelerators other than CUDA, where the overlap has not been measured."""
    return torch.Stream(device=device) if device.type == "cuda" else None


def current_stream(device: torch.device) -> torch.Stream:
    """The stream the training step runs on, on ``device``."""
    return torch.accelerator.current_stream(device)


def ready_event(stream: torch.Stream) -> torch.Event:
    """An event recorded on ``stream`` now: the work queued on it so far is done once it is."""
    event = torch.Event(device=stream.device)
    event.record(stream)
    return event


def rng_device() -> tuple[int, int] | None:
    """(this process's CUDA device, the devices it sees) once it uses CUDA: its RNG state is
    part of a checkpoint; None before (asking would create a CUDA context) and without CUDA."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device(), torch.cuda.device_count()
    return None


def get_rng_state() -> torch.Tensor:
    """The RNG state of this process's current CUDA device (see ``rng_device``)."""
    return torch.cuda.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    torch.cuda.set_rng_state(state)


def name(device: torch.device) -> str:
    """What kernels for ``device`` are built for: a CUDA GPU's name and compute capability
    ("NVIDIA H200 (sm_90)"), another accelerator's type ("xpu device")."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    return f"{device.type} device"


def as_accelerator(found: Accelerator | int) -> Accelerator:
    """``found``, or for an int (the planning functions' shorthand) that many CUDA devices."""
    return found if isinstance(found, Accelerator) else of_cuda(found)


# ------------------------------------------------------ whether this CPU computes bf16 natively

X86 = ("x86_64", "amd64", "i386", "i686")
ARM = ("aarch64", "arm64")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """Feature flags from /proc/cpuinfo ('flags' on x86, 'Features' on ARM); empty if unknown."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return set(value.split())
    return set()


def native_bf16(machine: str | None = None, flags: set[str] | None = None) -> bool | None:
    """True if the CPU has bf16 instructions, False if it has none, None when it cannot tell."""
    machine = (machine or platform.machine()).lower()
    if flags is None:
        flags = cpu_flags()
        if machine in X86 and hasattr(torch.cpu, "_is_avx512_bf16_supported"):
            # torch's own probe (cpuinfo), also where /proc is not available.
            return bool(torch.cpu._is_avx512_bf16_supported()
                        or torch.cpu._is_amx_tile_supported())
    if machine in X86:
        return bool(flags & {"avx512_bf16", "amx_bf16"})
    if machine in ARM:
        return "bf16" in flags if flags else None
    return None


def slow_bf16_warning(amp: str | None, device_type: str, native: bool | None) -> str | None:
    """The start-up warning for --amp bf16 on a CPU without bf16 instructions, else None."""
    if amp != "bf16" or device_type != "cpu" or native is not False:
        return None
    return ("--amp bf16: this CPU has no bf16 instructions (AVX512-BF16/AMX on x86, BF16 on "
            "ARM), so bf16 autocast is emulated and slower than fp32 (measured: 2x with AVX-512, "
            "10x with AVX2 only); drop --amp for CPU training here")
