"""The CPU kernels' int16 tiles on GGUF block weights (``backends/cpu/csrc/tile.h``): the
products of many rows of x (a prefill, a fused step of at least TILE_ROWS rows), per
format and per ISA path this CPU executes (tests/isa_paths.py).

Only the AVX-512 VNNI path has them; on the others ``gguf_tiles`` is False, the call is
refused, and the engine keeps its fallback (bands into torch's GEMM, tests/test_cpu_blocks.py).
Checked against float64 products of the exactly dequantized blocks:
- against the int16 activations the tiles multiply (x quantized per 32 values on one
  scale d = max|x| / 32767, rounded half to even): float32 summation only (1e-5 of the
  terms' magnitude);
- against the float activations: within half a step d / 2 per value;
- rows of a partly filled tile (N not a multiple of 16), every remainder of the rows of x
  (M mod 8), rows through an offsets table (bit for bit the rows read in order).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyengine.backends.cpu.blocks import BlockMatrix  # noqa: E402
from polyengine.models.blocks import BLOCK_FORMATS  # noqa: E402

from gguf_cases import block_matrix  # noqa: E402
from isa_paths import ISAS, kernels_for  # noqa: E402

K = 512  # two 256-weight super-blocks, sixteen 32-weight blocks


def _matrix(fmt: str, n: int, k: int = K, seed: int = 0) -> tuple[BlockMatrix, np.ndarray]:
    return block_matrix(fmt, n, k, seed)


def _q16(x: np.ndarray) -> np.ndarray:
    """x quantized per 32 values as tile.h's gt_quantize does, dequantized (float64)."""
    b = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(b).max(axis=2, keepdims=True)
    d = amax / np.float32(32767)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(amax > 0, np.float32(32767) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(b * inv), -32768, 32767)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


TILED = ("auto", "avx512")  # the paths that can have tiles (AVX-512 VNNI where the CPU has it)


@pytest.fixture(scope="module", params=TILED)
def kernels(request):
    return _tiles(kernels_for(request.param))


def _tiles(kernels):
    if not kernels.gguf_tiles:
        pytest.skip(f"no int16 tiles on the {kernels.isa} path ({kernels.q8_isa}): AVX-512 VNNI only")
    return kernels


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize(("m", "n"), [(1, 16), (7, 24), (8, 5), (9, 40), (20, 33)])
def test_tile_products(kernels, fmt, m, n):
    blocks, exact = _matrix(fmt, n, seed=m + n)
    rng = np.random.default_rng(100 + m)
    x = rng.standard_normal((m, K)).astype(np.float32)
    x[0, 32:64] = 0.0  # an all-zero activation block
    x[-1, 64:96] *= 1e3  # a block of another scale
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    y = kernels.gguf_tile_linear(torch.from_numpy(x), blocks, bias).numpy().astype(np.float64)
    xq = _q16(x)
    want = xq @ exact.T + bias.numpy()
    scale = np.abs(xq) @ np.abs(exact).T + np.abs(bias.numpy())
    assert np.all(np.abs(y - want) <= 1e-5 * scale + 1e-30), (fmt, np.max(np.abs(y - want) / scale))
    full = x.astype(np.float64) @ exact.T + bias.numpy()
    d = np.abs(x.reshape(m, -1, 32)).max(axis=2) / 32767  # (m, blocks)
    bound = (d[:, None, :] / 2 * np.abs(exact).reshape(n, -1, 32).sum(axis=2)[None]).sum(axis=2)  # (m, n)
    assert np.all(np.abs(y - full) <= bound * 1.001 + 1e-5 * scale), fmt


@pytest.mark.parametrize("fmt", ["Q4_1", "Q5_K", "Q6_K"])
def test_long_rows(kernels, fmt):
    """Rows of 4,096 weights (a tile of 128 KiB: more than the first call's) and a band of
    17 rows (one full tile and one of a single row)."""
    blocks, exact = _matrix(fmt, 17, k=4096, seed=3)
    x = np.random.default_rng(4).standard_normal((11, 4096)).astype(np.float32)
    y = kernels.gguf_tile_linear(torch.from_numpy(x), blocks).numpy().astype(np.float64)
    xq = _q16(x)
    assert np.all(np.abs(y - xq @ exact.T) <= 1e-5 * (np.abs(xq) @ np.abs(exact).T)), fmt


@pytest.mark.parametrize("fmt", ["Q6_K", "Q4_0", "Q8_0"])
def test_permuted_rows(kernels, fmt):
    """Rows through an offsets table (llama.cpp's Q/K order undone as a view) equal the
    rows read in order, bit for bit: a row's sums never depend on its tile."""
    blocks, _ = _matrix(fmt, 24)
    permuted = BlockMatrix.of(blocks.weight.permute_rows(3))
    assert permuted.offsets is not None
    order = np.arange(24).reshape(3, 4, 2).swapaxes(1, 2).reshape(-1)
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((10, K)).astype(np.float32))
    in_order = kernels.gguf_tile_linear(x, blocks).numpy()
    np.testing.assert_array_equal(kernels.gguf_tile_linear(x, permuted).numpy(), in_order[:, order])


@pytest.mark.parametrize("isa", ISAS)
def test_paths_without_tiles_refuse(isa):
    """The paths without AVX-512 VNNI have no tiles and say so; the library still loads."""
    kernels = kernels_for(isa)
    if kernels.gguf_tiles:
        assert kernels.q8_isa == "avx512-vnni"
        return
    blocks, _ = _matrix("Q8_0", 16)
    with pytest.raises(ValueError, match="no int16 tiles"):
        kernels.gguf_tile_linear(torch.zeros(9, K), blocks)


def test_refuses_what_it_cannot_read():
    kernels = _tiles(kernels_for("auto"))
    blocks, _ = _matrix("Q4_K", 16)
    with pytest.raises(ValueError, match="columns"):
        kernels.gguf_tile_linear(torch.zeros(3, K + 32), blocks)
