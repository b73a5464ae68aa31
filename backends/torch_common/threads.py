"""torch's CPU ops on a given number of threads, for the calling thread alone.

``torch.set_num_threads`` sets one count for the whole process. The prefill lane
(docs/design.md, "The prefill lane") wants its own thread's ops on its share of the
cores while the steps' thread keeps its own. OpenMP's thread count is an internal control
variable of each thread (``nthreads-var``, per data environment), which torch's parallel
ops read through ``omp_get_max_threads``: setting it on the calling thread, through the
OpenMP runtime torch loaded, changes that thread's ops only. A thread that never runs a
parallel region of more than one thread also starts no thread team, so the process keeps
the one team of the steps (see ``on_engine_thread`` in :mod:`.engine` for why that
matters on a small host).

Measured on 2 cores (docs/cpu.md, "The prefill lane"): switching torch's process-wide
count while the lane ran stalled the steps by ~150 ms at a time.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from typing import Iterator

import torch

__all__ = ["own_thread_count"]

# The OpenMP runtimes torch builds link (GNU, LLVM, Intel), by the file names they load as.
_RUNTIMES = ("libgomp", "libomp", "libiomp5")
_runtime: ctypes.CDLL | None | bool = False  # False: not looked up yet


def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (Linux: read from /proc/self/maps), or
    None where there is none to be found."""
    global _runtime
    if _runtime is False:
        _runtime = None
        if sys.platform.startswith("linux"):
            try:
                with open("/proc/self/maps", encoding="utf-8") as maps:
                    paths = sorted({line.split()[-1] for line in maps if "/" in line
                                    and any(name in line.rsplit("/", 1)[-1] for name in _RUNTIMES)})
            except OSError:
                paths = []
            for path in paths:
                try:
                    lib = ctypes.CDLL(path)
                    lib.omp_get_max_threads.restype = ctypes.c_int
                    lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                except (OSError, AttributeError):
                    continue
                _runtime = lib
                break
    return _runtime


@contextlib.contextmanager
def own_thread_count(n: int) -> Iterator[bool]:
    """The calling thread's torch ops on ``n`` threads inside the block, every other
    thread's as they were; yields whether it could (False: no OpenMP runtime found, the
    count left alone)."""
    lib = _openmp()
    if lib is None:
        yield False
        return
    # torch sets a thread's count to its process-wide one at the thread's first parallel
    # op or query: done first here, so that it does not undo the count set below.
    torch.get_num_threads()
    before = lib.omp_get_max_threads()
    lib.omp_set_num_threads(max(1, int(n)))
    try:
        yield True
    finally:
        lib.omp_set_num_threads(before)
