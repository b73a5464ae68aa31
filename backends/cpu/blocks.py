"""GGUF block weights in the cpu engine: the Model's records as the file maps them.

A projection, the LM head or the embedding table stored in one of the block formats
the kernels compute on (:data:`KERNEL_FORMATS`: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
Q5_K, Q6_K) stays a :class:`BlockMatrix`: the record's bytes where the file's memory map
holds them (a row permutation, such as llama.cpp's Q/K order undone, is a table of row
offsets, not a copy). What reads it:

- a decode step's products: ``csrc/gguf.h`` through :meth:`CpuKernels.gguf_linear`,
  activations quantized to int8 per 32 values as llama.cpp's ``vec_dot`` does (option
  ``int8_compute``: "int8x2" adds a second int8 row for the first's rounding error,
  "float" multiplies dequantized bands in float32);
- a prefill's GEMM and anything the kernels do not run: :class:`TiledBlockLinear`, one
  band of rows at a time dequantized into a reused float buffer (~1 MiB) and multiplied
  by torch's GEMM, never the whole matrix;
- the embedding lookup: only the looked-up rows are dequantized (:func:`embed_rows`).

Without the compiled kernels the same bands are dequantized by the core (exact, slower):
the fallback every path has, tested beside the kernels.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from polyengine.backends.torch_common.hostmem import HostArena
from polyengine.models.blocks import BLOCK_FORMATS, FORMATS, row_bytes
from polyengine.models.weights import Weight

__all__ = ["KERNEL_FORMATS", "BlockMatrix", "TiledBlockLinear", "embed_rows", "dequantize_band", "release_pages",
           "repacked", "repacked_for", "packing_arena"]

KERNEL_FORMATS = BLOCK_FORMATS  # every format of csrc/gguf.h
_BAND_ELEMENTS = 1 << 21  # floats per dequantized band (8 MiB in float32; docs/cpu.md, "Prefill on block weights")


@dataclass(eq=False)
class BlockMatrix:
    """A ``[n, k]`` weight in a block format, read where it lies: row ``i``'s bytes start
    at ``base + offsets[i]`` (``offsets`` None: ``base + i * ldw``)."""

    weight: Weight  # holds the memory map (and so the addresses) alive
    format: str
    ggml_type: int
    n: int
    k: int
    base: int
    ldw: int
    offsets: np.ndarray | None
    # the rows repacked sixteen at a time (option repack_weights; csrc/packed.h), which the
    # decode products read instead; the file's blocks stay for everything else
    packed: torch.Tensor | None = None

    @classmethod
    def of(cls, weight: Weight) -> "BlockMatrix":
        """The record as it is; ValueError for a format or shape the kernels do not take."""
        if weight.format not in KERNEL_FORMATS or len(weight.shape) != 2:
            raise ValueError(f"{weight.name or 'weight'}: {weight.format} {weight.shape} is not a block matrix")
        f = FORMATS[weight.format]
        data = weight.data
        if data.strides[-1] != 1 or any(s < 0 for s in data.strides):
            raise ValueError(f"{weight.name}: its rows' bytes are not contiguous")
        lead, strides = data.shape[:-1], data.strides[:-1]
        offsets = np.zeros(lead, np.int64)
        for axis, (size, stride) in enumerate(zip(lead, strides)):
            shape = [1] * len(lead)
            shape[axis] = size
            offsets = offsets + np.arange(size, dtype=np.int64).reshape(shape) * stride
        offsets = offsets.reshape(-1)
        n, k = weight.shape
        ldw = int(offsets[1] - offsets[0]) if n > 1 else row_bytes(f, k)
        even = n < 2 or bool(np.all(offsets == np.arange(n, dtype=np.int64) * ldw))
        return cls(weight, weight.format, f.ggml_type, n, k, int(data.ctypes.data), ldw if even else 0,
                   None if even else offsets)

    @property
    def row_bytes(self) -> int:
        """The bytes of one row packed (``ldw`` of a matrix whose rows follow each other)."""
        return row_bytes(FORMATS[self.format], self.k)

    def offsets_of(self, rows: torch.Tensor) -> np.ndarray:
        """Byte offsets of the given rows (int64)."""
        idx = rows.reshape(-1).cpu().numpy().astype(np.int64)
        return (self.offsets[idx] if self.offsets is not None else idx * self.ldw).astype(np.int64)


def release_pages(blocks: BlockMatrix) -> int:
    """Drop the pages of ``blocks``' record from this process's resident memory, once a
    repacked copy serves its products (option repack_weights): the file's pages stay in
    the page cache and fault back in if read again (an embedding lookup of a tied table
    reads a few rows). :meth:`polyengine.models.weights.Weight.release_pages`; returns
    the bytes released."""
    return blocks.weight.release_pages()


# Model -> its matrices repacked (option repack_weights), by weight name: every engine of
# one Model shares them, as the int8 copies are shared (a second engine repacking would
# read the released file pages back and hold a second copy beside the first's).
_PACKED: "weakref.WeakKeyDictionary[object, dict[str, torch.Tensor]]" = weakref.WeakKeyDictionary()


def repacked_for(model) -> bool:
    """Whether ``model``'s matrices were repacked (by an engine before this one)."""
    return bool(_PACKED.get(model))


