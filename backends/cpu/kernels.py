"""The CPU decode step, compiled for the host at first use.

The kernels are one small C++ library, ``csrc/``: headers of one part each
(``simd.h`` vector types, ``parallel.h`` threads, ``linear.h`` skinny products ``y = x @
W.T`` for a few rows of ``x`` (the live slots of a decode step) with float32, bfloat16 or
int8 weights, ``q8.h`` int8 weights against activations quantized to int8 per 32 values
(integer dot products: AVX-512 VNNI, AVX-VNNI or AVX2, as the host has), ``decode.h`` a
whole fused decode step (every layer for the live rows, in one call), ``gguf.h`` products
on GGUF block weights as the file maps them (:mod:`.blocks`), ``prefill_attn.h``
a prefill's causal attention) and the one file compiled, ``csrc/polyengine_cpu.cpp``,
which includes them and holds the C ABI (``docs/cpu-kernels.md``). It is compiled once
per host, ISA path and compiler with the system's C++ compiler into a cache folder
(:mod:`.build`: the cache key, pruning of old builds), then called through ctypes on the
tensors' memory: no Python extension build, no torch headers, a few seconds of
compiling. The ISA path (engine option ``isa``, :func:`isa_flags`) is ``-march=native``
by default ("auto"), or a lower instruction set forced so that every path is tested and
measured on any host that executes it: "avx512", "avx2", "scalar". The cache is private
to the user and its library is loaded only when its signed record matches it
(``polyengine.cache``): a damaged, empty, planted or foreign file is compiled again,
never ``dlopen``'ed. A loaded library must lay out the structs Python fills exactly as
this module's ctypes mirrors do (:func:`check_layout`). Where the kernels cannot be built
or loaded, :func:`load` raises :class:`KernelsUnavailable` naming the fix and the engine
stays on the shared torch forward (with a warning that says so).

Only the CPU path uses them: :class:`CpuKernels.linear` for at most :data:`MAX_ROWS`
rows in the shared forward (beyond that a GEMM library is compute-bound and faster)
and for a fused step's LM head, :class:`FusedDecoder` for decode steps. Each is a
switch of the engine (options ``cpu_kernels``, ``fused_decode`` and
``int8_compute``), kept only because the benchmark shows it helps.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from polyengine.cache import check, store
from polyengine.errors import UnsupportedFeature
from polyengine.hostinfo import ISA_PATHS, missing_for, runnable_isas
from polyengine.logs import compiling
from polyengine.models.blocks import FORMATS

from polyengine.backends.cpu.build import (KernelsUnavailable, cache_entry, cache_lock, compile_library, compiler,
                                           compiler_version, isa_flags, mark_used, prune, source_digest)

__all__ = ["CpuKernels", "FusedDecoder", "KernelsUnavailable", "load", "q8_fits", "isa_flags", "check_isa",
           "check_layout", "cache_entry", "ISA_CHOICES", "MAX_ROWS", "BLOCK_KERNEL_ROWS", "Q8_BLOCK",
           "SPLIT_PIECES"]

MAX_ROWS = 16
# Products on GGUF blocks run on the int8 kernels up to this many rows of x, past it on
# bands dequantized into torch's GEMM (docs/cpu.md, "Prefill"): a prefill alone is faster
# on the kernels up to ~60 rows on the default model and ~85-100 on 1B files, but pieces
# of a long prompt beside decoding streams were slower on them at 32 and 64 rows
# (benchmarks/scripts/prefill_under_load.py), so the limit stays at MAX_ROWS.
BLOCK_KERNEL_ROWS = MAX_ROWS
# With option dynamic_split, the chunks each thread takes its share of a fused step's
# product in (csrc/parallel.h, pe_for_share): 4, 8 and 16 each decoded the 1B Q4_K_M file
# 1.06-1.11x faster than fixed shares at batch 1, 64 did not (docs/cpu.md).
SPLIT_PIECES = 8
# Rows from which a fused step multiplies block weights on int16 tiles (csrc/tile.h), where
# the plan has them (option prefill_compute): measured in docs/cpu.md, "Prefill on block weights".
TILE_ROWS = 8
# Tokens up to which a prefill is one fused call where its products run on int16 tiles
# (MAX_ROWS elsewhere), and past MAX_ROWS the most (query, key) pairs its attention may
# take in all: a 24-token piece after 1,000 positions (24,576) was as fast as the torch
# forward, a 32-token one 1.10x slower, a fresh 64-token prompt 0.68x (docs/cpu.md,
# "Short prefills in the fused step").
TILED_FUSED_PREFILL_ROWS = 64
FUSED_PREFILL_SCORES = 25_000
Q8_BLOCK = 32  # int8 activations: values per scale (csrc/q8.h)
Q8_ISAS = {3: "avx512-vnni", 2: "avx-vnni", 1: "avx2", 0: "scalar"}
ISA_CHOICES = ("auto", *ISA_PATHS)
_COMPILED_ISAS = {2: "avx512", 1: "avx2", 0: "scalar"}  # pe_isa(): what the library was compiled with
_lock = threading.Lock()
_loaded: dict[int, "CpuKernels"] = {}


def check_isa(isa: str) -> None:
    """Refuse an ISA path this CPU cannot execute (its library would die with SIGILL),
    naming what the CPU lacks and the paths it does run."""
    if isa == "auto":
        return
    if isa not in ISA_PATHS:
        raise ValueError(f"unknown ISA path {isa!r}; choose from {', '.join(ISA_CHOICES)}")
    missing = missing_for(isa)
    if missing:
        raise UnsupportedFeature(
            f"isa={isa!r}", "cuda_torch",
            f"this CPU lacks {', '.join(missing)}; it runs isa {', '.join(repr(i) for i in runnable_isas())} "
            f"(or 'auto', the best of them)")


@dataclass
class CpuKernels:
    lib: ctypes.CDLL
    total_threads: int  # the threads a call uses with no prefill lane in flight
    path: Path
    requested: str = "auto"  # the ISA path asked for (option isa)
    # A prefill lane's threads (:meth:`lend`): its own on the lane's thread, the rest lent out.
    _local: threading.local = field(default_factory=threading.local, repr=False, compare=False)
    _lent: int = field(default=0, repr=False, compare=False)
    _lend_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def threads(self) -> int:
        """The threads a call made on the calling thread runs on: a prefill lane's own
        (:meth:`lend`) on the lane's thread, else the total less what lanes in flight hold
        (at least one)."""
        return getattr(self._local, "threads", 0) or max(1, self.total_threads - self._lent)

    @contextlib.contextmanager
    def lend(self, n: int):
        """The calling thread's calls run on ``n`` threads, and every other thread's on the
        rest, until the block ends (the prefill lane beside the decode steps: two thread
        teams that together fill the cores, never more; docs/cpu.md, "The prefill lane")."""
        with self._lend_lock:
            self._lent += n
        self._local.threads = n
        try:
            yield
        finally:
            self._local.threads = 0
            with self._lend_lock:
                self._lent -= n

    @property
    def isa(self) -> str:
        """The instruction set the library was compiled for ("avx512", "avx2", "scalar"):
        read from the library, so it says what runs, not what was asked."""
        return _COMPILED_ISAS[int(self.lib.pe_isa())]

    @property
    def flags(self) -> list[str]:
        return isa_flags(self.requested)

    @property
    def vector_width(self) -> int:
        return int(self.lib.pe_vector_width())

    @property
    def bf16_dot(self) -> str:
        """The instructions of bfloat16-activation products (option bf16_compute "bf16")."""
        return "avx512-bf16 vdpbf16ps" if self.lib.pe_bf16_dot() else "float32 fma"

    @property
    def q8_isa(self) -> str:
        """The instructions of the int8-activation products on this host."""
        return Q8_ISAS[int(self.lib.pe_q8_isa())]

    @property
    def attention_bf16(self) -> bool:
        """Whether :meth:`prefill_attention` has its bfloat16 path (vdpbf16ps) here."""
        return bool(self.lib.pe_pa_bf16())

    @property
    def attention_by_default(self) -> bool:
        """Whether option prefill_attention's auto picks :meth:`prefill_attention` on these
        kernels: the 16-float (AVX-512) paths, where it measured faster than torch's SDPA;
        the 8-float ones measured slower than torch's AVX-512 SDPA on that host."""
        return self.vector_width == 16

    def prefill_attention_fits(self, head_dim: int, bf16: bool) -> str | None:
        """None where :meth:`prefill_attention` runs heads of ``head_dim``, else why not."""
        if bf16 and not self.attention_bf16:
            return f"the {self.isa} kernels have no bfloat16 dot products (AVX512-BF16)"
        unit = 16 if bf16 else self.vector_width
        if head_dim % unit:
            return f"head_dim {head_dim} is not a multiple of {unit} (the kernel's vector width)"
        return None

    def prefill_attention(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float,
                          bf16: bool = False, start: int = 0) -> torch.Tensor:
        """Causal attention of a prefill (``csrc/prefill_attn.h``) whose T queries sit at
        positions ``start..start + T - 1``: from position 0, or continuing a prefix of
        ``start`` positions (a chunked prefill's later piece, a prefix-cache hit). ``q``
        (T, heads, head_dim) float32 with contiguous heads, ``keys``/``vals`` (kv_heads,
        start + T, head_dim) float32 with contiguous head_dim (the prefix's keys, then the
        new tokens'); query t attends keys ``0..start + t``. Returns (T, heads * head_dim).
        ``bf16``: q, k, v and the softmax weights rounded to bfloat16, products summed in
        float32 by vdpbf16ps; else float32 throughout."""
        if q.dim() != 3 or keys.dim() != 3:
            raise ValueError(f"prefill attention kernel: q (T, heads, head_dim) and keys (kv_heads, positions, "
                             f"head_dim), got q {tuple(q.shape)}, keys {tuple(keys.shape)}")
        t, nh, hd = q.shape
        nkv = keys.shape[0]
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"prefill attention kernel: start must be an int >= 0 (the queries' first "
                             f"position), got {start!r}")
        why = self.prefill_attention_fits(hd, bf16)
        if why is not None:
            raise ValueError(f"prefill attention kernel: {why}")
        if keys.shape != vals.shape or keys.shape[2] != hd or nkv == 0 or nh % nkv:
            raise ValueError(f"prefill attention kernel: q {tuple(q.shape)} does not fit keys {tuple(keys.shape)} "
                             f"/ values {tuple(vals.shape)}")
        if keys.shape[1] != start + t:
            raise ValueError(f"prefill attention kernel: keys hold {keys.shape[1]} positions, but queries at "
                             f"positions {start}..{start + t - 1} need start + T = {start + t}")
        if q.dtype != torch.float32 or keys.dtype != torch.float32 or vals.dtype != torch.float32:
            raise ValueError("prefill attention kernel: q, keys and values must be float32")
        if q.stride(2) != 1 or q.stride(1) != hd:
            q = q.contiguous()
        if keys.stride() != vals.stride() or keys.stride(2) != 1:
            keys, vals = keys.contiguous(), vals.contiguous()
        out = torch.empty((t, nh * hd), dtype=torch.float32)
        rc = self.lib.pe_prefill_attention(q.data_ptr(), q.stride(0), keys.data_ptr(), vals.data_ptr(), keys.stride(0),
                                           keys.stride(1), out.data_ptr(), t, start, nh, nkv, hd, scale, int(bf16),
                                           self.threads)
        if rc != 0:
            raise ValueError(f"prefill attention kernel refused q {tuple(q.shape)}, keys {tuple(keys.shape)}")
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
               int8_activations: int = 0, bf16_activations: bool = False) -> torch.Tensor:
        """``x @ weight.T (* scale) + bias`` for float32 ``x`` (..., K); ``weight`` (N, K)
        float32, bfloat16 (widened exactly in the kernels, float32 products), or int8 with
        ``scale`` (N,) or (N, K / group) float32. ``out``: a
        contiguous float32 buffer of at least M * N elements to write into (a decode
        step's logits, reused instead of a fresh ~6 MB allocation that faults in its
        pages each step). ``int8_activations``: with int8 weights, quantize ``x`` to int8
        per 32 values and use integer dot products (``csrc/q8.h``): 1 one int8 row
        per row of ``x``, 2 a second one carrying the first's rounding error; 0 float32.
        ``bf16_activations``: with bfloat16 weights, round ``x`` to bfloat16 and multiply
        pairs with vdpbf16ps where the ISA path has it (``pe_bf16_dot``)."""
        if not weight.is_contiguous():
            raise ValueError("the CPU kernels need contiguous weights")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        m, k = x2.shape
        n = weight.shape[0]
        if out is not None and out.is_contiguous() and out.dtype == torch.float32 and out.numel() >= m * n:
            y = out.view(-1)[: m * n].view(m, n)
        else:
            y = torch.empty((m, n), dtype=torch.float32)
        b = ctypes.c_void_p(bias.data_ptr()) if bias is not None else None
        if weight.dtype == torch.int8 and int8_activations:
            group = 0 if scale.dim() == 1 else k // scale.shape[1]
            if k % Q8_BLOCK or group % Q8_BLOCK:
                raise ValueError(f"int8 activations need K ({k}) and the int8 group ({group}) to be multiples of {Q8_BLOCK}")
            pairs = 2 if int8_activations == 2 else 1
            xq = torch.empty(pairs * m * k, dtype=torch.int8)
            xs = torch.empty(pairs * m * k // Q8_BLOCK + k, dtype=torch.float32)  # scales, then k residuals
            self.lib.pe_linear_q8(x2.data_ptr(), k, weight.data_ptr(), scale.data_ptr(), b, y.data_ptr(), n, m, n, k,
                                  group, self.threads, xq.data_ptr(), xs.data_ptr(), pairs,
                                  xs[pairs * m * k // Q8_BLOCK:].data_ptr())
        elif weight.dtype == torch.int8 and scale.dim() == 2:  # blockwise: (N, K / group) scales
            group = k // scale.shape[1]
            self.lib.pe_linear_i8_grouped(x2.data_ptr(), k, weight.data_ptr(), scale.data_ptr(), b, y.data_ptr(), n,
                                          m, n, k, group, self.threads)
        elif weight.dtype == torch.bfloat16 and bf16_activations:
            xb = torch.empty(m * k, dtype=torch.bfloat16)
            self.lib.pe_linear_bf16dot(x2.data_ptr(), k, weight.data_ptr(), b, y.data_ptr(), n, m, n, k, self.threads,
                                       xb.data_ptr())
        elif weight.dtype == torch.bfloat16:
            self.lib.pe_linear_bf16(x2.data_ptr(), k, weight.data_ptr(), b, y.data_ptr(), n, m, n, k, self.threads)
        elif weight.dtype == torch.int8:
            self.lib.pe_linear_i8(x2.data_ptr(), k, weight.data_ptr(), scale.data_ptr(), b, y.data_ptr(), n,
                                  m, n, k, self.threads)
        else:
            self.lib.pe_linear_f32(x2.data_ptr(), k, weight.data_ptr(), b, y.data_ptr(), n, m, n, k, self.threads)
        return y.reshape(*shape[:-1], n)


    def _gguf_operands(self, x: torch.Tensor, blocks, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A block product's float32 rows of ``x`` (M, K), contiguous, and its output (M, N):
        ``out``'s storage where it fits, as :meth:`linear`'s."""
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous() or x2.dtype != torch.float32:
            x2 = x2.contiguous().float()
        m, k = x2.shape
        if k != blocks.k:
            raise ValueError(f"x has {k} columns, the {blocks.format} matrix {blocks.k}")
        if out is not None and out.is_contiguous() and out.dtype == torch.float32 and out.numel() >= m * blocks.n:
            return x2, out.view(-1)[: m * blocks.n].view(m, blocks.n)
        return x2, torch.empty((m, blocks.n), dtype=torch.float32)

    def gguf_linear(self, x: torch.Tensor, blocks, bias: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, pairs: int = 1) -> torch.Tensor:
        """``x @ W.T + bias`` for float32 ``x`` (..., K) and a :class:`~.blocks.BlockMatrix`
        ``W`` in its GGUF blocks (``csrc/gguf.h``): ``x`` quantized to int8 per 32 values;
        ``pairs`` 2 adds the product of a second int8 row quantizing the first's rounding
        error (int8_compute "int8x2"). ``out`` as :meth:`linear`'s."""
        x2, y = self._gguf_operands(x, blocks, out)
        (m, k), n = x2.shape, blocks.n
        pairs, xq, xs, nb = self._int8_scratch(m, k, pairs)
        offsets = blocks.offsets
        rc = self.lib.pe_gguf_linear(blocks.ggml_type, x2.data_ptr(), k, blocks.base, blocks.ldw,
                                     None if offsets is None else offsets.ctypes.data,
                                     None if bias is None else bias.data_ptr(), y.data_ptr(), n, m, n, k,
                                     self.threads, xq.data_ptr(), xs.data_ptr(), xs[nb:].data_ptr(), pairs)
        if rc != 0:
            raise ValueError(f"the block kernels refused a {blocks.format} matrix of {k} columns")
        return y.reshape(*x.shape[:-1], n)

    @staticmethod
    def _int8_scratch(m: int, k: int, pairs: int) -> tuple[int, torch.Tensor, torch.Tensor, int]:
        """The int8 block products' scratch for ``m`` rows of ``k``: pairs (1 or 2), xq,
        xs (the scales, then from index nb their half-blocks' sums) and nb."""
        pairs = 2 if pairs == 2 else 1
        nb = pairs * m * k // Q8_BLOCK
        xq = torch.empty(pairs * m * k, dtype=torch.int8)
        xs = torch.empty(nb + 2 * m * k // Q8_BLOCK, dtype=torch.float32)
        return pairs, xq, xs, nb

    @property
    def gguf_tiles(self) -> bool:
        """Whether this library has :meth:`gguf_tile_linear` (the AVX-512 VNNI path)."""
        return bool(self.lib.pe_gguf_tiles())

    def gguf_tile_linear(self, x: torch.Tensor, blocks, bias: torch.Tensor | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`gguf_linear`'s product for many rows of ``x`` (a prefill): ``x``
        quantized to int16 per 32 values, sixteen weight rows unpacked once into a tile
        that every row of ``x`` runs over (``csrc/tile.h``). Only where :attr:`gguf_tiles`."""
        x2, y = self._gguf_operands(x, blocks, out)
        (m, k), n = x2.shape, blocks.n
        bias = None if bias is None else bias.contiguous().float()  # held: the call reads its pointer
        xq = torch.empty(m * k, dtype=torch.int16)
        xs = torch.empty(2 * m * k // Q8_BLOCK, dtype=torch.float32)  # scales, then the blocks' sums
        offsets = blocks.offsets
        packed = blocks.packed  # held through the call: the tiles are filled from it where set
        rc = self.lib.pe_gguf_tile_linear(blocks.ggml_type, x2.data_ptr(), k, blocks.base, blocks.ldw,
                                          None if offsets is None else offsets.ctypes.data,
                                          None if packed is None else packed.data_ptr(),
                                          None if bias is None else bias.data_ptr(),
                                          y.data_ptr(), n, m, n, k, self.threads, xq.data_ptr(), xs.data_ptr(),
                                          xs[m * k // Q8_BLOCK:].data_ptr())
        if rc == -2:
            raise ValueError("this build of the CPU kernels has no int16 tiles (gguf_tiles is False)")
        if rc != 0:
            raise ValueError(f"the block kernels refused a {blocks.format} matrix of {k} columns")
        return y.reshape(*x.shape[:-1], n)

    @property
    def gguf_packed(self) -> bool:
        """Whether this library has :meth:`gguf_packed_linear` (the AVX-512 VNNI path on
        512 bits; AVX2 and AVX-VNNI on 256)."""
        return bool(self.lib.pe_gguf_packs(FORMATS["Q4_0"].ggml_type, 32))  # one block of a packed format

    def gguf_packs(self, blocks) -> bool:
        """Whether :meth:`gguf_repack` takes ``blocks`` on this library (``csrc/packed.h``:
        every block format the loader keeps, on the AVX-512 VNNI, AVX-VNNI and AVX2 paths)."""
        return bool(self.lib.pe_gguf_packs(blocks.ggml_type, blocks.k))

    def gguf_packed_bytes(self, fmt: str, n: int, k: int) -> int:
        """Bytes of an ``(n, k)`` matrix of format ``fmt`` repacked (0: it does not repack here)."""
        ggml = FORMATS[fmt].ggml_type if fmt in FORMATS else -1
        return int(self.lib.pe_gguf_packed_bytes(ggml, n, k)) if self.lib.pe_gguf_packs(ggml, k) else 0

    def gguf_repack(self, blocks, out: torch.Tensor | None = None) -> torch.Tensor:
        """``blocks`` with sixteen rows interleaved (row offsets applied), as a uint8
        tensor for :meth:`gguf_packed_linear`: the same bits, another order in memory;
        written into ``out`` (uint8, contiguous, :meth:`gguf_packed_bytes` long) when given."""
        size = self.lib.pe_gguf_packed_bytes(blocks.ggml_type, blocks.n, blocks.k)
        if out is None:
            packed = torch.empty(size, dtype=torch.uint8)
        elif out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != size:
            raise ValueError(f"a {blocks.format} matrix repacks into {size:,} contiguous bytes, "
                             f"not a {out.dtype} tensor of {out.numel():,}")
        else:
            packed = out
        offsets = None if blocks.offsets is None else np.ascontiguousarray(blocks.offsets, dtype=np.int64)
        rc = self.lib.pe_gguf_repack(blocks.ggml_type, blocks.base, blocks.ldw,
                                     None if offsets is None else offsets.ctypes.data, blocks.n, blocks.k,
                                     packed.data_ptr(), self.threads)
        if rc != 0:
            raise ValueError(f"a {blocks.format} matrix of {blocks.k} columns does not repack on this library")
        return packed

    def gguf_packed_linear(self, x: torch.Tensor, blocks, packed: torch.Tensor, bias: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, pairs: int = 1) -> torch.Tensor:
        """:meth:`gguf_linear`'s product on ``packed``, ``blocks`` repacked by
        :meth:`gguf_repack`."""
        x2, y = self._gguf_operands(x, blocks, out)
        (m, k), n = x2.shape, blocks.n
        pairs, xq, xs, nb = self._int8_scratch(m, k, pairs)
        bias = None if bias is None else bias.contiguous().float()
        rc = self.lib.pe_gguf_packed_linear(blocks.ggml_type, x2.data_ptr(), k, packed.data_ptr(),
                                            None if bias is None else bias.data_ptr(), y.data_ptr(), n, m, n, k,
                                            self.threads, xq.data_ptr(), xs.data_ptr(), xs[nb:].data_ptr(), pairs)
        if rc != 0:
            raise ValueError(f"a {blocks.format} matrix of {k} columns has no packed products on this library")
        return y.reshape(*x.shape[:-1], n)

    def gguf_dequant(self, blocks, start: int, stop: int, out: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Rows ``start:stop`` of ``blocks`` (or, with ``rows``, the rows it lists) as
        float32 into the contiguous ``out``."""
        if rows is not None:
            offsets = blocks.offsets_of(rows)
            count = len(offsets)
        else:
            count = stop - start
            offsets = None if blocks.offsets is None else blocks.offsets[start:stop]
        if offsets is None:
            base = blocks.base + start * blocks.ldw
        else:
            base, offsets = blocks.base, np.ascontiguousarray(offsets, dtype=np.int64)
        if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < count * blocks.k:
            raise ValueError("gguf_dequant writes into a contiguous float32 buffer of the rows' size")
        rc = self.lib.pe_gguf_dequant(blocks.ggml_type, base, blocks.ldw, None if offsets is None else offsets.ctypes.data,
                                      count, blocks.k, out.data_ptr(), blocks.k, self.threads)
        if rc != 0:
            raise ValueError(f"the block kernels refused a {blocks.format} matrix of {blocks.k} columns")

    def threefry_bits(self, seed_lo: torch.Tensor, seed_hi: torch.Tensor, ctr_hi: torch.Tensor,
                      vocab: int) -> torch.Tensor:
        """The sampler stream's ``m = word0 >> 8`` (int32, (B, vocab)) for rows of keys
        ``seed_lo``/``seed_hi`` and counters ``(token id, ctr_hi)``, token ids 0 ..
        vocab - 1: what ``torch_common.threefry.threefry2x32``'s first word gives, shifted,
        in one pass (csrc/threefry.h). ``seed_lo``, ``seed_hi``, ``ctr_hi``: (B,) int32 bit
        patterns."""
        k0, k1, ctr = _stream_words(seed_lo, seed_hi, ctr_hi)
        out = torch.empty((k0.numel(), vocab), dtype=torch.int32)
        self.lib.pe_threefry_bits(k0.data_ptr(), k1.data_ptr(), ctr.data_ptr(), k0.numel(), vocab, out.data_ptr(),
                                  self.threads)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x / sqrt(mean(x^2) + eps) * weight`` over the rows of ``x`` (M, H) float32, as
        the fused step normalizes inside its layers (one call; torch's takes five ops)."""
        x, weight = x.contiguous(), weight.contiguous()
        if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.shape != x.shape[-1:]:
            raise ValueError("the kernels' RMS norm takes float32 rows and a float32 weight of their width")
        y = torch.empty_like(x)
        self.lib.pe_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
        return y

    def greedy(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy token of each row of ``x`` (B, V) float32 as ``argmax_lowest`` gives
        it (int64 (B,)), and which rows hold NaN or +inf (bool (B,)): one pass in place of
        the sampler's torch ops over the vocabulary (csrc/polyengine_cpu.cpp, pe_greedy)."""
        b, v = x.shape
        x = x.contiguous()
        tokens = torch.empty(b, dtype=torch.int64)
        broken = torch.empty(b, dtype=torch.uint8)
        self.lib.pe_greedy(x.data_ptr(), v, b, v, tokens.data_ptr(), broken.data_ptr())
        return tokens, broken.bool()

    def gumbel_draw(self, x: torch.Tensor, temperature: torch.Tensor, seed_lo: torch.Tensor, seed_hi: torch.Tensor,
                    ctr_hi: torch.Tensor) -> torch.Tensor:
        """Plain temperature sampling's draw (no top-k, top-p or min-p) for the rows of
        ``x`` (B, V) float32: argmax of ``(x - max) / T + gumbel`` in float64 with ties to
        the lowest id, the stream's noise computed only for tokens that can still win
        (csrc/threefry.h's gd_row); int64 (B,), 0 for a row with ``temperature`` <= 0."""
        b, v = x.shape
        x = x.contiguous()
        temp = temperature.reshape(b).to(torch.float32).contiguous()
        k0, k1, ctr = _stream_words(seed_lo, seed_hi, ctr_hi)
        threads = self.threads
        tokens = torch.empty(b, dtype=torch.int64)
        best = torch.empty(b * threads, dtype=torch.float64)
        best_j = torch.empty(b * threads, dtype=torch.int64)
        self.lib.pe_gumbel_draw(x.data_ptr(), v, b, v, temp.data_ptr(), k0.data_ptr(), k1.data_ptr(), ctr.data_ptr(),
                                tokens.data_ptr(), best.data_ptr(), best_j.data_ptr(), threads)
        return tokens

    def filtered_draw(self, x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor, seed_lo: torch.Tensor, seed_hi: torch.Tensor,
                      ctr_hi: torch.Tensor) -> torch.Tensor:
        """Sampling with top-k, top-p and min-p (0, 1 and 0: off) for the rows of ``x``
        (B, V) float32: the core's steps 3-5 in float64 over lists of the kept ids
        (csrc/threefry.h's fd_row); int64 (B,), 0 for a row with ``temperature`` <= 0."""
        b, v = x.shape
        x = x.contiguous()
        temp, tp, mp = (t.reshape(b).to(torch.float32).contiguous() for t in (temperature, top_p, min_p))
        tk = top_k.reshape(b).to(torch.int64).contiguous()
        k0, k1, ctr = _stream_words(seed_lo, seed_hi, ctr_hi)
        tokens = torch.empty(b, dtype=torch.int64)
        self.lib.pe_filtered_draw(x.data_ptr(), v, b, v, temp.data_ptr(), tk.data_ptr(), tp.data_ptr(), mp.data_ptr(),
                                  k0.data_ptr(), k1.data_ptr(), ctr.data_ptr(), tokens.data_ptr(), self.threads)
        return tokens


def _stream_words(seed_lo: torch.Tensor, seed_hi: torch.Tensor, ctr_hi: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A sampled row's key and counter words as the stream kernels take them: (B,)
    contiguous int32 each."""
    return tuple(t.reshape(-1).to(torch.int32).contiguous() for t in (seed_lo, seed_hi, ctr_hi))


def load(threads: int | None = None, isa: str = "auto") -> CpuKernels:
    """The kernels for this host and ISA path ``isa`` (:data:`ISA_CHOICES`; compiled on
    first use, cached by source, compiler, CPU and path in a private, signed cache:
    ``polyengine.cache``, :mod:`.build`). Raises :class:`UnsupportedFeature` for a path
    this CPU cannot execute, and :class:`KernelsUnavailable`, whose message names the fix,
    where they cannot be built or loaded or the library's struct layout is not this
    module's (:func:`check_layout`)."""
    check_isa(isa)
    threads = threads or torch.get_num_threads()
    with _lock:
        if (threads, isa) in _loaded:
            return _loaded[threads, isa]
        path, sources = cache_entry(isa)
        with cache_lock(path.parent) as lock:  # no other process prunes this build meanwhile
            record, reason = check(path)
            if record is None:
                cxx = compiler()
                if reason != "missing":  # damaged, planted or foreign: never dlopen'ed, built again
                    warnings.warn(f"cpu: not loading the cached CPU kernels ({reason}); compiling them again",
                                  stacklevel=3)
                with compiling(f"CPU kernels for ISA path {isa}"):
                    store(path, lambda tmp: compile_library(cxx, tmp, isa),
                          {"sources": sources, "source_digest": source_digest(isa), "compiler": cxx,
                           "compiler_version": compiler_version(cxx), "isa": isa, "flags": isa_flags(isa)})
            mark_used(path)
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as exc:
                raise KernelsUnavailable(f"loading the compiled kernels {path} failed ({exc}); fix: delete that "
                                         f"file (it is compiled again)") from None
            if record is None:
                prune(path, lock)  # a new build landed: the old ones of its kind go
        check_layout(lib, path)
        try:
            _bind(lib)
        except AttributeError as exc:  # ctypes: a symbol the library lacks
            raise KernelsUnavailable(f"the compiled kernels {path.name} lack a function ({exc}); fix: delete "
                                     f"{path} (it is compiled again)") from None
        kernels = CpuKernels(lib, threads, path, isa)
        _loaded[threads, isa] = kernels
        return kernels


def _bind(lib: ctypes.CDLL) -> None:
    """The C ABI's signatures (csrc/polyengine_cpu.cpp), so ctypes passes each argument
    at its C type."""
    lib.pe_vector_width.restype = lib.pe_isa.restype = ctypes.c_int
    ptr, long_, int_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.pe_linear_f32.argtypes = [ptr, long_, ptr, ptr, ptr, long_, int_, long_, long_, int_]
    lib.pe_linear_i8.argtypes = [ptr, long_, ptr, ptr, ptr, ptr, long_, int_, long_, long_, int_]
    lib.pe_linear_i8_grouped.argtypes = [ptr, long_, ptr, ptr, ptr, ptr, long_, int_, long_, long_, long_, int_]
    lib.pe_linear_bf16.argtypes = lib.pe_linear_f32.argtypes
    lib.pe_linear_f32.restype = lib.pe_linear_i8.restype = lib.pe_linear_i8_grouped.restype = None
    lib.pe_linear_bf16.restype = None
    lib.pe_linear_bf16dot.argtypes = [*lib.pe_linear_f32.argtypes, ptr]
    lib.pe_linear_bf16dot.restype = None
    lib.pe_bf16_dot.restype = ctypes.c_int
    lib.pe_linear_q8.argtypes = [ptr, long_, ptr, ptr, ptr, ptr, long_, int_, long_, long_, long_, int_, ptr, ptr,
                                 int_, ptr]
    lib.pe_linear_q8.restype = None
    lib.pe_q8_isa.restype = ctypes.c_int
    lib.pe_decode.argtypes = [ptr, ptr, ptr, int_, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
    lib.pe_decode.restype = None
    lib.pe_attention_runs.argtypes = [ptr, int_, ptr, ptr, ptr, int_]
    lib.pe_attention_runs.restype = ctypes.c_int
    lib.pe_prefill_attention.argtypes = [ptr, long_, ptr, ptr, long_, long_, ptr, int_, long_, int_, int_, int_,
                                         ctypes.c_float, int_, int_]
    lib.pe_prefill_attention.restype = lib.pe_pa_bf16.restype = ctypes.c_int
    lib.pe_gguf_linear.argtypes = [int_, ptr, long_, ptr, long_, ptr, ptr, ptr, long_, int_, long_, long_, int_, ptr,
                                   ptr, ptr, int_]
    lib.pe_gguf_dequant.argtypes = [int_, ptr, long_, ptr, long_, long_, ptr, long_, int_]
    lib.pe_gguf_linear.restype = lib.pe_gguf_dequant.restype = ctypes.c_int
    lib.pe_gguf_tile_linear.argtypes = [int_, ptr, long_, ptr, long_, ptr, ptr, ptr, ptr, long_, int_, long_, long_,
                                        int_, ptr, ptr, ptr]
    lib.pe_gguf_tile_linear.restype = lib.pe_gguf_tiles.restype = ctypes.c_int
    lib.pe_gguf_packs.argtypes = [int_, long_]
    lib.pe_gguf_packed_bytes.argtypes = [int_, long_, long_]
    lib.pe_gguf_repack.argtypes = [int_, ptr, long_, ptr, long_, long_, ptr, int_]
    lib.pe_gguf_packed_linear.argtypes = [int_, ptr, long_, ptr, ptr, ptr, long_, int_, long_, long_, int_, ptr, ptr,
                                          ptr, int_]
    lib.pe_gguf_packs.restype = lib.pe_gguf_repack.restype = lib.pe_gguf_packed_linear.restype = ctypes.c_int
    lib.pe_gguf_packed_bytes.restype = ctypes.c_long
    lib.pe_threefry_bits.argtypes = [ptr, ptr, ptr, int_, long_, ptr, int_]
    lib.pe_threefry_bits.restype = None
    lib.pe_gumbel_draw.argtypes = [ptr, long_, int_, long_, ptr, ptr, ptr, ptr, ptr, ptr, ptr, int_]
    lib.pe_gumbel_draw.restype = None
    lib.pe_filtered_draw.argtypes = [ptr, long_, int_, long_, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, int_]
    lib.pe_filtered_draw.restype = None
    lib.pe_rms_norm.argtypes = [ptr, ptr, ptr, int_, long_, ctypes.c_float]
    lib.pe_rms_norm.restype = None
    lib.pe_greedy.argtypes = [ptr, long_, int_, long_, ptr, ptr]
    lib.pe_greedy.restype = None
    lib.pe_decode_attention.argtypes = [ptr, long_, int_, ptr, ptr, ptr, ptr, ptr, ptr, ptr, int_]
    lib.pe_decode_attention.restype = ctypes.c_int
    lib.pe_split_check.argtypes = [long_, int_, int_, int_, long_, long_, ptr]
    lib.pe_split_check.restype = ctypes.c_long
    lib.pe_yield_count.argtypes = []
    lib.pe_yield_count.restype = ctypes.c_long


_Layout = dict[str, dict[str, tuple[int, int]]]  # struct -> field -> (offset, size); field "": (0, sizeof)


def _library_layout(lib: ctypes.CDLL) -> _Layout | None:
    """The layout of the ABI structs as the library's compiler laid them out
    (``pe_layout_field``), or None where the library does not report it."""
    describe = getattr(lib, "pe_layout_field", None)
    if describe is None:
        return None
    charpp, longp = ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_long)
    describe.argtypes = [ctypes.c_int, charpp, charpp, longp, longp]
    describe.restype = ctypes.c_int
    record, field = ctypes.c_char_p(), ctypes.c_char_p()
    offset, size = ctypes.c_long(), ctypes.c_long()
    out: _Layout = {}
    i = 0
    while describe(i, ctypes.byref(record), ctypes.byref(field), ctypes.byref(offset), ctypes.byref(size)) == 0:
        out.setdefault(record.value.decode(), {})[field.value.decode()] = (offset.value, size.value)
        i += 1
    return out


def _mirror_layout(structs: dict[str, type[ctypes.Structure]]) -> _Layout:
    """The same for ctypes mirrors, by the C name each stands for."""
    return {name: {"": (0, ctypes.sizeof(cls)),
                   **{f: (getattr(cls, f).offset, getattr(cls, f).size) for f, *_ in cls._fields_}}
            for name, cls in structs.items()}


def _abi_structs() -> dict[str, type[ctypes.Structure]]:
    return {"pe_layer": _Layer, "pe_dims": _Dims}


def check_layout(lib: ctypes.CDLL, path: Path, structs: dict[str, type[ctypes.Structure]] | None = None) -> None:
    """Refuse (:class:`KernelsUnavailable`) a library whose structs are laid out otherwise
    than this module's ctypes mirrors (``structs``: C name -> mirror, by default those the
    fused step passes), or that cannot say: a call would read fields at the wrong offsets,
    silently or as a crash. The cache key covers the C sources, not this file, so an edit
    of one without the other, or a compiler that packs differently, ends here."""
    have, want = _library_layout(lib), _mirror_layout(structs if structs is not None else _abi_structs())
    if have is None:
        raise KernelsUnavailable(f"the compiled kernels {path.name} do not report their struct layout "
                                 f"(pe_layout_field); fix: delete {path} (it is compiled again)")
    problems = []
    for name in sorted(have.keys() | want.keys()):
        c, py = have.get(name), want.get(name)
        if c is None or py is None:
            problems.append(f"{name} is {'not described by the library' if c is None else 'not mirrored here'}")
            continue
        for field in sorted(c.keys() | py.keys()):
            what = f"sizeof({name})" if field == "" else f"{name}.{field}"
            if field not in c or field not in py:
                problems.append(f"{what} is {'missing from the library' if field not in c else 'missing here'}")
            elif c[field] != py[field]:
                problems.append(f"{what} is (offset {c[field][0]}, {c[field][1]} bytes) in the library, "
                                f"(offset {py[field][0]}, {py[field][1]} bytes) here")
    if problems:
        raise KernelsUnavailable(
            f"the compiled kernels {path.name} and {Path(__file__).name} disagree on the structs passed between them: "
            f"{'; '.join(problems[:6])}{' ...' if len(problems) > 6 else ''}; fix: reinstall polyengine so that "
            f"both come from one version (in a checkout: make the ctypes mirrors match csrc/decode.h)")


def q8_fits(config, group: int) -> bool:
    """Whether int8 activations apply: every projection's input size (hidden,
    intermediate, heads x head_dim) and the int8 weight group are multiples of 32."""
    return all(k % Q8_BLOCK == 0 for k in (config.hidden_size, config.intermediate_size, config.q_size)) and (
        group % Q8_BLOCK == 0)


_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
          "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


class _Layer(ctypes.Structure):
    _fields_ = ([("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)]
                + [(p, ctypes.c_void_p) for p in _PROJECTIONS]
                + [(p + "_scale", ctypes.c_void_p) for p in _PROJECTIONS]
                + [(p + "_bias", ctypes.c_void_p) for p in _PROJECTIONS]
                + [("fmt", ctypes.c_int * len(_PROJECTIONS)), ("rowoff", ctypes.c_void_p * len(_PROJECTIONS)),
                   ("packed", ctypes.c_void_p * len(_PROJECTIONS))])


class _Dims(ctypes.Structure):
    _fields_ = [(n, ctypes.c_long) for n in ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "layers",
                                             "cache_rows", "cache_len")] + [
        ("eps", ctypes.c_float), ("int8", ctypes.c_int), ("group", ctypes.c_long), ("threads", ctypes.c_int),
        ("q8", ctypes.c_int), ("kv_type", ctypes.c_int), ("bf16", ctypes.c_int), ("gguf", ctypes.c_long),
        ("page_size", ctypes.c_long), ("table_len", ctypes.c_long), ("tile_rows", ctypes.c_long),
        ("att_runs", ctypes.c_long), ("split_pieces", ctypes.c_long), ("barrier_yield", ctypes.c_long)]


# The KV cache element types the fused step reads and writes (csrc/decode.h's PE_KV_*).
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class FusedDecoder:
    """A whole decode step on the CPU in one call (``csrc/decode.h``).

    Built once per engine over the weights dict of :class:`TorchWeights` (float32, or
    with the engine's int8 ``.qweight``/``.scale`` entries, or its bfloat16 ``.qweight``
    entries without scales: option ``weight_dtype``), or over a GGUF file's blocks
    (``blocks``: every projection a :class:`~.blocks.BlockMatrix`, against int8
    activations, one or two rows per row: ``int8_activations``) and the decode state's cache
    shape; :meth:`step` advances M rows by one token each, writing their K/V into the
    cache tensors, and returns the hidden states after the last layer (before the final
    norm). Holds references to every tensor it points at.
    """

    def __init__(self, kernels: CpuKernels, tensors: dict[str, torch.Tensor], config, *, cache_rows: int,
                 cache_len: int, quantized: bool, int8_activations: int = 0, kv_dtype: torch.dtype = torch.float32,
                 bf16_activations: bool = False, blocks: dict | None = None, page_size: int = 0,
                 tile_rows: int = 0, attention_runs: bool = True, split_pieces: int = 0, barrier_yield: int = 0):
        c = config
        self.kv_dtype, self.kernels, self.config = kv_dtype, kernels, c
        self.takes_runs = bool(attention_runs) and c.head_dim % kernels.vector_width == 0  # att_units' rule
        self._keep: list[torch.Tensor] = []

        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            if not t.is_contiguous() or t.dtype not in (torch.float32, torch.int8, torch.bfloat16):
                raise ValueError(f"the fused decoder needs contiguous float32/int8/bfloat16 tensors, got {t.dtype}")
            self._keep.append(t)
            return t.data_ptr()

        group = 0
        # quantized: int8 weights with scales, or bfloat16 ones (no scales)
        narrow = tensors[f"model.layers.0.{_NAMES['q']}.qweight"].dtype if quantized else torch.float32
        self._blocks = blocks or {}  # held: the addresses below point into their maps
        self._offsets: list[np.ndarray] = []
        if blocks and not int8_activations:
            raise ValueError("the fused decoder takes GGUF blocks against int8 activations (one or two rows)")
        self.layers = (_Layer * c.num_hidden_layers)()
        for i in range(c.num_hidden_layers):
            pre = f"model.layers.{i}."
            entry = self.layers[i]
            entry.input_norm = ptr(tensors[pre + "input_layernorm.weight"])
            entry.post_norm = ptr(tensors[pre + "post_attention_layernorm.weight"])
            for index, p in enumerate(_PROJECTIONS):
                name = pre + _NAMES[p]
                if blocks:
                    self._block(entry, index, p, blocks[name + ".weight"])
                elif narrow == torch.bfloat16:
                    setattr(entry, p, ptr(tensors[name + ".qweight"]))
                elif quantized:
                    scale = tensors[name + ".scale"]
                    g = 0 if scale.dim() == 1 else tensors[name + ".qweight"].shape[1] // scale.shape[1]
                    if i == 0 and p == "q":
                        group = g
                    elif g != group:
                        raise ValueError("the fused decoder needs one int8 grouping for every projection")
                    setattr(entry, p, ptr(tensors[name + ".qweight"]))
                    setattr(entry, p + "_scale", ptr(scale))
                else:
                    setattr(entry, p, ptr(tensors[name + ".weight"]))
                setattr(entry, p + "_bias", ptr(tensors.get(name + ".bias")))
        self.dims = _Dims(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                          c.head_dim, c.num_hidden_layers, cache_rows, cache_len, c.rms_norm_eps,
                          int(narrow == torch.int8), group, kernels.threads,
                          int(int8_activations) if narrow == torch.int8 or blocks else 0, KV_TYPES[kv_dtype],
                          (2 if bf16_activations else 1) if narrow == torch.bfloat16 else 0, int(bool(blocks)),
                          page_size, -(-cache_len // page_size) if page_size else 0,
                          tile_rows if blocks else 0, int(self.takes_runs), split_pieces, barrier_yield)
        if self.dims.q8 and not q8_fits(config, group):
            raise ValueError(f"int8 activations need every projection's input size and int8 group to be multiples "
                             f"of {Q8_BLOCK}")
        self.cos, self.sin = ptr(tensors["rope.cos"]), ptr(tensors["rope.sin"])
        self._local = threading.local()  # each thread's scratch (a prefill lane's beside the steps')

    def _block(self, entry: _Layer, index: int, projection: str, blocks) -> None:
        """Point projection ``index`` of a layer at a block matrix where the file maps it."""
        offsets = blocks.offsets
        if offsets is None and blocks.ldw != blocks.row_bytes:  # evenly spaced, not packed
            offsets = np.arange(blocks.n, dtype=np.int64) * blocks.ldw
        setattr(entry, projection, blocks.base)
        entry.fmt[index] = blocks.ggml_type
        if blocks.packed is not None:  # held by the BlockMatrix, which self._blocks holds
            entry.packed[index] = blocks.packed.data_ptr()
        if offsets is not None:
            offsets = np.ascontiguousarray(offsets, dtype=np.int64)
            self._offsets.append(offsets)
            entry.rowoff[index] = offsets.ctypes.data

    def prefill(self, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """A prefill's tokens as one step: ``x`` (T, hidden) float32 embeddings, in place ->
        the last layer's hidden states; token ``i`` at ``positions[i]`` of cache row
        ``rows[i]`` of the contiguous caches ``[layers, rows, kv_heads, length, head_dim]``
        (a prefill's own buffer, of any row count and length, in the decoder's
        ``kv_dtype``). Several tokens of one row see each other causally: the step writes
        every token's K/V before any attends, and a token attends its row up to its own
        position (csrc/decode.h)."""
        if k_cache.dim() != 5 or k_cache.shape != v_cache.shape:
            raise ValueError("a fused prefill takes contiguous caches [layers, rows, kv_heads, length, head_dim]")
        if int(positions.max()) >= k_cache.shape[3] or int(rows.max()) >= k_cache.shape[1]:
            raise ValueError("a fused prefill's positions and rows must lie inside its caches")
        d = _Dims()
        ctypes.memmove(ctypes.byref(d), ctypes.byref(self.dims), ctypes.sizeof(_Dims))
        d.cache_rows, d.cache_len, d.page_size, d.table_len = k_cache.shape[1], k_cache.shape[3], 0, 0
        return self._run(d, x, rows, positions, k_cache, v_cache, None)

    def _scratch_for(self, m: int, cache_len: int | None = None, threads: int | None = None) -> torch.Tensor:
        c, d = self.config, self.dims
        length = d.cache_len if cache_len is None else cache_len
        threads = d.threads if threads is None else threads
        kmax = max(c.hidden_size, c.intermediate_size, c.q_size)
        need = m * (2 * c.q_size + 2 * c.kv_size + 2 * c.intermediate_size + 2 * c.hidden_size)
        need += m * d.heads * length  # the attention scores
        need += threads * kmax + 4 * m * kmax // Q8_BLOCK + (2 * m * kmax + 3) // 4  # int8 activations
        # a run's attention (csrc/decode.h, att_tile_floats): per thread, at VW <= 16, after 64-byte alignment
        need += 16 + max(threads, 1) * ((length + 9 * c.head_dim + 2) * 16 + 2 * length)
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.numel() < need:
            scratch = self._local.scratch = torch.empty(need, dtype=torch.float32)
        return scratch

    def step(self, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, page_table: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (M, hidden) float32 embeddings of the tokens fed, in place -> the last
        layer's hidden states; ``rows``/``positions`` (M,) int32; caches of the
        decoder's ``kv_dtype`` (float32, bfloat16 or float16). Built with ``page_size``:
        the caches are page pools ``[layers, pages, kv_heads, page_size, head_dim]`` (their
        page count read here: a pool may grow) and ``rows`` index ``page_table`` (slots,
        pages per context) int64."""
        d = self.dims
        if (page_table is not None) != bool(d.page_size) or (page_table is not None and not (
                page_table.dtype == torch.int64 and page_table.is_contiguous() and page_table.shape[1] == d.table_len
                and k_cache.shape[3] == d.page_size)):
            raise ValueError(f"the fused decoder was built for {'pages of ' + str(d.page_size) if d.page_size else 'a contiguous cache'}: "
                             f"pass {'an int64 page table of ' + str(d.table_len) + ' pages a row' if d.page_size else 'no page table'}")
        if page_table is not None:
            d.cache_rows = k_cache.shape[1]  # the pool's pages: the layer stride
        return self._run(d, x, rows, positions, k_cache, v_cache, page_table)

    def attention_runs(self, rows: list[int], positions: list[int]) -> list[int]:
        """The run length of each attention unit that a step of these rows takes as one
        run (csrc/decode.h, attn_tile: a prefill's consecutive positions of one cache row,
        at least ATT_RUN_MIN of them); [] where every row attends alone."""
        r = np.ascontiguousarray(rows, dtype=np.int32)
        p = np.ascontiguousarray(positions, dtype=np.int32)
        out = np.zeros(4 * len(r) * max(self.dims.heads, 1), dtype=np.int32)
        n = self.kernels.lib.pe_attention_runs(ctypes.byref(self.dims), len(r), r.ctypes.data, p.ctypes.data,
                                               out.ctypes.data, len(out))
        return out[:n].tolist()

    def _run(self, d: "_Dims", x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, page_table: torch.Tensor | None) -> torch.Tensor:
        if not (x.is_contiguous() and x.dtype == torch.float32 and k_cache.is_contiguous() and v_cache.is_contiguous()
                and k_cache.dtype == v_cache.dtype == self.kv_dtype):
            raise ValueError(f"the fused decoder needs contiguous float32 activations and {self.kv_dtype} caches")
        rows = rows.to(torch.int32).contiguous()
        positions = positions.to(torch.int32).contiguous()
        d.threads = self.kernels.threads  # this thread's share while a prefill lane runs (CpuKernels.lend)
        scratch = self._scratch_for(x.shape[0], d.cache_len, d.threads)
        self.kernels.lib.pe_decode(ctypes.byref(d), self.layers, x.data_ptr(), x.shape[0], rows.data_ptr(),
                                   positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                   None if page_table is None else page_table.data_ptr(), self.cos, self.sin,
                                   scratch.data_ptr())
        return x
