"""The torch Threefry-2x32 port against the core's (NumPy): bit for bit.

Everything the torch sampler draws comes from this stream, so it is proved first.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from polyengine.sampling import gumbel
from polyengine.sampling import threefry as ref_threefry

from polyengine.backends.torch_common import threefry


# -- Threefry: bit for bit ------------------------------------------------------------------


def _edge_seeds(rng: np.random.Generator, n: int) -> list[int]:
    edges = [0, 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**63, 2**64 - 2, 2**64 - 1]
    return edges + [int(s) for s in rng.integers(0, 2**64, n, dtype=np.uint64)]


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


def test_uniforms_equal_reference_bit_for_bit():
    """Seeds over the full 64-bit range, every token id of a 49152 vocabulary (0 and
    vocab-1 included), steps and sample indices at both ends of their ranges."""
    rng = np.random.default_rng(1)
    seeds = _edge_seeds(rng, 23)  # 32 rows
    steps = [0, 2**20 - 1, 0, 2**20 - 1] + [int(s) for s in rng.integers(0, 2**20, len(seeds) - 4)]
    samples = [0, 4095, 4095, 0] + [int(s) for s in rng.integers(0, 4096, len(seeds) - 4)]
    vocab = 49152
    lo, hi = zip(*(threefry.split_seed(s) for s in seeds))
    col = lambda xs: torch.tensor(xs, dtype=torch.int64)[:, None]  # noqa: E731
    ctr = threefry.counter_hi(col(steps), col(samples))
    ids = torch.arange(vocab)[None, :]
    u64 = threefry.uniforms(col(lo), col(hi), ids, ctr, dtype=torch.float64).numpy()  # (32, V)
    u32 = threefry.uniforms(col(lo), col(hi), ids, ctr, dtype=torch.float32).numpy()
    for row, (seed, step, index) in enumerate(zip(seeds, steps, samples)):
        ref = ref_threefry.uniforms(seed, np.arange(vocab), step, index)
        assert np.array_equal(u64[row], ref), (seed, step, index)
        # float32: the same bits as rounding the exact value (both round to nearest even).
        assert np.array_equal(u32[row], ref.astype(np.float32)), (seed, step, index)


def test_gumbel_float32_is_finite_and_close_for_every_uniform():
    """All 2**24 possible uniforms: float32 noise is finite (a plain float32 u would
    round the largest to 1.0, i.e. +inf noise) and within 1e-6 of the float64 value."""
    for chunk in range(4):
        m = torch.arange(chunk << 22, (chunk + 1) << 22, dtype=torch.int32)
        g32 = threefry.gumbel_from_bits(m, torch.float32).double().numpy()
        u = (m.numpy().astype(np.float64) + 0.5) * 2.0**-24
        ref = -np.log(-np.log(u))
        assert np.isfinite(g32).all()
        np.testing.assert_allclose(g32, ref, rtol=0, atol=1e-6)


def test_gumbel_float64_matches_reference():
    seed = 2**64 - 1
    lo, hi = threefry.split_seed(seed)
    ctr = threefry.counter_hi(torch.tensor([[7]]), torch.tensor([[4095]]))
    g = threefry.gumbel(torch.tensor([[lo]]), torch.tensor([[hi]]), torch.arange(4096)[None], ctr, dtype=torch.float64)
    # Same formula on the same exact u; only the log implementations may differ by an ulp.
    np.testing.assert_allclose(g[0].numpy(), gumbel(seed, np.arange(4096), 7, 4095), rtol=1e-15, atol=1e-15)
