"""The driver's prefix cache and chunked prefill (core/driver/prefix_cache.py, prefill.py).

The cache alone (longest match, LRU within a byte budget, entries in use never evicted,
the radix tree against a brute-force model), then through the driver on the reference
backend: output with the cache and chunking equals output without them (greedy, seeded,
n > 1, shared system prompts, conversations), chunks interleave with decode steps,
eviction under memory pressure, requests cancelled while their prefix is shared, and
the budget counted by the engine's memory check. All tiny models: milliseconds each.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass

import numpy as np
import pytest

from polyengine import EngineConfig, SamplingParams
from polyengine.driver import LLM
from polyengine.driver.prefill import DEFAULT_PREFILL_CHUNK
from polyengine.driver.prefix_cache import PrefixCache
from polyengine.errors import InsufficientMemory
from polyengine.memory import simulated_limit
from polyengine.models import load_model


@dataclass
class FakePrefix:
    prompt_tokens: tuple[int, ...]
    nbytes: int = 10

    @property
    def true_length(self) -> int:
        return len(self.prompt_tokens)


# -- the cache alone --------------------------------------------------------------------------


def test_lookup_finds_the_longest_proper_prefix_and_how_far_prompts_agree():
    cache = PrefixCache(1000)
    for toks in ((1, 2, 3), (1, 2, 3, 4, 5), (1, 2, 9, 9), (7,)):
        cache.insert(FakePrefix(toks))
    entry, matched = cache.lookup([1, 2, 3, 4, 5, 6])
    assert entry.length == 5 and matched == 5
    entry, matched = cache.lookup([1, 2, 3, 4, 5])  # an equal entry leaves no token to prefill: the shorter one
    assert entry.length == 3 and matched == 5
    entry, matched = cache.lookup([1, 2, 9, 8])
    assert entry is None and matched == 3  # shares 3 tokens with (1, 2, 9, 9), no entry is a prefix
    assert cache.lookup([8, 1]) == (None, 0)
    assert cache.stats.queries == 4 and cache.stats.query_tokens == 17 and cache.stats.hits == 0


def test_covering_finds_the_shortest_entry_that_holds_a_shared_run():
    """Where a prompt parts from cached ones, the entry to cut the shared run from: any
    entry beginning with the run (the shortest), within the partition, also when the
    run ends inside an edge of the tree; a hit is counted only when one is acquired."""
    cache = PrefixCache(1000)
    for toks in ((1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 9), (1, 2, 3, 4, 9, 9, 9)):
        cache.insert(FakePrefix(toks))
    cache.insert(FakePrefix((1, 2, 3, 7)), partition="other")
    assert cache.covering([1, 2, 3]).length == 5  # inside the edge below (1, 2, 3, 4)
    assert cache.covering([1, 2, 3, 4, 5]).length == 6 and cache.covering([1, 2, 3, 4, 9, 9]).length == 7
    assert cache.covering([1, 2, 8]) is None and cache.covering([1, 2, 3, 4, 5, 6, 7]) is None
    assert cache.covering([1, 2, 3, 7]) is None and cache.covering([1, 2, 3, 7], "other").length == 4
    assert cache.stats.hits == 0 and cache.stats.queries == 0


def test_lru_eviction_within_the_budget_never_touches_entries_in_use():
    cache = PrefixCache(30)
    a, b, c = (cache.insert(FakePrefix((i, i + 1))) for i in (1, 3, 5))
    assert cache.stats.bytes == 30 and len(cache) == 3
    cache.acquire(a)  # a is in use and most recently used
    d = cache.insert(FakePrefix((7, 8)))  # evicts b, the least recently used entry not in use
    assert d is not None and [e.length for e in cache.entries()] == [2, 2, 2]
    assert cache.lookup([3, 4, 0]) == (None, 0) and cache.stats.evictions == 1
    cache.acquire(c)
    cache.acquire(d)
    assert cache.insert(FakePrefix((9, 9))) is None  # everything is in use: refused, nothing evicted
    assert cache.insert(FakePrefix((9, 9), nbytes=31)) is None  # larger than the whole budget
    assert cache.stats.evictions == 1 and cache.stats.bytes == 30
    for e in (a, c, d):
        cache.release(e)
    assert cache.insert(FakePrefix((9, 9))) is not None and cache.stats.evictions == 2
    assert cache.stats.hits == 3 and cache.stats.hit_tokens == 6


def test_entries_of_one_prompt_go_before_entries_where_prompts_part():
    """The two segments: an entry cut where prompts part outlives more recent entries
    filed for one prompt; among those, a hit makes an entry the most recent."""
    cache = PrefixCache(30)
    system = cache.insert(FakePrefix((1, 2)), shared=True)
    cache.insert(FakePrefix((1, 2, 3)))
    cache.insert(FakePrefix((4, 5)))
    cache.insert(FakePrefix((6, 7)))  # evicts (1, 2, 3): the oldest entry of one prompt
    assert system in cache.entries() and cache.lookup([1, 2, 3, 9]) == (system, 2)
    used = cache.lookup([4, 5, 9])[0]
    cache.acquire(used)
    cache.release(used)
    cache.insert(FakePrefix((8, 9)))  # evicts (6, 7): (4, 5) was continued since
    assert {e.prefix.prompt_tokens for e in cache.entries()} == {(1, 2), (4, 5), (8, 9)}
    assert not used.shared  # a hit refreshes an entry; it does not move it to the other segment


def test_an_entry_a_newer_one_extends_goes_first():
    """A conversation's previous turn, once its next turn is filed, is the least recent
    entry of its segment; an entry where prompts part is never demoted that way."""
    cache = PrefixCache(50)
    turn1 = cache.insert(FakePrefix((1, 2)))
    other = cache.insert(FakePrefix((7, 8)))
    system = cache.insert(FakePrefix((4, 4)), shared=True)
    cache.insert(FakePrefix((1, 2, 3, 4)))  # extends turn1: turn1 goes first now
    assert cache.entries()[0] is turn1
    cache.insert(FakePrefix((4, 4, 5)))  # extends the shared entry, which keeps its place
    cache.insert(FakePrefix((9, 9)))  # room for one more: turn1 leaves, not the older `other`
    assert turn1 not in cache.entries() and other in cache.entries() and system in cache.entries()


def test_resize_evicts_in_eviction_order_down_to_the_new_budget_and_keeps_entries_in_use():
    cache = PrefixCache(100)
    a, b, c, d = (cache.insert(FakePrefix((i, i + 1)), shared=i == 1) for i in (1, 3, 5, 7))
    cache.acquire(c)  # in use: stays whatever the budget
    cache.resize(25)
    # one-prompt entries first, least recently used first (b, then d); the shared a last
    assert [e.prefix.prompt_tokens for e in cache.entries()] == [(1, 2), (5, 6)]
    assert cache.budget == 25 and cache.stats.bytes == 20 and cache.stats.evictions == 2
    cache.resize(-5)  # counts as 0: everything not in use goes, the held entry stays over it
    assert cache.budget == 0 and [e.prefix.prompt_tokens for e in cache.entries()] == [(5, 6)]
    assert cache.insert(FakePrefix((9, 9))) is None  # no room: not filed
    cache.release(c)
    cache.resize(100)  # growing evicts nothing and makes room again
    assert cache.stats.bytes == 10 and cache.insert(FakePrefix((9, 9))) is not None
    assert (a, b, d) and cache.stats.evictions == 3


def test_an_entry_filed_twice_is_kept_once():
    cache = PrefixCache(100)
    first = cache.insert(FakePrefix((1, 2, 3)))
    assert cache.insert(FakePrefix((1, 2, 3), nbytes=50)) is first
    assert cache.stats.bytes == 10 and cache.stats.inserts == 1


def test_the_radix_tree_agrees_with_a_brute_force_model_through_inserts_and_evictions():
    """Random prompts over a 3-token alphabet (so they share long runs), random budgets:
    every lookup equals a scan over the live entries, and the byte count their sum."""
    rng = random.Random(7)
    for budget in (40, 90, 400):
        cache = PrefixCache(budget)
        for _ in range(400):
            toks = tuple(rng.randrange(3) for _ in range(rng.randint(1, 9)))
            if rng.random() < 0.5:
                cache.insert(FakePrefix(toks, nbytes=rng.randint(1, 30)))
            live = {e.prefix.prompt_tokens for e in cache.entries()}
            probe = tuple(rng.randrange(3) for _ in range(rng.randint(1, 10)))
            entry, matched = cache.lookup(probe)
            best = max((t for t in live if len(t) < len(probe) and probe[: len(t)] == t), key=len, default=None)
            agree = max((next((i for i, (x, y) in enumerate(zip(t, probe)) if x != y), min(len(t), len(probe)))
                         for t in live), default=0)
            assert (entry.prefix.prompt_tokens if entry else None) == best
            assert matched == agree
            assert cache.stats.bytes == sum(e.nbytes for e in cache.entries()) <= budget


# -- through the driver -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("random:tiny-gqa")


def make(model, block: int = 4, **cfg) -> LLM:
    base = dict(max_slots=3, max_prefill_length=60, max_cache_length=96)
    llm = LLM(model, backend="reference", tools=False, **{**base, **cfg})
    llm.scheduler.prefiller.block = block  # the tests' prompts are short
    return llm


def _prompts(rng: np.random.Generator, count: int, shared: int, vocab: int = 280) -> list[list[int]]:
    system = rng.integers(3, vocab, shared).tolist()
    return [system + rng.integers(3, vocab, int(rng.integers(1, 14))).tolist() for _ in range(count)]


SAMPLINGS = [
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.2, seed=5, max_tokens=6, ignore_eos=True,
                   logprobs=True, top_logprobs=2),
    SamplingParams(temperature=1.3, seed=9, n=2, max_tokens=5, ignore_eos=True),
]


@pytest.mark.parametrize("chunk", [0, 8, 5])
def test_output_with_the_cache_and_chunks_equals_output_without(tiny, chunk):
    """Shared system prompts and distinct ones, greedy, seeded (penalties over the whole
    prompt) and n = 2, mixed sampling per request so a cached prefix made with one
    request's parameters is continued with another's: every token and log-prob equals
    a run with neither cache nor chunks, and the cached tokens are reported."""
    on, off = make(tiny, prefill_chunk=chunk, prefix_cache_bytes=8 << 20), make(tiny, prefill_chunk=0, prefix_cache_bytes=0)
    assert on.scheduler.prefix_cache is not None and off.scheduler.prefix_cache is None
    rng = np.random.default_rng(chunk)
    prompts = _prompts(rng, 8, 30) + _prompts(rng, 3, 0)
    sampling = [SAMPLINGS[i % 3] for i in range(len(prompts))]
    reported = 0
    for round_ in range(3):  # later rounds find earlier rounds' prompts cached
        got, want = on.generate(prompts, sampling), off.generate(prompts, sampling)
        for g, w in zip(got, want):
            assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
            if g.outputs[0].logprobs is not None:
                np.testing.assert_allclose(g.outputs[0].logprobs, w.outputs[0].logprobs, rtol=1e-9)
        cached = [c.usage.cached_tokens for c in got]
        reported += sum(cached)
        assert all(c == 0 for c in (w.usage.cached_tokens for w in want))
        if round_ == 0:  # the second sharing the system prompt cuts the first's entry at 28 tokens
            assert cached[:1] == [0] and cached[1:8] == [28] * 7 and cached[8:] == [0] * 3
        if round_ == 2:  # every prompt continues an entry of its own, one piece short of it
            assert all(c >= len(p) - 4 for c, p in zip(cached, prompts)), cached
    cache = on.scheduler.prefix_cache
    assert cache.stats.hit_tokens == reported and all(e.refs == 0 for e in cache.entries())


def test_a_conversation_continues_its_previous_turn(tiny):
    """Each turn's prompt is the last turn's prompt, its answer and a new message: the
    last turn's prompt comes from the cache, and the answers equal uncached ones."""
    on, off = make(tiny, prefill_chunk=8), make(tiny, prefix_cache_bytes=0, prefill_chunk=0)
    rng = np.random.default_rng(3)
    sp = SamplingParams(temperature=0.8, seed=11, max_tokens=6, ignore_eos=True)
    prompt = rng.integers(3, 280, 12).tolist()
    for turn in range(4):
        got, want = on.generate([prompt], sp)[0], off.generate([prompt], sp)[0]
        assert got.token_ids == want.token_ids
        if turn:
            assert got.usage.cached_tokens == previous
        previous = len(prompt)
        prompt = prompt + got.token_ids + rng.integers(3, 280, 5).tolist()


