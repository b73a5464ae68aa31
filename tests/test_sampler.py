"""The reference sampler against its specification (docs/design.md, "Sampling").

Support and penalty checks use a plain-Python implementation written here from the
specification, independently of the NumPy code. Statistical tests use fixed seeds, so
they are deterministic; their docstrings state the probability that an ideal sampler
would fail them.
"""

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from polyengine.errors import InvalidRequest
from polyengine.sampling import (
    RowState,
    SamplingParams,
    filtered_probs,
    gumbel,
    process_logits,
    raw_logprobs,
    sample,
)
from polyengine.sampling.sampler import _top_p_keep

stats = pytest.importorskip("scipy.stats")

EOS = (1,)
ALPHA = 1e-6  # false-failure probability of each statistical assertion


def make_row(step=0, sample_index=0, prompt=(), completion=(), **params):
    params.setdefault("seed", 1234)
    return RowState(
        params=SamplingParams.create(**params),
        sample_index=sample_index,
        step=step,
        prompt_tokens=np.asarray(prompt),
        completion_tokens=np.asarray(completion),
    )


def normal_logits(seed, vocab, scale=2.0):
    return np.random.default_rng(seed).normal(size=vocab) * scale


# -- an independent, plain-Python statement of the semantics ---------------------------


def spec_logits(logits, row, eos):
    """Steps 1-2 with Python floats."""
    p = row.params
    x = [float(v) for v in logits]
    for tok, bias in p.logit_bias.items():
        x[tok] += bias
    if row.step < p.min_tokens:
        masked = set(eos) | set(p.stop_token_ids)
    elif p.ignore_eos:
        masked = set(eos)
    else:
        masked = set()
    for tok in masked:
        x[tok] = -math.inf
    for tok in set(row.prompt_tokens.tolist()) | set(row.completion_tokens.tolist()):
        if p.repetition_penalty != 1.0:
            x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok, count in Counter(row.completion_tokens.tolist()).items():
        x[tok] -= p.presence_penalty + p.frequency_penalty * count
    return x


def spec_argmax(values):
    best = max(values)
    return min(i for i, v in enumerate(values) if v == best)


def spec_support(logits, row, eos, slack):
    """The kept token set; ``slack`` > 0 loosens the top_p/min_p thresholds, < 0 tightens
    them (so float rounding at a boundary cannot make the comparison flaky)."""
    p = row.params
    x = spec_logits(logits, row, eos)
    if p.temperature == 0:
        return {spec_argmax(x)}
    z = [v / p.temperature for v in x]
    top = max(z)
    w = [math.exp(v - top) for v in z]
    alive = [i for i in range(len(z)) if z[i] > -math.inf]
    order = sorted(alive, key=lambda i: (-z[i], i))  # highest first, ties lower id first
    if 0 < p.top_k < len(z):
        order = order[: p.top_k]
    if p.top_p < 1.0:
        total = sum(w[i] for i in order)
        target, cum, n = p.top_p + slack, 0.0, len(order)
        for j, i in enumerate(order):
            cum += w[i] / total
            if cum >= target:
                n = j + 1
                break
        order = order[:n]
    if p.min_p > 0:
        wmax = max(w[i] for i in order)
        order = [i for i in order if w[i] >= p.min_p * (1 - slack) * wmax]
    return set(order)


# -- strategies ------------------------------------------------------------------------

seeds = st.integers(0, 2**64 - 1)


@st.composite
def sampling_cases(draw):
    vocab = draw(st.integers(2, 48))
    logits = normal_logits(draw(st.integers(0, 2**32 - 1)), vocab, draw(st.floats(0.1, 4.0)))
    params = dict(
        seed=draw(seeds),
        temperature=draw(st.one_of(st.just(0.0), st.floats(0.05, 3.0))),
        top_k=draw(st.integers(0, vocab + 2)),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0.05, 1.0))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 0.95))),
        repetition_penalty=draw(st.one_of(st.just(1.0), st.floats(0.5, 2.0))),
        presence_penalty=draw(st.floats(-2.0, 2.0)),
        frequency_penalty=draw(st.floats(-2.0, 2.0)),
    )
    completion = draw(st.lists(st.integers(0, vocab - 1), max_size=8))
    row = make_row(
        step=len(completion),
        sample_index=draw(st.integers(0, 4095)),
        prompt=draw(st.lists(st.integers(0, vocab - 1), max_size=8)),
        completion=completion,
        **params,
    )
    return logits, row


