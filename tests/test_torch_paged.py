"""Paged K/V in the torch engines (option ``page_size``): the cpu backend (its torch
path, and its fused host-compiled step on each ISA path this CPU runs) and
cuda_torch's device path on the CPU stand-in, each against the same engine with the
contiguous cache: every token and log-prob equal, pages shared on insert, continuation
and truncation, copied on the first write into a shared page, given back on free and
when a prefix is dropped; a bounded pool refuses cleanly and an unbounded one grows.
Tiny model: a few seconds, plus a kernel build per ISA path on first use."""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.backends.cpu.engine import CpuEngine  # noqa: E402
from polyengine.backends.cpu.plan import CpuHost  # noqa: E402
from polyengine.backends.cuda_torch.engine import CudaEngine  # noqa: E402
from polyengine.errors import InsufficientMemory, InvalidRequest  # noqa: E402
from polyengine.hostinfo import ISA_PATHS  # noqa: E402
from polyengine.models import load_model  # noqa: E402
from polyengine.pages import PageList  # noqa: E402

CFG = EngineConfig(max_slots=3, max_prefill_length=60, max_cache_length=96, dtype="float32")

# Adapters: the engines under test, each with the options it runs paged with. The
# cuda_torch kinds on a GPU (marker ``gpu``: skipped without one) run the same checks
# on CUDA, eager and with the decode step replayed from CUDA graphs.
KINDS = {
    "cpu-torch": (CpuEngine, {"cpu_kernels": False}),
    "cuda_torch-stand-in": (CudaEngine, {"device": "cpu"}),
    "cuda_torch-gpu": (CudaEngine, {"device": "cuda"}),
    "cuda_torch-gpu-graphs": (CudaEngine, {"device": "cuda", "cuda_graphs": True}),
}
_ON_GPU = ("cuda_torch-gpu", "cuda_torch-gpu-graphs")


def _kinds(*names):
    """Parameters over ``names`` (default: every kind), the GPU kinds marked ``gpu``."""
    return [pytest.param(k, marks=pytest.mark.gpu) if k in _ON_GPU else k for k in names or KINDS]


@pytest.fixture(scope="module")
def tiny():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("random:tiny-gqa")


