"""Paged K/V (core/pages.py, the reference's ``page_size`` option) and the prefix cache
serving a cached prompt's shared part (``truncate_prefix``).

The pool alone (counts, reuse order, copy on write, refusals), then the paged reference
against the contiguous one (bit for bit, pages shared on insert and continuation, given
back on free and when a prefix is dropped), then through the driver: the second and
third requests sharing a system prompt take its full pages from the cache, on the
reference (contiguous and paged) and the cpu backend, with outputs equal to the
uncached ones. Tiny models: about a second in all.
"""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest

from polyengine import EngineConfig, SamplingParams
from polyengine.driver import LLM
from polyengine.errors import InsufficientMemory, InvalidRequest, UnsupportedFeature
from polyengine.kit import EngineBase
from polyengine.models import load_model
from polyengine.pages import PageError, PageList, PagePool
from polyengine.protocol import Capabilities, protocol_problems

from polyengine.backends.reference.engine import ReferenceEngine

# -- the pool ---------------------------------------------------------------------------------


def test_pages_are_counted_shared_and_reused_lowest_first():
    pool = PagePool(4, capacity=6)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.held == 3 and pool.free == 3
    pool.share(a[:2])
    assert [pool.refcount(p) for p in a] == [2, 2, 1]
    assert pool.release(a) == [2]  # only the unshared page is freed
    assert pool.release(a[:2]) == [0, 1] and pool.held == 0
    assert pool.allocate(2) == [0, 1]  # a freed page is the next handed out
    with pytest.raises(InsufficientMemory, match="5 were asked for"):
        pool.allocate(5)
    assert pool.held == 2  # a refused allocation takes nothing


def test_double_frees_and_shares_of_free_pages_are_refused_before_any_change():
    pool = PagePool(4)
    a, b = pool.allocate(2)
    with pytest.raises(PageError, match="double free"):
        pool.release([a, b, b])
    assert pool.refcount(a) == pool.refcount(b) == 1
    pool.release([b])
    with pytest.raises(PageError, match="free"):
        pool.share([b])
    with pytest.raises(PageError, match="never allocated"):
        pool.refcount(7)


def test_copy_on_write_copies_a_shared_page_only():
    pool, copies = PagePool(4), []
    seq = PageList.new(pool, 6)  # pages [0, 1]: the second holds 2 of 4 positions
    other = seq.fork()
    assert [pool.refcount(p) for p in seq.pages] == [2, 2]
    other.prepare_write(6, 9, lambda s, d: copies.append((s, d)))  # adds page 2, then copies page 1 to write it
    assert copies == [(1, 3)] and other.pages == [0, 3, 2] and other.length == 9
    assert [pool.refcount(p) for p in (0, 1, 2, 3)] == [2, 1, 1, 1]
    seq.prepare_write(6, 7, lambda s, d: copies.append((s, d)))  # now its own: written in place
    assert copies == [(1, 3)] and seq.pages == [0, 1]
    head = other.fork(4)  # a full page only
    assert head.pages == [0] and pool.refcount(0) == 3
    for s in (seq, other, head):
        s.release()
    assert pool.held == 0


def test_a_pool_rebuilt_from_its_counts_reads_the_same():
    """PagePool.counts / from_counts (a multi-host leader's copy of its workers' pool):
    the same counts, held, free and shared pages, and the next ids handed out."""
    pool = PagePool(4, 8)
    a, b = pool.allocate(3), pool.allocate(2)
    pool.share(a[:2])
    pool.release([b[0], a[2]])
    copy = PagePool.from_counts(4, 8, pool.counts())
    assert copy.counts() == pool.counts() == [2, 2, 0, 0, 1]
    assert (copy.held, copy.free, copy.shared, copy.allocated) == (pool.held, pool.free, pool.shared, 5)
    assert [copy.refcount(p) for p in range(5)] == [pool.refcount(p) for p in range(5)]
    assert copy.allocate(3) == pool.allocate(3) == [2, 3, 5]
    with pytest.raises(PageError, match="negative"):
        PagePool.from_counts(4, None, [1, -1])


