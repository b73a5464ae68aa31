"""The CPU kernels' ISA paths as test parameters: every path runs where this CPU
executes it and is skipped, with the flags it lacks, elsewhere, so CI tests each ISA its
host can run (an AVX-512 host runs the AVX2 and scalar paths too) and says which it
could not. A library is built once per path and shared through the kernel cache."""

from __future__ import annotations

import pytest

from polyengine.hostinfo import missing_for

ISAS = ("auto", "avx512", "avx2", "scalar")  # the cpu backend's option isa (kernels.ISA_CHOICES)


def kernels_for(isa: str, threads: int = 2):
    """The engine's kernels for ISA path ``isa``; skips, saying why, where this CPU cannot
    execute it or no compiler builds it."""
    from polyengine.backends.cpu import kernels as cpu_kernels

    if isa != "auto" and missing_for(isa):
        pytest.skip(f"this CPU cannot execute isa={isa!r}: it lacks {', '.join(missing_for(isa))}")
    try:
        return cpu_kernels.load(threads, isa)
    except cpu_kernels.KernelsUnavailable as exc:
        pytest.skip(f"the CPU kernels cannot be built here: {exc}")
