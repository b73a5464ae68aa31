"""A weight as stored: its format, its logical shape and its raw data, never widened
as a whole.

A :class:`Weight` is what a :class:`~polyengine.models.Model` holds per tensor. Loaded
from a file, ``data`` is a read-only view of the file's memory map (GGUF blocks, or a
safetensors tensor in its own dtype): loading copies nothing. The shape is HF's
(``[out, in]`` for a projection, whatever order the file lists its dims in).

``data``'s layout: for a float format, an array of the format's element type (BF16 as
its uint16 bit patterns) whose C-order flattening is the tensor's; for a block format,
uint8 whose last axis is one row's bytes (``in / block * nbytes``) and whose leading
axes flatten, in C order, to the tensor's rows. So a permutation or selection of whole
rows (llama.cpp's per-head Q/K permutation undone, a fused tensor split, an expert of a
stacked one) is a strided view of the map, not a copy: :meth:`rows` copies only where a
caller needs the rows contiguous, one tensor at a time.

Conversion to float (:meth:`to_float`) is exact: float formats widen exactly, block
formats dequantize in float64 (:mod:`.blocks`) and are rounded once when float32 is
asked for. Formats other than those of :data:`~.blocks.FORMATS` that a GGUF file may
hold (Q2_K, Q3_K, the IQ types) are kept as blocks too and dequantized by the ``gguf``
package, in float32 (so not exactly for a float64 caller; said in docs/models.md).
"""

from __future__ import annotations

import math
import mmap
import sys
from dataclasses import dataclass

import numpy as np

from polyengine.errors import WeightsError
from polyengine.models.blocks import FLOAT_FORMATS, FORMATS, Format, dequantize_blocks
from polyengine.models.metadata import require_finite

__all__ = ["Weight", "format_info", "release_mapped"]

# Rows converted at a time: about 2 MiB per float64 temporary, whatever the tensor.
_CHUNK_ELEMENTS = 1 << 18
# The byte offsets of each block format's f16 fields (scales and mins): a non-finite
# weight can only come from one of them.
_F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}


def format_info(name: str) -> Format:
    """The :class:`Format` named ``name``: one of :data:`FORMATS`, or another ggml block
    type that the ``gguf`` package dequantizes."""
    if name in FORMATS:
        return FORMATS[name]
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType[name]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(FORMATS)}") from None
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    return Format(name, int(qtype), block, nbytes)