# -- properties ------------------------------------------------------------------------


@given(sampling_cases())
def test_never_outside_the_kept_set(case):
    logits, row = case
    eos = (0,)
    token = int(sample(logits[None], [row], eos).tokens[0])
    loose = spec_support(logits, row, eos, slack=1e-9)
    strict = spec_support(logits, row, eos, slack=-1e-9)
    assert token in loose
    if row.params.temperature == 0:
        support = set(np.flatnonzero(filtered_probs(logits, row, eos)).tolist())
    else:  # not filtered_probs: a kept token's probability may underflow to 0
        support = set(np.flatnonzero(process_logits(logits, row, eos) > -np.inf).tolist())
    assert strict <= support <= loose
    assert math.isclose(filtered_probs(logits, row, eos).sum(), 1.0, rel_tol=1e-12)


@given(sampling_cases())
def test_draw_is_gumbel_max_over_the_filtered_log_probs(case):
    logits, row = case
    token = int(sample(logits[None], [row], EOS).tokens[0])
    logp = process_logits(logits, row, EOS)
    if row.params.temperature == 0:
        assert token == spec_argmax(logp.tolist())
    else:
        g = gumbel(row.params.seed, np.arange(logits.size), row.step, row.sample_index)
        assert token == spec_argmax((logp + g).tolist())


@given(sampling_cases(), st.integers(0, 2**32 - 1))
def test_same_seed_same_token_whatever_the_neighbours(case, other_seed):
    logits, row = case
    alone = int(sample(logits[None], [row], EOS).tokens[0])
    again = int(sample(logits[None], [row], EOS).tokens[0])
    neighbour = make_row(seed=other_seed, temperature=0.7, top_k=3)
    noise = normal_logits(other_seed, logits.size)
    batch = sample(np.stack([noise, logits, noise]), [neighbour, row, neighbour], EOS)
    assert alone == again == int(batch.tokens[1])


@given(st.integers(0, 2**32 - 1), st.integers(2, 40), seeds)
def test_temperature_zero_is_argmax_with_ties_to_lowest_id(logit_seed, vocab, seed):
    # Small integers make exact ties common.
    logits = np.random.default_rng(logit_seed).integers(-2, 3, size=vocab).astype(np.float32)
    row = make_row(seed=seed, temperature=0.0)
    out = sample(logits[None], [row], EOS)
    assert int(out.tokens[0]) == spec_argmax(logits.tolist())
    probs = filtered_probs(logits, row, EOS)
    assert probs[spec_argmax(logits.tolist())] == 1.0 and probs.sum() == 1.0


@given(sampling_cases())
def test_top_k_one_is_greedy(case):
    logits, row = case
    p = row.params
    assume(p.temperature > 0)
    one = RowState(p.replace(top_k=1), row.sample_index, row.step, row.prompt_tokens, row.completion_tokens)
    greedy = RowState(p.replace(temperature=0.0), row.sample_index, row.step, row.prompt_tokens, row.completion_tokens)
    assert sample(logits[None], [one], EOS).tokens[0] == sample(logits[None], [greedy], EOS).tokens[0]


@given(st.integers(0, 2**32 - 1), st.integers(2, 40), st.integers(1, 41), seeds)
def test_top_k_ties_go_to_the_lower_id(logit_seed, vocab, k, seed):
    logits = np.random.default_rng(logit_seed).integers(-2, 3, size=vocab).astype(np.float64)
    row = make_row(seed=seed, top_k=k)
    kept = set(np.flatnonzero(np.isfinite(process_logits(logits, row, EOS))).tolist())
    expected = set(sorted(range(vocab), key=lambda i: (-logits[i], i))[:k])
    assert kept == expected


@given(sampling_cases())
def test_penalties_and_bias_follow_their_definitions(case):
    logits, row = case
    vocab = logits.size
    rng = np.random.default_rng(row.params.seed % 2**32)
    bias = {int(t): float(b) for t, b in zip(rng.integers(0, vocab, 3), rng.uniform(-5, 5, 3))}
    row.params = row.params.replace(temperature=0.0, logit_bias=bias)
    got = process_logits(logits, row, EOS)
    np.testing.assert_allclose(got, spec_logits(logits, row, EOS), rtol=1e-12, atol=1e-12)


def test_each_penalty_moves_the_right_tokens():
    logits = np.array([2.0, -2.0, 1.0, -1.0, 0.5])
    rep = process_logits(logits, make_row(temperature=0, repetition_penalty=2.0, prompt=[0, 1], completion=[1, 1]), EOS)
    np.testing.assert_array_equal(rep, [1.0, -4.0, 1.0, -1.0, 0.5])  # seen once or thrice: same
    pres = process_logits(logits, make_row(temperature=0, presence_penalty=0.5, prompt=[4], completion=[2, 2, 3]), EOS)
    np.testing.assert_array_equal(pres, [2.0, -2.0, 0.5, -1.5, 0.5])  # the prompt does not count
    freq = process_logits(logits, make_row(temperature=0, frequency_penalty=0.5, prompt=[4], completion=[2, 2, 3]), EOS)
    np.testing.assert_array_equal(freq, [2.0, -2.0, 0.0, -1.5, 0.5])
    bias = process_logits(logits, make_row(temperature=0, logit_bias={4: 3.0, 0: -1.0}), EOS)
    np.testing.assert_array_equal(bias, [1.0, -2.0, 1.0, -1.0, 3.5])
    assert sample(logits[None], [make_row(temperature=0, logit_bias={4: 3.0})], EOS).tokens[0] == 4


@given(st.integers(0, 6), seeds, st.floats(0.1, 2.0))
def test_min_tokens_masks_eos_and_stop_ids(min_tokens, seed, temperature):
    eos, stop = (5,), 4
    # EOS and the stop id lead the rest by 70 nats at temperature 2, more than any
    # Gumbel difference the stream can produce (about 20), so once unmasked one of them wins.
    logits = np.array([0.0, 0.1, 0.2, 0.3, 140.0, 150.0])
    for step in range(8):
        row = make_row(step=step, seed=seed, temperature=temperature, min_tokens=min_tokens,
                       stop_token_ids=[stop], completion=[0] * step)
        token = int(sample(logits[None], [row], eos).tokens[0])
        if step < min_tokens:
            assert token not in (stop, eos[0])
            assert filtered_probs(logits, row, eos)[[stop, eos[0]]].sum() == 0.0
        else:
            assert token in (stop, eos[0])


@given(st.integers(0, 8), seeds)
def test_ignore_eos_masks_eos_only(step, seed):
    logits = np.array([0.0, 0.1, 30.0, 40.0])
    eos = (3,)
    row = make_row(step=step, seed=seed, temperature=0.0, ignore_eos=True, stop_token_ids=[2])
    assert int(sample(logits[None], [row], eos).tokens[0]) == 2  # the stop id is still allowed
    assert process_logits(logits, row, eos)[3] == -np.inf


def test_filter_boundaries_and_ties():
    logits = np.array([1.0, 1.0, 0.0, 1.0])
    # min_p = 1 keeps exactly the tokens tied at the maximum probability.
    kept = np.isfinite(process_logits(logits, make_row(min_p=1.0), EOS))
    assert kept.tolist() == [True, True, False, True]
    # Four equal tokens: top_p = 0.4 needs two of them, the lower ids. (Not 0.5: whether
    # exp(-log 4) sums to exactly 0.5 depends on the platform's exp and log.)
    flat = process_logits(np.zeros(4), make_row(top_p=0.4), EOS)
    assert np.isfinite(flat).tolist() == [True, True, False, False]
    np.testing.assert_allclose(np.exp(flat[:2]), [0.5, 0.5])


def test_reported_logprobs_are_raw_and_top_logprobs_ordered_and_padded():
    logits = np.array([[1.0, 3.0, 3.0, 0.0, 2.0], [0.0, 0.0, 5.0, 1.0, 1.0], [0.5, 0.4, 0.3, 0.2, 0.1]])
    rows = [
        make_row(temperature=0, logprobs=True, top_logprobs=3, repetition_penalty=3.0, prompt=[1, 2]),
        make_row(temperature=0.8, logprobs=True, top_logprobs=1, seed=9),
        make_row(temperature=0),
    ]
    out = sample(logits, rows, EOS)
    raw = raw_logprobs(logits)
    assert out.tokens.dtype == np.int32 and out.logprobs.dtype == np.float32
    assert out.top_ids.dtype == np.int32 and out.top_logprobs.dtype == np.float32
    assert out.top_ids.shape == out.top_logprobs.shape == (3, 3)
    # Penalties steer the choice (row 0 picks 4) but never the reported log-probs.
    assert out.tokens[0] == 4
    np.testing.assert_allclose(out.logprobs, raw[np.arange(3), out.tokens], rtol=1e-6)
    assert out.top_ids[0].tolist() == [1, 2, 4]  # the tie 1/2 goes to the lower id first
    np.testing.assert_allclose(out.top_logprobs[0], raw[0, [1, 2, 4]], rtol=1e-6)
    assert out.top_ids[1].tolist() == [2, -1, -1]
    assert out.top_logprobs[1, 1:].tolist() == [-np.inf, -np.inf]
    assert out.top_ids[2].tolist() == [-1, -1, -1]
    none = sample(logits, [make_row(temperature=0)] * 3, EOS)
    assert none.top_ids.shape == (3, 0) and none.top_logprobs.shape == (3, 0)


def test_raw_logprobs_is_a_log_softmax():
    x = np.random.default_rng(0).normal(size=(3, 7)) * 50
    lp = raw_logprobs(x)
    assert lp.dtype == np.float64
    np.testing.assert_allclose(np.exp(lp).sum(-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(lp - lp[:, :1], x - x[:, :1], rtol=1e-12, atol=1e-9)


def test_refusals():
    logits = np.zeros((1, 4))
    unseeded = RowState(params=SamplingParams())
    with pytest.raises(InvalidRequest, match="seed"):
        sample(logits, [unseeded], EOS)
    with pytest.raises(InvalidRequest, match="2 row states"):
        sample(logits, [make_row(), make_row()], EOS)
    with pytest.raises(InvalidRequest, match="batch, vocab"):
        sample(np.zeros(4), [make_row()], EOS)
    with pytest.raises(InvalidRequest, match="logit_bias holds token id 9"):
        sample(logits, [make_row(logit_bias={9: 1.0})], EOS)
    with pytest.raises(InvalidRequest, match="stop_token_ids"):
        sample(logits, [make_row(min_tokens=2, stop_token_ids=[7])], EOS)
    with pytest.raises(InvalidRequest, match="every token is masked"):
        sample(np.zeros((1, 2)), [make_row(min_tokens=1, stop_token_ids=[0])], EOS)
    with pytest.raises(InvalidRequest, match="integer token ids"):
        make_row(completion=[0.5])
    with pytest.raises(InvalidRequest, match="step"):
        sample(logits, [make_row(step=2**20)], EOS)


def test_fast_top_p_equals_a_full_sort_on_a_large_vocabulary():
    """The growing-candidates nucleus must equal a full sort's, including when it grows."""
    rng = np.random.default_rng(3)
    for scale, top_p in [(0.05, 0.99), (0.5, 0.9), (3.0, 0.5), (8.0, 0.999)]:
        logp = raw_logprobs(rng.normal(size=49152) * scale)
        logp[rng.integers(0, 49152, 100)] = -np.inf
        alive = np.flatnonzero(logp > -np.inf)
        order = alive[np.lexsort((alive, -logp[alive]))]
        cum = np.cumsum(np.exp(logp[order]))
        n = min(int(np.searchsorted(cum, top_p)) + 1, order.size)
        expected = np.zeros(logp.size, dtype=bool)
        expected[order[:n]] = True
        np.testing.assert_array_equal(_top_p_keep(logp, top_p), expected)


def test_large_vocabulary_row():
    logits = normal_logits(0, 49152, 3.0)[None]
    row = make_row(top_k=40, top_p=0.9, min_p=0.01, repetition_penalty=1.1, frequency_penalty=0.2,
                   prompt=np.arange(200), completion=np.arange(50), step=50, logprobs=True, top_logprobs=5)
    out = sample(logits, [row], (2,))
    token = int(out.tokens[0])
    assert token in spec_support(logits[0], row, (2,), slack=1e-9)


# -- statistics ------------------------------------------------------------------------

FIT_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.6, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05, repetition_penalty=1.5, presence_penalty=0.5,
         frequency_penalty=0.3, logit_bias={3: 2.0}),
]


@pytest.mark.parametrize("params", FIT_CASES)
def test_goodness_of_fit(params):
    """Chi-square of 4000 draws (seeds 0..3999) against ``filtered_probs``.

    For an ideal sampler a random seed set fails with probability ALPHA = 1e-6 per case
    (5e-6 for the five cases); the seeds are fixed, so the outcome is deterministic.
    Bins expected to hold fewer than 5 draws are pooled; zero-probability tokens must
    never be drawn at all.
    """
    vocab, draws = 12, 4000
    logits = normal_logits(42, vocab, 1.5)
    rows = [make_row(seed=s, step=3, sample_index=2, prompt=[0, 5], completion=[3, 3, 7], **params)
            for s in range(draws)]
    probs = filtered_probs(logits, rows[0], EOS)
    counts = np.bincount(sample(np.tile(logits, (draws, 1)), rows, EOS).tokens, minlength=vocab)
    assert counts[probs == 0].sum() == 0
    expected = probs * draws
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(exp) < 2:
        assert counts[big].sum() == draws
        return
    assert stats.chisquare(obs, exp).pvalue > ALPHA


@pytest.mark.parametrize("vary", ["sample_index", "step"])
def test_draws_at_different_positions_are_independent(vary):
    """Two draws per seed (4000 seeds) that differ only in sample_index (or step) must agree
    at the collision rate sum(p**2) of independent draws. Two-sided binomial test; an
    ideal sampler fails it with probability ALPHA = 1e-6."""
    vocab, seeds_n = 8, 4000
    logits = normal_logits(7, vocab, 1.0)
    first = [make_row(seed=s, temperature=1.0) for s in range(seeds_n)]
    second = [make_row(seed=s, temperature=1.0, **{vary: 1}) for s in range(seeds_n)]
    batch = np.tile(logits, (seeds_n, 1))
    a = sample(batch, first, EOS).tokens
    b = sample(batch, second, EOS).tokens
    q = float(np.sum(filtered_probs(logits, first[0], EOS) ** 2))
    agree = int(np.sum(a == b))
    assert stats.binomtest(agree, seeds_n, q).pvalue > ALPHA


def test_tiny_temperatures_pick_the_argmax_not_nan():
    """T -> 0 must approach greedy; dividing unshifted logits by 5e-324 gave NaN and token 0."""
    logits = np.array([[0.5, 3.0, 1.0, 2.9]])
    for temperature in (5e-324, 1e-300, 1e-6):
        for seed in range(5):
            row = RowState(SamplingParams(temperature=temperature, seed=seed))
            assert int(sample(logits, [row], []).tokens[0]) == 1
