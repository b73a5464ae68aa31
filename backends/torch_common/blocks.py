"""GGUF block weights on a torch device, computed on as stored (no float copy of the matrix).

A projection or LM head stored in a block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
Q5_K, Q6_K) is repacked at load, one tensor at a time, from the core's exact split
(:func:`polyengine.models.int_blocks.split_blocks`: int8 values, a scale per group of
32 weights (Q6_K: 16), an offset per group for Q4_1/Q5_1/Q4_K/Q5_K) into one of two
forms, kept under the matrix's name in ``TorchWeights.tensors``:

- ``<name>.int4`` + ``<name>.int4_scales``: torch's group-wise int4 weight-only matmul
  (tinygemm's layout): ``_convert_weight_to_int4pack_for_cpu`` /
  ``_weight_int4pack_mm_for_cpu`` on the CPU (float32, bfloat16 or float16 activations),
  ``_convert_weight_to_int4pack`` / ``_weight_int4pack_mm`` on CUDA (bfloat16 only: the
  kernel's one type). Checked in torch 2.13: the op's weight is ``(q - 8) * scale + zero``
  per group of 32 along a row, ``q`` in [0, 15]. Q4_0 (``d (q - 8)``) maps onto it with
  zero 0; Q4_1 (``d q + m``) and Q4_K (``d sc q - dmin m`` per 32: scale ``d sc``, offset
  ``-dmin m``) with zero ``offset + 8 scale``: all exactly (Q4_0 bit for bit in float32;
  the others' zero is one float32 rounding). Used for these three where the op runs (the
  compute dtype, the device, and a row count divisible by 16).
- ``<name>.qvalues`` (int8) + ``<name>.qscale`` (+ ``<name>.qoffset``), the scales in
  the compute dtype: each product dequantizes the matrix in the compute dtype (exact
  in float32, see the core's split) into a temporary and runs ``F.linear`` on it. Q8_0,
  the 5- and 6-bit formats always, and the 4-bit ones where the int4 op does not run.
  Not ``_weight_int8pack_mm``: it takes one scale per output row, and the blocks have
  one per group; requantizing to per-row scales would change the weights by up to half
  a step of the row's largest group (docs/cuda_torch.md, "Quantized weights"), and the
  suite judges a quantized model against the oracle on the same blocks with the usual
  float tolerances.

:func:`block_linear` is the shared forward's ``linear`` hook that reads either form, and
plain ``<name>.weight`` (a matrix in any other format, converted to float at load).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from polyengine.models.int_blocks import FOUR_BIT_FORMATS, GROUP, INT_BLOCK_FORMATS, OFFSET_FORMATS, split_blocks
from polyengine.models.weights import Weight

__all__ = ["DEVICE_BLOCK_FORMATS", "int4_runs", "pack_matrix", "packed_bytes", "block_linear"]

DEVICE_BLOCK_FORMATS = INT_BLOCK_FORMATS  # every GGUF block format the core splits
_GROUP = 32  # the int4 op's group: the 4-bit formats' own
# CUDA's int4 layout: K tiles of 16 per inner tile; 8 is tinygemm's usual choice when K allows.
_INNER_K_TILES = (8, 4, 2)


def int4_runs(fmt: str, shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``fmt`` of ``shape`` goes on torch's int4 op on ``device`` in ``dtype``."""
    rows, cols = shape
    if fmt not in FOUR_BIT_FORMATS or cols % _GROUP:
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16, torch.float16) and rows % 16 == 0
    if device.type == "cuda":
        return dtype == torch.bfloat16 and rows % 8 == 0 and cols % (16 * _INNER_K_TILES[-1]) == 0
    return False


def packed_bytes(fmt: str, shape: tuple[int, int], device: torch.device, dtype: torch.dtype) -> int:
    """The device bytes of one matrix in the form :func:`pack_matrix` gives it."""
    rows, cols = shape
    groups = rows * cols // GROUP[fmt]
    if int4_runs(fmt, shape, device, dtype):
        return rows * cols // 2 + 2 * groups * dtype.itemsize
    return rows * cols + groups * dtype.itemsize * (2 if fmt in OFFSET_FORMATS else 1)


def pack_matrix(weight: Weight, name: str, *, device: torch.device, dtype: torch.dtype,
                force_int8: bool = False) -> dict[str, torch.Tensor]:
    """A block matrix (a record as stored, from ``Model.weight``) in its device form, as
    ``TorchWeights.tensors`` entries under ``name``. ``force_int8``: the int8 form even
    where the int4 op runs (tests compare the two). The record's file pages then leave
    the process's resident memory (:meth:`Weight.release_pages`): the form is what is read."""
    values, scale, offset = split_blocks(weight)
    weight.release_pages()
    if not force_int8 and int4_runs(weight.format, weight.shape, device, dtype):
        q = values.astype(np.int32) + (8 if weight.format == "Q4_0" else 0)  # [0, 15]
        zero = np.zeros_like(scale) if offset is None else offset + np.float32(8) * scale
        scales = torch.from_numpy(np.stack([scale.T, zero.T], axis=-1)).to(device=device, dtype=dtype)
        if device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q), 2)
        else:
            cols = q.shape[1]
            tiles = next(t for t in _INNER_K_TILES if cols % (16 * t) == 0)
            pairs = torch.from_numpy(((q[:, ::2] << 4) | q[:, 1::2]).astype(np.uint8)).to(device)
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
        return {name + ".int4": packed, name + ".int4_scales": scales.contiguous()}
    out = {name + ".qvalues": torch.from_numpy(values).to(device),
           name + ".qscale": torch.from_numpy(scale).to(device=device, dtype=dtype)}
    if offset is not None:
        out[name + ".qoffset"] = torch.from_numpy(offset).to(device=device, dtype=dtype)
    return out


def _dequantized(t: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    """``values * scale (+ offset)`` of matrix ``name`` in ``dtype`` ``[out, in]``."""
    values, scale = t[name + ".qvalues"], t[name + ".qscale"]
    rows, cols = values.shape
    w = values.to(dtype).reshape(rows, scale.shape[1], -1) * scale.to(dtype)[:, :, None]
    offset = t.get(name + ".qoffset")
    if offset is not None:
        w = w + offset.to(dtype)[:, :, None]
    return w.reshape(rows, cols)


def block_linear(t: dict[str, torch.Tensor], x: torch.Tensor, name: str) -> torch.Tensor:
    """The shared forward's ``linear`` hook over block matrices (and float ones)."""
    bias = t.get(name + ".bias")
    if name + ".int4" in t:
        lead = x.shape[:-1]
        x2 = x.reshape(math.prod(lead), x.shape[-1]).contiguous()
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, t[name + ".int4"], _GROUP, t[name + ".int4_scales"])
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2, t[name + ".int4"], _GROUP, t[name + ".int4_scales"])
        y = y.reshape(*lead, y.shape[-1])
        return y if bias is None else y + bias
    if name + ".qvalues" in t:
        return F.linear(x, _dequantized(t, name, x.dtype), bias)
    weight = t.get(name + ".weight")
    if weight is None and name == "lm_head":  # tied: the embedding table
        weight = t["model.embed_tokens.weight"]
    return F.linear(x, weight, bias)
