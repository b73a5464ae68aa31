"""One memory check for everything polyengine allocates.

The loader checks a model's host weights with it, and every engine checks what it
allocates itself (its own copy of the weights, the KV caches of all slots) with the
same function, on the host or on a device, before allocating. A refusal is an
:class:`~polyengine.errors.InsufficientMemory` that names what needed the memory,
where, both numbers, which limit binds, and what the user can change, in the spelling
of both the Python API and the command line.

Where the host limit comes from (:func:`host_memory_limits`): the smallest of
``MemAvailable``; the room under this process's cgroup and each of its ancestors
(v2 ``memory.max`` minus ``memory.current``, or v1 ``memory.limit_in_bytes`` minus
``memory.usage_in_bytes``); the room under ``ulimit -v`` (``RLIMIT_AS`` minus the
mapped size) and under ``ulimit -d`` (``RLIMIT_DATA`` minus the data segment), since
NumPy's large arrays count against both. On a device, whatever the backend's
``available`` callable reports. ``None`` means "unknown": no check.

An allocation that fails anyway (the check is an estimate; another process may take
memory in between) raises ``MemoryError``; :func:`as_insufficient` and
:func:`translating_memory_errors` turn that into the same typed error, so a user never
sees a raw NumPy traceback.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
from pathlib import Path
from typing import Callable, Iterator, Mapping

from polyengine.errors import InsufficientMemory

__all__ = [
    "available_host_memory", "host_memory_limits", "cgroup_available", "check_fits", "simulated_limit",
    "as_insufficient", "translating_memory_errors", "MARGIN_FRACTION", "MARGIN_MIN", "DEFAULT_ADVICE", "gib",
    "return_freed_memory", "resident_bytes", "reset_peak_resident",
    "engine_advice", "check_weights_fit", "LOAD_ADVICE",
]

# Slack on top of what is counted: allocator overhead, temporaries of a step.
MARGIN_FRACTION = 0.10
MARGIN_MIN = 256 * 1024**2
# What an engine's user can change, named as the API and the CLI spell it. Without an
# engine to ask, no dtype is named: one the backend does not declare would be refused.
_SHORTER = (
    "free some memory, or ask for less: a shorter context (max_cache_length=N in Python, --context-length N on "
    "the command line), fewer slots (max_slots=N in Python; the command line uses one)"
)
DEFAULT_ADVICE = _SHORTER + ", or a smaller compute dtype among those the backend declares (dtype= in Python, --dtype)"
_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def engine_advice(declared: "tuple[str, ...] | None", current: str | None) -> str:
    """The advice for an engine that declares ``declared`` dtypes and runs ``current``:
    a smaller dtype only if it declares one (so the advice can be followed as written)."""
    if declared is None:
        return DEFAULT_ADVICE
    size = _DTYPE_BYTES.get(current or (declared[0] if declared else ""), 0)
    smaller = [d for d in declared if _DTYPE_BYTES.get(d, size) < size]
    if not smaller:
        return _SHORTER
    d = smaller[0]
    return _SHORTER + f", or a smaller compute dtype (dtype={d!r} in Python, --dtype {d} on the command line)"
_RAISE_LIMIT = {
    "ulimit -v": "or raise the address-space limit (ulimit -v)",
    "ulimit -d": "or raise the data-segment limit (ulimit -d)",
    "cgroup": "or raise the container's memory limit (cgroup memory.max)",
}


def gib(n: int) -> str:
    """A byte count for people: MiB, GiB or TiB."""
    if n >= 2**40:
        return f"{n / 2**40:.2f} TiB"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        raw = path.read_text().strip()
    except OSError:
        return None
    if raw == "max":
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    return None if value >= 1 << 60 else value  # cgroup v1 spells "unlimited" as a huge number


def cgroup_available(root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Room left under this process's cgroup and every ancestor (the tightest), if any is limited.

    ``self_cgroup`` lists the process's cgroups (``/proc/self/cgroup``); ``root`` is where
    the hierarchy is mounted. Inside a container the process's own cgroup is usually the
    mount's root, which is read too.
    """
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    where: list[tuple[Path, str, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2
            where.append((root, path, "v2"))
        elif "memory" in controllers.split(","):
            where.append((root / "memory", path, "v1"))
    if not where:
        where = [(root, "/", "v2"), (root / "memory", "/", "v1")]
    rooms = []
    for base, path, version in where:
        limit_name, usage_name = ("memory.max", "memory.current") if version == "v2" else (
            "memory.limit_in_bytes", "memory.usage_in_bytes")
        rel = Path(path.lstrip("/"))
        for level in [rel, *rel.parents]:
            limit = _read_int(base / level / limit_name)
            usage = _read_int(base / level / usage_name)
            if limit is not None and usage is not None:
                rooms.append(max(0, limit - usage))
    return min(rooms) if rooms else None


def _proc_status_kib(field: str) -> int | None:
    try:
        with open(f"/proc/{os.getpid()}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def resident_bytes(field: str = "VmRSS") -> int | None:
    """This process's resident memory from ``/proc/self/status``, in bytes: ``"VmRSS"``
    (now) or ``"VmHWM"`` (the peak since the start or the last
    :func:`reset_peak_resident`). None where there is no ``/proc`` (not Linux)."""
    return _proc_status_kib(field)


def reset_peak_resident() -> bool:
    """Set this process's peak (``VmHWM``) to its resident memory now (``/proc/self/clear_refs``,
    value 5), so the next :func:`resident_bytes` ``("VmHWM")`` is the peak of what runs in
    between. False where the kernel offers no such reset."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _rlimit_room(which: int, used_field: str) -> int | None:
    """Room left under a resource limit (None when it is unlimited)."""
    try:
        soft, _ = resource.getrlimit(which)
    except (ValueError, OSError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    used = _proc_status_kib(used_field) or 0
    return max(0, soft - used)


def host_memory_limits() -> dict[str, int]:
    """Every host limit that applies here, by name, in bytes this process can still use.

    Names: ``"MemAvailable"``, ``"cgroup"``, ``"ulimit -v"`` (``RLIMIT_AS``),
    ``"ulimit -d"`` (``RLIMIT_DATA``); those that do not apply are left out.
    """
    found = {
        "MemAvailable": _meminfo_available(),
        "cgroup": cgroup_available(),
        "ulimit -v": _rlimit_room(resource.RLIMIT_AS, "VmSize"),
        "ulimit -d": _rlimit_room(resource.RLIMIT_DATA, "VmData"),
    }
    return {k: v for k, v in found.items() if v is not None}


def available_host_memory() -> int | None:
    """Bytes this process can still allocate on the host, or None where unknown."""
    limits = host_memory_limits()
    return min(limits.values()) if limits else None


def _binding(limits: Mapping[str, int]) -> str:
    name = min(limits, key=limits.get)
    return f" (the tightest limit: {name}; " + ", ".join(f"{k} {gib(v)}" for k, v in limits.items()) + ")"


def _advice(advice: str, limits: Mapping[str, int] | None) -> str:
    if not limits:
        return advice
    name = min(limits, key=limits.get)
    return advice + (f", {_RAISE_LIMIT[name]}" if name in _RAISE_LIMIT else "")


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
    limits = None
    if available is None and where == "host memory":
        have = available_host_memory()
        limits = host_memory_limits()
        if not limits or min(limits.values()) != have:
            limits = None  # measured twice, differently: name no limit rather than a wrong one
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
        + f", but only {have:,} bytes ({gib(have)}) are available"
        + (_binding(limits) if limits else "")
        + f"; {_advice(advice, limits)}",
        needed=needed, available=have, where=where,
    )


def as_insufficient(exc: MemoryError, what: str, *, advice: str = DEFAULT_ADVICE,
                    where: str = "host memory") -> InsufficientMemory:
    """The typed error for an allocation that failed (``exc``), or ``exc`` itself when it
    already is one. NumPy's ``_ArrayMemoryError`` says how much it asked for."""
    if isinstance(exc, InsufficientMemory):
        return exc
    asked = getattr(exc, "_total_size", None)
    asked = int(asked) if isinstance(asked, int) else None
    have = available_host_memory() if where == "host memory" else None
    limits = host_memory_limits() if have is not None else {}
    if not limits or min(limits.values()) != have:
        limits = {}
    wanted = f" asking for {asked:,} bytes ({gib(asked)})" if asked else ""
    detail = f" ({exc})" if str(exc) and not asked else ""
    out = InsufficientMemory(
        f"{what} ran out of {where}{wanted}{detail}"
        + (f"; {have:,} bytes ({gib(have)}) were available{_binding(limits)}" if have is not None else "")
        + f"; {_advice(advice, limits)}",
        needed=asked, available=have, where=where,
    )
    out.__cause__ = exc
    return out


@contextlib.contextmanager
def translating_memory_errors(what: str, *, advice: str = DEFAULT_ADVICE) -> Iterator[None]:
    """Run a block that allocates; a ``MemoryError`` in it leaves as InsufficientMemory."""
    try:
        yield
    except MemoryError as exc:
        raise as_insufficient(exc, what, advice=advice) from exc


def return_freed_memory() -> bool:
    """Hand memory freed inside the C heap back to the system (glibc's ``malloc_trim``).

    NumPy's arrays of a few MiB come from the heap, and glibc returns freed heap memory
    to the system only from its top: arrays released in the middle (a Model's float
    weights once their int8 copies exist) stay resident until trimmed. False where
    there is no glibc (nothing to do, or no way to do it)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


# What a user loading a model with widened weights can change.
LOAD_ADVICE = (
    "free some memory, or use a smaller model (one with fewer parameters), or, for a model file, keep its "
    "weights in the file's own format (load_model(..., dtype=None), the default: memory-mapped, nothing widened)"
)


def check_weights_fit(config, dtype, what: str) -> None:
    """Refuse (before allocating) a model's weights (``config``: a ModelConfig, in
    ``dtype``, a NumPy dtype) that would not fit in available memory."""
    import numpy as np

    check_fits(what, {f"its {np.dtype(dtype)} weights": config.num_parameters() * np.dtype(dtype).itemsize},
               advice=LOAD_ADVICE)
