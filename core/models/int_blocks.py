"""GGUF's block formats as integer arrays with a scale (and an offset) per group of
weights: the form device backends compute on, made exactly from the file's bytes.

Every block format stores small integers times an f16-derived scale, per group of 32
weights (Q6_K: 16), plus, for some, an offset per group: ``w = scale * values + offset``
(:func:`polyengine.models.blocks.split_raw` reads each layout). Split into

- ``values``: int8 ``[rows, in]``, the integers the blocks hold, one byte each: Q8_0
  ``q``; Q4_0 ``q - 8`` in [-8, 7]; Q5_0 ``q - 16`` in [-16, 15]; Q6_K ``q - 32`` in
  [-32, 31]; Q4_1 and Q4_K ``q`` in [0, 15]; Q5_1 and Q5_K ``q`` in [0, 31];
- ``scale``: float32 ``[rows, in / group]`` (:data:`~polyengine.models.blocks.GROUP`):
  Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 each block's f16 ``d``; the K formats' ``d`` times the
  sub-block's 6-bit scale (Q4_K, Q5_K) or int8 scale (Q6_K);
- ``offset``: float32, the same shape, for Q4_1/Q5_1 (``m``) and Q4_K/Q5_K (``-dmin``
  times the sub-block's 6-bit min); else None,

the weights are ``values * scale + offset``, computed in any float type. Every scale and
offset is exact in float32 (an f16 times an integer of at most 8 bits: at most 19
significant bits); a product with a value stays within float32's 24 bits (Q6_K's 18-bit
scale times a 6-bit value is the widest), and the offset's one addition rounds once, so
the float32 result is bit for bit :func:`~polyengine.models.blocks.dequantize_blocks`'
float32 (the exact value rounded once); narrower compute dtypes round the scale and the
result to themselves.

Nothing is widened to float: a tensor is split a bounded number of rows at a time,
its integer copy being the only thing kept. ``tests/test_device_blocks.py`` checks the
split against the exact dequantization, bit for bit in float32, for each format.
"""

from __future__ import annotations

import numpy as np

from polyengine.models.blocks import BLOCK_FORMATS, FORMATS, GROUP, OFFSET_FORMATS, split_raw
from polyengine.models.model import Model
from polyengine.models.quantize import quantized_names
from polyengine.models.weights import Weight

__all__ = ["INT_BLOCK_FORMATS", "FOUR_BIT_FORMATS", "GROUP", "OFFSET_FORMATS", "split_blocks", "block_matrices"]

# The block formats that split into (int8 values, a scale per group, an optional offset).
INT_BLOCK_FORMATS = BLOCK_FORMATS
# Those whose values fit four bits (``values`` + 8 for Q4_0; as they are for Q4_1/Q4_K).
FOUR_BIT_FORMATS = ("Q4_0", "Q4_1", "Q4_K")
# Rows split at a time: about 1 MiB of int8 values per chunk, whatever the tensor.
_CHUNK_ELEMENTS = 1 << 20


def split_blocks(weight: Weight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A 2-D block-format ``weight`` as ``(values, scale, offset)`` (see the module
    docstring), in the tensor's row order."""
    if weight.format not in INT_BLOCK_FORMATS or len(weight.shape) != 2:
        raise ValueError(f"split_blocks takes a 2-D tensor of {INT_BLOCK_FORMATS}, got {weight.format} {weight.shape}")
    f = FORMATS[weight.format]
    rows, cols = weight.shape
    groups = cols // GROUP[weight.format]
    src = weight.rows()  # (rows, row bytes), a view of the file where it can be
    values = np.empty((rows, cols), np.int8)
    scale = np.empty((rows, groups), np.float32)
    offset = np.empty((rows, groups), np.float32) if weight.format in OFFSET_FORMATS else None
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for r in range(0, rows, step):
        chunk = np.ascontiguousarray(src[r: r + step]).reshape(-1, f.nbytes)
        v, d, m = split_raw(weight.format, chunk)
        n = v.size // cols
        values[r: r + n] = v.reshape(n, cols)
        scale[r: r + n] = d.reshape(n, groups)
        if offset is not None:
            offset[r: r + n] = m.reshape(n, groups)
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
