"""The CPU kernels on GGUF block weights repacked sixteen rows interleaved
(``backends/cpu/csrc/packed.h``, option repack_weights): decode products of a few rows of
x, and prefill's int16 tiles filled from the repacked groups.

The AVX-512 VNNI path has them on 512 bits, AVX2 (and AVX-VNNI) on 256 (``gguf_packed``);
the scalar path refuses the option and the file's blocks serve
(tests/test_cpu_gguf_kernels.py). Checked against float64
products of the exactly dequantized blocks:
- with int8 activations: the float64 product of the dequantized weights and the
  dequantized int8 activations up to float32 summation (1e-5 of the terms' magnitude);
  with int8x2 against the float activations, within int8x2's bound;
- every row count of x from 1 to 7 (passes of four), rows past a whole group (N not a
  multiple of 16), rows through an offsets table (bit for bit the same rows in order);
- the tiles filled from the repacked groups bit for bit the tiles filled from the file.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyengine.backends.cpu.blocks import BlockMatrix, release_pages  # noqa: E402
from polyengine.models.blocks import BLOCK_FORMATS  # noqa: E402
from polyengine.models.weights import Weight  # noqa: E402

from gguf_cases import block_matrix, q8  # noqa: E402
from isa_paths import ISAS, kernels_for  # noqa: E402

K = 512
PACKED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _matrix(fmt: str, n: int, k: int = K, seed: int = 0) -> tuple[BlockMatrix, np.ndarray]:
    return block_matrix(fmt, n, k, seed)


@pytest.fixture(scope="module", params=("auto", "avx512", "avx2"))
def kernels(request):
    k = kernels_for(request.param)
    if not k.gguf_packed:
        pytest.skip(f"no packed products on the {k.isa} path ({k.q8_isa}): AVX-512 VNNI, AVX-VNNI and AVX2 only")
    return k


def _x(m: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(100 + seed)
    x = rng.standard_normal((m, K)).astype(np.float32)
    x[0, 32:64] = 0.0  # an all-zero activation block
    x[-1, 64:96] *= 1e3  # a block of another scale
    return x


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize(("m", "n"), [(1, 16), (2, 37), (3, 5), (4, 48), (5, 33), (7, 24), (13, 40), (32, 17)])
def test_packed_products_with_int8_activations(kernels, fmt, m, n):
    blocks, exact = _matrix(fmt, n, seed=m + n)
    x = _x(m, m + n)
    bias = torch.from_numpy(np.random.default_rng(n).standard_normal(n).astype(np.float32))
    packed = kernels.gguf_repack(blocks)
    assert packed.numel() == -(-n // 16) * blocks.row_bytes * 16 + (
        -(-n // 16) * (K // 256) * 64 if fmt in ("Q4_K", "Q5_K") else 0)  # their 6-bit scales widened to bytes
    y = kernels.gguf_packed_linear(torch.from_numpy(x), blocks, packed, bias).numpy().astype(np.float64)
    xq = q8(x)
    want = xq @ exact.T + bias.numpy()
    scale = np.abs(xq) @ np.abs(exact).T + np.abs(bias.numpy())
    assert np.all(np.abs(y - want) <= 1e-5 * scale + 1e-30), (fmt, np.max(np.abs(y - want) / scale))


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize("m", [1, 6])
def test_packed_products_with_int8x2_activations(kernels, fmt, m):
    """int8x2 (two int8 rows on one scale, the default): against the float activations
    within d / 508 a value (d = max|x| / 127 of its block), plus float32 summation; and
    the same products as the file's kernels up to float32 summation."""
    blocks, exact = _matrix(fmt, 40, seed=m)
    x = _x(m, m)
    packed = kernels.gguf_repack(blocks)
    y = kernels.gguf_packed_linear(torch.from_numpy(x), blocks, packed, pairs=2).numpy().astype(np.float64)
    full = x.astype(np.float64) @ exact.T
    step = np.abs(x.reshape(m, -1, 32)).max(axis=2) / 127 / 508  # (m, blocks)
    bound = step @ np.abs(exact).reshape(40, -1, 32).sum(axis=2).T
    scale = np.abs(x).astype(np.float64) @ np.abs(exact).T
    assert np.all(np.abs(y - full) <= bound + 1e-5 * scale), fmt
    y_file = kernels.gguf_linear(torch.from_numpy(x), blocks, pairs=2).numpy().astype(np.float64)
    assert np.all(np.abs(y - y_file) <= 1e-5 * scale + 1e-30)