def test_a_finalized_page_list_gives_its_pages_back_when_dropped():
    pool = PagePool(4)
    seq = PageList.new(pool, 8, finalize=True)
    keep = seq.fork(finalize=True)
    del seq
    gc.collect()
    assert pool.held == 2 and all(pool.refcount(p) == 1 for p in keep.pages)
    keep.release()  # an explicit release detaches the finalizer: no second release
    del keep
    gc.collect()
    assert pool.held == 0


# -- the paged reference --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("random:tiny-gqa")


CFG = EngineConfig(max_slots=3, max_prefill_length=60, max_cache_length=96)


def _engines(model, dtype="float64"):
    cfg = CFG.model_copy(update={"dtype": dtype})
    return ReferenceEngine(model, cfg), ReferenceEngine(model, cfg.model_copy(update={"options": {"page_size": 4}}))


def test_the_paged_reference_declares_its_pages_and_equals_the_contiguous_one(tiny):
    """Prefill, a continuation, a truncation, insert, bulk_insert, steps and a freed and
    reused slot: every token and log-prob of the paged engine equals the contiguous
    engine's exactly (the forward is the same; only where K/V live differs)."""
    flat, paged = _engines(tiny)
    assert paged.capabilities.paged_kv and paged.capabilities.page_size == 4 and not flat.capabilities.paged_kv
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 280, 23).tolist()
    sp = SamplingParams(temperature=0.9, seed=4, max_tokens=20, logprobs=True, n=2)
    runs = []
    for eng in (flat, paged):
        params, state = eng.load_params(), eng.init_decode_state()
        head, _ = eng.prefill(params=params, tokens=prompt[:10], sampling=sp)
        whole, first = eng.prefill(params=params, tokens=prompt[10:], sampling=sp, existing_prefix=head)
        cut = eng.truncate_prefix(params=params, prefix=whole, length=13)
        state = eng.insert(cut, state, 0)
        state, firsts = eng.bulk_insert(whole, state, [1, 2])
        out = [int(first.tokens[0, 0]), cut.first_token, *firsts.tokens[:, 0].tolist()]
        for step in range(8):
            if step == 4:
                state = eng.free_resource(state, 1)
                state = eng.insert(head, state, 1)
            state, res = eng.generate(params, state)
            out.append((res.tokens[:, 0].tolist(), res.logprobs[:, 0].tolist()))
        runs.append(out)
        np.testing.assert_array_equal(eng.export_prefix(cut).k, eng.export_prefix(whole).k[:, :, :13])
    assert runs[0] == runs[1]


def test_inserting_and_continuing_share_pages_and_free_gives_them_back(tiny):
    _, eng = _engines(tiny)
    pool, params, state = eng.pages, eng.load_params(), eng.init_decode_state()
    sp = SamplingParams(temperature=0, max_tokens=8)
    prefix, _ = eng.prefill(params=params, tokens=list(range(3, 13)), sampling=sp)  # 10 positions: pages of 4, 4, 2
    assert prefix.kv.length == 10 and len(prefix.kv.pages) == 3 and pool.held == 3
    state = eng.insert(prefix, state, 0)
    assert [pool.refcount(p) for p in prefix.kv.pages] == [2, 2, 2] and pool.held == 3  # shared, not copied
    state, _ = eng.generate(params, state)  # writes position 10: the shared partly filled page is copied
    seq = state.seqs[0]
    assert seq.pages[:2] == prefix.kv.pages[:2] and seq.pages[2] != prefix.kv.pages[2] and pool.held == 4
    more, _ = eng.prefill(params=params, tokens=[20, 21, 22], sampling=sp, existing_prefix=prefix)
    assert more.kv.pages[:2] == prefix.kv.pages[:2] and pool.refcount(prefix.kv.pages[0]) == 3
    state = eng.free_resource(state, 0)
    assert state.seqs[0] is None and pool.held == 5  # prefix's 3, more's copy of page 2 and its page 3
    other, flat = ReferenceEngine(tiny, CFG.model_copy(update={"options": {"page_size": 4}})), _engines(tiny)[0]
    for stranger in (other, flat):  # the same weights, other pages (or none): refused, never read
        with pytest.raises(InvalidRequest, match="another reference engine's pages"):
            stranger.insert(prefix, stranger.init_decode_state(), 0)
    del more, prefix
    gc.collect()
    assert pool.held == 0  # a dropped prefix gives its pages back


