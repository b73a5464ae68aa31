"""cuda_torch's KV cache on the host: pages held as the slots write them, handed back
when a slot is freed (option ``kv_memory``, backends/torch_common/hostmem.py), with
the tokens of the cache that holds every slot's full context from the start."""

from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.backends.cpu.engine import CpuEngine  # noqa: E402
from polyengine.backends.torch_common.hostmem import lazy, new_cache_tensor, release_row, resident_bytes  # noqa: E402
from polyengine.models import load_model  # noqa: E402

from isa_paths import ISAS, kernels_for  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages given back with madvise: Linux")
PAGE = 4096


def _engine(mode: str, **options) -> CpuEngine:
    model = load_model("random:tiny")  # 2 layers, 4 KV heads of 16: 128 KiB a (layer, slot) at 512 positions
    # contiguous rows (what kv_memory governs; the default pages' pool: tests/test_torch_paged.py)
    cfg = EngineConfig(max_slots=4, max_cache_length=512, options={"kv_memory": mode, "page_size": 0, **options})
    return CpuEngine(model, cfg)


def _run(eng: CpuEngine, probe=None) -> list[list[int]]:
    """A long sampled request in slot 0, freed; then two short ones in slots 0 and 2
    (slot 0's pages given back in between), one greedy, one sampled; returns every
    slot's tokens."""
    params, state = eng.load_params(), eng.init_decode_state()
    out = []
    for round_, (slots, steps) in enumerate((([0], 300), ([0, 2], 40))):
        got = {s: [] for s in slots}
        for i, slot in enumerate(slots):
            sp = SamplingParams(temperature=0.9 if (i + round_) % 2 == 0 else 0, seed=7 + i + round_, max_tokens=steps + 1)
            prefix, _ = eng.prefill(params=params, tokens=[3 + i, 9, 27, 81, 5, 11][: 4 + i], sampling=sp)
            state = eng.insert(prefix, state, slot)
            got[slot].append(int(prefix.first_token))
        for _ in range(steps):
            state, res = eng.generate(params, state)
            for slot in slots:
                got[slot].append(int(res.tokens[slot, 0]))
        if probe is not None:
            probe("decoded", state, slots)
        for slot in slots:
            state = eng.free_resource(state, slot)
        if probe is not None:
            probe("freed", state, slots)
        out += [got[s] for s in slots]
    return out


def test_grown_cache_holds_what_the_slots_wrote_and_gives_freed_slots_back():
    seen = {}

    def probe(when, state, slots):
        state.wait()
        seen[(when, tuple(slots))] = resident_bytes(state.k) + resident_bytes(state.v)

    eng = _engine("grow")
    state = eng.init_decode_state()
    full = 2 * state.k.numel() * state.k.element_size()
    assert lazy(state.k) and lazy(state.v) and resident_bytes(state.k) + resident_bytes(state.v) == 0
    tokens = _run(eng, probe)
    # slot 0 wrote 4 + 301 positions: per (layer, head) run of 32 KiB, 305 x 64 B -> 5 pages
    long = 2 * 2 * 4 * 5 * PAGE  # K and V, 2 layers, 4 heads
    assert seen[("decoded", (0,))] == long < full / 4
    assert seen[("freed", (0,))] == 0  # every page of slot 0 given back
    assert 0 < seen[("decoded", (0, 2))] <= 2 * 2 * 2 * 4 * PAGE  # two short rows: a page per (K/V, layer, head)
    assert seen[("freed", (0, 2))] == 0
    ref = _run(_engine("reserve"))  # every slot's full context from the start, as before
    assert tokens == ref
    assert len(tokens[0]) == 301 and len(set(tokens[0])) > 1


def test_the_reserved_cache_holds_every_slot_from_the_start():
    state = _engine("reserve").init_decode_state()
    assert not lazy(state.k) and release_row(state.k, 0) == 0
    assert resident_bytes(state.k) == state.k.numel() * state.k.element_size()


def test_the_live_rows_off_path_and_the_torch_forward_read_zeros_where_nothing_was_written():
    """The CUDA-shaped step (every slot computed, writes masked) and the torch forward
    (no kernels) over a grown cache give the reserved cache's tokens."""
    for options in ({"live_rows": False}, {"cpu_kernels": False}):
        assert _run(_engine("grow", **options)) == _run(_engine("reserve", **options)), options


