"""XLA:CPU's instruction scheduler for this backend's programs: the memory-minimizing one.

XLA:CPU's concurrency-optimized scheduler (the default of jaxlib 0.10) orders a program's
independent work early so that its thunks can run side by side. A matrix kept in a
file's blocks (:mod:`.quantize`) is dequantized inside the step from parameters alone, so
that scheduler dequantized every matrix of the model before the first layer ran, each
into a buffer of its own: a float32 copy of the whole model for the length of every step
(the decode program of a 1B Q4_0 file held 4.6 GiB of temporaries, peak RSS 6.3 GiB
against 2.7 GiB steady; docs/tpu_jax.md, "Quantized weights"). The memory-minimizing
scheduler (``--xla_cpu_enable_concurrency_optimized_scheduler=false``) dequantizes each
matrix where it is used.

The option is read once, from ``XLA_FLAGS``, when JAX creates its CPU client; jaxlib 0.10
ignores it as a per-program ``compiler_options`` entry (tried: the same 4.6 GiB). So
:func:`prefer_memory_scheduler` appends the flag to ``XLA_FLAGS`` when this backend's
programs are first imported, unless

- ``XLA_FLAGS`` already names the option (the user's choice stands),
- JAX's backends already exist (too late to change; nothing is touched), or
- this jaxlib does not know the flag (XLA stops a process whose ``XLA_FLAGS`` names an
  unknown flag, so its name is looked for in jaxlib's libraries first).

It applies to the whole process (every JAX program compiled for the CPU afterwards) and
to the processes it starts (Ray workers inherit ``XLA_FLAGS``). On a TPU or GPU the
option is inert: it is an XLA:CPU option.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

__all__ = ["OPTION", "FLAG", "prefer_memory_scheduler", "jaxlib_knows"]

OPTION = "xla_cpu_enable_concurrency_optimized_scheduler"
FLAG = f"--{OPTION}=false"
_MIN_LIBRARY_BYTES = 1 << 20  # jaxlib's small .so files are stubs that load the big one


def jaxlib_knows(option: str) -> bool:
    """Whether one of jaxlib's libraries holds ``option``'s name (XLA registers each
    flag by name, so a jaxlib without the name has no such flag)."""
    import jaxlib

    needle = option.encode()
    for lib in sorted(Path(jaxlib.__file__).parent.glob("*.so")):
        if lib.stat().st_size < _MIN_LIBRARY_BYTES:
            continue
        with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(needle) >= 0:
                return True
    return False


def prefer_memory_scheduler() -> str:
    """Append :data:`FLAG` to ``XLA_FLAGS`` where it can still take effect (see the module
    docstring). Returns what happened: ``"set"``, ``"user"`` (XLA_FLAGS names the option
    already), ``"late"`` (JAX's backends exist) or ``"unknown"`` (not in this jaxlib)."""
    current = os.environ.get("XLA_FLAGS", "")
    if OPTION in current:
        return "user"
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return "late"
    if not jaxlib_knows(OPTION):
        return "unknown"
    os.environ["XLA_FLAGS"] = f"{current} {FLAG}".strip()
    return "set"
