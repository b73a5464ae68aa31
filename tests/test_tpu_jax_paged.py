"""Paged K/V in the tpu_jax engine (option ``page_size``; backends/tpu_jax/paged.py), on
this machine's JAX CPU platform, against the same engine with the contiguous cache:
tokens equal and log-probs equal to float32 rounding (greedy, seeded, n=2, continuation,
truncation, bulk_insert, a freed and reused slot), exported prefixes equal bit for bit;
pages shared on insert, continuation and truncation, copied on the first write into a
shared page, given back on free and when a prefix is dropped; a bounded pool refuses
cleanly, an unbounded one grows and keeps what it held; the same on a mesh of two CPU
devices (a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=2``).
The no-recompilation test of the paged engine is tests/test_tpu_jax.py's, parametrized.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
if importlib.util.find_spec("torchax") is None:  # not importorskip: torchax imports only through compat
    pytest.skip("torchax is not installed (pip install 'polyengine[tpu]')", allow_module_level=True)

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.errors import InsufficientMemory, InvalidRequest, UnsupportedFeature  # noqa: E402
from polyengine.models import load_model  # noqa: E402

CFG = EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=64, dtype="float32")
# Decode attends over a page-table width bucket instead of the whole cache: the masked
# positions add exact zeros, so log-probs agree to float32 rounding (measured: equal).
LOGPROB_ATOL = 1e-6


pytestmark = pytest.mark.usefixtures("jax_compile_less")  # tiny models: compile time over run time


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny-gqa")


def _engine(model, **options):
    from polyengine.backends.tpu_jax.engine import TpuJaxEngine

    return TpuJaxEngine(model, CFG.model_copy(update={"options": options}))


def _run(eng, sp: SamplingParams):
    """Prefill, a continuation, a truncation, insert, bulk_insert, steps past page edges,
    a freed and reused slot: the tokens, the log-probs, and the prefixes' exported K/V."""
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
    for step in range(24):  # past page edges of 4 and 16
        if step == 4:
            state = eng.free_resource(state, 1)
            state = eng.insert(head, state, 1)
        state, res = eng.generate(params, state)
        valid = res.valid[:, 0].astype(bool)  # an empty slot's row is whatever its stale table row reads
        tokens.append(np.where(valid, res.tokens[:, 0], -1).tolist())
        logprobs.append(np.where(valid, res.logprobs[:, 0], 0.0))
    kv = [np.concatenate([e.k.ravel(), e.v.ravel()]) for e in map(eng.export_prefix, (head, whole, cut))]
    return tokens, np.asarray(logprobs), kv


SAMPLINGS = {
    "greedy": SamplingParams(temperature=0, max_tokens=20, logprobs=True, n=2),
    "seeded": SamplingParams(temperature=0.9, seed=4, max_tokens=20, logprobs=True, n=2, repetition_penalty=1.2),
}


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_paged_equals_the_contiguous_engine(tiny, page_size, sampling):
    flat, paged = _engine(tiny), _engine(tiny, page_size=page_size)
    assert paged.capabilities.page_size == page_size and not flat.capabilities.paged_kv
    want, want_lp, want_kv = _run(flat, SAMPLINGS[sampling])
    got, got_lp, got_kv = _run(paged, SAMPLINGS[sampling])
    assert got == want
    np.testing.assert_allclose(got_lp, want_lp, rtol=0, atol=LOGPROB_ATOL)
    for a, b in zip(want_kv, got_kv):  # the same prefill programs, scattered into pages and gathered back
        np.testing.assert_array_equal(a, b)
    gc.collect()
    assert paged.pages.held == 0  # the run's prefixes and slots gave every page back


def test_the_conformance_page_rules_hold(tiny):
    """The conformance suite's page-rule program (rule 18e, conformance/pages.py), which
    `polyengine conformance --option page_size=N` runs as test_page_rules, in CI here."""
    from polyengine.conformance.pages import page_rule_problems

    eng = _engine(tiny, page_size=4)
    assert page_rule_problems(eng, eng.load_params(), list(range(3, 9)), [40, 41, 42]) == []


