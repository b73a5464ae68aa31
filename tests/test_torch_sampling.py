"""The torch sampler and Threefry port against the core's reference (NumPy float64).

The Threefry tests come first: everything else draws from that stream. Sampler tests
install random requests (every parameter visited at its edges) in a few rows, record
random completions, and compare one step with ``polyengine.sampling.sample``:

- float64: tokens and top log-prob ids equal exactly, log-probs to 1e-12.
- float32: a token may differ only where float32 noise can decide, which
  :func:`_float32_explains` checks against the float64 reference with the bound
  ``_F32_EPS * (1 + scale)``, ``scale`` the largest finite processed logit magnitude
  (float32 carries ~7 digits, so each score is good to a few 1e-7 of its scale; the
  bound leaves an order of magnitude of margin).

Everything is deterministic (fixed seeds): no test here fails by chance.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from polyengine.errors import InvalidRequest
from polyengine.sampling import RowState, SamplingParams, gumbel, process_logits, raw_logprobs
from polyengine.sampling import sample as reference_sample
from polyengine.sampling import threefry as ref_threefry
from polyengine.sampling.sampler import _top_ids

from polyengine.backends.torch_common import threefry
from polyengine.backends.torch_common.sampling import (
    SamplerFlags,
    TorchSampler,
    argmax_lowest,
    sample,
    top_n,
)

_F32_EPS = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """These tensors are tiny: a second thread gains nothing, and on a shared two-core
    machine every parallel op can wait ~20 ms at a barrier for a descheduled thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- Threefry: bit for bit ------------------------------------------------------------------


def _edge_seeds(rng: np.random.Generator, n: int) -> list[int]:
    edges = [0, 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**63, 2**64 - 2, 2**64 - 1]
    return edges + [int(s) for s in rng.integers(0, 2**64, n, dtype=np.uint64)]


@pytest.mark.parametrize("int64", [False, True], ids=["int32", "int64"])
def test_threefry_words_equal_reference(int64):
    rng = np.random.default_rng(0)
    words = [rng.integers(0, 2**32, 20000, dtype=np.int64) for _ in range(4)]
    for w in words:
        w[:4] = [0, 1, 2**31, 2**32 - 1]  # the words' edges, in every position
    ref0, ref1 = ref_threefry.threefry2x32(*words)
    fn = threefry.threefry2x32_int64 if int64 else threefry.threefry2x32
    y0, y1 = fn(*(torch.from_numpy(w) for w in words))
    mask = (1 << 32) - 1
    assert np.array_equal(y0.numpy().astype(np.int64) & mask, ref0.astype(np.int64))
    assert np.array_equal(y1.numpy().astype(np.int64) & mask, ref1.astype(np.int64))


def test_uniforms_equal_reference_bit_for_bit():
    """Seeds over the full 64-bit range, every token id of a 49152 vocabulary (0 and
    vocab-1 included), steps and sample indices at both ends of their ranges."""
    rng = np.random.default_rng(1)
    seeds = _edge_seeds(rng, 23)  # 32 rows
    steps = [0, 2**20 - 1, 0, 2**20 - 1] + [int(s) for s in rng.integers(0, 2**20, len(seeds) - 4)]
    samples = [0, 4095, 4095, 0] + [int(s) for s in rng.integers(0, 4096, len(seeds) - 4)]
    vocab = 49152
    lo, hi = zip(*(threefry.split_seed(s) for s in seeds))
    col = lambda xs: torch.tensor(xs, dtype=torch.int64)[:, None]  # noqa: E731
    ctr = threefry.counter_hi(col(steps), col(samples))
    ids = torch.arange(vocab)[None, :]
    u64 = threefry.uniforms(col(lo), col(hi), ids, ctr, dtype=torch.float64).numpy()  # (32, V)
    u32 = threefry.uniforms(col(lo), col(hi), ids, ctr, dtype=torch.float32).numpy()
    for row, (seed, step, index) in enumerate(zip(seeds, steps, samples)):
        ref = ref_threefry.uniforms(seed, np.arange(vocab), step, index)
        assert np.array_equal(u64[row], ref), (seed, step, index)
        # float32: the same bits as rounding the exact value (both round to nearest even).
        assert np.array_equal(u32[row], ref.astype(np.float32)), (seed, step, index)


