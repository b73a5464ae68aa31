"""The block KV layout of the neuron engine (option ``page_size``; docs/neuron.md, "Pages"),
on its CPU compile path, against the same engine with the contiguous cache: tokens and
log-probs equal exactly in float32 (greedy, seeded with a penalty, n=2, continuation,
truncation, bulk_insert, an override, a freed and reused slot; async and sync steps;
speculation), exported prefixes equal bit for bit; blocks shared on insert,
continuation and truncation, copied on the first write into a shared block, given back
on free and when a prefix is dropped; a bounded pool refuses cleanly, an unbounded one
grows (its graphs compiled once per size) and keeps what it held; the driver admits
requests by free blocks. (The Neuron path: tests/test_neuron_device.py.)
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyengine import EngineConfig, Override, SamplingParams  # noqa: E402
from polyengine.backends.neuron.compile import COUNTS  # noqa: E402
from polyengine.backends.neuron.engine import NeuronEngine  # noqa: E402
from polyengine.errors import InsufficientMemory, InvalidRequest  # noqa: E402
from polyengine.models import load_model  # noqa: E402
from polyengine.pages import PageList  # noqa: E402

CFG = EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=64, dtype="float32")


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny-gqa")


def _engine(model, **options):
    return NeuronEngine(model, CFG.model_copy(update={"options": options}))


def _run(eng, sp: SamplingParams):
    """Prefill, a continuation, a truncation, insert, bulk_insert, steps past block edges,
    an override, a freed and reused slot: the valid tokens, their log-probs, and the
    prefixes' exported K/V."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 280, 23).tolist()
    params, state = eng.load_params(), eng.init_decode_state()
    head, _ = eng.prefill(params=params, tokens=prompt[:10], sampling=sp)
    whole, first = eng.prefill(params=params, tokens=prompt[10:], sampling=sp, existing_prefix=head)
    cut = eng.truncate_prefix(params=params, prefix=whole, length=13)
    state = eng.insert(cut, state, 0)
    state, firsts = eng.bulk_insert(whole, state, [1, 3])
    tokens = [int(first.tokens[0, 0]), cut.first_token, *firsts.tokens[:, 0].tolist()]
    logprobs = []
    for step in range(24):  # past block edges of 4 and 16
        if step == 4:
            state = eng.free_resource(state, 1)
            state = eng.insert(head, state, 1)
        overrides = {3: Override(7, int(res.lengths[3]) - 1)} if step == 9 else None
        state, res = eng.generate(params, state, overrides=overrides)
        valid = res.valid.astype(bool)  # (slots, k): an empty slot's row is not compared
        tokens.append(np.where(valid, res.tokens, -1).tolist())
        logprobs.append(np.where(valid, res.logprobs, 0.0))
    kv = [np.concatenate([e.k.ravel(), e.v.ravel()]) for e in map(eng.export_prefix, (head, whole, cut))]
    return tokens, np.asarray(logprobs), kv


SAMPLINGS = {
    "greedy": SamplingParams(temperature=0, max_tokens=20, logprobs=True, n=2),
    "seeded": SamplingParams(temperature=0.9, seed=4, max_tokens=20, logprobs=True, n=2, repetition_penalty=1.2),
}


@pytest.mark.parametrize("options", [{"page_size": 4}, {"page_size": 16}, {"page_size": 16, "async_steps": False},
                                     {"page_size": 4, "speculation": 2}], ids=["ps4", "ps16", "ps16-sync", "ps4-spec2"])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_paged_equals_the_contiguous_engine(tiny, options, sampling):
    flat_options = {k: v for k, v in options.items() if k != "page_size"}
    flat, paged = _engine(tiny, **flat_options), _engine(tiny, **options)
    assert paged.capabilities.page_size == options["page_size"] and not flat.capabilities.paged_kv
    want, want_lp, want_kv = _run(flat, SAMPLINGS[sampling])
    got, got_lp, got_kv = _run(paged, SAMPLINGS[sampling])
    assert got == want
    # The same float32 computation: the attended keys are the same values, the positions
    # past a row's length weigh exactly 0 (the contiguous cache holds zeros there, blocks
    # hold whatever they hold), so log-probs are equal, not close.
    np.testing.assert_array_equal(got_lp, want_lp)
    for a, b in zip(want_kv, got_kv):
        np.testing.assert_array_equal(a, b)
    gc.collect()
    assert paged.pages.held == 0  # the run's prefixes and slots gave every block back


