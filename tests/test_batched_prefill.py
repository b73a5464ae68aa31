"""Batched prefill (capability batched_prefill): the engines' prefill_batch equals one
prefill per entry, and the driver's per-step token budget batches the pieces of every
request being prefilled without changing any output (docs/serving.md, "Prefill and
decode in one step")."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from polyengine import EngineConfig, SamplingParams
from polyengine.driver import LLM
from polyengine.engine import PrefillRequest
from polyengine.errors import InvalidRequest
from polyengine.models import load_model
from polyengine.plugins import create_engine
from polyengine.backends.reference.engine import ReferenceEngine

from test_prefix_cache import PrefillLog, make

GREEDY = SamplingParams(temperature=0)
SEEDED = SamplingParams(temperature=1.1, seed=7, top_p=0.9, repetition_penalty=1.2, logprobs=True, top_logprobs=3)


@pytest.fixture(scope="module")
def tiny():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("random:tiny-gqa")


# -- the engines ---------------------------------------------------------------------------

ENGINES = {
    # backend, options, logits tolerance (max abs): float64 exact, float32 by rounding
    "reference": ({}, 1e-12),
    "reference-buckets": ({}, 1e-12),
    "cpu": ({}, 2e-5),
    "cuda_torch": ({"device": "cpu"}, 2e-5),
    "cpu-paged": ({"page_size": 4}, 2e-5),  # continuing paged prefixes, new K/V scattered into pages
    # one program per output bucket (docs/tpu_jax.md, "Batched prefill"; off by default on the CPU)
    "tpu_jax": ({"batched_prefill": "on"}, 2e-5),
    "tpu_jax-paged": ({"batched_prefill": "on", "page_size": 4}, 2e-5),
}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engine(request, tiny):
    name = request.param
    options, tol = ENGINES[name]
    buckets = (8, 16, 32, 60) if name.endswith("buckets") else None
    if name.startswith("tpu_jax"):
        pytest.importorskip("jax")
        request.getfixturevalue("jax_compile_less")  # tiny models: compile time over run time
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = create_engine(name.split("-")[0], model=tiny, config=EngineConfig(
            max_slots=3, max_prefill_length=60, max_cache_length=96, prefill_buckets=buckets, options=options))
    return eng, eng.load_params(), tol


def _requests(eng, params, rng):
    """Entries of different lengths, from position 0 and continuing prefixes of different
    lengths, greedy and seeded (penalties over the whole prompt)."""
    a, b, c = (rng.integers(3, 250, n).tolist() for n in (23, 6, 17))
    head_a, _ = eng.prefill(params=params, tokens=a[:9], sampling=GREEDY)
    head_c, _ = eng.prefill(params=params, tokens=c[:3], sampling=SEEDED)
    return [PrefillRequest(a[9:], SEEDED, head_a), PrefillRequest(b, GREEDY), PrefillRequest(c[3:], GREEDY, head_c),
            PrefillRequest(c, SamplingParams(temperature=0.8, seed=8))]


def test_prefill_batch_equals_one_prefill_per_entry(engine):
    """Each entry's prefix (prompt, logits, first token, log-probs) equals its own prefill
    call's, and its K/V continue the same: a further piece gives the same logits."""
    eng, params, tol = engine
    assert eng.capabilities.batched_prefill
    requests = _requests(eng, params, np.random.default_rng(1))
    batch = eng.prefill_batch(params=params, requests=requests)
    for i, (req, (prefix, first)) in enumerate(zip(requests, batch)):
        alone, first_alone = eng.prefill(params=params, tokens=req.tokens, sampling=req.sampling,
                                         existing_prefix=req.existing_prefix)
        assert list(prefix.prompt_tokens) == list(alone.prompt_tokens), i
        np.testing.assert_allclose(prefix.host_logits(), alone.host_logits(), rtol=0, atol=tol, err_msg=f"entry {i}")
        assert prefix.first_token == alone.first_token == int(first.row_tokens(0)[0]), i
        np.testing.assert_allclose(first.logprobs, first_alone.logprobs, atol=tol * 10, err_msg=f"entry {i}")
        np.testing.assert_array_equal(first.top_ids, first_alone.top_ids, err_msg=f"entry {i}")
        more = [5, 9, 11]
        on_batch, _ = eng.prefill(params=params, tokens=more, sampling=GREEDY, existing_prefix=prefix)
        on_alone, _ = eng.prefill(params=params, tokens=more, sampling=GREEDY, existing_prefix=alone)
        np.testing.assert_allclose(on_batch.host_logits(), on_alone.host_logits(), rtol=0, atol=tol,
                                   err_msg=f"entry {i}'s K/V continued")