def test_gumbel_float32_is_finite_and_close_for_every_uniform():
    """All 2**24 possible uniforms: float32 noise is finite (a plain float32 u would
    round the largest to 1.0, i.e. +inf noise) and within 1e-6 of the float64 value."""
    for chunk in range(4):
        m = torch.arange(chunk << 22, (chunk + 1) << 22, dtype=torch.int32)
        g32 = threefry.gumbel_from_bits(m, torch.float32).double().numpy()
        u = (m.numpy().astype(np.float64) + 0.5) * 2.0**-24
        ref = -np.log(-np.log(u))
        assert np.isfinite(g32).all()
        np.testing.assert_allclose(g32, ref, rtol=0, atol=1e-6)


def test_gumbel_float64_matches_reference():
    seed = 2**64 - 1
    lo, hi = threefry.split_seed(seed)
    ctr = threefry.counter_hi(torch.tensor([[7]]), torch.tensor([[4095]]))
    g = threefry.gumbel(torch.tensor([[lo]]), torch.tensor([[hi]]), torch.arange(4096)[None], ctr, dtype=torch.float64)
    # Same formula on the same exact u; only the log implementations may differ by an ulp.
    np.testing.assert_allclose(g[0].numpy(), gumbel(seed, np.arange(4096), 7, 4095), rtol=1e-15, atol=1e-15)


# -- primitives -----------------------------------------------------------------------------------


def test_argmax_and_top_n_break_ties_to_the_lowest_id():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [float("nan")] * 6])
    assert argmax_lowest(x).tolist() == [1, 0, 5]  # a NaN row still yields an in-range id
    rng = np.random.default_rng(2)
    vals = rng.integers(0, 5, (8, 40)).astype(np.float64)  # heavy ties
    vals[0] = 1.0
    for n in (1, 3, 7, 20, 40):
        ids, got = top_n(torch.from_numpy(vals), n)
        for r in range(vals.shape[0]):
            want = _top_ids(vals[r], n)
            assert ids[r].tolist() == want.tolist(), (n, r)
            assert np.array_equal(got[r].numpy(), vals[r][want])


def test_flags_follow_the_installed_requests():
    flags = SamplerFlags.of([SamplingParams(temperature=0, top_k=5, top_p=0.5)], 100)
    assert not flags.sampling and not flags.top_k and not flags.top_p  # greedy rows filter nothing
    flags = SamplerFlags.of([SamplingParams(top_k=50, top_p=0.9), SamplingParams(top_k=20)], 100)
    assert flags.candidates == 50 and flags.greedy is False
    flags = SamplerFlags.of([SamplingParams(top_k=50), SamplingParams(top_p=0.9)], 100)
    assert flags.candidates is None  # a top-p row without top-k needs the whole order
    assert SamplerFlags.of([], 100) == SamplerFlags(
        greedy=False, sampling=False, bias=False, eos_mask=False, repetition=False,
        presence_frequency=False, top_k=False, top_p=False, min_p=False, logprobs=False, candidates=None,
    )


# -- the sampler against the reference --------------------------------------------------------


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


def _random_batch(rng, vocab, rows, eos, dtype):
    """A sampler with random requests and completions, the matching reference rows,
    and logits with exact ties and negative values on seen tokens."""
    sampler = TorchSampler(vocab, rows, eos, dtype=dtype)
    ref_rows = []
    for r in range(rows):
        params = _random_params(rng, vocab)
        prompt = rng.integers(0, vocab, int(rng.integers(0, 12)))
        index = int(rng.choice([0, 1, 4095]))
        sampler.install(r, params, prompt, sample_index=index)
        ref_rows.append(RowState(params, index, 0, prompt, np.zeros(0, np.int64)))
    for _ in range(int(rng.integers(0, 6))):
        toks = rng.integers(0, vocab, rows)
        sampler.record(torch.from_numpy(toks))
        for r, row in enumerate(ref_rows):
            row.completion_tokens = np.append(row.completion_tokens, toks[r])
            row.step += 1
    logits = rng.standard_normal((rows, vocab)) * float(rng.choice([0.5, 3.0, 20.0]))
    logits[:, 5] = logits[:, 9] = logits.max(axis=1)  # exact ties at the top
    logits[:, 2] = logits[:, 3]
    return sampler, ref_rows, logits