@dataclass(frozen=True, eq=False)
class Weight:
    """One tensor: ``format`` (``"F32"``, ``"BF16"``, ``"Q4_K"``...), ``shape`` (logical,
    HF orientation) and ``data`` (see the module docstring; read-only when mapped)."""

    format: str
    shape: tuple[int, ...]
    data: np.ndarray
    source: str = "<memory>"
    name: str = ""

    def __post_init__(self) -> None:
        f = format_info(self.format)
        n = math.prod(self.shape)
        if f.is_float:
            ok = self.data.dtype == np.dtype(f.numpy) and self.data.size == n
        else:
            per_row = self.shape[-1] // f.block * f.nbytes if self.shape else 0
            ok = (self.data.dtype == np.uint8 and bool(self.shape) and self.shape[-1] % f.block == 0
                  and self.data.ndim >= 1 and self.data.shape[-1] == per_row
                  and math.prod(self.data.shape[:-1]) == math.prod(self.shape[:-1]))
        if not ok:
            raise ValueError(f"{self.format} data of shape {self.data.shape} ({self.data.dtype}) cannot hold a "
                             f"tensor of shape {self.shape}")

    @classmethod
    def from_array(cls, arr: np.ndarray, *, source: str = "<memory>", name: str = "") -> "Weight":
        """A float array as a record of its own dtype (float64/32/16; any other is
        taken as float32), sharing its memory."""
        arr = np.asarray(arr)
        fmt = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}.get(arr.dtype)
        if fmt is None:
            arr, fmt = arr.astype(np.float32), "F32"
        return cls(fmt, tuple(int(d) for d in arr.shape), arr, source, name)

    def __repr__(self) -> str:
        where = "mapped" if not self.data.flags.writeable else "in memory"
        return f"Weight({self.name or '?'}: {self.format} {self.shape}, {self.nbytes:,} bytes {where})"

    @property
    def info(self) -> Format:
        return format_info(self.format)

    @property
    def is_float(self) -> bool:
        return self.format in FLOAT_FORMATS

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def num_rows(self) -> int:
        return math.prod(self.shape[:-1])

    def rows(self) -> np.ndarray:
        """The data as 2-D ``[rows, row]`` in the tensor's row order (a copy only where
        ``data`` is a permuted view)."""
        if self.is_float:
            return self.data.reshape(self.num_rows, self.shape[-1] if self.shape else 1)
        return self.data.reshape(-1, self.data.shape[-1])

    def select(self, index: int) -> "Weight":
        """Entry ``index`` of the first axis (an expert of a stacked tensor), as a view."""
        if self.is_float:
            return Weight(self.format, self.shape[1:], self.data.reshape(self.shape)[index], self.source, self.name)
        return Weight(self.format, self.shape[1:], self.data.reshape(*self.shape[:-1], -1)[index], self.source,
                      self.name)

    def row_slice(self, start: int, stop: int) -> "Weight":
        """Rows ``start:stop`` (a part of a fused tensor), as a view."""
        data = self.rows()[start:stop]
        shape = (stop - start, *self.shape[1:])
        return Weight(self.format, shape, data.reshape(shape) if self.is_float else data, self.source, self.name)

    def permute_rows(self, n_head: int) -> "Weight":
        """Undo llama.cpp's Q/K row permutation (within each head it interleaved the two
        rotate-half halves): whole rows move, as a strided view of the same data."""
        rows = self.shape[0]
        half = rows // n_head // 2
        if self.is_float:
            view = self.data.reshape(n_head, half, 2, *self.shape[1:]).swapaxes(1, 2)
        elif len(self.shape) == 2:
            view = self.data.reshape(n_head, half, 2, -1).swapaxes(1, 2)
        else:
            # A 1-D block tensor is one row: its elements cannot move without widening.
            return Weight.from_array(self.to_float(np.float32).reshape(n_head, half, 2).swapaxes(1, 2).reshape(rows),
                                     source=self.source, name=self.name)
        return Weight(self.format, self.shape, view, self.source, self.name)

    def to_float(self, dtype: np.dtype | str | None = None) -> np.ndarray:
        """The tensor as floats of its logical shape, exactly (see the module docstring).
        ``dtype`` None: a float format's own dtype (BF16 as float32), float32 for blocks.
        An F32/F16/F64 record asked for its own dtype returns its data itself (a view)."""
        f = self.info
        if dtype is None:
            dtype = f.numpy if self.format in ("F64", "F32", "F16") else np.float32
        dt = np.dtype(dtype)
        if f.is_float and self.format != "BF16":
            out = self.data.reshape(self.shape)
            return out if out.dtype == dt else out.astype(dt)
        rows = self.rows()
        out = np.empty((rows.shape[0], self.shape[-1] if self.shape else 1), dt)
        step = max(1, _CHUNK_ELEMENTS // max(out.shape[1], 1))
        for r in range(0, rows.shape[0], step):
            out[r: r + step] = self._convert_rows(rows[r: r + step], dt)
        return require_finite(out.reshape(self.shape), file=self.source, tensor=self.name or None)

    def _convert_rows(self, rows: np.ndarray, dt: np.dtype) -> np.ndarray:
        if self.format == "BF16":
            return (rows.astype(np.uint32) << 16).view(np.float32)
        f = self.info
        blocks = np.ascontiguousarray(rows).reshape(-1, f.nbytes)
        if self.format in FORMATS:
            return dequantize_blocks(self.format, blocks, dt).reshape(rows.shape[0], -1)
        import gguf

        try:
            out = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(f.ggml_type))
        except (ValueError, NotImplementedError) as exc:
            raise WeightsError(f"cannot convert {self.format} data: {exc}", file=self.source,
                               tensor=self.name or None) from None
        return out.reshape(rows.shape[0], -1)

    def check_finite(self) -> None:
        """Refuse (WeightsError naming the tensor) a tensor holding NaN or infinity,
        reading only what can hold one: every value of a float format, the f16 scales
        of a block format (formats of the ``gguf`` package are checked when converted)."""
        rows = self.rows()
        step = max(1, (_CHUNK_ELEMENTS * 4) // max(rows.shape[1], 1))
        for r in range(0, rows.shape[0], step):
            chunk = rows[r: r + step]
            if self.format == "BF16":
                bad = ((chunk & 0x7F80) == 0x7F80).any()
            elif self.is_float:
                bad = not np.isfinite(chunk).all()
            elif self.format in _F16_FIELDS:
                b = chunk.reshape(chunk.shape[0], -1, self.info.nbytes)
                bad = any(((b[:, :, at + 1] & 0x7C) == 0x7C).any() for at in _F16_FIELDS[self.format])
            else:
                return
            if bad:  # widen this one tensor for a message that says where and what
                with np.errstate(all="ignore"):
                    values = self.to_float(np.float32)  # a block format's conversion raises here
                require_finite(values, file=self.source, tensor=self.name or None)

    def release_pages(self) -> int:
        """Drop the pages of this record's bytes from the process's resident memory, once
        a copy of them (a conversion, a backend's own form) is what is read: the file's
        pages stay in the page cache and fault back in if the record is read again, so
        this changes memory, never values (:func:`release_mapped`). Returns the bytes
        released (0 for a record not mapped from a file, or off Linux)."""
        return release_mapped(self.data)

    def bytes_for_hash(self):
        """The raw data, chunk by chunk, in the tensor's row order (for fingerprints)."""
        rows = self.rows()
        step = max(1, (1 << 22) // max(rows.strides[0] if rows.ndim else 1, 1))
        for r in range(0, rows.shape[0], step):
            yield memoryview(np.ascontiguousarray(rows[r: r + step])).cast("B")


def release_mapped(data: np.ndarray) -> int:
    """``madvise(MADV_DONTNEED)`` on the whole pages inside the span of ``data``, a view
    (strided, permuted rows included) of a file's memory map: those pages leave the
    process's resident memory and read back from the file's page cache when touched
    (the map is private and read-only, so nothing is lost). Pages ``data`` shares with
    its neighbours at either end stay. Linux only; for memory not mapped from a file,
    nothing is done. Returns the bytes released."""
    base = data
    while base is not None and not isinstance(base, mmap.mmap):  # the views' chain down to the file's map
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    if not sys.platform.startswith("linux") or base is None or data.size == 0:
        return 0
    start = data.ctypes.data - np.frombuffer(base, np.uint8).ctypes.data  # offsets in the map
    lo = start + sum((n - 1) * st for n, st in zip(data.shape, data.strides) if st < 0)
    hi = start + sum((n - 1) * st for n, st in zip(data.shape, data.strides) if st > 0) + data.itemsize
    page = mmap.PAGESIZE
    lo, hi = -(-lo // page) * page, hi // page * page
    if hi <= lo:
        return 0
    try:
        base.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    except (OSError, ValueError):  # refused, or the map is closed: nothing released
        return 0
    return hi - lo