@pytest.mark.parametrize("fmt", PACKED)
def test_rows_through_offsets_repack_as_the_rows_in_order(kernels, fmt):
    """A permuted view (llama.cpp's Q/K order undone) repacks through its offsets: the
    products are bit for bit those of a matrix whose rows lie in that order."""
    blocks, _ = _matrix(fmt, 40, seed=3)
    perm = np.random.default_rng(0).permutation(40)
    raw = blocks.weight.data
    view = BlockMatrix.of(Weight(fmt, (40, K), raw[perm], name="v"))  # a copy in order
    permuted = BlockMatrix.of(Weight(fmt, (40, K), raw, name="p"))
    permuted.offsets = (perm * blocks.ldw).astype(np.int64)
    x = torch.from_numpy(_x(3, 3))
    a = kernels.gguf_packed_linear(x, view, kernels.gguf_repack(view), pairs=2)
    b = kernels.gguf_packed_linear(x, permuted, kernels.gguf_repack(permuted), pairs=2)
    assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", PACKED)
@pytest.mark.parametrize(("m", "n"), [(9, 16), (20, 37)])
def test_tiles_filled_from_the_packed_groups(kernels, fmt, m, n):
    """Prefill's int16 tiles (csrc/tile.h) filled from the repacked groups instead of the
    file's rows: the same products, bit for bit."""
    if not kernels.gguf_tiles:
        pytest.skip("no int16 tiles")
    blocks, _ = _matrix(fmt, n, seed=m)
    x = torch.from_numpy(_x(m, m))
    bias = torch.from_numpy(np.random.default_rng(m).standard_normal(n).astype(np.float32))
    from_file = kernels.gguf_tile_linear(x, blocks, bias)
    blocks.packed = kernels.gguf_repack(blocks)
    assert torch.equal(kernels.gguf_tile_linear(x, blocks, bias), from_file)


@pytest.mark.parametrize("isa", ISAS)
def test_which_formats_and_paths_repack(isa):
    kernels = kernels_for(isa)
    for fmt in BLOCK_FORMATS:
        blocks, _ = _matrix(fmt, 16)
        assert kernels.gguf_packs(blocks) == (kernels.gguf_packed and fmt in PACKED), (isa, fmt)
        assert (kernels.gguf_packed_bytes(fmt, 16, K) > 0) == kernels.gguf_packs(blocks)
    assert kernels.gguf_packed == (kernels.q8_isa != "scalar"), (isa, kernels.q8_isa)


def test_release_pages_drops_a_mapped_matrix_and_keeps_its_values(tmp_path):
    """After repacking, the file's pages of a matrix leave the process (madvise): what is
    read afterwards is the file's bytes again."""
    import mmap
    import sys

    blocks, exact = _matrix("Q4_K", 64, k=4096)
    path = tmp_path / "w.bin"
    blocks.weight.data.tofile(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    raw = np.frombuffer(mm, dtype=np.uint8).reshape(blocks.weight.data.shape)
    mapped = BlockMatrix.of(Weight("Q4_K", (64, 4096), raw, name="m"))
    assert int(raw.sum(dtype=np.int64)) > 0  # every page read in
    released = release_pages(mapped)
    if sys.platform.startswith("linux"):
        assert released >= raw.nbytes - 2 * mmap.PAGESIZE
    assert release_pages(blocks) == 0  # not a file's map: nothing done
    np.testing.assert_array_equal(raw, blocks.weight.data)
