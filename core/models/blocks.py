"""The weight formats a model's tensors are stored in: GGUF's block formats and the
float ones, their layouts, exact dequantization and a simple quantizer for each.

A block format stores a row of ``k`` weights as ``k / block`` blocks of ``nbytes``
bytes, one after another along the row (the input dimension of an ``[out, in]``
matrix): a whole row is whole blocks, so a permutation or a slice of rows is one of
block rows. Within a block (llama.cpp's ``ggml-common.h`` layouts, little-endian):

- ``Q8_0`` (32 weights, 34 bytes): f16 ``d``, 32 int8 ``q``; ``w = d q``.
- ``Q4_0`` (32, 18): f16 ``d``, 16 bytes of nibbles (low: weights 0-15, high: 16-31);
  ``w = d (q - 8)``.
- ``Q4_1`` (32, 20): f16 ``d``, f16 ``m``, nibbles as Q4_0; ``w = d q + m``.
- ``Q5_0`` (32, 22): f16 ``d``, 32 bits ``qh`` (bit j: the fifth bit of weight j),
  nibbles as Q4_0; ``w = d (q - 16)``.
- ``Q5_1`` (32, 24): f16 ``d``, f16 ``m``, ``qh``, nibbles; ``w = d q + m``.
- ``Q4_K`` (256, 144): f16 ``d``, f16 ``dmin``, 12 bytes holding eight 6-bit scales and
  mins of the eight 32-weight sub-blocks, 128 bytes of nibbles (byte ``32 i + l``: low
  nibble sub-block ``2i``, high ``2i + 1``, weight ``l``); ``w = d sc q - dmin m``.
- ``Q5_K`` (256, 176): Q4_K's header, 32 bytes ``qh`` (bit ``s`` of byte ``l``: the fifth
  bit of weight ``l`` of sub-block ``s``), then Q4_K's nibbles.
- ``Q6_K`` (256, 210): 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8
  scales (one per 16 weights), f16 ``d``; ``w = d sc (q - 32)``.

Dequantization is exact in float64 (an f16 times small integers, plus at most one such
product: well inside float64's 53 bits); the float32 result is that value rounded once,
which for Q8_0, Q4_0 and Q5_0 (one product of at most 19 bits) is exact too. Every
function works on ``(n_blocks, nbytes)`` uint8 arrays.

The quantizers exist to write test models: each makes valid blocks that dequantize
close to their input (round to nearest on each block's own scale), not llama.cpp's
searched optimum. Q8_0, Q4_0, Q4_1 and Q5_0 are ``gguf.quants.quantize``'s; the others
are written here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Format", "FORMATS", "FLOAT_FORMATS", "BLOCK_FORMATS", "EXACT_FLOAT32", "GROUP", "OFFSET_FORMATS",
           "format_of_ggml", "split_raw", "dequantize_blocks", "quantize_blocks", "row_bytes"]


@dataclass(frozen=True)
class Format:
    name: str
    ggml_type: int
    block: int  # weights per block (1 for a float format)
    nbytes: int  # bytes per block
    numpy: str | None = None  # the element dtype of a float format (BF16: its bit patterns)

    @property
    def is_float(self) -> bool:
        return self.numpy is not None


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("F64", 28, 1, 8, "<f8"),
    Format("F32", 0, 1, 4, "<f4"),
    Format("F16", 1, 1, 2, "<f2"),
    Format("BF16", 30, 1, 2, "<u2"),
    Format("Q8_0", 8, 32, 34),
    Format("Q4_0", 2, 32, 18),
    Format("Q4_1", 3, 32, 20),
    Format("Q5_0", 6, 32, 22),
    Format("Q5_1", 7, 32, 24),
    Format("Q4_K", 12, 256, 144),
    Format("Q5_K", 13, 256, 176),
    Format("Q6_K", 14, 256, 210),
)}
FLOAT_FORMATS = tuple(n for n, f in FORMATS.items() if f.is_float)
BLOCK_FORMATS = tuple(n for n, f in FORMATS.items() if not f.is_float)
# Block formats whose float32 dequantization is exact (one product of <= 24 bits).
EXACT_FLOAT32 = frozenset({"Q8_0", "Q4_0", "Q5_0"})
_BY_GGML = {f.ggml_type: f for f in FORMATS.values()}


def format_of_ggml(ggml_type: int) -> Format | None:
    """The format of a ggml type number, or None for one not handled here."""
    return _BY_GGML.get(ggml_type)


def row_bytes(fmt: Format, columns: int) -> int:
    """Bytes of one row of ``columns`` weights (a multiple of the block size)."""
    return columns // fmt.block * fmt.nbytes


# -- dequantization (float64, exact) ----------------------------------------------------


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The f16 at byte ``at`` of every block, as float64 ``(n, 1)``."""
    return np.ascontiguousarray(raw[:, at: at + 2]).view("<f2").astype(np.float64)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: low nibbles first (weights 0-15), then high (16-31)."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes (a little-endian uint32) -> bit j of it for j = 0..31."""
    word = np.ascontiguousarray(qh).view("<u4").astype(np.uint32)  # (n, 1)
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> the eight 6-bit scales and mins ``(n, 8)`` each."""
    p = packed.astype(np.uint8)
    sc = np.empty((p.shape[0], 8), np.uint8)
    mn = np.empty((p.shape[0], 8), np.uint8)
    sc[:, :4] = p[:, 0:4] & 63
    mn[:, :4] = p[:, 4:8] & 63
    sc[:, 4:] = (p[:, 8:12] & 15) | ((p[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)
    return sc, mn


def _k_low(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> the low four bits of 256 weights as ``(n, 8, 32)`` (sub-block, weight)."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)


# -- the split: integers, a scale per group, an offset per group --------------------------

# Weights per scale (and offset) in a format's split: Q6_K scales each 16, the others 32.
GROUP = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16}
# The formats whose split has an offset per group (``w = scale q + offset``).
OFFSET_FORMATS = frozenset({"Q4_1", "Q5_1", "Q4_K", "Q5_K"})


def _sp_q8_0(raw):
    return np.ascontiguousarray(raw[:, 2:34]).view(np.int8), _f16(raw, 0), None


def _sp_q4_0(raw):
    return _nibbles(raw[:, 2:18]).astype(np.int8) - np.int8(8), _f16(raw, 0), None


def _sp_q4_1(raw):
    return _nibbles(raw[:, 4:20]).astype(np.int8), _f16(raw, 0), _f16(raw, 2)


def _sp_q5_0(raw):
    q = _nibbles(raw[:, 6:22]) | (_fifth_bits(raw[:, 2:6]) << 4)
    return q.astype(np.int8) - np.int8(16), _f16(raw, 0), None


def _sp_q5_1(raw):
    q = _nibbles(raw[:, 8:24]) | (_fifth_bits(raw[:, 4:8]) << 4)
    return q.astype(np.int8), _f16(raw, 0), _f16(raw, 2)


def _k_split(raw, q):
    sc, mn = _k_scales(raw[:, 4:16])
    return q.reshape(-1, 256).astype(np.int8), _f16(raw, 0) * sc, -(_f16(raw, 2) * mn)


def _sp_q4_k(raw):
    return _k_split(raw, _k_low(raw[:, 16:144]))


def _sp_q5_k(raw):
    high = (raw[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # (n, 8, 32)
    return _k_split(raw, _k_low(raw[:, 48:176]) | (high << 4))


def _sp_q6_k(raw):
    ql = raw[:, 0:128].reshape(-1, 2, 1, 2, 32)  # (half, nibble, part, l)
    low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(-1, 2, 4, 32)  # group g = 2 nibble + part
    qh = raw[:, 128:192].reshape(-1, 2, 1, 32)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    q = (low | (high << 4)).reshape(-1, 256).astype(np.int8) - np.int8(32)
    scales = np.ascontiguousarray(raw[:, 192:208]).view(np.int8)  # one per 16 weights
    return q, _f16(raw, 208) * scales, None


_SPLIT = {"Q8_0": _sp_q8_0, "Q4_0": _sp_q4_0, "Q4_1": _sp_q4_1, "Q5_0": _sp_q5_0, "Q5_1": _sp_q5_1,
          "Q4_K": _sp_q4_k, "Q5_K": _sp_q5_k, "Q6_K": _sp_q6_k}


def split_raw(fmt: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(n_blocks, nbytes)`` uint8 blocks of ``fmt`` -> ``values`` int8 ``(n, block)``,
    ``scale`` float64 ``(n, block / GROUP[fmt])`` and ``offset`` (the same shape, for
    :data:`OFFSET_FORMATS`; else None), where weight ``j`` is ``values[j] * scale[g] +
    offset[g]`` for its group ``g = j // GROUP[fmt]``. Every value is exact: a scale is an
    f16 times a 6- or 8-bit integer (at most 19 significant bits), an offset one such
    product (a K format's ``-dmin m``)."""
    f = FORMATS[fmt]
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] != f.nbytes:
        raise ValueError(f"{fmt} blocks are (n, {f.nbytes}) bytes, got shape {raw.shape}")
    return _SPLIT[fmt](raw)


