"""The CPU under the process: model name and ISA flags, read once from /proc/cpuinfo.

Backends pick speed paths and offered dtypes by what the CPU has (bf16 units, AVX-512,
AMX), and reports name the CPU they ran on; this is the one reader. Where
/proc/cpuinfo is absent (not Linux) the flags are empty and the model is what
``platform`` knows.
"""

from __future__ import annotations

import functools
import platform

__all__ = ["cpu_model", "cpu_flags", "has_bf16_units", "ISA_PATHS", "ISA_NEEDS", "runnable_isas", "missing_for"]

# The CPU kernel paths, best first, and the /proc/cpuinfo flags each one's compiler
# target (-march=skylake-avx512, -march=haswell, -march=x86-64) emits instructions of;
# "scalar" is the x86-64 baseline (SSE2), or plain C++ off x86.
ISA_PATHS = ("avx512", "avx2", "scalar")
ISA_NEEDS: dict[str, tuple[str, ...]] = {
    "avx512": ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "bmi1", "bmi2", "f16c",
               "movbe", "popcnt", "abm"),
    "avx2": ("avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "popcnt", "abm"),
    "scalar": (),
}


@functools.lru_cache(maxsize=1)
def _read() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:  # x86; arm64 says Features
                    flags = frozenset(value.split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s first "model name")."""
    return _read()[0]


def cpu_flags() -> frozenset[str]:
    """The first CPU's ISA flags (empty where unknown)."""
    return _read()[1]


def has_bf16_units() -> bool:
    """bf16 arithmetic in hardware (AMX or AVX512-BF16); elsewhere bf16 matmuls are
    widened to float32 element by element and are slower than float32 itself."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def missing_for(isa: str) -> tuple[str, ...]:
    """The flags ``isa`` (one of :data:`ISA_PATHS`) needs that this CPU lacks; empty when
    it runs here. Off x86 only "scalar" runs (the others are x86 instruction sets)."""
    if isa not in ISA_NEEDS:
        raise ValueError(f"unknown ISA path {isa!r}; choose from {', '.join(ISA_PATHS)}")
    if isa != "scalar" and platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386"):
        return (f"an x86 CPU (this one is {platform.machine()})",)
    return tuple(f for f in ISA_NEEDS[isa] if f not in cpu_flags())


def runnable_isas() -> tuple[str, ...]:
    """The CPU kernel paths this CPU executes, best first ("scalar" always)."""
    return tuple(isa for isa in ISA_PATHS if not missing_for(isa))
