"""GGUF's 32-weight integer blocks as integer arrays with a scale (and an offset) per
block: the form device backends compute on, made exactly from the file's bytes.

Q8_0, Q4_0 and Q4_1 store each block of 32 weights as small integers times one f16
scale (plus, for Q4_1, one f16 offset): ``w = scale * values + offset``. Split into

- ``values``: int8 ``[rows, in]`` (Q8_0: ``q``; Q4_0: ``q - 8``, in [-8, 7]; Q4_1: ``q``,
  in [0, 15]), the same integers the blocks hold, one byte each;
- ``scale``: float32 ``[rows, in / 32]``, each block's f16 ``d`` (exact: f16 widens to
  float32 exactly);
- ``offset``: float32 ``[rows, in / 32]`` for Q4_1 (its ``m``), else None,

the weights are ``values * scale + offset``, computed in any float type: in float32 a
product of an int8 and an f16 (at most 19 significant bits) is exact, and Q4_1's one
addition rounds once, so the float32 result is bit for bit
:func:`~polyengine.models.blocks.dequantize_blocks`' float32 (the exact value rounded
once); narrower compute dtypes round the scale and the result to themselves.

Nothing is widened to float: a tensor is split a bounded number of rows at a time,
its integer copy being the only thing kept. ``tests/test_device_blocks.py`` checks the
split against the exact dequantization, bit for bit in float32, for each format.
"""

from __future__ import annotations

import numpy as np

from polyengine.models.blocks import FORMATS
from polyengine.models.model import Model
from polyengine.models.quantize import quantized_names
from polyengine.models.weights import Weight

__all__ = ["INT_BLOCK_FORMATS", "split_blocks", "nibbles", "block_matrices"]

# The block formats that split into (int8 values, a scale per 32, an optional offset).
INT_BLOCK_FORMATS = ("Q8_0", "Q4_0", "Q4_1")
# Rows split at a time: about 1 MiB of int8 values per chunk, whatever the tensor.
_CHUNK_ELEMENTS = 1 << 20


def nibbles(qs: np.ndarray) -> np.ndarray:
    """``(n, 16)`` bytes of a 4-bit block -> its 32 values ``(n, 32)`` uint8 in weight
    order (low nibbles are weights 0-15, high nibbles 16-31)."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _split(fmt: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(n, nbytes)`` blocks -> values ``(n, 32)`` int8, scale ``(n,)``, offset ``(n,)`` or None."""
    d = np.ascontiguousarray(raw[:, 0:2]).view("<f2")[:, 0].astype(np.float32)
    if fmt == "Q8_0":
        return np.ascontiguousarray(raw[:, 2:34]).view(np.int8), d, None
    if fmt == "Q4_0":
        return (nibbles(raw[:, 2:18]).astype(np.int8) - np.int8(8)), d, None
    m = np.ascontiguousarray(raw[:, 2:4]).view("<f2")[:, 0].astype(np.float32)
    return nibbles(raw[:, 4:20]).astype(np.int8), d, m


def split_blocks(weight: Weight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A 2-D ``weight`` of one of :data:`INT_BLOCK_FORMATS` as ``(values, scale, offset)``
    (see the module docstring), in the tensor's row order."""
    if weight.format not in INT_BLOCK_FORMATS or len(weight.shape) != 2:
        raise ValueError(f"split_blocks takes a 2-D tensor of {INT_BLOCK_FORMATS}, got {weight.format} {weight.shape}")
    f = FORMATS[weight.format]
    rows, cols = weight.shape
    per_row = cols // f.block
    src = weight.rows()  # (rows, row bytes), a view of the file where it can be
    values = np.empty((rows, cols), np.int8)
    scale = np.empty((rows, per_row), np.float32)
    offset = np.empty((rows, per_row), np.float32) if weight.format == "Q4_1" else None
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for r in range(0, rows, step):
        chunk = np.ascontiguousarray(src[r: r + step]).reshape(-1, f.nbytes)
        n = chunk.shape[0] // per_row
        v, d, m = _split(weight.format, chunk)
        values[r: r + n] = v.reshape(n, cols)
        scale[r: r + n] = d.reshape(n, per_row)
        if offset is not None:
            offset[r: r + n] = m.reshape(n, per_row)
    return values, scale, offset


def block_matrices(model: Model, formats: tuple[str, ...]) -> dict[str, str]:
    """Projection/head name -> its source weight, for every matrix of ``model`` stored in
    one of :data:`INT_BLOCK_FORMATS` that is also in ``formats`` (a backend's
    ``weight_formats``): the matrices a device backend keeps as integers and scales.
    The embedding table is never one (a lookup, which a tied head reads as floats), nor
    are stacked experts."""
    out = {}
    for name, source in quantized_names(model.config):
        if source == "model.embed_tokens.weight" or ".mlp.experts." in source or source not in model.records:
            continue
        fmt = model.records[source].format
        if fmt in INT_BLOCK_FORMATS and fmt in formats:
            out[name] = source
    return out
