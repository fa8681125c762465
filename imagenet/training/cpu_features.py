"""Whether this CPU computes bf16 natively: --amp bf16 on one that does not is much slower.

Without AVX512-BF16 / AMX (x86) or the BF16 extension (ARM), bf16 is emulated: every operand
is converted to fp32 and back. Measured with benchmarks/bench_train_step.py (resnet18, 112 px,
batch 16, 1 thread; bf16 vs fp32 steps per second, same run), on an AVX512-BF16 CPU with oneDNN
capped by ONEDNN_MAX_CPU_ISA: natively bf16 is 1.34x faster; with AVX-512 but no BF16 it is
about 2x slower (0.47x-0.63x), with AVX2 only about 10x slower (0.09x-0.13x). Detected from the
CPU's feature flags, not guessed from a model or host name.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

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