def test_batch_groups_bound_each_forward():
    from polyengine.backends.torch_common.engine import batch_groups

    assert batch_groups([5, 9, 3], None) == [[0, 1, 2]]
    assert batch_groups([128] * 8, 512) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert batch_groups([10, 30, 5, 600, 4], 64) == [[0, 1], [2], [3], [4]]  # padded sizes: 2 x 30 = 60, then 3 x 30 > 64


def test_a_token_cap_splits_the_batch_into_forwards_with_the_same_results(tiny):
    """The cpu engine's prefill_forward_tokens: entries past the cap run as further forwards
    (counted), each entry's prefix and first token as in one forward; a refused entry
    still refuses the whole batch before any work."""
    from polyengine.backends.cpu.engine import CpuEngine

    config = EngineConfig(max_slots=3, max_prefill_length=60, max_cache_length=96, options={"fused_prefill": False})
    whole, capped = CpuEngine(tiny, config), CpuEngine(tiny, config)
    whole.prefill_forward_tokens, capped.prefill_forward_tokens = None, 40
    params = whole.load_params()
    cparams = capped.load_params()
    rng = np.random.default_rng(3)
    requests = [PrefillRequest(rng.integers(3, 250, n).tolist(), GREEDY if n % 2 else SEEDED) for n in (23, 6, 17, 30)]
    calls = []
    run = capped._prefill_checked
    capped._prefill_checked = lambda params, reqs, checked: calls.append(len(reqs)) or run(params, reqs, checked)
    got = capped.prefill_batch(params=cparams, requests=requests)
    assert calls == [1, 2, 1]  # 23 | 6 + 17 (2 x 17) | 30
    for i, ((p, first), (q, want)) in enumerate(zip(got, whole.prefill_batch(params=params, requests=requests))):
        np.testing.assert_allclose(p.host_logits(), q.host_logits(), rtol=0, atol=2e-5, err_msg=f"entry {i}")
        assert int(first.row_tokens(0)[0]) == int(want.row_tokens(0)[0]), i
    calls.clear()
    with pytest.raises(InvalidRequest, match="prefill_batch entry 3"):
        capped.prefill_batch(params=cparams, requests=[*requests[:3], PrefillRequest([tiny.config.vocab_size], GREEDY)])
    assert calls == []


def test_a_refused_entry_refuses_the_batch_before_any_work(engine):
    eng, params, _ = engine
    good = PrefillRequest([5, 6, 7], GREEDY)
    with pytest.raises(InvalidRequest, match="prefill_batch entry 1"):
        eng.prefill_batch(params=params, requests=[good, PrefillRequest([eng.vocab_size], GREEDY)])
    with pytest.raises(InvalidRequest, match="non-empty sequence"):
        eng.prefill_batch(params=params, requests=[])


def test_the_kit_loops_for_an_engine_without_the_capability(tiny):
    """EngineBase.prefill_batch is a loop over prefill: every engine has the method."""
    from polyengine.backends.reference.engine import ReferenceEngine
    from polyengine.engine import EngineBase

    class Looping(ReferenceEngine):
        prefill_batch = EngineBase.prefill_batch

    eng = Looping(tiny, EngineConfig(max_slots=2, max_prefill_length=60, max_cache_length=96))
    params = eng.load_params()
    requests = _requests(eng, params, np.random.default_rng(2))
    for req, (prefix, _) in zip(requests, eng.prefill_batch(params=params, requests=requests)):
        alone, _ = eng.prefill(params=params, tokens=req.tokens, sampling=req.sampling,
                               existing_prefix=req.existing_prefix)
        assert prefix.first_token == alone.first_token
        np.testing.assert_array_equal(prefix.host_logits(), alone.host_logits())


# -- the driver ----------------------------------------------------------------------------

SAMPLINGS = [
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.2, seed=5, max_tokens=6, ignore_eos=True,
                   logprobs=True, top_logprobs=2),
    SamplingParams(temperature=1.3, seed=9, n=2, max_tokens=5, ignore_eos=True),
]