def repacked(model, name: str, blocks: BlockMatrix, kernels, arena: HostArena | None = None) -> torch.Tensor:
    """``blocks`` (the Model's record ``name``) repacked sixteen rows interleaved
    (``kernels.gguf_repack``; into a piece of ``arena`` when given), made once per Model;
    the first time, its file pages are released (:func:`release_pages`)."""
    done = _PACKED.setdefault(model, {})
    if name not in done:
        out = None if arena is None else arena.take(kernels.gguf_packed_bytes(blocks.format, blocks.n, blocks.k))
        done[name] = kernels.gguf_repack(blocks, out)
        release_pages(blocks)
    return done[name]


def packing_arena(model, matrices: dict[str, BlockMatrix], kernels, *, huge: bool) -> HostArena | None:
    """One :class:`HostArena` for those of ``matrices`` this Model has not repacked yet
    (None when it has them all): with ``huge``, in transparent huge pages."""
    done = _PACKED.get(model) or {}
    sizes = [kernels.gguf_packed_bytes(b.format, b.n, b.k) for name, b in matrices.items() if name not in done]
    return HostArena(HostArena.size_of(sizes), huge=huge) if sizes else None


def dequantize_band(blocks: BlockMatrix, start: int, stop: int, out: torch.Tensor, kernels=None) -> None:
    """Rows ``start:stop`` as float32 into ``out`` ``(stop - start, k)``: the kernels'
    dequantization, or the core's (exact in float64, then rounded) without them."""
    if kernels is not None:
        kernels.gguf_dequant(blocks, start, stop, out)
        return
    band = blocks.weight.row_slice(start, stop).to_float(np.float32)
    out.copy_(torch.from_numpy(band))


def embed_rows(blocks: BlockMatrix, tokens: torch.Tensor, kernels=None) -> torch.Tensor:
    """The embedding rows of ``tokens`` (any shape) as float32 ``(*tokens.shape, k)``:
    only those rows are dequantized."""
    flat = tokens.reshape(-1)
    out = torch.empty((flat.numel(), blocks.k), dtype=torch.float32)
    if kernels is not None:
        kernels.gguf_dequant(blocks, 0, flat.numel(), out, rows=flat)
    else:
        for i, token in enumerate(flat.tolist()):
            dequantize_band(blocks, token, token + 1, out[i: i + 1])
    return out.reshape(*tokens.shape, blocks.k)


class BandBuffers:
    """The reused band buffers of a tiled product, one set per calling thread (a prefill
    lane's products run beside the decode steps': docs/cpu.md, "The prefill lane")."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _band(self, rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        buffers = self._local.__dict__.setdefault("buffers", {})
        buffer = buffers.get(dtype)
        if buffer is None or buffer.numel() < rows * k:
            buffer = buffers[dtype] = torch.empty(max(rows * k, _BAND_ELEMENTS), dtype=dtype)
        return buffer[: rows * k].view(rows, k)


class TiledBlockLinear(BandBuffers):
    """``x @ W.T + bias`` for a :class:`BlockMatrix` ``W`` by bands of rows dequantized
    into a reused float32 buffer of the calling thread's (rounded to ``compute``, the
    GEMM's operand dtype, where that is not float32)."""

    def __call__(self, x: torch.Tensor, blocks: BlockMatrix, bias: torch.Tensor | None = None, *,
                 kernels=None, compute: torch.dtype | None = None) -> torch.Tensor:
        n, k = blocks.n, blocks.k
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        compute = compute or x.dtype
        band = max(1, min(n, _BAND_ELEMENTS // k))
        yt = torch.empty((n, x2.shape[0]), dtype=compute)  # transposed: each band writes whole rows
        xt = x2.to(compute).t()
        for r in range(0, n, band):
            rows = min(band, n - r)
            w = self._band(rows, k, torch.float32)
            dequantize_band(blocks, r, r + rows, w, kernels)
            if compute != torch.float32:
                w = self._band(rows, k, compute).copy_(w)
            torch.mm(w, xt, out=yt[r: r + rows])
        y = yt.t().to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, n)

