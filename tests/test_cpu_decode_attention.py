"""The fused decode step's attention (csrc/decode.h) against float64 attention on the same
cache values, on every ISA path the host runs: by GQA group (``attn_group``: the scores a
vector of keys at a time, summed across lanes by one shuffle tree, the head shapes of the
usual models compiled with their shape known, any other at run time) and one query head
at a time (``attn_head``), on float32, bfloat16 and float16 K/V, contiguous and paged
(pages of 16 and of 4 positions, a row's pages scattered through the pool), rows whose
keys are one position, whole vectors of keys and vectors plus a remainder."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from isa_paths import ISAS, kernels_for  # noqa: E402

LAYERS, LAYER, CACHE_LEN = 2, 1, 48
POSITIONS = [0, 15, 31, 40]  # 1, 16, 32 and 41 keys: one, whole vectors (8 or 16 lanes), and a remainder
# (heads, kv_heads, head_dim): groups 2, 3, 4 and 8 at 64 (attn_group_of's compiled shapes:
# 4 vectors a head on AVX-512, 8 on the 8-lane paths), 3 at 128 (8 or 16 vectors: compiled),
# 4 at 256 (Gemma's: 16 vectors on AVX-512, compiled; 32 on the others, one head at a time),
# 5 at 64 and 3 at 32 (the run-time shape where not compiled), and no grouping (one query
# head per KV head: always attn_head)
SHAPES = [(4, 2, 64), (9, 3, 64), (8, 2, 64), (16, 2, 64), (9, 3, 128), (4, 1, 256), (10, 2, 64), (6, 2, 32),
          (3, 3, 64)]
KV = {"float32": 0, "bfloat16": 1, "float16": 2}


def _stored(values: np.ndarray, kv: str) -> tuple[np.ndarray, np.ndarray]:
    """The cache's elements as the kernel reads them, and their exact float64 values."""
    if kv == "float32":
        return values, values.astype(np.float64)
    if kv == "float16":
        half = values.astype(np.float16)
        return half, half.astype(np.float64)
    t = torch.from_numpy(values).to(torch.bfloat16)
    return t.view(torch.int16).numpy(), t.double().numpy()


def _caches(rng, heads_kv: int, hd: int, page_size: int, kv: str):
    """K and V pools (stored), their exact float64 values in the logical layout [rows,
    kv_heads, S, hd], the page table (None: contiguous) and the dims' row count."""
    rows = len(POSITIONS)
    logical = rng.standard_normal((2, LAYERS, rows, heads_kv, CACHE_LEN, hd)).astype(np.float32)
    stored, exact = zip(*(_stored(logical[i], kv) for i in range(2)))
    if not page_size:
        return stored, np.stack(exact), None, rows
    per_row = CACHE_LEN // page_size
    table = rng.permutation(rows * per_row).reshape(rows, per_row).astype(np.int64)  # pages scattered
    pools = []
    for kind in stored:  # each row's positions p..p+page_size into its page table[r, p // page_size]
        pool = np.zeros((LAYERS, rows * per_row, heads_kv, page_size, hd), kind.dtype)
        for r in range(rows):
            for p in range(per_row):
                pool[:, table[r, p]] = kind[:, r, :, p * page_size:(p + 1) * page_size]
        pools.append(pool)
    return pools, np.stack(exact), table, rows * per_row


def _reference(q: np.ndarray, exact: np.ndarray, heads: int, heads_kv: int, hd: int) -> np.ndarray:
    group = heads // heads_kv
    out = np.zeros((len(POSITIONS), heads, hd))
    for m, pos in enumerate(POSITIONS):
        for a in range(heads):
            k = exact[0, LAYER, m, a // group, :pos + 1]
            v = exact[1, LAYER, m, a // group, :pos + 1]
            s = k @ q[m, a].astype(np.float64) / np.sqrt(hd)
            w = np.exp(s - s.max())
            out[m, a] = (w / w.sum()) @ v
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("heads", "heads_kv", "hd"), SHAPES)
def test_decode_attention_by_group_and_by_head_is_float64_attention(isa, heads, heads_kv, hd):
    from polyengine.backends.cpu.kernels import _Dims

    kernels = kernels_for(isa)
    lib, width = kernels.lib, kernels.vector_width
    group = heads // heads_kv
    grouped_shape = hd % width == 0 and hd // width <= 16 and 1 < group <= 8
    rng = np.random.default_rng(heads * 1000 + hd)
    for kv in KV:
        for page_size in (0, 16, 4):
            stored, exact, table, cache_rows = _caches(rng, heads_kv, hd, page_size, kv)
            q = rng.standard_normal((len(POSITIONS), heads, hd)).astype(np.float32)
            d = _Dims(heads=heads, kv_heads=heads_kv, head_dim=hd, layers=LAYERS, cache_rows=cache_rows,
                      cache_len=CACHE_LEN, kv_type=KV[kv], threads=1, page_size=page_size,
                      table_len=CACHE_LEN // page_size if page_size else 0)
            rows = np.arange(len(POSITIONS), dtype=np.int32)
            pos = np.asarray(POSITIONS, np.int32)
            want = _reference(q, exact, heads, heads_kv, hd)
            got = {}
            for grouped in (1, 0):
                att = np.full((len(POSITIONS), heads, hd), np.nan, np.float32)
                ran = lib.pe_decode_attention(
                    ctypes.byref(d), LAYER, len(POSITIONS), rows.ctypes.data, pos.ctypes.data, q.ctypes.data,
                    stored[0].ctypes.data, stored[1].ctypes.data, None if table is None else table.ctypes.data,
                    att.ctypes.data, grouped)
                assert ran == (grouped and grouped_shape), (kv, page_size)
                np.testing.assert_allclose(att, want, rtol=1e-5, atol=2e-6, err_msg=f"{kv}, pages of {page_size}, "
                                           f"{'by group' if ran else 'by head'}")
                got[grouped] = att
            # the group's sums are the per-head loop's, in its order: equal within float32 rounding
            np.testing.assert_allclose(got[1], got[0], rtol=1e-5, atol=1e-6)