@pytest.mark.parametrize("vocab", [64, 257])
def test_float64_equals_reference(vocab):
    rng = np.random.default_rng(vocab)
    eos = (3, 7, vocab - 1)  # several EOS ids, one at the vocabulary's end
    for trial in range(25):
        sampler, rows, logits = _random_batch(rng, vocab, 6, eos, torch.float64)
        ref = reference_sample(logits, rows, eos)
        for flags in (sampler.flags, SamplerFlags()):  # the fast paths and the full path
            out = sample(sampler.state, torch.from_numpy(logits), None, flags, 20)
            assert out.tokens.tolist() == ref.tokens.tolist(), (trial, flags)
            raw = raw_logprobs(logits)
            np.testing.assert_allclose(out.logprobs.numpy(), raw[np.arange(6), ref.tokens], rtol=1e-12, atol=1e-12)
            for r, row in enumerate(rows):
                k = row.params.top_logprobs
                assert out.top_ids[r, :k].tolist() == ref.top_ids[r, :k].tolist()
                np.testing.assert_allclose(out.top_logprobs[r, :k].numpy(), raw[r][ref.top_ids[r, :k]], rtol=1e-12)


def _loosened(params: SamplingParams, eps: float) -> SamplingParams:
    return params.replace(top_p=min(1.0, params.top_p * (1 + eps) + eps), min_p=max(0.0, params.min_p * (1 - eps) - eps))


def _float32_explains(logits_row: np.ndarray, row: RowState, eos, ours: int, theirs: int) -> bool:
    """Whether float32 noise can turn the reference's ``theirs`` into ``ours``: their
    float64 scores lie within the bound, counting ``ours`` as kept when loosening
    top-p/min-p by the bound keeps it (a filter boundary within noise)."""
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


def test_float32_equals_reference_up_to_float_noise():
    rng = np.random.default_rng(32)
    vocab, eos = 128, (0, 5)
    differ = total = 0
    for trial in range(40):
        sampler, rows, logits = _random_batch(rng, vocab, 6, eos, torch.float32)
        logits = logits.astype(np.float32)
        ref = reference_sample(logits, rows, eos)
        out = sampler.sample(torch.from_numpy(logits), num_top=20)
        raw = raw_logprobs(logits)
        for r, row in enumerate(rows):
            ours, theirs = int(out.tokens[r]), int(ref.tokens[r])
            total += 1
            if ours != theirs:
                differ += 1
                assert _float32_explains(logits[r].astype(np.float64), row, eos, ours, theirs), (trial, r, row.params)
            # Reported log-probs: float32 log-softmax of the same logits.
            assert abs(float(out.logprobs[r]) - raw[r, ours]) <= 1e-5 * (1 + abs(raw[r, ours]))
            k = row.params.top_logprobs
            np.testing.assert_allclose(out.top_logprobs[r, :k].numpy(), raw[r][out.top_ids[r, :k].numpy()], rtol=1e-5, atol=1e-5)
    assert differ <= total // 20, f"{differ} of {total} tokens differ"


def test_float32_differs_only_where_the_bound_allows():
    """A constructed float32 difference: 1.0 + bias 0.1 rounds to float32(1.1) and
    ties with token 2, while float64 puts token 2 ahead by 2.4e-8. The helper accepts
    that difference and refuses one the bound does not cover."""
    logits = np.array([[0.0, 1.0, np.float32(1.1), -3.0]], dtype=np.float32)
    params = SamplingParams(temperature=0.0, logit_bias={1: 0.1}, seed=0)
    sampler = TorchSampler(4, 1, (), dtype=torch.float32)
    sampler.install(0, params, [])
    row = RowState(params)
    ours = int(sampler.sample(torch.from_numpy(logits)).tokens[0])
    theirs = int(reference_sample(logits, [row], ()).tokens[0])
    assert (ours, theirs) == (1, 2)
    assert _float32_explains(logits[0].astype(np.float64), row, (), ours, theirs)
    assert not _float32_explains(logits[0].astype(np.float64), row, (), 0, theirs)


