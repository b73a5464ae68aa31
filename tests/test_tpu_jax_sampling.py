"""The JAX sampler of tpu_jax against the core's reference (NumPy float64).

The stream comes first: JAX's own ``threefry_2x32``, keyed and counted as the core's,
must give the core's uniforms bit for bit (in float64, with x64 on for that test) and
the same 24-bit integers without x64. Then the sampler: random requests (every
parameter visited at its edges) installed in a few rows with random completions, one
step compared with ``polyengine.sampling.sample``. The sampler works in float32, so a
token may differ only where float32 noise can decide, judged as in the torch port's
tests (``tests/test_torch_sampling.py``): the reference's two scores within
``_F32_EPS * (1 + scale)``. Deterministic seeds: nothing here fails by chance.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from polyengine.errors import InvalidRequest  # noqa: E402
from polyengine.sampling import RowState, SamplingParams, gumbel, process_logits, raw_logprobs  # noqa: E402
from polyengine.sampling import sample as reference_sample  # noqa: E402
from polyengine.sampling import threefry as ref_threefry  # noqa: E402
from polyengine.sampling.sampler import _top_ids  # noqa: E402

from polyengine.backends.tpu_jax import sampling as smp  # noqa: E402

_F32_EPS = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _compile_less():
    """The test models are tiny: XLA's optimizations cost more compile time than they
    save at run time (the suite compiles ~20 programs), so they are off here."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)
_VOCAB, _ROWS = 128, 6  # one shape for every sampler test: one compilation
# Jitted once: eager JAX would compile every primitive of a step separately.
_sample = jax.jit(smp.sample, static_argnames=("num_top", "candidates"))
_install, _record, _override = jax.jit(smp.install), jax.jit(smp.record), jax.jit(smp.override)


def _edge_seeds(rng: np.random.Generator, n: int) -> list[int]:
    edges = [0, 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**63, 2**64 - 2, 2**64 - 1]
    return edges + [int(s) for s in rng.integers(0, 2**64, n, dtype=np.uint64)]


def _stream_inputs():
    rng = np.random.default_rng(1)
    seeds = _edge_seeds(rng, 23)  # 32 rows
    steps = [0, 2**20 - 1, 0, 2**20 - 1] + [int(s) for s in rng.integers(0, 2**20, len(seeds) - 4)]
    samples = [0, 4095, 4095, 0] + [int(s) for s in rng.integers(0, 4096, len(seeds) - 4)]
    lo, hi = zip(*(smp.split_seed(s) for s in seeds))
    ctr = smp.counter_hi(jnp.asarray(steps, jnp.int32), jnp.asarray(samples, jnp.int32))
    return seeds, steps, samples, jnp.asarray(lo, jnp.uint32), jnp.asarray(hi, jnp.uint32), ctr


def test_uniforms_equal_the_core_bit_for_bit():
    """Seeds over the full 64-bit range, every id of a 49152 vocabulary, steps and
    sample indices at both ends of their ranges: float64 uniforms identical to the
    core's, and the stream's 24-bit integers identical without x64."""
    vocab = 49152
    seeds, steps, samples, lo, hi, ctr = _stream_inputs()
    ids = jnp.arange(vocab, dtype=jnp.uint32)
    bits = np.asarray(smp.uniform_bits(lo, hi, ids, ctr))  # (32, V) uint32, no x64
    with jax.enable_x64(True):
        u64 = np.asarray(smp.uniforms(lo, hi, ids, ctr, dtype=jnp.float64))
    assert u64.dtype == np.float64
    for row, (seed, step, index) in enumerate(zip(seeds, steps, samples)):
        ref = ref_threefry.uniforms(seed, np.arange(vocab), step, index)
        assert np.array_equal(u64[row], ref), (seed, step, index)
        x0, _ = ref_threefry.threefry2x32(*smp.split_seed(seed), np.arange(vocab), step + (index << 20))
        assert np.array_equal(bits[row], x0 >> 8), (seed, step, index)