def test_a_prefix_in_two_slots_holds_one_copy_of_its_full_pages(tiny):
    from polyengine.pages import PageList

    eng = _engine(tiny, page_size=4)
    pool, params, state = eng.pages, eng.load_params(), eng.init_decode_state()
    sp = SamplingParams(temperature=0, max_tokens=8)
    prefix, _ = eng.prefill(params=params, tokens=list(range(3, 13)), sampling=sp)  # 10 positions: 4, 4, 2
    assert isinstance(eng.prefix_pages(prefix), PageList) and eng.prefix_pages(prefix).length == 10
    assert pool.held == 3
    pages = eng.prefix_pages(prefix).pages
    state, _ = eng.bulk_insert(prefix, state, [0, 2])
    assert [pool.refcount(p) for p in pages] == [3, 3, 3] and pool.held == 3  # shared, not copied
    table = np.asarray(state.arrays.table)
    assert table[0, :3].tolist() == table[2, :3].tolist() == pages
    state, _ = eng.generate(params, state)  # position 10 in each slot: the partly filled page copied, once each
    s0, s2 = eng.slot_pages(state, 0), eng.slot_pages(state, 2)
    assert s0.pages[:2] == s2.pages[:2] == pages[:2] and pool.held == 5
    assert len({s0.pages[2], s2.pages[2], pages[2]}) == 3 and eng.slot_pages(state, 1) is None
    table = np.asarray(state.arrays.table)
    assert table[0, :3].tolist() == s0.pages and table[2, :3].tolist() == s2.pages
    before = eng.export_prefix(prefix)
    more, _ = eng.prefill(params=params, tokens=[20, 21, 22], sampling=sp, existing_prefix=prefix)
    assert more.kv.seq.pages[:2] == pages[:2] and pool.refcount(pages[0]) == 4
    cut = eng.truncate_prefix(params=params, prefix=more, length=9)  # 8 positions shared, the 9th written
    assert cut.kv.seq.pages[:2] == pages[:2] and pool.refcount(pages[0]) == 5
    np.testing.assert_array_equal(eng.export_prefix(prefix).k, before.k)  # the slots' and continuations' writes
    state = eng.free_resource(state, 0)
    state = eng.free_resource(state, 2)
    assert [pool.refcount(p) for p in pages] == [3, 3, 1]  # the prefix, more and cut hold the rest
    for stranger in (_engine(tiny, page_size=4), _engine(tiny)):  # the same weights, other pages (or none)
        with pytest.raises(InvalidRequest, match="another .* engine's pages"):
            stranger.insert(prefix, stranger.init_decode_state(), 0)
    del more, prefix, cut
    gc.collect()
    assert pool.held == 0  # dropped prefixes give their pages back