def test_release_keeps_pages_shared_with_a_neighbouring_row():
    t = new_cache_tensor((2, 3, 1, 100, 4), torch.float32, torch.device("cpu"))  # runs of 1600 B: no whole page
    t.fill_(1.5)
    assert release_row(t, 1) == 0 and bool((t == 1.5).all())
    big = new_cache_tensor((2, 3, 1, 1024, 8), torch.float32, torch.device("cpu"))  # runs of 32 KiB: 8 pages each
    big.fill_(2.0)
    assert release_row(big, 1) == 2 * 8 * PAGE
    assert bool((big[:, 1] == 0).all()) and bool((big[:, 0] == 2).all()) and bool((big[:, 2] == 2).all())
    assert resident_bytes(big) == 2 * 2 * 8 * PAGE
    np.testing.assert_array_equal(big[:, 1].numpy(), np.zeros((2, 1, 1024, 8), np.float32))


# -- kv_dtype: K/V stored as bfloat16 or float16 under float32 compute ------------------------


def _logits_run(eng: CpuEngine, steps: int = 24):
    """Greedy decode of one prompt in slot 1; returns (tokens, last step's logprobs of
    the top tokens, the state)."""
    params, state = eng.load_params(), eng.init_decode_state()
    prefix, _ = eng.prefill(params=params, tokens=[5, 17, 33, 2, 9, 41, 7], sampling=SamplingParams(
        temperature=0, logprobs=True, top_logprobs=5, max_tokens=steps + 1))
    state = eng.insert(prefix, state, 1)
    tokens, lps = [int(prefix.first_token)], []
    for _ in range(steps):
        state, res = eng.generate(params, state)
        tokens.append(int(res.tokens[1, 0]))
        lps.append(np.asarray(res.top_logprobs[1, 0], np.float64))
    state.wait()
    return tokens, np.stack(lps), state


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_a_narrow_kv_cache_stores_half_the_bytes_and_decodes_like_float32(kv, isa):
    """On every ISA path the host runs (the fused step's conversions are vector code of
    each path's width: scalar SSE2, AVX2's F16C, AVX-512)."""
    kernels_for(isa)  # skips a path this CPU cannot execute, naming the flags it lacks
    narrow = {path: _logits_run(_engine("grow", kv_dtype=kv, **opts))
              for path, opts in (("fused", {"isa": isa}), ("torch", {"cpu_kernels": False}))}
    full_tokens, full_lps, full_state = _logits_run(_engine("grow"))
    for path, (tokens, lps, state) in narrow.items():
        assert state.k.dtype == state.v.dtype == getattr(torch, kv), path
        assert state.k.element_size() * 2 == full_state.k.element_size()
        # the rounding of K/V moves log-probs by far less than the model's own gaps
        np.testing.assert_allclose(lps, full_lps, atol=0.05 if kv == "bfloat16" else 0.01, err_msg=path)
        assert tokens[:8] == full_tokens[:8], path
    # the fused step and the torch forward (through the codec) store and read the same values
    np.testing.assert_allclose(narrow["fused"][1], narrow["torch"][1], atol=2e-3)
    assert narrow["fused"][0] == narrow["torch"][0]
    f, t = narrow["fused"][2], narrow["torch"][2]
    written = slice(0, 7 + 24)
    np.testing.assert_allclose(f.k[:, 1, :, written].float().numpy(), t.k[:, 1, :, written].float().numpy(),
                               atol=1e-2, rtol=1e-2)
    # and the narrow values are the float32 engine's, rounded
    np.testing.assert_allclose(f.k[:, 1, :, written].float().numpy(), full_state.k[:, 1, :, written].numpy(),
                               atol=2e-2, rtol=1e-2 if kv == "bfloat16" else 2e-3)


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_a_prefix_keeps_its_kv_in_the_kv_dtype_and_gives_its_pages_back_when_dropped(kv):
    """A prefill's own cache is in the KV dtype (half the bytes of the float32 one the
    prefix used to keep, and of the driver's prefix cache budget), holding the values the
    float32 prefill computes, rounded; its pages are a map of their own, unmapped when
    the prefix is dropped (the heap keeps no hole of it)."""
    import gc
    import weakref

    from polyengine.backends.torch_common import hostmem

    narrow, full = _engine("grow", kv_dtype=kv), _engine("grow")
    tokens, sp = [5, 17, 33, 2, 9, 41, 7], SamplingParams(temperature=0, max_tokens=4)
    p_narrow, _ = narrow.prefill(params=narrow.load_params(), tokens=tokens, sampling=sp)
    p_full, _ = full.prefill(params=full.load_params(), tokens=tokens, sampling=sp)
    for a, b in zip(p_narrow.kv, p_full.kv):
        assert a.dtype == getattr(torch, kv) and b.dtype == torch.float32
        assert a.shape == b.shape
        # layer 0 reads nothing rounded before it: exactly the float32 values, rounded
        assert torch.equal(a[0], b[0].to(a.dtype))
        np.testing.assert_allclose(a.float().numpy(), b.numpy(), atol=3e-2, rtol=1e-2)
    # (the cpu backend prefills the prompt's own rows, no bucket padding: docs/cpu.md, "Prefill rows")
    assert p_narrow.nbytes * 2 == p_full.nbytes == full.kv_bytes(len(tokens))
    assert narrow.kv_itemsize == 2 and narrow.prefix_cache_bytes * 2 == full.prefix_cache_bytes
    # continuing a narrow prefix (a prefix cache hit, a chunk) copies it as it is
    more, _ = narrow.prefill(params=narrow.load_params(), tokens=[8, 8], sampling=sp, existing_prefix=p_narrow)
    assert torch.equal(more.kv[0][:, :, : len(tokens)], p_narrow.kv[0])
    # and the decode cache receives the prefix's bytes unchanged
    state = narrow.insert(p_narrow, narrow.init_decode_state(), 2)
    assert torch.equal(state.k[:, 2, :, : len(tokens)], p_narrow.kv[0])
    mapping = weakref.ref(hostmem._map_of(p_narrow.kv[0]))
    assert mapping() is not None
    del p_narrow, more, a
    gc.collect()
    assert mapping() is None