def _engine(tiny, kind, **options):
    cls, base = KINDS[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cpu backend's fallback notice (kernels off)
        return cls(tiny, CFG.model_copy(update={"options": {**base, **options}}))


def _run(eng):
    """Prefill, a continuation, a truncation, insert, bulk_insert, steps, a freed and
    reused slot: the tokens and log-probs, and the prefixes' exported K/V."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 280, 23).tolist()
    sp = SamplingParams(temperature=0.9, seed=4, max_tokens=20, logprobs=True, n=2)
    params, state = eng.load_params(), eng.init_decode_state()
    head, _ = eng.prefill(params=params, tokens=prompt[:10], sampling=sp)
    whole, first = eng.prefill(params=params, tokens=prompt[10:], sampling=sp, existing_prefix=head)
    cut = eng.truncate_prefix(params=params, prefix=whole, length=13)
    state = eng.insert(cut, state, 0)
    state, firsts = eng.bulk_insert(whole, state, [1, 2])
    out = [int(first.tokens[0, 0]), cut.first_token, *firsts.tokens[:, 0].tolist()]
    for step in range(24):  # past page edges of 4 and 16
        if step == 4:
            state = eng.free_resource(state, 1)
            state = eng.insert(head, state, 1)
        state, res = eng.generate(params, state)
        out.append((res.tokens[:, 0].tolist(), res.logprobs[:, 0].tolist()))
    kv = [np.concatenate([e.k.ravel(), e.v.ravel()]) for e in map(eng.export_prefix, (head, whole, cut))]
    return out, kv


@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize(("page_size", "kv_dtype"), [(4, "auto"), (16, "auto"), (4, "bfloat16")])
def test_paged_equals_the_contiguous_cache(tiny, kind, page_size, kv_dtype):
    """The same forward over the same K/V, only read through a page table: equal tokens
    and log-probs (float32, bit for bit) and equal prefixes; K/V stored narrow too."""
    flat = _engine(tiny, kind, kv_dtype=kv_dtype, page_size=0)  # contiguous (the cpu backend's default is pages)
    paged = _engine(tiny, kind, page_size=page_size, kv_dtype=kv_dtype)
    assert paged.capabilities.page_size == page_size and not flat.capabilities.paged_kv
    (want, want_kv), (got, got_kv) = _run(flat), _run(paged)
    assert got == want
    for a, b in zip(want_kv, got_kv):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("isa", ISA_PATHS)
@pytest.mark.parametrize(("kv_dtype", "page_size"), [("auto", 4), ("bfloat16", 4), ("auto", 6)])
def test_the_fused_cpu_step_reads_pages_on_every_isa_path(tiny, isa, kv_dtype, page_size):
    """The host-compiled fused decode step (csrc/decode.h) reading and writing K/V through
    the page table equals itself on the contiguous cache, bit for bit, on each ISA path
    this CPU runs (each built on first use); a page size that is a power of two (a shift
    and a mask) and one that is not (a division)."""
    if isa not in CpuHost.detect().runnable:
        pytest.skip(f"this CPU cannot run the {isa} path")
    options = {"isa": isa, "kv_dtype": kv_dtype, "page_size": 0}
    flat, paged = (CpuEngine(tiny, CFG.model_copy(update={"options": {**options, **o}}))
                   for o in ({}, {"page_size": page_size}))
    if flat.plan.kernels is None:
        pytest.skip(f"the CPU kernels do not build here: {flat.plan.kernels_fallback}")
    assert flat.plan.fused_decode and paged.plan.fused_decode
    (want, want_kv), (got, got_kv) = _run(flat), _run(paged)
    assert paged._fused.dims.page_size == page_size and got == want
    for a, b in zip(want_kv, got_kv):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", _kinds())
def test_the_conformance_page_rules_hold(tiny, kind):
    """The conformance suite's page-rule program (rule 18e, conformance/pages.py) on this
    kind with pages of 4, bounded and not: what `polyengine conformance --option
    page_size=N` runs as test_page_rules, here on every kind in CI."""
    from polyengine.conformance.pages import page_rule_problems

    for options in ({"page_size": 4}, {"page_size": 4, "kv_pages": 40}):
        eng = _engine(tiny, kind, **options)
        assert page_rule_problems(eng, eng.load_params(), list(range(3, 9)), [40, 41, 42]) == [], options


@pytest.mark.parametrize("kind", _kinds())
def test_a_prefix_in_two_slots_holds_one_copy_of_its_full_pages(tiny, kind):
    eng = _engine(tiny, kind, page_size=4)
    pool, params, state = eng.pages, eng.load_params(), eng.init_decode_state()
    sp = SamplingParams(temperature=0, max_tokens=8)
    prefix, _ = eng.prefill(params=params, tokens=list(range(3, 13)), sampling=sp)  # 10 positions: 4, 4, 2
    assert isinstance(prefix.kv, PageList) and prefix.kv.length == 10 and pool.held == 3
    assert eng.prefix_pages(prefix) is prefix.kv
    state, _ = eng.bulk_insert(prefix, state, [0, 2])
    assert [pool.refcount(p) for p in prefix.kv.pages] == [3, 3, 3] and pool.held == 3  # shared, not copied
    state, _ = eng.generate(params, state)  # position 10 in each slot: the partly filled page copied, once each
    s0, s2 = eng.slot_pages(state, 0), eng.slot_pages(state, 2)
    assert s0.pages[:2] == s2.pages[:2] == prefix.kv.pages[:2] and pool.held == 5
    assert len({s0.pages[2], s2.pages[2], prefix.kv.pages[2]}) == 3 and eng.slot_pages(state, 1) is None
    assert state.page_table[0, :3].tolist() == s0.pages and state.page_table[2, :3].tolist() == s2.pages
    more, _ = eng.prefill(params=params, tokens=[20, 21, 22], sampling=sp, existing_prefix=prefix)
    assert more.kv.pages[:2] == prefix.kv.pages[:2] and pool.refcount(prefix.kv.pages[0]) == 4
    cut = eng.truncate_prefix(params=params, prefix=more, length=9)  # 8 positions shared, the 9th written
    assert cut.kv.pages[:2] == prefix.kv.pages[:2] and pool.refcount(prefix.kv.pages[0]) == 5
    state = eng.free_resource(state, 0)
    state = eng.free_resource(state, 2)
    assert [pool.refcount(p) for p in prefix.kv.pages] == [3, 3, 1]  # the prefix, more and cut hold the rest
    other = _engine(tiny, kind, page_size=4)
    for stranger in (other, _engine(tiny, kind)):  # the same weights, other pages (or none): refused, never read
        with pytest.raises(InvalidRequest, match="another .* engine's pages"):
            stranger.insert(prefix, stranger.init_decode_state(), 0)
    del more, prefix, cut
    gc.collect()
    assert pool.held == 0  # dropped prefixes give their pages back


@pytest.mark.parametrize("kind", _kinds("cuda_torch-stand-in", *_ON_GPU))
def test_a_bounded_pool_is_checked_and_refuses_cleanly(tiny, kind):
    with pytest.raises(InvalidRequest, match="kv_pages=5 needs page_size"):
        _engine(tiny, kind, kv_pages=5)
    with pytest.raises(InvalidRequest, match="at least one context's pages and one more"):
        _engine(tiny, kind, page_size=16, kv_pages=6)  # 96 positions: 6 pages, and one for a copy on write
    eng = _engine(tiny, kind, page_size=16, kv_pages=7)
    params, state = eng.load_params(), eng.init_decode_state()
    assert eng._paged.tensors[0].shape[1] == 7
    sp = SamplingParams(temperature=0, max_tokens=8)
    a, _ = eng.prefill(params=params, tokens=list(range(3, 51)), sampling=sp)  # 48 positions: 3 full pages
    b, _ = eng.prefill(params=params, tokens=list(range(3, 50)), sampling=sp)  # 47: 3 pages, the last partly filled
    with pytest.raises(InsufficientMemory, match="K/V page pool"):
        eng.prefill(params=params, tokens=list(range(3, 40)), sampling=sp)  # 3 more pages: 1 is free
    assert eng.pages.held == 6
    state = eng.insert(b, state, 0)
    state, _ = eng.generate(params, state)  # the shared last page copied: the seventh page
    assert eng.pages.held == 7
    state = eng.insert(a, state, 1)
    with pytest.raises(InsufficientMemory, match="K/V page pool"):
        eng.generate(params, state)  # slot 1 needs a fresh page at position 48: none left
    assert eng.pages.held == 7 and state.slots[0].total == 49  # nothing moved
    state = eng.free_resource(state, 1)
    del a
    gc.collect()  # a's pages back in the pool
    state, res = eng.generate(params, state)  # slot 0 takes one
    assert res.valid[0, 0] and not res.valid[1, 0]


@pytest.mark.parametrize("kind", _kinds("cuda_torch-stand-in", *_ON_GPU))
def test_an_unbounded_pool_grows_and_keeps_what_it_held(tiny, kind):
    """Past every slot's full context (the pool's first size), prefixes the driver keeps
    take more pages: the pool grows and the K/V already held read the same."""
    eng = _engine(tiny, kind, page_size=16)
    params, state = eng.load_params(), eng.init_decode_state()
    first = eng._paged.tensors[0].shape[1]
    assert first == 3 * 6  # 3 slots x 96 positions in pages of 16
    sp = SamplingParams(temperature=0, max_tokens=4)
    kept = [eng.prefill(params=params, tokens=list(range(3 + i, 63 + i)), sampling=sp)[0] for i in range(6)]
    before = eng.export_prefix(kept[0]).k
    for i in range(6, 10):
        kept.append(eng.prefill(params=params, tokens=list(range(3 + i, 63 + i)), sampling=sp)[0])
    assert eng.pages.held == 40 and eng._paged.tensors[0].shape[1] >= 40 > first
    np.testing.assert_array_equal(eng.export_prefix(kept[0]).k, before)
    state = eng.insert(kept[-1], state, 0)
    state, res = eng.generate(params, state)
    flat = _engine(tiny, kind)
    p, _ = flat.prefill(params=flat.load_params(), tokens=list(range(12, 72)), sampling=sp)
    s, want = flat.generate(flat.load_params(), flat.insert(p, flat.init_decode_state(), 0))
    assert res.tokens[0, 0] == want.tokens[0, 0]