def test_a_bounded_pool_is_checked_and_refuses_cleanly(tiny):
    with pytest.raises(InvalidRequest, match="kv_pages=5 needs page_size"):
        _engine(tiny, kv_pages=5)
    with pytest.raises(InvalidRequest, match="at least one context's pages and one more"):
        _engine(tiny, page_size=16, kv_pages=4)  # 64 positions: 4 pages, and one for a copy on write
    with pytest.raises(UnsupportedFeature, match="kv_quantize='int8' with page_size"):
        _engine(tiny, page_size=16, kv_quantize="int8")
    with pytest.raises(InvalidRequest, match="page_size=-1"):
        _engine(tiny, page_size=-1)
    eng = _engine(tiny, page_size=8, kv_pages=9)
    params, state = eng.load_params(), eng.init_decode_state()
    assert eng._paged.peek()[0].shape[2] == 9 and "the K/V pool of 9 pages x 8 positions" in eng._needs()
    sp = SamplingParams(temperature=0, max_tokens=8)
    a, _ = eng.prefill(params=params, tokens=list(range(3, 27)), sampling=sp)  # 24 positions: 3 full pages
    b, _ = eng.prefill(params=params, tokens=list(range(3, 26)), sampling=sp)  # 23: 3 pages, the last partly filled
    c, _ = eng.prefill(params=params, tokens=list(range(5, 21)), sampling=sp)  # 16: 2 full pages
    with pytest.raises(InsufficientMemory, match="K/V page pool"):
        eng.prefill(params=params, tokens=list(range(3, 20)), sampling=sp)  # 3 more pages: 1 is free
    assert eng.pages.held == 8
    state = eng.insert(b, state, 0)
    state, _ = eng.generate(params, state)  # the shared last page copied: the ninth page
    assert eng.pages.held == 9
    state = eng.insert(a, state, 1)
    with pytest.raises(InsufficientMemory, match="K/V page pool"):
        eng.generate(params, state)  # both slots need a fresh page for position 24: none left
    assert eng.pages.held == 9 and state.slots[0].total == 25  # nothing moved
    state = eng.free_resource(state, 1)
    del a
    gc.collect()  # a's pages back in the pool
    state, res = eng.generate(params, state)  # slot 0 goes on
    assert res.valid[0, 0] and not res.valid[1, 0]
    flat = _engine(tiny)
    fp = flat.load_params()
    fs = flat.insert(flat.prefill(params=fp, tokens=list(range(3, 26)), sampling=sp)[0], flat.init_decode_state(), 0)
    for _ in range(2):
        fs, want = flat.generate(fp, fs)
    assert res.tokens[0, 0] == want.tokens[0, 0]
    del c


def test_an_unbounded_pool_grows_and_keeps_what_it_held(tiny):
    """Past every slot's full context (the pool's first size), prefixes the driver keeps
    take more pages: the pool grows and the K/V already held read the same."""
    eng = _engine(tiny, page_size=16)
    params, state = eng.load_params(), eng.init_decode_state()
    sp = SamplingParams(temperature=0, max_tokens=4)
    kept = [eng.prefill(params=params, tokens=list(range(3 + i, 27 + i)), sampling=sp)[0] for i in range(8)]
    first = eng._paged.size
    assert first == 4 * 4 and eng.pages.held == 16  # 4 slots x 64 positions in pages of 16
    before = eng.export_prefix(kept[0]).k
    kept.append(eng.prefill(params=params, tokens=list(range(11, 35)), sampling=sp)[0])
    assert eng.pages.held == 18 and eng._paged.size == 24  # grown by half
    np.testing.assert_array_equal(eng.export_prefix(kept[0]).k, before)
    state = eng.insert(kept[-1], state, 0)
    state, res = eng.generate(params, state)
    flat = _engine(tiny)
    p, _ = flat.prefill(params=flat.load_params(), tokens=list(range(11, 35)), sampling=sp)
    _, want = flat.generate(flat.load_params(), flat.insert(p, flat.init_decode_state(), 0))
    assert res.tokens[0, 0] == want.tokens[0, 0]


def test_the_driver_admits_requests_by_free_pages_and_equals_the_contiguous_engine(tiny):
    """The driver's block manager on a bounded pool of 9 pages of 8 positions (one context
    and one more) with four slots: four seeded requests of 17-20 prompt tokens (3 pages)
    writing 3 tokens each (a copy of the partly filled last page: 4 pages apiece) cannot
    all run at once and are admitted by the pages free; none is preempted (their writes
    stay in the copied page), and tokens and log-probs equal the contiguous
    engine's. (Preemption is not exercised here: on an engine that declares
    async_results the driver's replay of a preempted request sends an override one
    position behind, on the torch cpu engine too; see docs/tpu_jax.md, Pages.)"""
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

    want, _, _ = run(_engine(tiny))
    got, stats, running = run(_engine(tiny, page_size=8, kv_pages=9))
    assert stats["preemptions"] == 0 and stats["total"] == 9 and running < 4, (stats, running)
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt == wt
        np.testing.assert_allclose(gl, wl, rtol=0, atol=LOGPROB_ATOL)


