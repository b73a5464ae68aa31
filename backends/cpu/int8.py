"""int8 and bfloat16 weights in torch: the core's quantizer's arrays as tensors, bfloat16
copies (option ``weight_dtype``), and their product without the host-compiled kernels.

The int8 copies come from :func:`polyengine.models.quantize.quantize_model` (the one
quantizer and mode table every backend uses); here they only become torch tensors that
share the NumPy arrays' memory. :class:`TiledInt8Linear` multiplies by them where the
kernels do not (no C++ compiler, option ``cpu_kernels`` off, or more rows than the
kernels take: prefill): it widens one band of weight rows at a time into a float buffer
it reuses (8 MiB: fewer, larger GEMMs than small bands kept in cache) and multiplies that band, instead of
allocating and writing a float copy of the whole matrix on every call.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from polyengine.models import Model
from polyengine.models.quantize import quantize_model, replace_matrices

from polyengine.backends.cpu.blocks import _BAND_ELEMENTS, BandBuffers

__all__ = ["int8_tensors", "bf16_tensors", "has_bf16_copies", "dequantize", "TiledInt8Linear"]

# Weights widened per band: 2^21 float32 values (8 MiB, blocks.py's _BAND_ELEMENTS), a band
# of rows of any matrix (fewer, larger GEMMs; 1 MiB bands prefilled 512 tokens of the
# default model with quantize=int8-block32 at 0.94x, docs/benchmarks/2026-12-quantized.md).


def int8_tensors(model: Model, mode: str) -> dict[str, torch.Tensor]:
    """``<name>.qweight`` (int8) and ``<name>.scale`` (float32) for every projection and
    the LM head, sharing the memory of the core quantizer's arrays (kept with the Model)."""
    return {name: torch.from_numpy(np.ascontiguousarray(arr)) for name, arr in quantize_model(model, mode).items()}


# Model -> its bfloat16 copies (fused layout, below); they die with the Model. Kept so
# that every engine of one Model shares them, as the int8 copies are shared (the float
# matrices of an exclusive Model are released once copied, so a second engine could
# not copy them again).
_BF16: "weakref.WeakKeyDictionary[Model, dict[str, torch.Tensor]]" = weakref.WeakKeyDictionary()

# Projections that read the same input, and the one matrix the torch forward takes for
# them when present (torch_common.model: ``qkv_proj``, ``gate_up_proj``).
_SHARED_INPUT = (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                 ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")))


def has_bf16_copies(model: Model) -> bool:
    """Whether :func:`bf16_tensors` already holds ``model``'s bfloat16 copies."""
    return model in _BF16


def bf16_tensors(model: Model, *, fused: bool = True) -> dict[str, torch.Tensor]:
    """``<name>.qweight`` as bfloat16 (no scale; round to nearest even, torch's
    ``.to(torch.bfloat16)``) for every projection and the LM head: the names and sources
    of the int8 copies. Made on first use and kept with the Model (every engine of it
    shares them); an exclusive Model releases each float matrix as its copy exists
    (``replace_matrices``; the embedding table stays a float32 lookup).

    Each layer's q/k/v (gate/up) are row slices of one matrix; ``fused`` adds that matrix
    as ``qkv_proj`` (``gate_up_proj``), with their biases concatenated likewise, so the
    torch forward runs one GEMM where it ran three (two) and converts their input once
    (option ``fuse_projections``); the kernels read the slices, which are contiguous.
    Either way no memory is added: the separate matrices are the slices."""
    out = _BF16.get(model)
    if out is None:
        out = {}

        def bf16(name: str, w: np.ndarray) -> None:
            out[name + ".qweight"] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16)

        replace_matrices(model, bf16, why="its bfloat16 copy (option weight_dtype) replaced it")
        _fuse_shared_inputs(out, model)
        _BF16[model] = out
    if fused:
        return dict(out)
    suffixes = tuple("." + name for name, _ in _SHARED_INPUT)
    return {k: v for k, v in out.items() if not k.rpartition(".")[0].endswith(suffixes)}