def test_tiny_temperature_draws_among_tied_maxima_like_the_reference():
    """temperature 1e-30 (below float32's normal range) is not greedy: the draw
    decides between tied maxima, in float32 as in the reference."""
    vocab = 50
    logits = np.zeros((4, vocab))
    logits[:, [7, 11, 30]] = 2.0
    for dtype in (torch.float32, torch.float64):
        sampler = TorchSampler(vocab, 4, (), dtype=dtype)
        rows = []
        for r in range(4):
            params = SamplingParams(temperature=1e-30, seed=1000 + r)
            sampler.install(r, params, [])
            rows.append(RowState(params))
        out = sampler.sample(torch.from_numpy(logits).to(dtype))
        ref = reference_sample(logits, rows, ())
        assert out.tokens.tolist() == ref.tokens.tolist()
        assert set(ref.tokens.tolist()) - {7} , "the test needs a draw that is not the lowest id"


# -- state changes: record, override, clear, rows ---------------------------------------------------


def test_override_counts_the_forced_token_not_the_sampled_one():
    vocab, eos = 40, (1,)
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=1.5, repetition_penalty=1.7, seed=3)
    sampler = TorchSampler(vocab, 2, eos, dtype=torch.float64)
    sampler.install(1, params, [4, 5])
    row = RowState(params, 0, 0, np.array([4, 5]), np.zeros(0, np.int64))
    logits = np.linspace(-1.0, 1.0, vocab)[None].repeat(2, 0)
    for tok, forced in [(39, None), (39, 38), (38, None), (20, 37)]:
        sampler.record(torch.tensor([0, tok]), torch.tensor([False, True]))
        row.completion_tokens = np.append(row.completion_tokens, tok)
        if forced is not None:
            sampler.override(torch.tensor([forced]), rows=torch.tensor([1]))
            row.completion_tokens[-1] = forced
        row.step = len(row.completion_tokens)
        out = sampler.sample(torch.from_numpy(logits), rows=torch.tensor([1]))
        assert int(out.tokens[0]) == int(reference_sample(logits[:1], [row], eos).tokens[0])
    state = sampler.state
    assert int(state.step[1]) == 4 and int(state.step[0]) == 0
    counts = np.bincount(row.completion_tokens, minlength=vocab)
    assert state.counts[1].tolist() == counts.tolist()  # 39, 38, 38, 37: forced ones count
    assert int(state.last_token[1]) == 37


def test_override_before_any_token_records_it_as_the_first():
    sampler = TorchSampler(10, 1, ())
    sampler.install(0, SamplingParams(seed=1), [])
    sampler.override(torch.tensor([6]))
    assert int(sampler.state.step[0]) == 1 and sampler.state.counts[0].tolist() == [0] * 6 + [1] + [0] * 3


def test_clear_returns_a_row_to_neutral_greedy():
    vocab = 30
    sampler = TorchSampler(vocab, 2, (0,))
    sampler.install(0, SamplingParams(seed=5, top_k=3, logit_bias={4: 50.0}, min_tokens=5, repetition_penalty=2.0), [1, 2])
    sampler.record(torch.tensor([4, 0]))
    sampler.clear(0)
    assert sampler.params(0) is None and not sampler.flags.sampling
    logits = torch.randn(2, vocab)
    logits[:, 0] = 10.0  # EOS, no longer masked
    assert sampler.sample(logits).tokens.tolist() == [0, 0]
    assert int(sampler.state.counts[0].sum()) == 0 and int(sampler.state.step[0]) == 0


def test_a_request_draws_the_same_tokens_whatever_its_row_and_neighbours():
    vocab = 100
    rng = np.random.default_rng(9)
    params = SamplingParams(seed=2**40 + 3, temperature=0.9, top_p=0.8, frequency_penalty=0.5)
    logits = rng.standard_normal(vocab)
    outs = []
    for row, rows in [(0, 1), (3, 4), (6, 8)]:
        sampler = TorchSampler(vocab, rows, (2,), dtype=torch.float64)
        for other in range(rows):
            if other != row:
                sampler.install(other, _random_params(rng, vocab), rng.integers(0, vocab, 3))
        sampler.install(row, params, [1, 2, 3])
        batch = torch.from_numpy(np.tile(logits, (rows, 1)))
        toks = []
        for _ in range(5):
            tok = int(sampler.sample(batch).tokens[row])
            toks.append(tok)
            sampler.record(torch.full((rows,), tok))
        # The same row sampled alone, addressed through ``rows``:
        alone = sampler.sample(batch[:1], rows=torch.tensor([row])).tokens
        outs.append((toks, int(alone[0])))
    assert outs[0] == outs[1] == outs[2]


