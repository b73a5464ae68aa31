"""The few statistics the benchmark reports, and the process's peak resident set.

Rates are always ``count / seconds`` of one run; a metric over several runs is the
median of the per-run values (never the rate of summed counts over summed times, which
would weight slow runs more). Percentiles interpolate linearly between order
statistics (NumPy's default), so the p50 of an even count is the mean of the middle two.
"""

from __future__ import annotations

import math
import resource
from typing import Iterable, Sequence

from polyengine.memory import resident_bytes

__all__ = ["median", "percentile", "rate", "spread", "summary", "peak_rss_bytes", "MIB"]

MIB = 1024 * 1024


def _values(xs: Iterable[float]) -> list[float]:
    vals = sorted(float(x) for x in xs)
    if not vals:
        raise ValueError("no samples")
    if any(math.isnan(v) for v in vals):
        raise ValueError("a sample is NaN")
    return vals


def percentile(xs: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    vals = _values(xs)
    pos = (len(vals) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def median(xs: Iterable[float]) -> float:
    return percentile(xs, 50)


def rate(count: float, seconds: float) -> float:
    """Items per second of one run."""
    if seconds <= 0:
        raise ValueError(f"a rate needs a positive duration, got {seconds} s for {count} items")
    return count / seconds


def spread(xs: Sequence[float]) -> float:
    """(max - min) / median: how far apart the repeats were (0 for a single run)."""
    vals = _values(xs)
    mid = median(vals)
    return 0.0 if mid == 0 else (vals[-1] - vals[0]) / abs(mid)


def summary(xs: Sequence[float]) -> dict[str, float | int | list[float]]:
    """Median, spread and the raw samples, as the JSON report stores every metric."""
    return {"median": median(xs), "spread": spread(xs), "samples": [float(x) for x in xs]}


def peak_rss_bytes() -> int:
    """This process's peak resident set: ``VmHWM`` from /proc, else ``ru_maxrss``."""
    peak = resident_bytes("VmHWM")
    if peak is not None:
        return peak
    # ru_maxrss is in KiB on Linux (bytes on macOS, where /proc does not exist either).
    import sys

    scale = 1 if sys.platform == "darwin" else 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale
