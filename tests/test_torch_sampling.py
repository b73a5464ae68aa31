"""What only the torch sampler and Threefry port have: Threefry's words in int32 and
int64 arithmetic, float32 uniforms, float64 noise, the flags' fast paths, the stateful
``TorchSampler`` (rows, clear, the bulk-insert flow) and a step under torch.export.

The contract both device samplers keep against the core's reference (the stream bit
for bit, ties, the sampler up to float32 noise, overrides, refusals) is in
``tests/test_device_samplers.py``, run on this port and the JAX one. Everything is
deterministic (fixed seeds): no test here fails by chance.
"""

from __future__ import annotations


from dataclasses import replace

import numpy as np
import pytest
import torch

from polyengine.errors import InvalidRequest
from polyengine.sampling import RowState, SamplingParams, gumbel, raw_logprobs
from polyengine.sampling import sample as reference_sample
from polyengine.sampling import threefry as ref_threefry

from polyengine.backends.torch_common import threefry
from polyengine.backends.torch_common.sampling import SamplerFlags, TorchSampler, sample

from sampler_cases import edge_seeds, float32_explains, random_params, random_requests


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """These tensors are tiny: a second thread gains nothing, and on a shared two-core
    machine every parallel op can wait ~20 ms at a barrier for a descheduled thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- Threefry: bit for bit ------------------------------------------------------------------


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


def test_float32_uniforms_round_the_exact_ones():
    """The float32 uniforms are the core's exact values rounded (both round to nearest
    even), for seeds over the full 64-bit range and the stream's edges (the float64
    ones equal the core's bit for bit: tests/test_device_samplers.py)."""
    rng = np.random.default_rng(1)
    seeds = edge_seeds(rng, 23)  # 32 rows
    steps = [0, 2**20 - 1, 0, 2**20 - 1] + [int(s) for s in rng.integers(0, 2**20, len(seeds) - 4)]
    samples = [0, 4095, 4095, 0] + [int(s) for s in rng.integers(0, 4096, len(seeds) - 4)]
    vocab = 49152
    lo, hi = zip(*(threefry.split_seed(s) for s in seeds))
    col = lambda xs: torch.tensor(xs, dtype=torch.int64)[:, None]  # noqa: E731
    ctr = threefry.counter_hi(col(steps), col(samples))
    ids = torch.arange(vocab)[None, :]
    u32 = threefry.uniforms(col(lo), col(hi), ids, ctr, dtype=torch.float32).numpy()
    for row, (seed, step, index) in enumerate(zip(seeds, steps, samples)):
        ref = ref_threefry.uniforms(seed, np.arange(vocab), step, index)
        assert np.array_equal(u32[row], ref.astype(np.float32)), (seed, step, index)


def test_gumbel_float64_matches_reference():
    seed = 2**64 - 1
    lo, hi = threefry.split_seed(seed)
    ctr = threefry.counter_hi(torch.tensor([[7]]), torch.tensor([[4095]]))
    g = threefry.gumbel(torch.tensor([[lo]]), torch.tensor([[hi]]), torch.arange(4096)[None], ctr, dtype=torch.float64)
    # Same formula on the same exact u; only the log implementations may differ by an ulp.
    np.testing.assert_allclose(g[0].numpy(), gumbel(seed, np.arange(4096), 7, 4095), rtol=1e-15, atol=1e-15)


# -- primitives -----------------------------------------------------------------------------------


def test_flags_follow_the_installed_requests():
    flags = SamplerFlags.of([SamplingParams(temperature=0, top_k=5, top_p=0.5)], 100)
    assert not flags.sampling and not flags.top_k and not flags.top_p  # greedy rows filter nothing
    flags = SamplerFlags.of([SamplingParams(top_k=50, top_p=0.9), SamplingParams(top_k=20)], 100)
    assert flags.candidates == 50 and flags.greedy is False
    flags = SamplerFlags.of([SamplingParams(top_k=50), SamplingParams(top_p=0.9)], 100)
    assert flags.candidates is None  # a top-p row without top-k needs the whole order
    assert SamplerFlags.of([], 100) == SamplerFlags(
        greedy=False, sampling=False, bias=False, eos_mask=False, min_tokens=False, repetition=False,
        presence_frequency=False, top_k=False, top_p=False, min_p=False, logprobs=False, candidates=None,
    )


# -- the sampler against the reference --------------------------------------------------------


@pytest.mark.parametrize("vocab", [64, 257])
def test_float64_fast_paths_and_full_path_equal_reference(vocab):
    """The flags' fast paths (steps skipped where every installed request leaves them
    neutral) and the full path give the reference's tokens exactly in float64."""
    rng = np.random.default_rng(vocab)
    eos = (3, 7, vocab - 1)  # several EOS ids, one at the vocabulary's end
    for trial in range(25):
        reqs, recorded, rows, logits = random_requests(rng, vocab, 6)
        sampler = TorchSampler(vocab, 6, eos, dtype=torch.float64)
        for r, (params, prompt, index) in enumerate(reqs):
            sampler.install(r, params, prompt, sample_index=index)
        for toks in recorded:
            sampler.record(torch.from_numpy(toks))
        ref = reference_sample(logits, rows, eos)
        # the fast paths (with the sparse EOS masking too) and the full path
        for flags, eos_ids in ((sampler.flags, None), (sampler.flags, sampler.eos_ids), (SamplerFlags(), None)):
            out = sample(sampler.state, torch.from_numpy(logits), None, flags, 20, eos_ids=eos_ids)
            assert out.tokens.tolist() == ref.tokens.tolist(), (trial, flags)
            raw = raw_logprobs(logits)
            np.testing.assert_allclose(out.logprobs.numpy(), raw[np.arange(6), ref.tokens], rtol=1e-12, atol=1e-12)
            for r, row in enumerate(rows):
                k = row.params.top_logprobs
                assert out.top_ids[r, :k].tolist() == ref.top_ids[r, :k].tolist()
                np.testing.assert_allclose(out.top_logprobs[r, :k].numpy(), raw[r][ref.top_ids[r, :k]], rtol=1e-12)


def test_the_sparse_eos_masking_equals_the_dense_mask():
    """Where no installed row has min_tokens, the ignore_eos rows' EOS columns are written
    as -inf (penalised_logits with the sampler's eos_ids) in place of the mask over the
    whole vocabulary: the same values, the same tokens, the logits left as they were; a
    min_tokens row brings the dense mask back (it masks stop ids too)."""
    from polyengine.backends.torch_common.sampling import penalised_logits

    vocab, eos = 300, (3, 7, 299, 7)  # a repeated id is one column
    sampler = TorchSampler(vocab, 4, eos)
    assert sampler.eos_ids.tolist() == [3, 7, 299]
    for row, params in enumerate([SamplingParams(temperature=0, ignore_eos=True, seed=0), SamplingParams(temperature=0, seed=1),
                                  SamplingParams(seed=2, temperature=0.9, ignore_eos=True), SamplingParams(seed=3)]):
        sampler.install(row, params, [1, 2])
    assert sampler.flags.eos_mask and not sampler.flags.min_tokens
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    logits[:, [3, 7, 299]] = 30.0  # EOS would win every row it is not masked in
    before = logits.clone()
    dense = penalised_logits(sampler.state, logits, None, replace(sampler.flags, min_tokens=True))
    sparse = penalised_logits(sampler.state, logits, None, sampler.flags, eos_ids=sampler.eos_ids)
    assert torch.equal(dense, sparse) and torch.equal(logits, before)
    assert torch.isneginf(sparse[[0, 2]][:, [3, 7, 299]]).all() and torch.equal(sparse[[1, 3]], logits[[1, 3]])
    got = sampler.sample(logits).tokens.tolist()
    assert got == sample(sampler.state, logits, None, replace(sampler.flags, min_tokens=True)).tokens.tolist()
    assert got[1] == 3 and got[0] not in eos
    sampler.install(1, SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5], seed=1), [1, 2])
    assert sampler.flags.min_tokens  # the dense mask: row 1 loses EOS and its stop id while early
    masked = penalised_logits(sampler.state, logits, None, sampler.flags, eos_ids=sampler.eos_ids)
    assert torch.isneginf(masked[1, [3, 5, 7, 299]]).all() and torch.isneginf(masked[0, [3, 7, 299]]).all()


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
    assert float32_explains(logits[0].astype(np.float64), row, (), ours, theirs)
    assert not float32_explains(logits[0].astype(np.float64), row, (), 0, theirs)


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
                sampler.install(other, random_params(rng, vocab), rng.integers(0, vocab, 3))
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


def test_install_refuses_rows_and_sample_indices_outside_their_range():
    """The port's own refusals (the request's are the core's, tested for both ports in
    tests/test_device_samplers.py): a row outside the sampler, a sample index outside
    the stream's layout; nothing changes."""
    sampler = TorchSampler(4, 2, (0, 1))
    before = {k: v.clone() for k, v in sampler.state.as_dict().items()}
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


def test_the_sampler_updates_its_state_in_place_as_the_pure_functions_do():
    """TorchSampler's record/override/forget change its state's own tensors (no new
    (R, V) counts a step) and give what the pure functions give, which leave their input
    as it was, and what a per-row model of the rules gives (an override of a row with no
    completion token yet is its first): a sequence of each, by mask and by rows."""
    from collections import Counter

    from polyengine.backends.torch_common.sampling import SamplerState, forget, override, record

    vocab, rows = 16, 4
    sampler = TorchSampler(vocab, rows, (2,))
    sampler.install(1, SamplingParams(seed=3, temperature=0.7), [5, 6])
    pure = SamplerState(**{k: v.clone() for k, v in sampler.state.as_dict().items()})
    counts = sampler.state.counts.data_ptr()
    model = [{"counts": Counter(), "step": 0, "last": 0} for _ in range(rows)]
    rng = np.random.default_rng(0)
    ops = {"record": record, "override": override, "forget": forget}
    for i, name in enumerate(["override", "record", "override", "record", "forget", "override", "record", "forget"]):
        tokens = torch.from_numpy(rng.integers(0, vocab, rows))
        mask = torch.from_numpy(rng.random(rows) < 0.7)
        mask[i % rows] = True
        if i % 2:  # by rows: the masked rows as a batch
            getattr(sampler, name)(tokens[mask], rows=torch.nonzero(mask)[:, 0])
        else:
            getattr(sampler, name)(tokens, mask=mask)
        before = {k: v.clone() for k, v in pure.as_dict().items()}
        new = ops[name](pure, tokens, mask)
        assert all(torch.equal(before[k], v) for k, v in pure.as_dict().items()), f"{name} changed its input"
        pure = new
        assert all(torch.equal(v, getattr(sampler.state, k)) for k, v in pure.as_dict().items()), name
        for r in np.nonzero(mask.numpy())[0]:
            row, t = model[r], int(tokens[r])
            if name == "override" and row["step"]:
                row["counts"][row["last"]] -= 1
            if name == "forget":
                row["counts"][t] -= 1
                row["step"] -= 1
                continue
            row["counts"][t] += 1
            row["step"] += name == "record" or not row["step"]
            row["last"] = t
        for r, row in enumerate(model):
            assert [row["counts"][t] for t in range(vocab)] == sampler.state.counts[r].tolist(), (name, r)
            assert row["step"] == int(sampler.state.step[r]), (name, r)
            assert not row["step"] or row["last"] == int(sampler.state.last_token[r]), (name, r)
    assert sampler.state.counts.data_ptr() == counts