def test_gumbel_is_finite_and_close_for_every_uniform():
    """All 2**24 possible uniforms: float32 noise is finite and within 1e-6 of the
    float64 value (a plain float32 u would round the largest to 1.0: +inf noise)."""
    g32 = np.asarray(jax.jit(smp.gumbel_from_bits)(jnp.arange(1 << 24, dtype=jnp.uint32)), np.float64)
    u = (np.arange(1 << 24, dtype=np.float64) + 0.5) * 2.0**-24
    assert np.isfinite(g32).all()
    np.testing.assert_allclose(g32, -np.log(-np.log(u)), rtol=0, atol=1e-6)


def test_argmax_and_top_n_break_ties_to_the_lowest_id():
    x = jnp.asarray([[1.0, 3.0, 3.0, 2.0, 3.0, 2.0], [0.0, -0.0, 0.0, -0.0, 0.0, 0.0], [np.nan] * 6])
    assert smp.argmax_lowest(x).tolist() == [1, 0, 5]  # a NaN row still yields an in-range id
    ids, _ = smp.top_n(x[1:2], 6)
    assert ids.tolist() == [[0, 1, 2, 3, 4, 5]]  # -0.0 and 0.0 are one value
    vals = np.random.default_rng(2).integers(0, 5, (8, 40)).astype(np.float32)  # heavy ties
    for n in (1, 3, 7, 20, 40):
        ids, got = smp.top_n(jnp.asarray(vals), n)
        for r in range(vals.shape[0]):
            want = _top_ids(vals[r].astype(np.float64), n)
            assert np.asarray(ids[r]).tolist() == want.tolist(), (n, r)
            assert np.array_equal(np.asarray(got[r]), vals[r][want])


# -- the sampler against the reference ------------------------------------------------------


def _random_params(rng: np.random.Generator, vocab: int) -> SamplingParams:
    """Each parameter off half of the time, else at an edge or a random value."""
    pick = lambda *xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    kw: dict = {"seed": int(pick(0, 2**32 - 1, 2**32, 2**64 - 1, int(rng.integers(0, 2**64, dtype=np.uint64))))}
    kw["temperature"] = float(pick(0.0, 0.0, 1.0, 0.7, 2.5, 1e-3))
    if rng.random() < 0.5:
        kw["top_k"] = int(pick(1, 2, 5, vocab - 1, vocab, vocab + 10))
    if rng.random() < 0.5:
        kw["top_p"] = float(pick(1e-9, 0.3, 0.9, 0.999, 1.0))
    if rng.random() < 0.4:
        kw["min_p"] = float(pick(1e-6, 0.1, 0.5, 1.0))
    if rng.random() < 0.4:
        kw["repetition_penalty"] = float(pick(0.5, 1.0, 1.3, 100.0))
    if rng.random() < 0.4:
        kw["presence_penalty"] = float(pick(-2.0, 2.0, rng.uniform(-2, 2)))
    if rng.random() < 0.4:
        kw["frequency_penalty"] = float(pick(-2.0, 2.0, rng.uniform(-2, 2)))
    if rng.random() < 0.3:
        ids = [0, vocab - 1, *rng.integers(0, vocab, 2).tolist()]
        kw["logit_bias"] = {int(i): float(pick(-100.0, 100.0, rng.uniform(-5, 5))) for i in ids}
    if rng.random() < 0.3:
        kw["min_tokens"] = int(pick(1, 3, 100))
    if rng.random() < 0.3:
        kw["ignore_eos"] = True
    if rng.random() < 0.3:
        kw["stop_token_ids"] = [0, vocab - 1, int(rng.integers(vocab))]
    if rng.random() < 0.3:
        kw.update(logprobs=True, top_logprobs=int(pick(1, 5, 20)))
    return SamplingParams(**kw)


def _state(rows: list[tuple[SamplingParams, np.ndarray, int]], vocab: int, eos) -> smp.SamplerState:
    """A device state with each (params, prompt, sample index) installed in its row."""
    s = smp.neutral_state(len(rows), jnp.asarray(smp.neutral_rows(1, vocab, eos).eos_mask))
    for r, (params, prompt, index) in enumerate(rows):
        row = smp.request_row(params, prompt, vocab, eos)
        mask = jnp.arange(len(rows)) == r
        s = _install(s, jax.tree_util.tree_map(jnp.asarray, row), mask, jnp.full(len(rows), index, jnp.int32))
    return s


def _random_batch(rng, vocab, rows, eos):
    reqs, ref_rows = [], []
    for _ in range(rows):
        params = _random_params(rng, vocab)
        prompt = rng.integers(0, vocab, int(rng.integers(0, 12)))
        index = int(rng.choice([0, 1, 4095]))
        reqs.append((params, prompt, index))
        ref_rows.append(RowState(params, index, 0, prompt, np.zeros(0, np.int64)))
    state = _state(reqs, vocab, eos)
    for _ in range(int(rng.integers(0, 6))):
        toks = rng.integers(0, vocab, rows)
        state = _record(state, jnp.asarray(toks, jnp.int32), jnp.ones(rows, bool))
        for r, row in enumerate(ref_rows):
            row.completion_tokens = np.append(row.completion_tokens, toks[r])
            row.step += 1
    logits = rng.standard_normal((rows, vocab)) * float(rng.choice([0.5, 3.0, 20.0]))
    logits[:, 5] = logits[:, 9] = logits.max(axis=1)  # exact ties at the top
    logits[:, 2] = logits[:, 3]
    return state, ref_rows, logits.astype(np.float32)


def _loosened(params: SamplingParams, eps: float) -> SamplingParams:
    return params.replace(top_p=min(1.0, params.top_p * (1 + eps) + eps), min_p=max(0.0, params.min_p * (1 - eps) - eps))


def _float32_explains(logits_row: np.ndarray, row: RowState, eos, ours: int, theirs: int) -> bool:
    """Whether float32 noise can turn the reference's ``theirs`` into ``ours`` (the
    torch port's criterion: their float64 scores lie within the bound, counting
    ``ours`` as kept when loosening top-p/min-p by the bound keeps it)."""
    x = process_logits(logits_row, dataclasses.replace(row, params=row.params.replace(temperature=0.0)), eos)
    if row.params.temperature == 0.0:
        scale = np.abs(x[np.isfinite(x)]).max()
        return x[theirs] - x[ours] <= _F32_EPS * (1 + scale)
    loose = dataclasses.replace(row, params=_loosened(row.params, _F32_EPS))
    logp = process_logits(logits_row, loose, eos)
    scale = np.abs(logp[np.isfinite(logp)]).max() + np.abs(x[np.isfinite(x)]).max() / row.params.temperature
    g = gumbel(row.params.seed, np.arange(x.shape[0]), row.step, row.sample_index)
    s = logp + g
    return bool(np.isfinite(s[ours]) and s[theirs] - s[ours] <= _F32_EPS * (1 + scale))


@pytest.mark.parametrize("candidates", [3, 64], ids=["full-sort", "top-k-candidates"])
def test_sampler_equals_the_reference_up_to_float32_noise(candidates):
    """Both filter paths: with 3 candidates nearly every filtering batch sorts the whole
    vocabulary, with 64 most take the bounded path."""
    rng = np.random.default_rng(32)
    vocab, eos = _VOCAB, (0, 5)
    fn = lambda s, x: _sample(s, x, jnp.ones(x.shape[0], bool), num_top=20, candidates=candidates)  # noqa: E731
    differ = total = 0
    for trial in range(30):
        state, rows, logits = _random_batch(rng, vocab, _ROWS, eos)
        ref = reference_sample(logits.astype(np.float64), rows, eos)
        out = fn(state, jnp.asarray(logits))
        raw = raw_logprobs(logits)
        for r, row in enumerate(rows):
            ours, theirs = int(out.tokens[r]), int(ref.tokens[r])
            total += 1
            if ours != theirs:
                differ += 1
                assert _float32_explains(logits[r].astype(np.float64), row, eos, ours, theirs), (trial, r, row.params)
            assert abs(float(out.logprobs[r]) - raw[r, ours]) <= 1e-5 * (1 + abs(raw[r, ours]))
            k = row.params.top_logprobs
            assert k == 0 or _same_tops(raw[r], out, r, k), (trial, r)
    assert differ <= total // 20, f"{differ} of {total} tokens differ"