class PrefillLog:
    """Wraps an engine: records each prefill's token count, and the step it ran in (the
    entries of a batched prefill too; ``batches`` the token counts of each batched call)."""

    def __init__(self, engine):
        self.engine, self.calls, self.step, self.batches = engine, [], 0, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prefill(self, **kw):
        self.calls.append((self.step, len(kw["tokens"]), kw["existing_prefix"] is not None))
        return self.engine.prefill(**kw)

    def prefill_batch(self, *, params, requests):
        self.calls += [(self.step, len(r.tokens), r.existing_prefix is not None) for r in requests]
        self.batches.append([len(r.tokens) for r in requests])
        return self.engine.prefill_batch(params=params, requests=requests)


def test_a_long_prompt_is_prefilled_a_chunk_per_step_while_streams_decode(tiny):
    """Two streams decode; a 57-token prompt arrives: it is prefilled in pieces of at most
    8 tokens, one chunk's worth per step, and the running streams get a token in every
    step meanwhile. With nothing decoding, the prompt is one piece (there is no pace to
    keep, and small pieces cost more)."""
    base = make(tiny, prefill_chunk=8, max_num_batched_tokens=8, prefix_cache_bytes=0, max_slots=3)
    log = PrefillLog(base.engine)
    llm = LLM.from_engine(log, tools=False)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    streams = [llm.submit([5 + i, 6, 7], sp) for i in range(2)]
    llm.step()
    long = llm.submit(list(range(3, 60)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    gaps = 0
    while not long.done:
        log.step += 1
        before = [len(s.samples[0].out.token_ids) for s in streams]
        llm.step()
        gaps += sum(len(s.samples[0].out.token_ids) == b for s, b in zip(streams, before))
    pieces = [(step, n) for step, n, _ in log.calls[2:]]
    assert [n for _, n in pieces] == [8] * 7 + [1] and len({s for s, _ in pieces}) == 8  # one chunk per step
    assert gaps == 0
    alone = make(tiny, prefill_chunk=8, prefix_cache_bytes=0)
    log2 = PrefillLog(alone.engine)
    solo = LLM.from_engine(log2, tools=False)
    solo.generate([list(range(3, 60))], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert [n for _, n, _ in log2.calls] == [57]
    assert long.completion.token_ids == solo.generate([list(range(3, 60))], long.sampling)[0].token_ids


def test_the_second_prompt_sharing_a_system_prompt_runs_one_prefill(tiny):
    """Where a prompt parts from a cached one, the shared part is cut as a head
    (engine.prefix_head: no forward, no logits of its own) and filed; the prompt's own
    tokens are then its one prefill, continuing the head (no truncate_prefix, whose cut
    prefills the last shared token again); the third continues the filed head; the
    answers equal uncached ones."""
    on, off = make(tiny, prefill_chunk=0), make(tiny, prefix_cache_bytes=0, prefill_chunk=0)
    log = PrefillLog(on.engine)
    cuts = []
    log.truncate_prefix = lambda **kw: cuts.append(kw["length"]) or on.engine.truncate_prefix(**kw)
    llm = LLM.from_engine(log, tools=False)
    llm.scheduler.prefiller.block = 4
    assert llm.scheduler.prefiller.heads
    rng = np.random.default_rng(4)
    system = rng.integers(3, 280, 30).tolist()
    prompts = [system + rng.integers(3, 280, 6).tolist() for _ in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        log.calls.clear()
        got = llm.generate([prompt], sp)[0]
        assert got.token_ids == off.generate([prompt], sp)[0].token_ids
        if i:  # 28 tokens from the cache (the cut at the block below where they part), the other 8 prefilled once
            assert got.usage.cached_tokens == 28 and [(n, cont) for _, n, cont in log.calls] == [(8, True)], log.calls
    assert cuts == []
    heads = [e for e in llm.scheduler.prefix_cache.entries() if e.prefix.logits is None]
    assert [e.length for e in heads] == [28]


def test_conversations_under_memory_pressure_continue_their_latest_turn(tiny):
    """Four conversations taking turns, a budget below their working set (their latest
    turns plus the new ones): every turn after the first continues the conversation's
    previous prompt (superseded turns are evicted first), and the answers equal
    uncached ones."""
    per_token = tiny.config.kv_bytes_per_token(8)
    on = make(tiny, prefix_cache_bytes=150 * per_token)
    off = make(tiny, prefix_cache_bytes=0, prefill_chunk=0)
    rng = np.random.default_rng(1)
    convs = [rng.integers(3, 280, 8).tolist() for _ in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for turn in range(4):
        for c, prompt in enumerate(convs):
            got = on.generate([prompt], sp)[0]
            assert got.token_ids == off.generate([prompt], sp)[0].token_ids
            assert got.usage.cached_tokens == (0 if turn == 0 else len(prompt) - 8), (turn, c)
            convs[c] = prompt + got.token_ids + rng.integers(3, 280, 4).tolist()
    assert on.scheduler.prefix_cache.stats.evictions > 0


def test_eviction_under_memory_pressure_keeps_the_budget_and_the_output(tiny):
    """A budget of about three prompts' K/V and twelve prompts in three families, taken
    in turn: entries are evicted (counted), the cache never holds more than its budget,
    the families' shared prefixes are still continued, and every output equals the
    uncached one."""
    per_token = tiny.config.kv_bytes_per_token(8)  # the reference computes in float64
    on = make(tiny, prefix_cache_bytes=100 * per_token, prefill_chunk=8)
    off = make(tiny, prefix_cache_bytes=0, prefill_chunk=0)
    cache = on.scheduler.prefix_cache
    rng = np.random.default_rng(5)
    families = [_prompts(rng, 4, 20) for _ in range(3)]
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    for prompt in [p for trio in zip(*families) for p in trio]:
        assert on.generate([prompt], sp)[0].token_ids == off.generate([prompt], sp)[0].token_ids
        assert cache.stats.bytes <= cache.budget
    assert cache.stats.evictions > 0 and cache.stats.hits > 0 and len(cache) >= 1


def test_a_request_cancelled_while_its_prefix_is_shared(tiny):
    """Three requests continue one cached system prompt; the second is cancelled in the
    middle of its chunked prefill (streams decoding, so it takes several steps). It lets
    go of the entry, nothing leaks, and the others' output equals the uncached output;
    a request continuing the cancelled one's cached neighbours is exact too."""
    llm = make(tiny, prefill_chunk=4, max_num_batched_tokens=4, max_slots=4)
    off = make(tiny, prefix_cache_bytes=0, prefill_chunk=0, max_slots=4)
    cache = llm.scheduler.prefix_cache
    rng = np.random.default_rng(9)
    prompts = _prompts(rng, 4, 24)
    sp = SamplingParams(temperature=0.7, seed=21, max_tokens=8, ignore_eos=True)
    llm.generate(prompts[:1], sp)  # the system prompt's neighbourhood is now cached
    llm.generate(prompts[1:2], sp)  # leaves an entry where the two prompts part
    keeper = llm.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    llm.step()  # something decodes: prefills now go a chunk per step
    a, b, c = (llm.submit(p + rng.integers(3, 280, 9).tolist(), sp) for p in prompts[1:])
    filling = lambda: [r for r, _ in llm.scheduler._filling]  # noqa: E731
    while b not in filling():
        llm.step()
    llm.step()
    assert b in filling() and not b.done  # b is part way through
    b.cancel()
    assert b.status == "cancelled" and b not in filling()
    while not (a.done and c.done and keeper.done):
        llm.step()
    for req in (a, c):
        assert req.completion.token_ids == off.generate([req.prompt_tokens], sp)[0].token_ids
        assert req.completion.usage.cached_tokens >= 24
    assert all(e.refs == 0 for e in cache.entries())
    assert cache.stats.bytes == sum(e.nbytes for e in cache.entries()) <= cache.budget
    again = llm.generate([b.prompt_tokens], sp)[0]
    assert again.token_ids == off.generate([b.prompt_tokens], sp)[0].token_ids and again.usage.cached_tokens >= 24


def test_the_budget_is_counted_by_the_memory_check_and_both_can_be_turned_off(tiny):
    """The default budget is as large as the slots' KV cache and the engine refuses,
    before allocating, what does not fit with it (the message names the setting); with
    prefix_cache_bytes=0 the same limit fits. prefill_chunk=0 prefills a prompt whole."""
    cfg = dict(max_slots=3, max_prefill_length=60, max_cache_length=96)
    from polyengine.backends.reference.engine import ReferenceEngine

    eng = ReferenceEngine(tiny, EngineConfig(**cfg))
    slots_kv = 3 * 96 * tiny.config.kv_bytes_per_token(8)
    assert eng.prefix_cache_bytes == slots_kv
    needed_without = ReferenceEngine(tiny, EngineConfig(**cfg, prefix_cache_bytes=0)).check_memory({})
    weights = tiny.config.num_parameters() * 8
    limit = weights + slots_kv + slots_kv // 2 + (256 << 20)  # room for the caches, not for the budget too
    with simulated_limit(limit), pytest.raises(InsufficientMemory, match="prefix_cache_bytes"):
        ReferenceEngine(tiny, EngineConfig(**cfg))
    with simulated_limit(limit):
        ReferenceEngine(tiny, EngineConfig(**cfg, prefix_cache_bytes=0))
    assert needed_without >= 0
    whole = make(tiny, prefill_chunk=0)
    log = PrefillLog(whole.engine)
    LLM.from_engine(log, tools=False).generate([list(range(3, 60))], SamplingParams(max_tokens=2, seed=1))
    assert [n for _, n, _ in log.calls] == [57]
    assert make(tiny).scheduler.prefiller.chunk == DEFAULT_PREFILL_CHUNK


def test_engines_without_prefix_reuse_run_without_cache_or_chunks():
    from mock_engine import MockEngine, tiny_model

    eng = MockEngine(tiny_model(), EngineConfig(max_slots=2, max_prefill_length=40, max_cache_length=64,
                                                prefill_chunk=4, prefix_cache_bytes=1 << 20))
    llm = LLM.from_engine(eng, tools=False)
    assert llm.scheduler.prefix_cache is None and llm.scheduler.prefiller.chunk == 0
    out = llm.generate([list(range(1, 30))], SamplingParams(max_tokens=3))[0]
    assert out.token_ids == [sum(range(1, 30)) % 50, (sum(range(1, 30)) + 1) % 50, (sum(range(1, 30)) + 2) % 50]


def test_on_a_cache_that_grows_the_default_budget_is_what_the_slots_leave(tiny):
    """cuda_torch's host cache grows with use (kv_memory "grow"): its default prefix
    budget shares the slots' bytes, so cached prefixes and the slots' K/V together never
    exceed a reserved cache's (the memory check counts the cache once). Long requests
    push the cached prompts out as they grow; output equals the uncached engine's. An
    explicit budget, or a reserved cache, keeps a budget of its own."""
    pytest.importorskip("torch")
    base = dict(max_slots=2, max_prefill_length=96, max_cache_length=128, options={"cpu_kernels": False})
    grow = LLM(tiny, backend="cpu", tools=False, **base)
    eng, cache = grow.engine, grow.scheduler.prefix_cache
    slots_kv = eng.kv_bytes(2 * 128)
    assert eng.prefix_cache_shares_kv and eng.prefix_cache_bytes == slots_kv
    for other in (dict(prefix_cache_bytes=slots_kv), dict(options={"cpu_kernels": False, "kv_memory": "reserve"})):
        separate = LLM(tiny, backend="cpu", tools=False, **{**base, **other}).engine
        assert not separate.prefix_cache_shares_kv
        # counted beside the cache; shared, it lies within the KV cache's own bytes (counted once)
        assert separate.check_memory({}) - eng.check_memory({}) == separate.prefix_cache_bytes == slots_kv
    off = LLM(tiny, backend="cpu", tools=False, prefix_cache_bytes=0, **base)
    rng = np.random.default_rng(3)
    short = [rng.integers(3, 280, 40).tolist() for _ in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for p in short:
        assert grow.generate([p], sp)[0].token_ids == off.generate([p], sp)[0].token_ids
    assert len(cache) == 3 and cache.stats.evictions == 0
    long_sp = SamplingParams(temperature=0.8, seed=4, max_tokens=60, ignore_eos=True)
    reqs = [grow.submit(rng.integers(3, 280, 60).tolist(), long_sp) for _ in range(2)]
    seen = 0
    while not all(r.done for r in reqs):
        # what the slots hold when the step starts sizes the cache for that step
        in_use = sum(len(r.prompt_tokens) + len(s.out.token_ids) for r, s in grow.scheduler._slots.values())
        grow.step()
        assert cache.budget == max(0, slots_kv - eng.kv_bytes(in_use))
        assert cache.stats.bytes <= max(cache.budget, 0) or all(e.refs for e in cache.entries())
        seen = max(seen, in_use)
    assert seen >= 2 * 100 and cache.stats.evictions >= 2  # 240 of 256 positions at the end: little room left
    for r in reqs:
        assert r.completion.outputs[0].token_ids == off.generate([r.prompt_tokens], long_sp)[0].token_ids
    grow.step()
    assert cache.budget == slots_kv  # nothing runs: the whole budget again
