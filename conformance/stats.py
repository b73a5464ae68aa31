"""Statistics for the sampler layer: chi-square goodness of fit and support sets.

Self-contained (NumPy and ``math`` only) so the suite needs no SciPy: the chi-square
survival function is the regularized upper incomplete gamma function, computed by
its series or continued fraction as in Numerical Recipes (section 6.2); the tests
check it against SciPy to 1e-10.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from polyengine.sampling import RowState, SamplingParams, filtered_probs
from polyengine.sampling.masks import unpack_mask

__all__ = [
    "rel_l2", "chi2_sf", "GoodnessOfFit", "goodness_of_fit", "noncentrality", "allowed_tokens", "boundary_tokens",
]

# Categories whose expected count is under this are pooled (Cochran's rule of thumb).
MIN_EXPECTED = 5.0


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    """Relative L2 error ``|got - want| / |want|`` of two flat arrays, in float64."""
    g = np.asarray(got, np.float64).reshape(-1)
    w = np.asarray(want, np.float64).reshape(-1)
    if g.shape != w.shape:
        return float("inf")
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-300))


def _gamma_q(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x)."""
    if x <= 0.0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1.0:  # the series for P converges fast here
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    # Lentz's continued fraction for Q
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return math.exp(log_front) * h


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if not math.isfinite(statistic):
        return 0.0
    return _gamma_q(df / 2.0, statistic / 2.0)


@dataclass(frozen=True)
class GoodnessOfFit:
    statistic: float
    df: int
    p_value: float
    bins: int
    samples: int
    outside: int  # samples that fell on zero-probability tokens
    boundary: int = 0  # samples on boundary tokens, left out of the test (see goodness_of_fit)

    def to_dict(self) -> dict[str, float | int]:
        return {k: getattr(self, k) for k in ("statistic", "df", "p_value", "bins", "samples", "outside", "boundary")}


def _bins(probs: np.ndarray, n: int) -> list[np.ndarray]:
    """The chi-square's bins as groups of token ids: each token with ``n * p >= 5`` on its
    own, the rest of the support pooled into one bin (merged into the smallest bin if
    the pool itself is too small). Shared by the test and its power calculation."""
    big = np.flatnonzero(n * probs >= MIN_EXPECTED)
    groups = [big[i : i + 1] for i in range(big.size)]
    rest = np.flatnonzero((probs > 0) & (n * probs < MIN_EXPECTED))
    if rest.size:
        if n * probs[rest].sum() >= MIN_EXPECTED or not groups:
            groups.append(rest)
        else:
            i = int(np.argmin([probs[g].sum() for g in groups]))
            groups[i] = np.concatenate([groups[i], rest])
    return groups


