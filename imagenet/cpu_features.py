"""Whether this CPU computes bf16 natively: --amp bf16 on one that does not is much slower.

Without AVX512-BF16 / AMX (x86) or the BF16 extension (ARM), oneDNN converts every bf16
operand to fp32 and back, and bf16 autocast costs several times fp32's step time (about 10x
measured on such a CPU; benchmarks/bench_bf16.py measures it on yours). Detected from the CPU's
feature flags, not guessed from a model or host name.
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
            "ARM), so bf16 autocast is emulated and runs several times slower than fp32 (about "
            "10x measured); drop --amp for CPU training here")
