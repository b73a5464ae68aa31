"""Shared cases of the block-kernel tests (test_cpu_gguf_kernels.py, _tiles.py, _packed.py):
a block matrix of random weights with its exactly dequantized values, and x as the
kernels quantize it."""

from __future__ import annotations

import numpy as np

from polyengine.backends.cpu.blocks import BlockMatrix
from polyengine.models.blocks import FORMATS, dequantize_blocks, quantize_blocks
from polyengine.models.weights import Weight


def block_matrix(fmt: str, n: int, k: int, seed: int = 0) -> tuple[BlockMatrix, np.ndarray]:
    """An ``(n, k)`` matrix in format ``fmt`` (its first block all zero) and its float64 values."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w[0, :32] = 0.0  # an all-zero block
    raw = quantize_blocks(fmt, w)
    exact = dequantize_blocks(fmt, raw.reshape(-1, FORMATS[fmt].nbytes)).reshape(n, k)
    return BlockMatrix.of(Weight(fmt, (n, k), raw, name="w")), exact


def q8(x: np.ndarray) -> np.ndarray:
    """x quantized per 32 values as csrc/q8.h does (symmetric, round half to even), dequantized."""
    b = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(b).max(axis=2, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d > 0, np.clip(np.rint(b / np.where(d > 0, d, 1)), -127, 127), 0)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)