def goodness_of_fit(tokens: np.ndarray, probs: np.ndarray, exclude: np.ndarray | None = None) -> GoodnessOfFit:
    """Pearson's chi-square of sampled ``tokens`` against the exact ``probs``, binned
    as :func:`_bins` says. A sample on a zero-probability token makes the statistic
    infinite (p = 0).

    ``exclude`` (a boolean mask, e.g. :func:`boundary_tokens`) names tokens a correct
    lower-precision sampler may keep or drop by rounding at a filter boundary. The test
    is then conditional: draws on them are left out, and the rest are judged against
    ``probs`` restricted to the other tokens and renormalised. Whichever way the backend
    decided each boundary token, the remaining draws follow exactly that distribution,
    so the false-failure rate is unchanged; draws on tokens outside both ``probs`` and
    ``exclude`` still fail.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    boundary = 0
    if exclude is not None and exclude.any():
        on_boundary = exclude[tokens]
        boundary = int(on_boundary.sum())
        tokens = tokens[~on_boundary]
        probs = np.where(exclude, 0.0, probs)
        if probs.sum() <= 0:  # every allowed token is a boundary token: nothing left to judge
            return GoodnessOfFit(0.0, 1, 1.0, 0, int(tokens.size), 0, boundary)
        probs = probs / probs.sum()
    n = tokens.size
    counts = np.bincount(tokens, minlength=probs.shape[0]).astype(np.float64)
    outside = int(counts[probs <= 0].sum())
    groups = _bins(probs, n)
    obs_a = np.array([counts[g].sum() for g in groups])
    exp_a = np.array([n * probs[g].sum() for g in groups])
    bins = obs_a.size
    if outside:
        return GoodnessOfFit(float("inf"), max(bins - 1, 1), 0.0, bins, n, outside, boundary)
    if bins < 2:  # a single-token support: the only check is that nothing fell outside
        return GoodnessOfFit(0.0, 1, 1.0, bins, n, 0, boundary)
    stat = float(np.sum((obs_a - exp_a) ** 2 / exp_a))
    df = bins - 1
    return GoodnessOfFit(stat, df, chi2_sf(stat, df), bins, n, 0, boundary)


def noncentrality(probs: np.ndarray, alternative: np.ndarray, n: int) -> float:
    """The noncentrality ``n * sum((q - p)^2 / p)`` of :func:`goodness_of_fit`'s statistic
    for ``n`` draws from ``alternative`` (q) judged against ``probs`` (p), with the same
    bins. The statistic is then about chi-square with that noncentrality: at 100 and up
    to 60 bins, a check at ALPHA = 1e-4 fails with probability about 0.99 or more.
    Infinite when q puts mass where p has none.
    """
    p = np.asarray(probs, np.float64)
    q = np.asarray(alternative, np.float64)
    if np.any(q[p <= 0] > 0):
        return float("inf")
    groups = _bins(p, n)
    pa = np.array([p[g].sum() for g in groups])
    qa = np.array([q[g].sum() for g in groups])
    return float(n * np.sum((qa - pa) ** 2 / pa))


def _moved(row: RowState, top_p: float, min_p: float) -> RowState:
    p = row.params
    moved = SamplingParams.model_construct(**{
        **p.model_dump(),
        "top_p": min(1.0, max(1e-12, top_p)) if p.top_p < 1.0 else 1.0,
        "min_p": min(1.0, max(0.0, min_p)) if p.min_p > 0.0 else 0.0,
    })
    return RowState(moved, row.sample_index, row.step, row.prompt_tokens, row.completion_tokens, row.token_mask)


def _top_k_near_tie(logits: np.ndarray, row: RowState, slack: float) -> np.ndarray:
    """Tokens that may swap places across the top-k boundary by rounding: those within
    ``slack`` (relative) of the k-th value, when the k-th and (k+1)-th are that close."""
    p = row.params
    near = np.zeros(logits.shape[0], bool)
    if 0 < p.top_k < logits.shape[0]:
        x = np.asarray(logits, np.float64) / (p.temperature or 1.0)
        if row.token_mask is not None:  # the k-th among the ids the mask allows
            x = np.where(unpack_mask(row.token_mask, x.shape[0]), x, -np.inf)
        v = np.sort(x)[::-1]
        band = 2 * slack * max(1.0, abs(v[p.top_k - 1]))
        if v[p.top_k - 1] - v[p.top_k] <= band:
            near = np.abs(x - v[p.top_k - 1]) <= band
    return near


def allowed_tokens(
    logits: np.ndarray, row: RowState, eos_token_ids, slack: float
) -> tuple[np.ndarray, np.ndarray]:
    """The token sets a sample may come from: ``(strict, lenient)`` boolean masks.

    ``strict`` is the float64 top-k/top-p/min-p set of the core sampler. ``lenient``
    moves each boundary outwards by ``slack`` (top-p mass + slack, min-p ratio - slack,
    and the tokens near-tied with the k-th value), so a token a lower-precision sampler
    may legitimately keep by rounding is not called a violation; such tokens are
    reported as boundary cases.
    """
    p = row.params
    strict = filtered_probs(logits, row, eos_token_ids) > 0
    if p.temperature == 0.0:
        return strict, strict
    lenient = filtered_probs(logits, _moved(row, p.top_p + slack, p.min_p - slack), eos_token_ids) > 0
    return strict, lenient | strict | _top_k_near_tie(logits, row, slack)


def boundary_tokens(logits: np.ndarray, row: RowState, eos_token_ids, slack: float) -> np.ndarray:
    """Tokens whose membership in the top-k/top-p/min-p set may flip when each boundary
    moves by ``slack`` either way: the lenient set (:func:`allowed_tokens`) minus the
    set of the tightened filters (top-p mass - slack, min-p ratio + slack, without the
    tokens near-tied with the k-th). Empty when the request filters nothing."""
    p = row.params
    if p.temperature == 0.0 or (p.top_k == 0 and p.top_p >= 1.0 and p.min_p == 0.0):
        return np.zeros(np.asarray(logits).shape[0], bool)
    _, lenient = allowed_tokens(logits, row, eos_token_ids, slack)
    inner = filtered_probs(logits, _moved(row, p.top_p - slack, p.min_p + slack), eos_token_ids) > 0
    return lenient & ~(inner & ~_top_k_near_tie(logits, row, slack))