def _fuse_shared_inputs(tensors: dict[str, torch.Tensor], model: Model) -> None:
    """Replace each layer's q/k/v (gate/up) bfloat16 matrices by row slices of one
    concatenated matrix, added under the fused name with the concatenated biases."""
    for layer in range(model.config.num_hidden_layers):
        for fused, parts in _SHARED_INPUT:
            names = [f"model.layers.{layer}.{part}" for part in parts]
            weights = [tensors.get(n + ".qweight") for n in names]
            if any(w is None for w in weights):
                continue
            whole = torch.cat(weights)
            row = 0
            for n, w in zip(names, weights):
                tensors[n + ".qweight"] = whole[row: row + w.shape[0]]
                row += w.shape[0]
            tensors[f"model.layers.{layer}.{fused}.qweight"] = whole
            biases = [model.weights.get(n + ".bias") for n in names]
            if any(b is not None for b in biases):
                tensors[f"model.layers.{layer}.{fused}.bias"] = torch.from_numpy(np.concatenate([
                    np.asarray(b, np.float32) if b is not None else np.zeros(w.shape[0], np.float32)
                    for b, w in zip(biases, weights)]))


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` (per row ``(N,)`` or per block ``(N, K / group)``) as ``dtype``."""
    n, k = q.shape
    if scale.dim() == 1:
        return (q.to(torch.float32) * scale[:, None]).to(dtype)
    return (q.to(torch.float32).reshape(n, scale.shape[1], -1) * scale[:, :, None]).reshape(n, k).to(dtype)


class TiledInt8Linear(BandBuffers):
    """``x @ dequantize(q, scale).T + bias``, one band of weight rows at a time into one
    reused float buffer of the calling thread's.

    ``compute=torch.bfloat16`` runs the GEMM on bfloat16 operands (option
    ``prefill_compute``: torch's bfloat16 GEMM, on AVX512-BF16 or AMX units where the CPU
    has them, is ~4x its float32 one here): ``x`` is rounded to bfloat16, each widened
    band (``q * scale`` in float32) is rounded once to bfloat16, the product comes back
    rounded to bfloat16 and is widened to ``x``'s dtype; per-row scales and the bias are
    applied after, in ``x``'s dtype. bfloat16 weights need no band: they are the operand."""

    def __call__(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None,
                 bias: torch.Tensor | None = None, *, compute: torch.dtype | None = None) -> torch.Tensor:
        """``q``: int8 with ``scale`` (per row or per block), or bfloat16 without one;
        ``compute``: the GEMM's operand dtype (None: ``x``'s)."""
        n, k = q.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        compute = compute or x.dtype
        if q.dtype == compute and scale is None:  # bfloat16 weights on bfloat16 operands: no band
            y = torch.nn.functional.linear(x2.to(compute), q).to(x.dtype)
        else:
            band = max(1, min(n, _BAND_ELEMENTS // k))
            yt = torch.empty((n, m), dtype=compute)  # y transposed: each band writes contiguous rows
            xt = x2.to(compute).t()
            blocks = scale is not None and scale.dim() == 2
            for r in range(0, n, band):
                rows = min(band, n - r)
                w = self._band(rows, k, x.dtype)
                w.copy_(q[r: r + rows])  # widen (a vectorized conversion; a mixed-dtype mul is ~2x slower)
                if blocks:  # a scale per block of the band's rows
                    w.view(rows, scale.shape[1], -1).mul_(scale[r: r + rows, :, None].to(x.dtype))
                if compute != x.dtype:  # rounded once, into a second reused buffer
                    w = self._band(rows, k, compute).copy_(w)
                torch.mm(w, xt, out=yt[r: r + rows])
            yt = yt.to(x.dtype)
            if scale is not None and not blocks:  # a scale per output row: applied once to the output
                yt.mul_(scale[:, None].to(x.dtype))
            y = yt.t().contiguous()  # (M, N): a copy of the output only, small next to the weights
        if bias is not None:
            y += bias
        return y.reshape(*lead, n)