def test_a_narrow_kv_cache_is_refused_where_compute_is_not_float32():
    from polyengine.errors import UnsupportedFeature

    model = load_model("random:tiny")
    with pytest.raises(UnsupportedFeature, match="kv_dtype='float16' with dtype bfloat16"):
        CpuEngine(model, EngineConfig(max_slots=2, max_cache_length=64, dtype="bfloat16",
                                        options={"kv_dtype": "float16"}))
    eng = CpuEngine(model, EngineConfig(max_slots=2, max_cache_length=64, dtype="bfloat16",
                                          options={"kv_dtype": "bfloat16"}))  # the compute dtype itself: fine
    assert eng.init_decode_state().k.dtype == torch.bfloat16


def test_a_grown_cache_copies_and_pickles_like_any_tensor():
    """Its storage is its own region only (the guard pages around it are not part of it):
    deepcopy and pickle read the storage whole."""
    import copy
    import pickle

    t = new_cache_tensor((2, 3, 1, 100, 4), torch.float32, torch.device("cpu"))
    t[1, 2, 0, 7] = 3.0
    assert t.untyped_storage().nbytes() <= t.numel() * 4 + PAGE
    for other in (copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        assert torch.equal(other, t)


def test_host_arena_hands_out_aligned_pieces_of_one_map(tmp_path):
    """HostArena: pieces 64-byte aligned, one after another in one map that lives as long
    as a piece does; asking past its size is an error; the THP mode is read from the
    kernel's setting (the bracketed word)."""
    import gc

    from polyengine.backends.torch_common.hostmem import HUGE_PAGE, HostArena, transparent_huge_pages

    sizes = [100, 64, 1, 4096]
    arena = HostArena(HostArena.size_of(sizes), huge=True)
    assert HostArena.size_of(sizes) == 128 + 64 + 64 + 4096
    pieces = [arena.take(n) for n in sizes]
    assert [p.numel() for p in pieces] == sizes and pieces[0].data_ptr() % HUGE_PAGE == 0
    assert [p.data_ptr() - pieces[0].data_ptr() for p in pieces] == [0, 128, 192, 256]
    for i, p in enumerate(pieces):
        p.fill_(i + 1)
    assert [int(p.max()) for p in pieces] == [1, 2, 3, 4]  # no piece overlaps the next
    with pytest.raises(ValueError, match="left"):
        arena.take(1)
    last = pieces[-1]
    del arena, pieces
    gc.collect()
    assert int(last.sum()) == 4 * 4096  # the map outlives the arena object and the other pieces
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert transparent_huge_pages(str(setting)) == "madvise"
    assert transparent_huge_pages(str(tmp_path / "missing")) == ""