def test_truncate_prefix_is_checked_and_capability_guarded(tiny):
    flat, _ = _engines(tiny)
    params = flat.load_params()
    prefix, _ = flat.prefill(params=params, tokens=[5, 6, 7, 8], sampling=SamplingParams(seed=1))
    assert flat.truncate_prefix(params=params, prefix=prefix, length=4) is prefix
    for bad in (0, 5, 2.0, True):
        with pytest.raises(InvalidRequest, match="1..4"):
            flat.truncate_prefix(params=params, prefix=prefix, length=bad)
    one = flat.truncate_prefix(params=params, prefix=prefix, length=1)
    again, _ = flat.prefill(params=params, tokens=[5], sampling=prefix.sampling)
    assert one.first_token == again.first_token and np.array_equal(one.logits, again.logits)
    flat.capabilities = flat.capabilities.model_copy(update={"prefix_truncate": False})
    with pytest.raises(UnsupportedFeature, match="truncate_prefix"):
        flat.truncate_prefix(params=params, prefix=prefix, length=2)
    # an engine without the capability may lack the method; with it, the method is required
    absent = type("Absent", (), {"capabilities": flat.capabilities})()
    assert not any("truncate_prefix" in p for p in protocol_problems(absent))
    absent.capabilities = Capabilities(dtypes=("float32",), prefix_reuse=True, prefix_truncate=True)
    assert any("truncate_prefix" in p for p in protocol_problems(absent))
    with pytest.raises(ValueError, match="prefix_truncate needs prefix_reuse"):
        Capabilities(dtypes=("float32",), prefix_truncate=True)


def test_the_kits_truncation_through_portable_prefixes_equals_a_prefill(tiny):
    """The kit's way (export, cut, import, continue by the last token), used by any
    engine with portable prefixes that does not share pages: in float32 the round trip
    is exact, so the cut prefix's logits equal a prefill of its tokens'."""
    eng, _ = _engines(tiny, "float32")
    eng._prefix_head = lambda prefix, length: EngineBase._prefix_head(eng, prefix, length)
    params = eng.load_params()
    tokens = list(range(3, 30))
    sp = SamplingParams(temperature=0.7, seed=2)
    whole, _ = eng.prefill(params=params, tokens=tokens, sampling=sp)
    cut = eng.truncate_prefix(params=params, prefix=whole, length=16)
    direct, _ = eng.prefill(params=params, tokens=tokens[:16], sampling=whole.sampling)
    np.testing.assert_allclose(cut.logits, direct.logits, rtol=0, atol=1e-5)
    assert cut.first_token == direct.first_token and cut.prompt_tokens.tolist() == tokens[:16]


# -- through the driver ---------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "options"), [("reference", {}), ("reference", {"page_size": 16}),
                                                      ("cpu", {"cpu_kernels": False})])  # no kernel build: seconds
