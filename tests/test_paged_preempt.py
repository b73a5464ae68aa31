"""The driver's block manager on a bounded K/V page pool (the paged reference's
``kv_pages``): admission by the pages a request needs now, preemption by recompute when
a step would run out, the page metrics, and a prefix cache that counts shared pages once.

Every workload runs twice, on a bounded pool and on an unbounded one, with fixed seeds:
tokens, log-probs, finish reasons and every streamed delta must be equal (a preempted
request's completion is replayed as forced tokens, so the sampler's state, and with it
the seeded stream, is the one it had). Tiny random models: a few seconds each.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from polyengine import SamplingParams
from polyengine.driver import LLM
from polyengine.driver.prefix_cache import PrefixCache
from polyengine.errors import InvalidRequest
from polyengine.models import load_model
from polyengine.sampling.params import StructuredOutput


@pytest.fixture(scope="module")
def tiny():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("random:tiny-gqa")


def _run(llm: LLM, work: list[tuple[object, SamplingParams]]) -> tuple[list, dict]:
    """Submit every request at once and step to the end; per request its outputs and its
    streamed deltas, and what the run saw: the most requests running at once, pages held."""
    reqs = [llm.submit(p, sp) for p, sp in work]
    pool, seen = llm.engine.pages, {"running": 0, "held": 0}
    while not all(r.done for r in reqs):
        llm.step()
        seen["running"] = max(seen["running"], len({id(r) for r, _ in llm.scheduler._slots.values()}))
        seen["held"] = max(seen["held"], pool.held)
    out = []
    for r in reqs:
        c = r.completion
        deltas = [(d.index, d.text, list(d.token_ids), d.finish_reason, d.logprobs, d.top_logprobs) for d in r.events]
        outs = [(o.token_ids, o.logprobs, o.top_logprobs, o.finish_reason, o.stop_reason, o.text, o.forced)
                for o in c.outputs]
        out.append((outs, deltas))
        for o in c.outputs:  # each token streamed exactly once
            assert [t for d in deltas if d[0] == o.index for t in d[2]] == o.token_ids
    return out, seen


def test_requests_are_admitted_by_the_pages_they_need_now(tiny):
    """40 pages of 4 positions; eight requests of 8-10 prompt tokens that may write 80
    tokens (a worst case of 24 pages each: reserving it, one would run at a time) and
    stop after 6. Admitted by the pages they need now, seven run at once; none is
    preempted, and the outputs equal an unbounded pool's."""
    kw = dict(backend="reference", tools=False, max_slots=8, max_prefill_length=60, max_cache_length=96)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 280, int(rng.integers(8, 11))).tolist() for _ in range(8)]
    sp = SamplingParams(temperature=1.0, seed=1, max_tokens=80, stop_token_ids=list(range(200, 288, 3)))
    bounded = LLM(tiny, options={"page_size": 4, "kv_pages": 40}, **kw)
    assert bounded.scheduler.prepare(prompts[0], sp).pages == 24  # the worst case: 40 pages hold one
    got, seen = _run(bounded, [(p, sp) for p in prompts])
    want, _ = _run(LLM(tiny, options={"page_size": 4}, **kw), [(p, sp) for p in prompts])
    assert got == want
    assert seen["running"] >= 7 and seen["held"] <= 40
    assert bounded.page_stats["preemptions"] == 0