@pytest.mark.parametrize("budget", [5, 12, 40])
def test_driver_output_with_batched_prefill_equals_one_prompt_at_a_time(tiny, budget):
    """Streams decoding while prompts arrive (shared system prompts and distinct ones,
    greedy, seeded and n = 2), with the prefix cache and chunks: every token and log-prob
    equals a run that prefills each prompt whole, alone, without the cache; several
    requests' pieces did share prefill_batch calls, within the step's budget."""
    on = make(tiny, prefill_chunk=8, max_num_batched_tokens=budget, prefix_cache_bytes=8 << 20, max_slots=6)
    off = make(tiny, prefill_chunk=0, prefix_cache_bytes=0, max_slots=6)
    log = PrefillLog(on.engine)
    llm = LLM.from_engine(log, tools=False)
    llm.scheduler.prefiller.block = 4
    rng = np.random.default_rng(budget)
    system = rng.integers(3, 280, 20).tolist()
    prompts = [(system if i % 2 else []) + rng.integers(3, 280, int(rng.integers(3, 30))).tolist() for i in range(9)]
    sampling = [SAMPLINGS[i % 3] for i in range(len(prompts))]
    keeper = llm.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    llm.step()
    reqs = [llm.submit(p, s) for p, s in zip(prompts, sampling)]
    while not all(r.done for r in reqs):
        llm.step()
    keeper.cancel()
    want = off.generate(prompts, sampling)
    for r, w in zip(reqs, want):
        assert [o.token_ids for o in r.completion.outputs] == [o.token_ids for o in w.outputs]
        if w.outputs[0].logprobs is not None:
            np.testing.assert_allclose(r.completion.outputs[0].logprobs, w.outputs[0].logprobs, rtol=1e-9)
    assert any(len(b) > 1 for b in log.batches), log.batches  # pieces of several requests in one call
    assert all(sum(b) <= budget for b in log.batches), log.batches  # the budget, while the keeper decodes


def test_the_step_budget_bounds_every_step_and_batches_the_waiting_prompts(tiny):
    """Two streams decode; three prompts arrive at once. Every step prefills at most the
    budget's prompt tokens in one call (the pieces of every prompt being prefilled), the
    streams get a token every step, and the prompts start together (not one after the
    other)."""
    base = make(tiny, prefill_chunk=16, max_num_batched_tokens=10, prefix_cache_bytes=0, max_slots=5)
    log = PrefillLog(base.engine)
    llm = LLM.from_engine(log, tools=False)
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    streams = [llm.submit([5 + i, 6, 7], sp) for i in range(2)]
    llm.step()
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 280, n).tolist() for n in (23, 4, 13)]
    late = [llm.submit(p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)) for p in prompts]
    gaps = 0
    while not all(r.done for r in late):
        log.step += 1
        before = [len(s.samples[0].out.token_ids) for s in streams]
        llm.step()
        gaps += sum(len(s.samples[0].out.token_ids) == b for s, b in zip(streams, before))
    per_step: dict[int, int] = {}
    for step, n, _ in log.calls[2:]:  # after the two streams' own prompts
        per_step[step] = per_step.get(step, 0) + n
    assert max(per_step.values()) <= 10 and sum(per_step.values()) == 40 and gaps == 0
    # Steps: the first prompt's 10 (alone: one prefill call); its rest to its chunk's end
    # (6) beside the second (4); its last 7 beside the third's first 3; the third's 10.
    assert [n for _, n, _ in log.calls[2:]] == [10, 6, 4, 7, 3, 10]
    assert log.batches == [[3, 3], [6, 4], [7, 3]]  # the streams' prompts, then two steps of two requests
    solo = make(tiny, prefill_chunk=0, prefix_cache_bytes=0)
    for r, p in zip(late, prompts):
        assert r.completion.token_ids == solo.generate([p], r.sampling)[0].token_ids


def test_max_num_batched_tokens_is_checked_and_reaches_the_scheduler(tiny):
    llm = make(tiny, max_num_batched_tokens=7)
    assert llm.scheduler.prefiller.step_tokens == 7
    with pytest.raises(InvalidRequest):
        make(tiny, max_num_batched_tokens=0)
    from polyengine.driver.prefill import DEFAULT_STEP_TOKENS

    assert make(tiny).scheduler.prefiller.step_tokens == DEFAULT_STEP_TOKENS


class FlakyRows(ReferenceEngine):
    """Raises an untyped error (think: device out of memory) for any forward holding one
    prompt, whether it runs alone or batched with others."""

    def _prefill_rows(self, params, checked, existing):
        if any(list(toks) == [9] for toks, _, _, _ in checked):
            raise RuntimeError("device ran out of memory")
        return super()._prefill_rows(params, checked, existing)