def test_every_request_after_the_first_takes_the_shared_system_prompts_full_pages(tiny, backend, options):
    """A 45-token system prompt, then requests with other user turns: the second one
    already takes the system prompt's 2 full pages (32 tokens) from the cache, cut from
    the first one's entry; so do the third and later; outputs equal a run without the
    cache. A second family of prompts does not take the first's tokens."""
    kw = dict(backend=backend, tools=False, max_slots=2, max_prefill_length=60, max_cache_length=96, options=options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cpu backend's fallback notice
        on, off = LLM(tiny, **kw), LLM(tiny, prefix_cache_bytes=0, prefill_chunk=0, **kw)
    assert on.scheduler.prefiller.block == 16
    rng = np.random.default_rng(7)
    systems = [rng.integers(3, 280, 45).tolist() for _ in range(2)]
    prompts = [systems[i // 3] + rng.integers(3, 280, int(rng.integers(2, 9))).tolist() for i in range(6)]
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True)
    got = [on.generate([p], sp)[0] for p in prompts]
    want = off.generate(prompts, sp)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.usage.cached_tokens for g in got] == [0, 32, 32, 0, 32, 32]
    assert all(e.refs == 0 for e in on.scheduler.prefix_cache.entries())


# -- the page rules, as the conformance suite checks them -------------------------------------


class CopiesOnInsert(ReferenceEngine):
    """Gives each slot its own copy of the prefix's pages."""

    def _install(self, prefix, state, slots, *, draw):
        out = super()._install(prefix, state, slots, draw=draw)
        for slot in slots:
            shared = state.seqs[slot]
            own = PageList.new(self.pages, shared.length, finalize=True)
            for src, dst in zip(shared.pages, own.pages):
                self._copy_page(src, dst)
            shared.release()
            state.seqs[slot] = own
        return out


class FreesSharedPages(ReferenceEngine):
    """free_resource drops a reference too many from every page the slot shares."""

    def _release(self, state, slot):
        shared = [p for p in state.seqs[slot].pages if self.pages.refcount(p) > 1]
        super()._release(state, slot)
        self.pages.release(shared)


class ReusesHeldPages(ReferenceEngine):
    """Its pool hands out the lowest ids whether or not they are held."""

    def __init__(self, model, config):
        super().__init__(model, config)

        class Careless(PagePool):
            def allocate(self, n):
                out = list(range(n))
                while len(self._refs) < n:
                    self._refs.append(0)
                for p in out:
                    self._refs[p] = max(self._refs[p], 1)
                return out

        self.pages = Careless(self.pages.page_size)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # a broken pool's leftovers
@pytest.mark.parametrize(("engine_type", "broken"), [
    (ReferenceEngine, None), (CopiesOnInsert, "insert copied pages"),
    (FreesSharedPages, "released pages the prefix still holds"), (ReusesHeldPages, "handed out again"),
])
def test_the_page_rules_catch_what_breaks_them(tiny, engine_type, broken):
    """The conformance suite's page rules (conformance/pages.py) pass on the paged
    reference and name each broken rule of a backend that breaks it."""
    from polyengine.conformance.pages import page_rule_problems

    eng = engine_type(tiny, CFG.model_copy(update={"options": {"page_size": 4}}))
    problems = page_rule_problems(eng, eng.load_params(), list(range(3, 9)), [40, 41, 42])
    if broken is None:
        assert problems == []
    else:
        assert any(broken in p for p in problems), problems
    del eng
    gc.collect()  # the broken engines' page lists give their pages back here, not in a later test


def test_a_bounded_page_pool_admits_requests_by_free_pages(tiny):
    """26 pages of 4 positions (about one 96-token context): eight requests of 8-10
    prompt tokens and 6 new ones (each 5 pages at worst, so reserving worst cases would
    run five at a time) run seven or more at a time in 8 slots, admitted by the pages they need
    now (tests/test_paged_preempt.py has more); none fails, the outputs equal an
    unbounded pool's, and a request that could never fit is refused at submit."""
    kw = dict(backend="reference", tools=False, max_slots=8, max_prefill_length=60, max_cache_length=96)
    bounded = LLM(tiny, options={"page_size": 4, "kv_pages": 26}, **kw)
    free = LLM(tiny, options={"page_size": 4}, **kw)
    assert bounded.engine.pages.capacity == 26 and free.engine.pages.capacity is None
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 280, int(rng.integers(8, 11))).tolist() for _ in range(8)]
    sp = SamplingParams(temperature=0.7, seed=1, max_tokens=6, ignore_eos=True)
    reqs = [bounded.submit(p, sp) for p in prompts]
    running = 0
    while not all(r.done for r in reqs):
        bounded.step()
        running = max(running, len(bounded.scheduler._slots))
        assert bounded.engine.pages.held <= 26
    assert running >= 7  # 7 one prefill at a time; 8 when a step prefills several prompts together
    assert [r.completion.token_ids for r in reqs] == [c.token_ids for c in free.generate(prompts, sp)]
    with pytest.raises(InvalidRequest, match="pool holds 26"):
        bounded.submit(prompts[0], SamplingParams(n=2, max_tokens=80))
    with pytest.raises(InvalidRequest, match="kv_pages"):
        ReferenceEngine(tiny, CFG.model_copy(update={"options": {"page_size": 4, "kv_pages": 24}}))