def test_tpu_jax_ray_refuses_bad_page_options_before_any_worker_starts(tiny):
    """The leader makes the single-host engine's page refusals itself (and refuses pages
    with prefill workers) before it connects to Ray: none of these starts a worker. Pages
    on the workers: tests/test_tpu_jax_ray.py::test_pages_on_the_ray_engine."""
    pytest.importorskip("ray")
    from polyengine.backends.tpu_jax.ray_engine import RayTpuEngine

    for options, error, match in (({"page_size": 16, "prefill_workers": 1}, UnsupportedFeature, "prefill_workers"),
                                  ({"page_size": 16, "kv_quantize": "int8"}, UnsupportedFeature, "int8"),
                                  ({"kv_pages": 9}, InvalidRequest, "kv_pages=9 needs page_size")):
        with pytest.raises(error, match=match):
            RayTpuEngine(tiny, CFG.model_copy(update={"options": options}))


# -- two CPU devices ------------------------------------------------------------------------


def _sharded_main() -> None:
    """In the subprocess: the workload on one device (contiguous and paged) and on a mesh of
    two (paged: tp 2 over the KV heads; dp 2 over the slots); prints one JSON line."""
    from polyengine.backends.tpu_jax.engine import TpuJaxEngine

    assert len(jax.devices()) == 2, jax.devices()
    jax.config.update("jax_disable_most_optimizations", True)
    model = load_model("random:tiny-gqa")
    out = {}
    for sampling in SAMPLINGS:
        want = _run(TpuJaxEngine(model, CFG.model_copy(update={"options": {"tensor_parallel": 1, "data_parallel": 1}})),
                    SAMPLINGS[sampling])
        for name, options in (("tp2", {"tensor_parallel": 2, "data_parallel": 1}),
                              ("dp2", {"tensor_parallel": 1, "data_parallel": 2})):
            eng = TpuJaxEngine(model, CFG.model_copy(update={"options": {**options, "page_size": 4}}))
            got = _run(eng, SAMPLINGS[sampling])
            k = eng._paged.peek()[0]
            out[f"{sampling}-{name}"] = {
                "mesh": eng.plan.describe(), "tokens_equal": got[0] == want[0],
                "logprobs_max_abs_diff": float(np.abs(got[1] - want[1]).max()),
                "kv_max_abs_diff": max(float(np.abs(a - b).max()) for a, b in zip(got[2], want[2])),
                "pool_shard_shape": list(k.addressable_shards[0].data.shape), "pool_shape": list(k.shape),
            }
    print("RESULT " + json.dumps(out))


def on_two_cpu_devices(script: str) -> dict:
    """Run ``script`` with argument ``sharded`` on two JAX CPU devices (a subprocess, tiny
    models' compile flags); the dict of its last ``RESULT`` line."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    proc = subprocess.run([sys.executable, script, "sharded"], env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_paged_on_two_cpu_devices_equals_one():
    out = on_two_cpu_devices(__file__)
    assert set(out) == {f"{s}-{m}" for s in SAMPLINGS for m in ("tp2", "dp2")}
    for what, r in out.items():
        assert r["tokens_equal"], what
        # A sharded reduction adds in another order: float32 rounding (tests/test_tpu_jax_sharding.py's bound).
        assert r["logprobs_max_abs_diff"] <= 1e-5 and r["kv_max_abs_diff"] <= 1e-5, (what, r)
    tp2, dp2 = out["greedy-tp2"], out["greedy-dp2"]
    assert tp2["mesh"] == "mesh dp=1 x tp=2" and dp2["mesh"] == "mesh dp=2 x tp=1"
    assert tp2["pool_shard_shape"][1] * 2 == tp2["pool_shape"][1]  # the KV heads split over tp
    assert dp2["pool_shard_shape"] == dp2["pool_shape"]  # every dp group holds the whole pool


if __name__ == "__main__" and sys.argv[1:] == ["sharded"]:
    _sharded_main()