def test_the_conformance_page_rules_hold(tiny):
    """The conformance suite's page-rule program (rule 18e, conformance/pages.py), which
    `polyengine conformance --option page_size=N` runs as test_page_rules, in CI here
    (the CPU compile path)."""
    from polyengine.conformance.pages import page_rule_problems

    eng = _engine(tiny, page_size=4)
    assert page_rule_problems(eng, eng.load_params(), list(range(3, 9)), [40, 41, 42]) == []


def test_a_prefix_in_two_slots_holds_one_copy_of_its_full_blocks(tiny):
    eng = _engine(tiny, page_size=4)
    pool, params, state = eng.pages, eng.load_params(), eng.init_decode_state()
    sp = SamplingParams(temperature=0, max_tokens=8)
    prefix, _ = eng.prefill(params=params, tokens=list(range(3, 13)), sampling=sp)  # 10 positions: 4, 4, 2
    assert isinstance(eng.prefix_pages(prefix), PageList) and eng.prefix_pages(prefix).length == 10
    assert pool.held == 3
    pages = list(eng.prefix_pages(prefix).pages)
    state, _ = eng.bulk_insert(prefix, state, [0, 2])
    assert [pool.refcount(p) for p in pages] == [3, 3, 3] and pool.held == 3  # shared, not copied
    assert state.k is None and state.v is None  # no per-slot cache: the engine's block pools
    before = eng.export_prefix(prefix)
    state, _ = eng.generate(params, state)  # position 10 in each slot: the partly filled block copied, once each
    s0, s2 = eng.slot_pages(state, 0), eng.slot_pages(state, 2)
    assert s0.pages[:2] == s2.pages[:2] == pages[:2] and pool.held == 5
    assert len({s0.pages[2], s2.pages[2], pages[2]}) == 3 and eng.slot_pages(state, 1) is None
    more, _ = eng.prefill(params=params, tokens=[20, 21, 22], sampling=sp, existing_prefix=prefix)
    assert more.kv.pages[:2] == pages[:2] and more.kv.pages[2] != pages[2] and pool.refcount(pages[0]) == 4
    cut = eng.truncate_prefix(params=params, prefix=more, length=9)  # 8 positions shared, the 9th written
    assert cut.kv.pages[:2] == pages[:2] and pool.refcount(pages[0]) == 5
    for _ in range(3):
        state, _ = eng.generate(params, state)
    after = eng.export_prefix(prefix)  # the slots' and continuations' writes left it as it was
    np.testing.assert_array_equal(after.k, before.k)
    np.testing.assert_array_equal(after.v, before.v)
    state = eng.free_resource(state, 0)
    state = eng.free_resource(state, 2)
    assert [pool.refcount(p) for p in pages] == [3, 3, 1]  # the prefix, more and cut hold the rest
    for stranger in (_engine(tiny, page_size=4), _engine(tiny)):  # the same weights, other blocks (or none)
        with pytest.raises(InvalidRequest, match="another .* engine's pages"):
            stranger.insert(prefix, stranger.init_decode_state(), 0)
    del more, prefix, cut
    gc.collect()
    assert pool.held == 0  # dropped prefixes give their blocks back