def _same_tops(raw_row, out, r, k) -> bool:
    """The reference's top ids, except for swaps between log-probs equal within float32
    noise: the reported values, descending, are the k largest."""
    ids = np.asarray(out.top_ids[r, :k])
    if ids.tolist() == _top_ids(raw_row, k).tolist():
        return True
    vals = raw_row[ids]
    return bool(np.all(np.diff(vals) <= 1e-5) and np.all(np.abs(vals - np.sort(raw_row)[::-1][:k]) <= 1e-5))


def test_tiny_temperature_draws_among_tied_maxima_like_the_reference():
    """temperature 1e-30 (below float32's normal range) is not greedy: the draw decides
    between tied maxima, as in the reference."""
    logits = np.zeros((_ROWS, _VOCAB), np.float32)
    logits[:, [7, 11, 30]] = 2.0
    params = [SamplingParams(temperature=1e-30, seed=1000 + r) for r in range(_ROWS)]
    state = _state([(p, np.zeros(0, np.int64), 0) for p in params], _VOCAB, ())
    out = _sample(state, jnp.asarray(logits), jnp.ones(_ROWS, bool), num_top=20, candidates=64)
    ref = reference_sample(logits.astype(np.float64), [RowState(p) for p in params], ())
    assert out.tokens.tolist() == ref.tokens.tolist()
    assert set(ref.tokens.tolist()) - {7}, "the test needs a draw that is not the lowest id"


def test_override_counts_the_forced_token_not_the_sampled_one():
    eos = (1,)
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=1.5, repetition_penalty=1.7, seed=3)
    others = [(SamplingParams(seed=0), np.zeros(0, np.int64), 0)] * (_ROWS - 1)
    state = _state([others[0], (params, np.array([4, 5]), 0), *others[1:]], _VOCAB, eos)
    row = RowState(params, 0, 0, np.array([4, 5]), np.zeros(0, np.int64))
    logits = np.linspace(-1.0, 1.0, _VOCAB, dtype=np.float32)[None].repeat(_ROWS, 0)
    live = jnp.arange(_ROWS) == 1
    for tok, forced in [(127, None), (127, 126), (126, None), (20, 125)]:
        state = _record(state, jnp.full(_ROWS, tok, jnp.int32), live)
        row.completion_tokens = np.append(row.completion_tokens, tok)
        if forced is not None:
            state = _override(state, jnp.full(_ROWS, forced, jnp.int32), live)
            row.completion_tokens[-1] = forced
        row.step = len(row.completion_tokens)
        out = _sample(state, jnp.asarray(logits), live, num_top=20, candidates=64)
        assert int(out.tokens[1]) == int(reference_sample(logits[:1].astype(np.float64), [row], eos).tokens[0])
    assert state.step.tolist() == [0, 4] + [0] * (_ROWS - 2)
    assert np.asarray(state.counts[1]).tolist() == np.bincount(row.completion_tokens, minlength=_VOCAB).tolist()
    assert int(state.last_token[1]) == 125


def test_request_row_refuses_what_a_step_could_not():
    for params, prompt in [
        (SamplingParams(), [1]),  # no seed
        (SamplingParams(seed=1, logit_bias={4: 1.0}), [1]),
        (SamplingParams(seed=1, stop_token_ids=[9]), [1]),
        (SamplingParams(seed=1), [1, 4]),
        (SamplingParams(seed=1, min_tokens=1, stop_token_ids=[2, 3]), []),  # all four masked
    ]:
        with pytest.raises(InvalidRequest):
            smp.request_row(params, prompt, 4, (0, 1))
