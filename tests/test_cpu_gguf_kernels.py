"""The CPU kernels on GGUF block weights (``backends/cpu/csrc/gguf.h``), per format and
per ISA path this CPU executes (tests/isa_paths.py: "auto" is -march=native, then the
forced avx512, avx2 and scalar builds).

Checked against float64 products of the exactly dequantized blocks
(``polyengine.models.blocks.dequantize_blocks``):
- the dequantization into float32 equals the float64 values rounded once (exact);
- the products with int8 activations equal the float64 product of the dequantized
  weights and the dequantized int8 activations (the activations' quantization is the
  kernels' one approximation) up to float32 summation (1e-5 of the terms' magnitude),
  and are within the stated activation bound of the float64 product of the float
  activations;
- rows read through a table of offsets (a permuted view of the map) and embedding rows.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyengine.backends.cpu.blocks import BlockMatrix, TiledBlockLinear, embed_rows  # noqa: E402
from polyengine.models.blocks import BLOCK_FORMATS  # noqa: E402
from polyengine.models.weights import Weight  # noqa: E402

from gguf_cases import block_matrix, q8  # noqa: E402
from isa_paths import ISAS, kernels_for  # noqa: E402

N, K = 24, 512  # K: two 256-weight super-blocks, sixteen 32-weight blocks


def _matrix(fmt: str, seed: int = 0, n: int = N, k: int = K) -> tuple[BlockMatrix, np.ndarray]:
    return block_matrix(fmt, n, k, seed)


_q8 = q8


@pytest.fixture(scope="module", params=ISAS)
def kernels(request):
    return kernels_for(request.param)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_dequantize_is_exact(kernels, fmt):
    blocks, exact = _matrix(fmt)
    out = torch.empty((N, K), dtype=torch.float32)
    kernels.gguf_dequant(blocks, 0, N, out)
    np.testing.assert_array_equal(out.numpy(), exact.astype(np.float32))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("m", [1, 3, 7])
def test_products_with_int8_activations(kernels, fmt, m):
    blocks, exact = _matrix(fmt, seed=m)
    rng = np.random.default_rng(100 + m)
    x = rng.standard_normal((m, K)).astype(np.float32)
    x[0, 32:64] = 0.0  # an all-zero activation block
    bias = torch.from_numpy(rng.standard_normal(N).astype(np.float32))
    y = kernels.gguf_linear(torch.from_numpy(x), blocks, bias).numpy().astype(np.float64)
    xq = _q8(x)
    want = xq @ exact.T + bias.numpy()
    scale = np.abs(xq) @ np.abs(exact).T + np.abs(bias.numpy())
    assert np.all(np.abs(y - want) <= 1e-5 * scale + 1e-30), (fmt, np.max(np.abs(y - want) / scale))
    # against the float activations: within the activation rounding's bound (half a step
    # of each block's scale per value, docs/cpu.md)
    full = x.astype(np.float64) @ exact.T + bias.numpy()
    step = np.abs(x.reshape(m, -1, 32)).max(axis=2) / 127  # (m, blocks)
    bound = (step[:, None, :] / 2 * np.abs(exact).reshape(N, -1, 32).sum(axis=2)[None]).sum(axis=2)  # (m, N)
    assert np.all(np.abs(y - full) <= bound * 1.001 + 1e-5 * scale)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("m", [1, 3, 7])
def test_int8x2_products_within_their_bound(kernels, fmt, m):
    """int8x2 (gguf.h's gq_quantize_x2): two int8 rows on one scale, combined in int32 as
    254 * first + second: each activation within d / 508 of its value (d = the block's
    max|x| / 127), so a product is within the sum over blocks of d / 508 times the block's
    sum of |w| of the float64 product of the float activations (plus float32 summation)."""
    blocks, exact = _matrix(fmt, seed=10 + m)
    rng = np.random.default_rng(200 + m)
    x = rng.standard_normal((m, K)).astype(np.float32)
    x[0, 32:64] = 0.0  # an all-zero activation block
    x[-1, 64:96] *= 1e3  # a block of another scale
    bias = torch.from_numpy(rng.standard_normal(N).astype(np.float32))
    y = kernels.gguf_linear(torch.from_numpy(x), blocks, bias, pairs=2).numpy().astype(np.float64)
    full = x.astype(np.float64) @ exact.T + bias.numpy()
    scale = np.abs(x.astype(np.float64)) @ np.abs(exact).T + np.abs(bias.numpy())
    d = np.abs(x.reshape(m, -1, 32)).max(axis=2) / 127  # (m, blocks)
    bound = (d[:, None, :] / 508 * np.abs(exact).reshape(N, -1, 32).sum(axis=2)[None]).sum(axis=2)  # (m, N)
    assert np.all(np.abs(y - full) <= bound * 1.01 + 2e-6 * scale), (fmt, np.max(np.abs(y - full) / (bound + 1e-30)))
    one = kernels.gguf_linear(torch.from_numpy(x), blocks, bias).numpy()
    assert np.abs(y - full).max() < np.abs(one - full).max() / 20


@pytest.mark.parametrize("fmt", ["Q4_1", "Q5_1", "Q4_0", "Q5_0", "Q8_0"])
@pytest.mark.parametrize("k", [32 * 19, 32 * 1027])
@pytest.mark.parametrize("pairs", [1, 2])
def test_minimum_terms_in_groups_of_eight_blocks_and_their_remainder(kernels, fmt, k, pairs):
    """Q4_1/Q5_1 add their minimums' terms, and Q4_0/Q5_0 their zero points' (-8 and -16
    times the block's scale, their quants multiplied unsigned), eight blocks at a time after
    a row (gguf.h's mnrow), the last K/32 mod 8 blocks one at a time, and rows past
    GQ_MIN_BLOCKS (1024 blocks) a block at a time: each as exact as the int8 products
    (Q8_0, signed bytes and no such term: the control)."""
    n, m = 5, 3
    blocks, exact = _matrix(fmt, seed=k + pairs, n=n, k=k)
    rng = np.random.default_rng(k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = kernels.gguf_linear(torch.from_numpy(x), blocks, pairs=pairs).numpy().astype(np.float64)
    scale = np.abs(x.astype(np.float64)) @ np.abs(exact).T
    if pairs == 1:  # against the int8 activations the kernel multiplies: float32 summation only
        xq = _q8(x)
        assert np.all(np.abs(y - xq @ exact.T) <= 1e-5 * (np.abs(xq) @ np.abs(exact).T)), fmt
    else:  # int8x2: within its bound of the float activations' product
        d = np.abs(x.reshape(m, -1, 32)).max(axis=2) / 127
        bound = (d[:, None, :] / 508 * np.abs(exact).reshape(n, -1, 32).sum(axis=2)[None]).sum(axis=2)
        assert np.all(np.abs(y - x.astype(np.float64) @ exact.T) <= bound * 1.01 + 2e-6 * scale), fmt


@pytest.mark.parametrize("fmt", ["Q4_K", "Q8_0"])
def test_int8x2_is_close_to_float(kernels, fmt):
    blocks, exact = _matrix(fmt)
    x = np.random.default_rng(5).standard_normal((2, K)).astype(np.float32)
    full = x.astype(np.float64) @ exact.T
    one = kernels.gguf_linear(torch.from_numpy(x), blocks).numpy()
    two = kernels.gguf_linear(torch.from_numpy(x), blocks, pairs=2).numpy()
    assert np.abs(two - full).max() < np.abs(one - full).max() / 20


@pytest.mark.parametrize("fmt", ["Q6_K", "Q5_0", "Q4_K", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("pairs", [1, 2])
def test_permuted_rows_and_embedding_rows(kernels, fmt, pairs):
    """Rows through an offsets table (llama.cpp's Q/K order undone as a view: computed in
    memory order, gguf.h's gq_rows_in_memory_order, with the two threads' halves cutting
    the middle head) equal the rows read in order, bit for bit; a table that reads a row
    twice (no permutation) still gives each row; and the embedding lookup of chosen rows."""
    blocks, exact = _matrix(fmt, n=24)
    record = blocks.weight.permute_rows(3)  # 3 heads of 8 rows: a strided view, not a copy
    permuted = BlockMatrix.of(record)
    assert permuted.offsets is not None and np.shares_memory(record.data, blocks.weight.data)
    order = np.arange(24).reshape(3, 4, 2).swapaxes(1, 2).reshape(-1)
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((2, K)).astype(np.float32))
    bias = torch.from_numpy(np.random.default_rng(4).standard_normal(24).astype(np.float32))
    y = kernels.gguf_linear(x, permuted, bias, pairs=pairs).numpy()
    in_order = kernels.gguf_linear(x, blocks, pairs=pairs).numpy()
    np.testing.assert_array_equal(y, (torch.from_numpy(in_order[:, order]) + bias).numpy())
    repeated = np.array([5, 5, 0, 23, 7, 7, 7, 1] * 3)  # rows read more than once: the table as given
    twice = BlockMatrix(blocks.weight, blocks.format, blocks.ggml_type, 24, K, blocks.base, 0,
                        repeated.astype(np.int64) * blocks.row_bytes)
    np.testing.assert_array_equal(kernels.gguf_linear(x, twice, pairs=pairs).numpy(), in_order[:, repeated])
    tokens = torch.tensor([[5, 0], [15, 5]])
    rows = embed_rows(blocks, tokens, kernels)
    np.testing.assert_array_equal(rows.numpy(), exact[tokens.numpy()].astype(np.float32))


@pytest.mark.parametrize("with_kernels", [True, False])
def test_tiled_prefill_product(with_kernels):
    """A prefill's product by dequantized bands (the kernels' dequantization, or the
    core's without them), float32 and bfloat16 operands."""
    kernels = kernels_for("auto") if with_kernels else None
    blocks, exact = _matrix("Q4_K", n=40)
    x = torch.from_numpy(np.random.default_rng(9).standard_normal((33, K)).astype(np.float32))
    want = x.double().numpy() @ exact.T
    tiled = TiledBlockLinear()
    y = tiled(x, blocks, kernels=kernels).double().numpy()
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)
    yb = tiled(x, blocks, kernels=kernels, compute=torch.bfloat16).double().numpy()
    assert np.abs(yb - want).max() < 0.05 * np.abs(want).max()


@pytest.mark.parametrize("with_kernels", [True, False])
def test_tiled_prefill_product_over_several_bands(with_kernels, monkeypatch):
    """Bands of 3 rows (and a last one of 1): every band lands in its own rows of the
    product, as one band over the whole matrix would."""
    import polyengine.backends.cpu.blocks as blocks_module

    kernels = kernels_for("auto") if with_kernels else None
    blocks, exact = _matrix("Q4_1", n=10)
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((5, K)).astype(np.float32))
    monkeypatch.setattr(blocks_module, "_BAND_ELEMENTS", 3 * K)
    y = TiledBlockLinear()(x, blocks, kernels=kernels).double().numpy()
    np.testing.assert_allclose(y, x.double().numpy() @ exact.T, rtol=1e-4, atol=1e-4)


def test_refuses_what_it_cannot_read():
    kernels = kernels_for("auto")
    blocks, _ = _matrix("Q8_0")
    with pytest.raises(ValueError, match="columns"):
        kernels.gguf_linear(torch.zeros((1, K + 32)), blocks)
    with pytest.raises(ValueError, match="not a block matrix"):
        BlockMatrix.of(Weight.from_array(np.zeros((2, 32), np.float32)))
