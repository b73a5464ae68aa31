"""The CPU under the process: model name and ISA flags, read once from /proc/cpuinfo.

Backends pick speed paths and offered dtypes by what the CPU has (bf16 units, AVX-512,
AMX), and reports name the CPU they ran on; this is the one reader. Where
/proc/cpuinfo is absent (not Linux) the flags are empty and the model is what
``platform`` knows.
"""

from __future__ import annotations

import functools
import platform

__all__ = ["cpu_model", "cpu_flags", "has_bf16_units"]


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
