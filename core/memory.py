"""One memory check for everything polyengine allocates.

The loader checks a model's host weights with it, and every engine checks what it
allocates itself (its own copy of the weights, the KV caches of all slots) with the
same function, on the host or on a device, before allocating. A refusal is an
:class:`~polyengine.errors.InsufficientMemory` that names what needed the memory,
where, both numbers, and what the user can change.

Where the limit comes from: on the host, the smallest of ``MemAvailable``, the cgroup
limit minus its usage and ``RLIMIT_AS`` minus the process's mapped size (whichever of
them exist); on a device, whatever the backend's ``available`` callable reports (e.g.
free device memory from NVML or the framework). ``None`` means "unknown": no check.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
from pathlib import Path
from typing import Callable, Mapping

from polyengine.errors import InsufficientMemory

__all__ = ["available_host_memory", "check_fits", "simulated_limit", "MARGIN_FRACTION", "MARGIN_MIN", "gib"]

# Slack on top of what is counted: allocator overhead, temporaries of a step.
MARGIN_FRACTION = 0.10
MARGIN_MIN = 256 * 1024**2
DEFAULT_ADVICE = (
    "free some memory, or use a smaller model, fewer slots (max_slots / --max-slots) "
    "or a shorter context (max_cache_length / --context-length)"
)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_available() -> int | None:
    """Room left under this process's cgroup (v2 ``memory.max``, or v1), if limited."""
    candidates = [
        (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
        (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")),
    ]
    for limit_file, usage_file in candidates:
        try:
            raw = limit_file.read_text().strip()
            if raw == "max":
                return None
            limit = int(raw)
            usage = int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 1 << 60:  # cgroup v1 spells "unlimited" as a huge number
            return None
        return max(0, limit - usage)
    return None


def _rlimit_available() -> int | None:
    """Address space left under ``ulimit -v`` (RLIMIT_AS), if one is set."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ValueError, OSError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open(f"/proc/{os.getpid()}/statm", encoding="ascii") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        size = 0
    return max(0, soft - size)


def available_host_memory() -> int | None:
    """Bytes this process can still allocate on the host, or None where unknown."""
    values = [v for v in (_meminfo_available(), _cgroup_available(), _rlimit_available()) if v is not None]
    return min(values) if values else None


_simulated = threading.local()


@contextlib.contextmanager
def simulated_limit(nbytes: int):
    """Within this block (on this thread) every check sees at most ``nbytes`` available,
    host or device: how the conformance suite checks that a backend refuses, before
    allocating, what would not fit, without needing a machine that is actually full."""
    previous = getattr(_simulated, "limit", None)
    _simulated.limit = int(nbytes)
    try:
        yield
    finally:
        _simulated.limit = previous


def check_fits(
    what: str,
    needs: Mapping[str, int],
    *,
    where: str = "host memory",
    available: int | None | Callable[[], int | None] = None,
    advice: str = DEFAULT_ADVICE,
    margin: bool = True,
) -> int:
    """Refuse, before allocating, what would not fit; return the bytes counted.

    ``needs`` maps a description ("float32 weights", "KV cache of 8 slots x 1024
    positions") to bytes. ``available`` is a number, a callable returning one, or
    None for host memory (:func:`available_host_memory`). A margin of 10% (at least
    256 MiB) is added unless ``margin`` is False.
    """
    total = sum(int(v) for v in needs.values())
    needed = total + (max(MARGIN_MIN, int(total * MARGIN_FRACTION)) if margin else 0)
    if available is None and where == "host memory":
        have = available_host_memory()
    elif callable(available):
        have = available()
    else:
        have = available
    limit = getattr(_simulated, "limit", None)
    if limit is not None:
        have = limit if have is None else min(have, limit)
    if have is None or needed <= have:
        return needed
    parts = ", ".join(f"{k} ({gib(v)})" for k, v in needs.items())
    raise InsufficientMemory(
        f"{what} needs {needed:,} bytes ({gib(needed)}) of {where} for {parts}"
        + (" plus a margin" if margin else "")
        + f", but only {have:,} bytes ({gib(have)}) are available; {advice}",
        needed=needed, available=have, where=where,
    )
