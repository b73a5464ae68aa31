"""The sampler layer's statistics: chi-square tail, goodness of fit, support sets."""

from __future__ import annotations

import numpy as np
import pytest

from polyengine.sampling import RowState, SamplingParams, filtered_probs

from polyengine.conformance.cli import scoreboard
from polyengine.conformance.pytest_plugin import format_table
from polyengine.conformance.stats import allowed_tokens, chi2_sf, goodness_of_fit, rel_l2


@pytest.mark.parametrize("df", [1, 2, 5, 17, 31, 120])
def test_chi2_sf_matches_scipy(df):
    stats = pytest.importorskip("scipy.stats")
    for x in (0.0, 0.01, 0.5, df * 0.5, df, df + 3.0, 2.0 * df + 10.0, 5.0 * df + 60.0):
        assert chi2_sf(x, df) == pytest.approx(stats.chi2.sf(x, df), rel=1e-9, abs=1e-15)
    assert chi2_sf(float("inf"), df) == 0.0


def _probs(n=40, seed=0):
    p = np.random.default_rng(seed).dirichlet(np.ones(n) * 0.7)
    p[3] = 0.0  # a token outside the support
    return p / p.sum()


def test_goodness_of_fit_accepts_the_true_distribution():
    """False-failure probability: 1e-3 (the threshold), fixed seed: deterministic."""
    p = _probs()
    draws = np.random.default_rng(1).choice(p.size, size=2000, p=p)
    fit = goodness_of_fit(draws, p)
    assert fit.p_value > 1e-3 and fit.outside == 0 and fit.bins >= 10


def test_goodness_of_fit_rejects_a_tempered_distribution():
    p = _probs()
    wrong = p ** 0.7 / np.sum(p ** 0.7)  # what ignoring temperature 0.7 looks like
    draws = np.random.default_rng(2).choice(p.size, size=2000, p=wrong)
    assert goodness_of_fit(draws, p).p_value < 1e-4


def test_goodness_of_fit_flags_zero_probability_draws():
    p = _probs()
    fit = goodness_of_fit(np.array([0, 1, 3, 3]), p)
    assert fit.outside == 2 and fit.p_value == 0.0


def test_allowed_tokens_lenient_only_at_the_boundary():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    row = RowState(SamplingParams(top_p=0.7, seed=0))
    strict, lenient = allowed_tokens(logits, row, (), slack=1e-9)
    # token 2 sits where 0.4 + 0.3 meets top_p=0.7 (kept or not by rounding); token 3 never is
    assert strict[:2].all() and not strict[3] and not lenient[3]
    assert (filtered_probs(logits, row, ()) > 0).tolist() == strict.tolist()
    strict_k, lenient_k = allowed_tokens(logits, RowState(SamplingParams(top_k=2, seed=0)), (), slack=1e-6)
    assert strict_k.tolist() == lenient_k.tolist() == [True, True, False, False]


def test_rel_l2():
    assert rel_l2([1.0, 0.0], [1.0, 0.0]) == 0.0
    assert rel_l2([1.0, 1.0], [1.0, 0.0]) == pytest.approx(1.0)
    assert rel_l2([1.0], [1.0, 2.0]) == float("inf")


def test_tables():
    summary = {"surface": {"passed": 4, "failed": 0, "xfailed": 0, "skipped": 0},
               "numerics": {"passed": 1, "failed": 1, "xfailed": 1, "skipped": 2}}
    rows = format_table(summary)
    assert rows[0].split() == ["layer", "passed", "failed", "xfailed", "skipped"]
    assert rows[-1].split() == ["total", "5", "1", "1", "2"]
    report = {"backend": "x", "summary": summary, "tests": [
        {"id": "test_a", "layer": "surface", "status": "passed"},
        {"id": "test_b[m-float16]", "layer": "numerics", "status": "failed"},
    ]}
    board = scoreboard([report, {**report, "backend": "y", "tests": report["tests"][:1]}], [("z", "unavailable: no GPU")])
    assert "| `test_b[m-float16]` | numerics | **FAIL** | - |" in board
    assert "not run: `z`: unavailable: no GPU" in board