def test_a_failed_batch_is_run_piece_by_piece_and_fails_only_its_request(tiny):
    """A batched call that raises changed nothing; the driver runs its pieces one by one,
    so only the request whose piece fails alone fails, and the others' output is exact."""
    eng = FlakyRows(tiny, EngineConfig(max_slots=4, max_prefill_length=60, max_cache_length=96))
    assert eng.capabilities.batched_prefill
    log = PrefillLog(eng)
    llm = LLM.from_engine(log, tools=False)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    good, bad, more = ([1, 5, 9], [9], [1, 2, 8])
    reqs = [llm.submit(p, sp) for p in (good, bad, more)]
    llm.scheduler.run_until(lambda: all(r.done for r in reqs))
    assert log.batches == [[3, 1, 3]]  # tried together once, then one by one
    assert reqs[1].status == "failed" and isinstance(reqs[1].error, RuntimeError)
    solo = make(tiny, prefill_chunk=0, prefix_cache_bytes=0)
    for r, p in ((reqs[0], good), (reqs[2], more)):
        assert r.completion.token_ids == solo.generate([p], sp)[0].token_ids


def test_a_subclass_with_its_own_prefill_does_not_declare_batched_prefill(tiny):
    """Its prefill_batch is the kit's loop over that prefill, so the driver calls prefill
    per piece and a failure stays the request's own."""

    class OwnPrefill(ReferenceEngine):
        def prefill(self, **kwargs):
            return super().prefill(**kwargs)

    eng = OwnPrefill(tiny, EngineConfig(max_slots=2, max_prefill_length=60, max_cache_length=96))
    assert not eng.capabilities.batched_prefill
    assert ReferenceEngine(tiny, EngineConfig(max_slots=2, max_prefill_length=60,
                                              max_cache_length=96)).capabilities.batched_prefill


@pytest.mark.parametrize("page_size", [0, 4])
def test_a_prompt_past_the_cap_prefills_in_pieces_with_the_same_results(tiny, page_size):
    """The cpu engine's prefill_forward_tokens bounds a long prompt's forward too: alone,
    or as a lone entry of prefill_batch, it runs as even pieces under the cap, each
    continuing the one before (counted); its prefix's logits, first token and K/V as
    one forward gives them, and no piece's own prefix keeps pages."""
    from polyengine.backends.cpu.engine import CpuEngine

    config = EngineConfig(max_slots=2, max_prefill_length=120, max_cache_length=160,
                          options={"fused_prefill": False, "page_size": page_size})
    whole, capped = CpuEngine(tiny, config), CpuEngine(tiny, config)
    whole.prefill_forward_tokens, capped.prefill_forward_tokens = None, 40
    params, cparams = whole.load_params(), capped.load_params()
    runs = []
    kv_run = capped._kv_run
    capped._kv_run = lambda params, prefix, start, end: runs.append((start, end)) or kv_run(params, prefix, start, end)
    rng = np.random.default_rng(5)
    tokens = rng.integers(3, 250, 100).tolist()
    for how in ("prefill", "prefill_batch"):
        runs.clear()
        for eng, p in ((whole, params), (capped, cparams)):
            if how == "prefill":
                eng.got = eng.prefill(params=p, tokens=tokens, sampling=SEEDED)
            else:
                (eng.got,) = eng.prefill_batch(params=p, requests=[PrefillRequest(tokens, SEEDED)])
        assert runs == [(0, 33), (33, 66), (66, 100)], how
        (got, first), (want, want_first) = capped.got, whole.got
        np.testing.assert_allclose(got.host_logits(), want.host_logits(), rtol=0, atol=2e-5, err_msg=how)
        assert int(first.row_tokens(0)[0]) == int(want_first.row_tokens(0)[0]), how
        a, b = capped.export_prefix(got), whole.export_prefix(want)
        np.testing.assert_allclose(a.k, b.k, rtol=0, atol=1e-5, err_msg=how)
        np.testing.assert_allclose(a.v, b.v, rtol=0, atol=1e-5, err_msg=how)
        if page_size:
            assert capped.pages.held == len(got.kv.pages) == -(-100 // page_size), how  # the pieces' pages given back
            got.kv.release()
            want.kv.release()
            assert capped.pages.held == 0, how