def test_bulk_insert_flow_gives_each_sample_its_own_stream():
    """One request in three rows with sample indices 0..2, sampled and recorded
    through ``rows`` (how an engine's bulk_insert uses the sampler)."""
    vocab = 64
    params = SamplingParams(seed=77, temperature=1.0)
    sampler = TorchSampler(vocab, 5, (), dtype=torch.float64)
    slots = [4, 0, 2]
    for i, slot in enumerate(slots):
        sampler.install(slot, params, [9, 9], sample_index=i)
    logits = np.random.default_rng(0).standard_normal(vocab)
    rows_t = torch.tensor(slots)
    out = sampler.sample(torch.from_numpy(np.tile(logits, (3, 1))), rows=rows_t)
    ref = reference_sample(np.tile(logits, (3, 1)), [RowState(params, i, 0, [9, 9]) for i in range(3)], ())
    assert out.tokens.tolist() == ref.tokens.tolist() and len(set(ref.tokens.tolist())) > 1
    sampler.record(out.tokens, rows=rows_t)
    assert sampler.state.step.tolist() == [1, 0, 1, 0, 1]
    assert [int(sampler.state.counts[s, t]) for s, t in zip(slots, out.tokens.tolist())] == [1, 1, 1]


def test_install_refuses_bad_requests_before_changing_anything():
    sampler = TorchSampler(4, 2, (0, 1))
    before = {k: v.clone() for k, v in sampler.state.as_dict().items()}
    bad = [
        (SamplingParams(), [1]),  # no seed
        (SamplingParams(seed=1, logit_bias={4: 1.0}), [1]),
        (SamplingParams(seed=1, stop_token_ids=[9]), [1]),
        (SamplingParams(seed=1), [1, 4]),
        (SamplingParams(seed=1, min_tokens=1, stop_token_ids=[2, 3]), []),  # all four masked
    ]
    for params, prompt in bad:
        with pytest.raises(InvalidRequest):
            sampler.install(0, params, prompt)
    with pytest.raises(InvalidRequest):
        sampler.install(2, SamplingParams(seed=1), [])
    with pytest.raises(InvalidRequest):
        sampler.install(0, SamplingParams(seed=1), [], sample_index=4096)
    assert all(torch.equal(before[k], v) for k, v in sampler.state.as_dict().items())
    assert sampler.params(0) is None


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # raised inside torch.export
def test_sample_and_record_export_with_the_state_as_a_pytree():
    """No host sync or data-dependent shape inside: torch.export traces a step (state
    passed in and out as a dict), for the full path and for computed flags."""
    from polyengine.backends.torch_common.sampling import SamplerState, record

    vocab, rows = 64, 4
    sampler = TorchSampler(vocab, rows, (2, 3))
    for r in range(rows):
        sampler.install(r, SamplingParams(
            seed=r, temperature=0.8 if r else 0.0, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
            presence_penalty=0.3, logit_bias={1: 2.0}, min_tokens=2, logprobs=True, top_logprobs=3,
        ), [1, 2])

    class Step(torch.nn.Module):
        def __init__(self, flags):
            super().__init__()
            self.flags = flags

        def forward(self, logits, state):
            out = sample(SamplerState(**state), logits, None, self.flags, 3)
            new = record(SamplerState(**state), out.tokens, torch.ones_like(out.tokens, dtype=torch.bool))
            return out.tokens, out.logprobs, out.top_ids, out.top_logprobs, new.as_dict()

    logits = torch.from_numpy(np.random.default_rng(4).standard_normal((rows, vocab)).astype(np.float32))
    for flags in (SamplerFlags(), sampler.flags):
        program = torch.export.export(Step(flags), (logits, sampler.state.as_dict()))
        got = program.module()(logits, sampler.state.as_dict())
        want = Step(flags)(logits, sampler.state.as_dict())
        assert all(torch.equal(a, b) for a, b in zip(got[:4], want[:4]))
        assert all(torch.equal(got[4][k], want[4][k]) for k in want[4])