def dequantize_blocks(fmt: str, raw: np.ndarray, dtype=np.float64) -> np.ndarray:
    """``(n_blocks, nbytes)`` uint8 blocks of ``fmt`` -> ``(n_blocks, block)`` weights:
    exact in float64, rounded once to float32 when asked."""
    values, scale, offset = split_raw(fmt, raw)
    n = values.shape[0]
    w = values.reshape(n, scale.shape[1], -1) * scale[:, :, None]
    if offset is not None:
        w = w + offset[:, :, None]
    out = w.reshape(n, -1)
    return out if np.dtype(dtype) == np.float64 else out.astype(dtype)


# -- quantization (valid blocks for test models) ------------------------------------------


def _as_f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``x`` rounded to f16: its 2 bytes per value ``(n, 2)`` and the value as float64."""
    h = np.asarray(x, np.float64).astype("<f2").reshape(-1, 1)
    return h.view(np.uint8), h.astype(np.float64)


def _levels(x: np.ndarray, scale: np.ndarray, offset: np.ndarray, top: int) -> np.ndarray:
    """``round((x + offset) / scale)`` in ``[0, top]`` (0 where the scale is 0)."""
    safe = np.where(scale > 0, scale, 1.0)
    q = np.rint((x + offset) / safe)
    return np.where(scale > 0, np.clip(q, 0, top), 0).astype(np.uint8)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """32 values ``(n, 32)`` -> 16 bytes: weight j low, weight j + 16 high."""
    return (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)


def _q_q5_1(x):
    lo, hi = x.min(axis=1), x.max(axis=1)
    d_b, d = _as_f16((hi - lo) / 31)
    m_b, m = _as_f16(lo)
    q = _levels(x, d, -m, 31)
    qh = ((q >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return np.concatenate([d_b, m_b, qh.astype("<u4").reshape(-1, 1).view(np.uint8), _pack_nibbles(q)], axis=1)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _q_k(x, top):
    """Q4_K (``top`` 15) or Q5_K (31): per 32-weight sub-block a scale and a min (<= 0),
    both 6-bit multiples of the super-block's f16 ``d`` and ``dmin``."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    step = (sub.max(axis=2) - lo) / top
    d_b, d = _as_f16(step.max(axis=1) / 63)
    dmin_b, dmin = _as_f16((-lo).max(axis=1) / 63)
    sc = _levels(step, d, 0.0, 63)
    mn = _levels(-lo, dmin, 0.0, 63)
    q = _levels(sub, (d * sc)[:, :, None], (dmin * mn)[:, :, None], top)  # (n, 8, 32)
    low = (q & 15).reshape(-1, 4, 2, 32)
    nibbles = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    parts = [d_b, dmin_b, _pack_k_scales(sc, mn)]
    if top == 31:
        parts.append(((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8))
    return np.concatenate([*parts, nibbles], axis=1)


def _q_q6_k(x):
    sub = x.reshape(-1, 16, 16)
    step = np.abs(sub).max(axis=2) / 31
    d_b, d = _as_f16(step.max(axis=1) / 127)
    sc = _levels(step, d, 0.0, 127)  # non-negative int8 scales
    q = _levels(sub, (d * sc)[:, :, None], 32 * (d * sc)[:, :, None], 63)  # stored q + 32, in [0, 63]
    u = q.reshape(-1, 2, 4, 32)  # (half, group, l)
    ql = np.concatenate([(u[:, :, 0] & 15) | ((u[:, :, 2] & 15) << 4),
                         (u[:, :, 1] & 15) | ((u[:, :, 3] & 15) << 4)], axis=2).reshape(-1, 128)
    qh = ((u >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8)
    return np.concatenate([ql, qh.reshape(-1, 64), sc.astype(np.uint8), d_b], axis=1)


def quantize_blocks(fmt: str, x: np.ndarray) -> np.ndarray:
    """Weights ``(rows, k)`` (``k`` a multiple of the block) -> ``(rows, k / block * nbytes)``
    uint8 rows of ``fmt`` blocks (see the module docstring: valid, not optimal)."""
    f = FORMATS[fmt]
    x = np.asarray(x, np.float32)
    if x.ndim != 2 or x.shape[1] % f.block:
        raise ValueError(f"{fmt} quantizes (rows, k) with k a multiple of {f.block}, got shape {x.shape}")
    rows = x.shape[0]
    if f.is_float:

        return narrow_bf16(x) if fmt == "BF16" else x.astype(f.numpy)
    if fmt in ("Q8_0", "Q4_0", "Q4_1", "Q5_0"):
        import gguf

        return gguf.quants.quantize(x, gguf.GGMLQuantizationType[fmt]).reshape(rows, -1)
    blocks = x.reshape(-1, f.block).astype(np.float64)
    raw = {"Q5_1": _q_q5_1, "Q4_K": lambda b: _q_k(b, 15), "Q5_K": lambda b: _q_k(b, 31), "Q6_K": _q_q6_k}[fmt](blocks)
    return raw.reshape(rows, -1)


def narrow_bf16(x: np.ndarray) -> np.ndarray:
    """float32 to BF16 bit patterns (uint16), rounded to nearest even (torch's rounding)."""
    bits = np.ascontiguousarray(x, dtype="<f4").view("<u4").astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
