"""The core's readers of this process's resident memory (``polyengine.memory``), which
the benches (``benchmarks/stats.py``, ``benchmarks/scripts/phase_rss.py``, the cpu
backend's ``long_prefill``) share: the peak sees an allocation that is gone, and a
reset brings it back to what is resident now."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from polyengine.memory import reset_peak_resident, resident_bytes

MIB = 1 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_peak_sees_a_freed_allocation_until_it_is_reset():
    # A map of its own, not the heap: whatever allocator the process runs (other tests'
    # libraries load theirs), unmapping it gives its pages back at once.
    block = mmap.mmap(-1, 256 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = np.frombuffer(block, dtype=np.uint8)
    view[:] = 1  # every page written: resident
    held = resident_bytes("VmRSS")
    del view
    block.close()
    after = resident_bytes("VmRSS")
    assert held - after > 192 * MIB, (held, after)
    assert resident_bytes("VmHWM") > held - 16 * MIB  # the kernel's counters lag by a few pages
    assert reset_peak_resident()
    peak = resident_bytes("VmHWM")
    assert peak < held - 128 * MIB, (peak, held)
    assert abs(peak - resident_bytes("VmRSS")) < 64 * MIB


def test_without_proc_the_readers_say_so(monkeypatch):
    import builtins

    real_open = builtins.open

    def no_proc(path, *a, **k):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", no_proc)
    assert resident_bytes("VmRSS") is None
    assert reset_peak_resident() is False