def _preempting(tiny_text, chunk=4, **more):
    kw = dict(backend="reference", tools=False, max_slots=4, max_prefill_length=32, max_cache_length=64,
              prefill_chunk=chunk, **more)
    return (LLM(tiny_text, options={"page_size": 4, "kv_pages": 17}, **kw),
            LLM(tiny_text, options={"page_size": 4}, **kw))


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9},
                                           "c": {"enum": ["x", "y"]}},
          "required": ["n", "c"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_text():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("random:tiny")


@pytest.mark.parametrize("case", ["greedy", "seeded", "n2", "stop", "schema"])
def test_preempted_requests_are_recomputed_to_the_unbounded_output(tiny_text, case):
    """17 pages of 4 positions (one 64-token context and a page) for four requests that
    grow to 30-45 positions each: the newest is preempted again and again, re-prefilled
    (in chunks of 4) and its completion replayed. Greedy; seeded with penalties, min_tokens
    and top log-probs; n=2; a stop string; a JSON schema: every output and streamed delta
    equals the unbounded pool's, and pages never exceed the pool."""
    prompts = ["the quick brown fox", "a b c d e f", "hello there, general", "zzz yyy"]
    base = dict(max_tokens=28, ignore_eos=True, logprobs=True)
    sps = {
        "greedy": [SamplingParams(temperature=0, **base)] * 4,
        "seeded": [SamplingParams(temperature=0.9, seed=5 + i, top_k=40, presence_penalty=0.5,
                                  frequency_penalty=0.3, repetition_penalty=1.1, min_tokens=4, top_logprobs=2, **base)
                   for i in range(4)],
        "n2": [SamplingParams(temperature=0.8, seed=9, n=2, max_tokens=10, ignore_eos=True, logprobs=True)] * 4,
        "stop": [SamplingParams(temperature=1.0, seed=11 + i, **base) for i in range(4)],
        "schema": [SamplingParams(temperature=1.0, seed=3 + i, max_tokens=40,
                                  structured=StructuredOutput(json_schema=SCHEMA)) for i in range(4)],
    }[case]
    bounded, free = _preempting(tiny_text)
    if case == "stop":  # a stop string that first occurs late in each unbounded completion
        texts = [c.text for c in free.generate(prompts, sps)]
        stops = [next(t[i: i + 2] for i in range(len(t) * 2 // 3, len(t) - 1) if t.find(t[i: i + 2]) == i)
                 for t in texts]
        sps = [sp.replace(stop=[stop]) for sp, stop in zip(sps, stops)]
    work = list(zip(prompts, sps))
    got, seen = _run(bounded, work)
    want, _ = _run(free, work)
    assert got == want
    assert bounded.page_stats["preemptions"] > 0 and seen["held"] <= 17
    if case == "stop":
        assert all(o[3] == "stop" and isinstance(o[4], str) for outs, _ in got for o in outs)
    if case == "schema":
        import json

        assert all(o[3] == "stop" and json.loads(o[5]).keys() == {"n", "c"} for outs, _ in got for o in outs)


def test_a_request_preempted_during_its_chunked_prefill_starts_again_under_its_grammar(tiny_text):
    """The newest request may be preempted while its prompt is prefilled in pieces (it
    holds the pages of the pieces done): it is prefilled again from the start and its
    first token is drawn under its grammar's mask, as without the preemption."""
    bounded, free = _preempting(tiny_text, chunk=2, max_num_batched_tokens=2)  # one 2-token piece a step
    work = [("ab", SamplingParams(temperature=0.9, seed=1, max_tokens=20, ignore_eos=True)),
            ("the cat sat on a mat, hat", SamplingParams(temperature=1.0, seed=4, max_tokens=24,
                                                         structured=StructuredOutput(json_schema=SCHEMA)))]
    sched = bounded.scheduler
    reqs = [bounded.submit(*work[0])]
    bounded.step()  # the first one decodes: the second one's prompt is prefilled 2 tokens a step
    reqs.append(bounded.submit(*work[1]))
    for _ in range(4):
        bounded.step()
    assert len(sched._filling) == 1 and sched._filling[0][0] is reqs[1] and sched._filling[0][1].done == 8
    held = bounded.engine.pages.held
    sched._preempt(reqs[1])  # what _make_step_room does to the newest request when a step would run out
    assert sched._queue[0] is reqs[1] and reqs[1].status == "queued" and bounded.engine.pages.held < held
    while not all(r.done for r in reqs):
        bounded.step()
    got = [[(o.token_ids, o.logprobs, o.top_logprobs, o.finish_reason, o.stop_reason, o.text, o.forced)
            for o in r.completion.outputs] for r in reqs]
    want = [[(o.token_ids, o.logprobs, o.top_logprobs, o.finish_reason, o.stop_reason, o.text, o.forced)
             for o in free.generate([p], sp)[0].outputs] for p, sp in work]
    assert got == want and bounded.page_stats["preemptions"] == 1


def test_a_preempted_request_whose_first_sample_finished_resumes_only_the_other(tiny):
    """n=2, the first sample stopped (a stop id), the second still running when the
    request is preempted: admitted again, the finished sample's slot is freed at once and
    the other replays and continues; the outputs equal the unbounded pool's."""
    kw = dict(backend="reference", tools=False, max_slots=2, max_prefill_length=40, max_cache_length=64)
    prompt = list(range(3, 15))
    sp = SamplingParams(temperature=0.8, seed=6, n=2, max_tokens=20, logprobs=True)
    free = LLM(tiny, options={"page_size": 4}, **kw)
    first, second = (o.token_ids for o in free.generate([prompt], sp)[0].outputs)
    stop = next(t for t in first[1:] if t not in second)
    sp = sp.replace(stop_token_ids=[stop])
    want, _ = _run(free, [(prompt, sp)])
    bounded = LLM(tiny, options={"page_size": 4, "kv_pages": 40}, **kw)
    req = bounded.submit(prompt, sp)
    while not req.samples[0].finished:
        bounded.step()
    assert not req.samples[1].finished
    bounded.scheduler._preempt(req)  # what _make_step_room does to the newest request when a step would run out
    assert bounded.engine.pages.held == len(bounded.scheduler.prefix_cache.idle_pages())  # the cache's alone
    while not req.done:
        bounded.step()
    got = [(o.token_ids, o.logprobs, o.top_logprobs, o.finish_reason, o.stop_reason, o.text, o.forced)
           for o in req.completion.outputs]
    assert got == want[0][0] and req.preemptions == 1
    assert not bounded.scheduler._slots  # the finished sample's slot too was freed


def test_a_request_that_cannot_fit_alone_is_refused_at_submit(tiny_text):
    bounded, _ = _preempting(tiny_text)
    with pytest.raises(InvalidRequest, match="pool holds 17") as err:
        bounded.submit("hello", SamplingParams(n=2, max_tokens=40))
    assert err.value.field == "max_tokens"
    bounded.submit("hello", SamplingParams(max_tokens=40))  # 1 sample: fits alone


def test_page_metrics_count_pages_and_preemptions(tiny_text):
    """The LLM's page_stats and the server's /metrics report the pool's pages and the
    preemptions; an engine without pages reports zeros."""
    bounded, free = _preempting(tiny_text)
    assert bounded.page_stats == {"total": 17, "free": 17, "in_use": 0, "shared": 0, "preemptions": 0}
    reqs = [bounded.submit(p, SamplingParams(temperature=0, max_tokens=28, ignore_eos=True))
            for p in ["the quick brown fox", "a b c d e f", "hello there, general", "zzz yyy"]]
    saw_shared = 0
    while not all(r.done for r in reqs):
        bounded.step()
        st = bounded.page_stats
        assert st["in_use"] + st["free"] == 17 and st["in_use"] == bounded.engine.pages.held
        saw_shared = max(saw_shared, st["shared"])
    assert saw_shared > 0  # slots share their prompt's full pages with the cached prefix
    assert bounded.page_stats["preemptions"] == sum(r.preemptions for r in reqs) > 0
    flat = LLM(tiny_text, backend="reference", tools=False, max_slots=1, max_cache_length=32)
    assert flat.page_stats == {"total": 0, "free": 0, "in_use": 0, "shared": 0, "preemptions": 0}


def test_the_server_exports_page_metrics(tiny_text):
    """Through AsyncLLM (what the server serves), a preempting workload streams the
    unbounded pool's tokens, and /metrics reports the pages and the preemptions."""
    import asyncio

    pytest.importorskip("prometheus_client")
    from polyengine.driver import AsyncLLM
    from serving.metrics import Metrics

    bounded, free = _preempting(tiny_text)
    prompts = ["the quick brown fox", "a b c d e f", "hello there, general", "zzz yyy"]
    sp = SamplingParams(temperature=0.9, seed=2, max_tokens=28, ignore_eos=True)
    want = [c.token_ids for c in free.generate(prompts, sp)]

    async def main():
        async with AsyncLLM.from_llm(bounded) as llm:
            metrics = Metrics()
            metrics.watch(llm)
            done = await asyncio.gather(*(llm.generate(p, sp) for p in prompts))
            return [c.token_ids for c in done], metrics.render().decode(), llm.page_stats

    got, text, stats = asyncio.run(main())
    assert got == want and stats["preemptions"] > 0
    for name in ("total", "free", "in_use", "shared"):
        assert f"polyengine_kv_pages_{name} {float(stats[name])}" in text, text
    assert stats["total"] == 17 and stats["free"] + stats["in_use"] == 17
    assert f"polyengine_preemptions_total {float(stats['preemptions'])}" in text


def test_the_prefix_cache_counts_a_shared_page_once(tiny):
    """Two entries, the second extending the first, share its full pages: the paged cache
    counts them once (the first's 3 pages and the second's 2 more), where counting whole
    entries would count 8; a budget of 5 pages holds both."""
    kw = dict(backend="reference", tools=False, max_slots=2, max_prefill_length=60, max_cache_length=96)
    llm = LLM(tiny, options={"page_size": 4}, **kw)
    eng, params = llm.engine, llm.scheduler.params
    page = eng.kv_bytes(4)
    cache = llm.scheduler.prefix_cache
    assert cache._pages_of is not None
    sp = SamplingParams(temperature=0)
    first, _ = eng.prefill(params=params, tokens=list(range(3, 15)), sampling=sp)  # 12 positions: 3 pages
    second, _ = eng.prefill(params=params, tokens=list(range(15, 23)), sampling=sp, existing_prefix=first)  # 20: 5
    paged = PrefixCache(5 * page, pages_of=lambda p: eng.prefix_pages(p).pages, page_bytes=page)
    whole = PrefixCache(5 * page)
    for c in (paged, whole):
        c.insert(first)
        c.insert(second)
    assert len(paged) == 2 and paged.stats.bytes == 5 * page and paged.stats.evictions == 0
    assert len(whole) == 1 and whole.stats.evictions == 1  # whole entries: 3 + 5 pages do not fit 5
    assert paged.evict_next() and paged.stats.bytes == 5 * page  # the first's pages stay with the second
    assert paged.evict_next() and paged.stats.bytes == 0 and not paged.evict_next()


def test_pages_to_write_counts_new_pages_and_copies():
    from polyengine.pages import PageList, PagePool

    pool = PagePool(4, capacity=10)
    seq = PageList.new(pool, 6)  # pages 0 and 1 (2 of 4 positions)
    assert seq.pages_to_write(6, 7) == 0 and seq.pages_to_write(6, 9) == 1  # in place; one new page
    other = seq.fork()
    assert pool.shared == 2
    assert other.pages_to_write(6, 7) == 1 and other.pages_to_write(6, 9) == 2  # a copy of page 1, and a new one
    other.prepare_write(6, 9, lambda s, d: None)
    assert pool.held == 4 and pool.shared == 1 and other.pages_to_write(9, 10) == 0


@pytest.mark.parametrize("seed", [101, 107, 108, 111])
def test_random_workloads_on_a_tight_pool_equal_the_unbounded_output(tiny, seed):
    """Random page sizes (2, 4, 8), pools from one context and a page up, slots, chunk
    sizes, prompts sharing a system prompt, n, greedy and seeded with a penalty and a stop
    id: outputs equal the unbounded pool's, the pool is never exceeded, and once the cache
    lets go every page is free again (the seeds are ones that preempt)."""
    import gc

    rng = np.random.default_rng(seed)
    ps, mcl = int(rng.choice([2, 4, 8])), 64
    kv = int(mcl // ps + 1 + rng.integers(0, 12))
    kw = dict(backend="reference", tools=False, max_slots=int(rng.integers(2, 6)), max_prefill_length=40,
              max_cache_length=mcl, prefill_chunk=int(rng.choice([0, 3, 8])))
    system, work = rng.integers(3, 280, 20).tolist(), []
    for _ in range(int(rng.integers(3, 9))):
        n = int(rng.choice([1, 1, 2]))
        prompt = (system[: int(rng.integers(0, 20))] + rng.integers(3, 280, int(rng.integers(3, 25))).tolist())[:38]
        mt = int(rng.integers(1, mcl - len(prompt) + 1))
        while n * -(-(len(prompt) + mt) // ps) + 1 > kv:  # fits the pool alone
            mt -= 1
        if mt < 1:
            n, mt = 1, 1
        work.append((prompt, SamplingParams(temperature=float(rng.choice([0, 0.8])), seed=int(rng.integers(0, 99)), n=n,
                                            max_tokens=mt, logprobs=True, presence_penalty=0.3,
                                            stop_token_ids=[int(rng.integers(3, 280))])))
    bounded = LLM(tiny, options={"page_size": ps, "kv_pages": kv}, **kw)
    got, seen = _run(bounded, work)
    want, _ = _run(LLM(tiny, options={"page_size": ps}, **kw), work)
    assert got == want and seen["held"] <= kv and bounded.page_stats["preemptions"] > 0
    bounded.scheduler.prefix_cache.clear()
    gc.collect()
    assert bounded.engine.pages.held == 0


def _system_prompt_work(n: int = 8, max_tokens: int = 4) -> tuple[list[int], list[tuple[list[int], SamplingParams]]]:
    """``n`` requests: one 32-token system prompt (8 pages of 4) and a 4-token user turn each."""
    rng = np.random.default_rng(4)
    system = rng.integers(3, 280, 32).tolist()
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=max_tokens, ignore_eos=True, logprobs=True)
    return system, [(system + rng.integers(3, 280, 4).tolist(), sp) for _ in range(n)]


def test_admission_does_not_count_the_pages_a_cache_hit_shares(tiny, monkeypatch):
    """24 pages of 4 positions; eight requests of a shared 32-token system prompt and a
    4-token user turn, 4 new tokens each. Counting each whole prompt (11 pages to start,
    what admission did before) three run at once; not counting the system prompt's 8
    cached pages (the second request cuts them from the first's entry, the others continue
    that cut) seven do, none preempted. Outputs equal an unbounded pool's, and once the
    cache lets go every page is free."""
    import gc

    from polyengine.driver.prefill import Prefiller

    kw = dict(backend="reference", tools=False, max_slots=8, max_prefill_length=40, max_cache_length=48)
    _, work = _system_prompt_work()
    want, _ = _run(LLM(tiny, options={"page_size": 4}, **kw), work)
    shared = LLM(tiny, options={"page_size": 4, "kv_pages": 24}, **kw)
    got, seen = _run(shared, work)
    assert got == want and seen["held"] <= 24 and shared.page_stats["preemptions"] == 0
    assert seen["running"] == 7
    shared.scheduler.prefix_cache.clear()
    gc.collect()
    assert shared.engine.pages.held == 0

    monkeypatch.setattr(Prefiller, "cache_hit", lambda self, tokens, partition=None: (None, 0))  # the whole prompt
    whole = LLM(tiny, options={"page_size": 4, "kv_pages": 24}, **kw)
    got, seen_whole = _run(whole, work)
    assert got == want and seen_whole["running"] == 3 < seen["running"]


def test_the_entry_a_waiting_request_shares_is_not_the_one_evicted_for_it(tiny):
    """The pool: 10 pages free, an idle entry of the system prompt (8 pages, first in the
    eviction order) and an idle entry of another prompt (2 pages of its own). A request
    of the system prompt and 4 more tokens needs 11 pages counting its whole prompt, 3
    sharing the entry's 8: the room is made by evicting the other entry, never the one it
    shares, and its prefill then continues that entry. When sharing cannot fit even after
    evicting every other idle entry, the count is redone without the hit (the shared
    entry may go too: a request alone always fits): a donor of 10 pages that a cut shares 8
    of (as a head), 5 free pages, 3 more for the step."""
    kw = dict(backend="reference", tools=False, max_slots=2, max_prefill_length=40, max_cache_length=48)
    llm = LLM(tiny, options={"page_size": 4, "kv_pages": 24}, **kw)
    eng, params, pre = llm.engine, llm.scheduler.params, llm.scheduler.prefiller
    cache, pool = pre.cache, eng.pages
    system, work = _system_prompt_work(1)
    prompt = work[0][0]
    sp = SamplingParams(temperature=0)
    other, _ = eng.prefill(params=params, tokens=list(range(100, 108)), sampling=sp)
    sysp, _ = eng.prefill(params=params, tokens=system, sampling=sp)
    mine = cache.insert(sysp)  # filed first: least recently used, so first in the eviction order
    cache.insert(other)
    del other, sysp
    assert [e.length for e in cache._eviction_order()] == [32, 8] and pool.held == 10
    hold = pool.allocate(4)  # what running requests hold: 10 pages free
    need = pre.pages_now(len(prompt), [0])
    assert need == 11 and pre.cache_hit(prompt) == (mine, 8)
    assert pre.make_room_for(prompt, None, need + 1)  # 4 beside a step's 1 more: 10 free
    assert [e.length for e in cache.entries()] == [32, 8] and pool.free == 10  # nothing had to go
    assert pre.make_room_for(prompt, None, need + 8)  # 11 of its own: the other entry goes, not the shared one
    assert [e.length for e in cache.entries()] == [32] and pool.free == 12
    job = pre.start(prompt, sp)
    assert job.cached == 32 and job.held is mine
    pre.abandon(job)
    del job, mine  # each holds the system prompt's prefix, and with it its pages
    cache.clear()
    pool.release(hold)
    assert pool.held == 0
    donor, _ = eng.prefill(params=params, tokens=system + list(range(100, 108)), sampling=sp)  # 40 tokens: 10 pages
    cache.insert(donor)
    del donor  # the cache's alone now (a reference kept here would keep its pages)
    hold = pool.allocate(9)  # 5 free; a cut at 32 shares its 8 whole pages (a head, engine.prefix_head)
    entry, pages = pre.cache_hit(prompt)
    assert pre.heads and (entry.length, pages) == (40, 8)
    del entry
    assert pre.make_room_for(prompt, None, need + 3)  # sharing: 6 > 5 free; the whole prompt: 14 <= 5 + 10
    assert len(cache) == 0 and pool.free == 15 and pre.cache_hit(prompt) == (None, 0)
    pool.release(hold)


@pytest.mark.parametrize("backend", ["cpu", "tpu_jax", "neuron"])
def test_preemption_on_an_engine_that_pipelines_its_steps(tiny_text, backend):
    """The cpu, tpu_jax and neuron backends declare ``async_results``: step n+1 is
    dispatched before step n is read. A replay forces a token in place of the engine's
    last one each step, so while a slot replays the loop runs in lock step (pipelined, the
    forced token's step had already run: the engine refused the override). 17 pages of 4
    for four requests that grow to 30-45 positions: preempted and replayed, greedy,
    outputs equal the unbounded pool's (tpu_jax's gather over its page pools, neuron's
    block KV layout on its CPU compile path)."""
    kw = dict(backend=backend, tools=False, max_slots=4, max_prefill_length=32, max_cache_length=64, prefill_chunk=4)
    prompts = ["the quick brown fox", "a b c d e f", "hello there, general", "zzz yyy"]
    work = [(p, SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)) for p in prompts]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the backends' fallback notes on a tiny model
        bounded = LLM(tiny_text, options={"page_size": 4, "kv_pages": 17}, **kw)
        free = LLM(tiny_text, options={"page_size": 4}, **kw)
    assert bounded.engine.capabilities.async_results
    got, seen = _run(bounded, work)
    want, _ = _run(free, work)
    assert [[o[0] for o in outs] for outs, _ in got] == [[o[0] for o in outs] for outs, _ in want]
    assert bounded.page_stats["preemptions"] > 0 and seen["held"] <= 17