def test_the_graphs_take_block_tables_of_a_static_width_per_sequence_bucket(tiny):
    """One token-generation graph per batch x sequence bucket, whose block-table input is
    ceil(kv_len / page_size) wide; the context graph takes a slot mapping of its bucket."""
    eng = _engine(tiny, page_size=16, seq_buckets=(16, 32, 64))
    c, w = tiny.config, len(eng._names)
    pool = (c.num_hidden_layers, 16, c.num_key_value_heads, 16, c.head_dim)  # 4 slots x 4 blocks of 16
    assert set(eng.graphs) == {("context", 24, 16), ("continuation", 24, 24, 16),
                               ("context_batch", 2, 24, 16), ("context_batch", 4, 24, 16),  # batched_prefill
                               ("decode", 4, 16, 16), ("decode", 4, 32, 16), ("decode", 4, 64, 16)}
    for kv in (16, 32, 64):  # weights, K pool, V pool, the block table (slots x blocks of this bucket), seq_ids...
        shapes = [shape for shape, _ in eng.graphs[("decode", 4, kv, 16)].fn.signature]
        assert shapes[w: w + 4] == [pool, pool, (4, kv // 16), (4,)]
    shapes = [shape for shape, _ in eng.graphs[("context", 24, 16)].fn.signature]
    assert shapes[w:] == [pool, pool, (1, 24), (1,), (24,)]  # pools, the prompt, its last position, the slot mapping
    shapes = [shape for shape, _ in eng.graphs[("context_batch", 4, 24, 16)].fn.signature]
    assert shapes[w:] == [pool, pool, (4, 24), (4,), (96,)]  # four prompts: one slot mapping of them all
    params, state = eng.load_params(), eng.init_decode_state()
    sp = SamplingParams(temperature=0, max_tokens=40, logprobs=True)
    flat = _engine(tiny, seq_buckets=(16, 32, 64))
    fstate, fparams = flat.init_decode_state(), flat.load_params()
    p, _ = eng.prefill(params=params, tokens=list(range(3, 15)), sampling=sp)
    q, _ = flat.prefill(params=fparams, tokens=list(range(3, 15)), sampling=sp)
    state, fstate = eng.insert(p, state, 2), flat.insert(q, fstate, 2)
    for _ in range(30):  # through the buckets 16, 32 and 64
        state, got = eng.generate(params, state)
        fstate, want = flat.generate(fparams, fstate)
        assert got.tokens[2, 0] == want.tokens[2, 0] and got.logprobs[2, 0] == want.logprobs[2, 0]


def test_slots_at_the_cache_limit_equal_the_contiguous_engine(tiny):
    """Slots that reach max_cache_length stop yielding while others go on; a step in which
    every busy slot is at its limit writes nothing and still takes its bucket's table."""
    sp = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, logprobs=True)
    out = []
    for eng in (_engine(tiny), _engine(tiny, page_size=16)):
        params, state = eng.load_params(), eng.init_decode_state()
        state = eng.insert(eng.prefill(params=params, tokens=list(range(3, 27)), sampling=sp)[0], state, 0)
        state = eng.insert(eng.prefill(params=params, tokens=list(range(5, 25)), sampling=sp)[0], state, 2)
        rows = []
        for _ in range(48):  # past both slots' limits (40 and 44 completion tokens)
            state, res = eng.generate(params, state)
            valid = res.valid[:, 0].astype(bool)  # an empty slot's row is not compared
            rows.append((np.where(valid, res.tokens[:, 0], -1).tolist(), valid.tolist(),
                         np.where(valid, res.logprobs[:, 0], 0.0).tolist(), res.lengths.tolist()))
        out.append(rows)
    assert out[0] == out[1]
    assert out[1][-1][1] == [False] * 4 and out[1][-1][3][0] == 40 and out[1][-1][3][2] == 44


def test_a_bounded_pool_is_checked_and_refuses_cleanly(tiny):
    with pytest.raises(InvalidRequest, match="kv_pages=5 needs page_size"):
        _engine(tiny, kv_pages=5)
    with pytest.raises(InvalidRequest, match="at least one context's pages and one more"):
        _engine(tiny, page_size=16, kv_pages=4)  # 64 positions: 4 blocks, and one for a copy on write
    with pytest.raises(InvalidRequest, match="page_size=-1"):
        _engine(tiny, page_size=-1)
    eng = _engine(tiny, page_size=8, kv_pages=9)
    params, state = eng.load_params(), eng.init_decode_state()
    assert eng._paged.tensors[0].shape[1] == 9
    compiled = COUNTS["compiled"]
    sp = SamplingParams(temperature=0, max_tokens=8)
    a, _ = eng.prefill(params=params, tokens=list(range(3, 27)), sampling=sp)  # 24 positions: 3 full blocks
    b, _ = eng.prefill(params=params, tokens=list(range(3, 26)), sampling=sp)  # 23: 3 blocks, the last partly filled
    c, _ = eng.prefill(params=params, tokens=list(range(5, 21)), sampling=sp)  # 16: 2 full blocks
    with pytest.raises(InsufficientMemory, match="K/V page pool"):
        eng.prefill(params=params, tokens=list(range(3, 20)), sampling=sp)  # 3 more blocks: 1 is free
    assert eng.pages.held == 8
    state = eng.insert(b, state, 0)
    state, _ = eng.generate(params, state)  # the shared last block copied: the ninth block
    assert eng.pages.held == 9
    state = eng.insert(a, state, 1)
    with pytest.raises(InsufficientMemory, match="K/V page pool"):
        eng.generate(params, state)  # both slots need a fresh block for position 24: none left
    assert eng.pages.held == 9 and state.slots[0].total == 25  # nothing moved
    state = eng.free_resource(state, 1)
    del a
    gc.collect()  # a's blocks back in the pool
    state, res = eng.generate(params, state)  # slot 0 goes on
    assert res.valid[0, 0] and not res.valid[1, 0]
    assert COUNTS["compiled"] == compiled  # one pool size: nothing compiled after construction
    flat = _engine(tiny)
    fp = flat.load_params()
    fs = flat.insert(flat.prefill(params=fp, tokens=list(range(3, 26)), sampling=sp)[0], flat.init_decode_state(), 0)
    for _ in range(2):
        fs, want = flat.generate(fp, fs)
    assert res.tokens[0, 0] == want.tokens[0, 0]
    del c


def test_an_unbounded_pool_grows_and_keeps_what_it_held(tiny):
    """Past every slot's full context (the pool's first size), prefixes the driver keeps
    take more blocks: the pool grows, its graphs are compiled once for the new size, and
    the K/V already held read the same."""
    eng = _engine(tiny, page_size=16)
    params, state = eng.load_params(), eng.init_decode_state()
    sp = SamplingParams(temperature=0, max_tokens=4)
    kept = [eng.prefill(params=params, tokens=list(range(3 + i, 27 + i)), sampling=sp)[0] for i in range(8)]
    assert eng._paged.tensors[0].shape[1] == 4 * 4 and eng.pages.held == 16  # 4 slots x 64 positions in blocks of 16
    before = eng.export_prefix(kept[0]).k
    compiled = COUNTS["compiled"]
    kept.append(eng.prefill(params=params, tokens=list(range(11, 35)), sampling=sp)[0])
    assert eng.pages.held == 18 and eng._paged.tensors[0].shape[1] == 24  # grown by half
    np.testing.assert_array_equal(eng.export_prefix(kept[0]).k, before)
    state = eng.insert(kept[-1], state, 0)
    state, res = eng.generate(params, state)
    token = int(res.tokens[0, 0])  # read: the step (on the worker thread) has run
    grown = COUNTS["compiled"] - compiled
    assert grown == 2  # the context and token-generation graphs of 24 blocks, once each
    state = eng.insert(kept[1], state, 1)
    state, again = eng.generate(params, state)
    assert again.valid[1, 0] and COUNTS["compiled"] - compiled == grown  # not again
    flat = _engine(tiny)
    p, _ = flat.prefill(params=flat.load_params(), tokens=list(range(11, 35)), sampling=sp)
    _, want = flat.generate(flat.load_params(), flat.insert(p, flat.init_decode_state(), 0))
    assert token == want.tokens[0, 0]


def test_the_driver_admits_requests_by_free_blocks_and_equals_the_contiguous_engine(tiny):
    """The driver's block manager on a bounded pool of 9 blocks of 8 positions (one context
    and one more) with four slots: four seeded requests of 17-20 prompt tokens (3 blocks)
    writing 3 tokens each (a copy of the partly filled last block: 4 blocks apiece)
    cannot all run at once and are admitted by the blocks free; tokens and log-probs
    equal the contiguous engine's."""
    from polyengine.driver import LLM

    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 280, int(n)).tolist() for n in (17, 18, 19, 20)]
    sps = [SamplingParams(temperature=0.8, seed=10 + i, max_tokens=3, ignore_eos=True, logprobs=True)
           for i in range(4)]

    def run(eng):
        llm = LLM.from_engine(eng, tools=False)
        reqs = [llm.submit(p, sp) for p, sp in zip(prompts, sps)]
        running = 0
        while not all(r.done for r in reqs):
            llm.step()
            running = max(running, len({id(r) for r, _ in llm.scheduler._slots.values()}))
        return [(o.token_ids, o.logprobs) for r in reqs for o in r.completion.outputs], llm.page_stats, running

    # batched prefill off in both: the bounded pool admits fewer prompts at once, and a
    # batch of other rows rounds its logits differently (tests/test_neuron_batched.py)
    want, _, _ = run(_engine(tiny, batched_prefill="off"))
    got, stats, running = run(_engine(tiny, page_size=8, kv_pages=9, batched_prefill="off"))
    assert stats["preemptions"] == 0 and stats["total"] == 9 and running < 4, (stats, running)
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt == wt
        np.testing.assert_array_equal(gl, wl)
