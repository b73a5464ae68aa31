"""int8 weights and an int8 KV cache: how they are stored and read on the mesh.

Weights (option ``quantize``): every projection and the LM head become ``<name>.qweight``
(int8, ``[out, in]``) and ``<name>.scale`` (float32), made by the core's one quantizer
and mode table (:mod:`polyengine.models.quantize`, the same as the ``cpu`` backend's): one
scale per output channel (``"int8"``) or one per 32 weights of a row
(``"int8-block32"``). The float matrices are dropped; the embedding table stays float
(it is a lookup). :func:`int8_linear` is the shared model's ``linear`` hook that reads them:
per channel, the product runs on the int8 matrix cast to the compute dtype and the
scale multiplies the output (so XLA can fuse the cast into the dot); blockwise, the
matrix is dequantized first. Accumulation is in the compute dtype.

KV cache (option ``kv_quantize="int8"``): K and V are stored as int8 with a scale per
slot, position and KV head: each token's head vector is rounded against its own
absmax (/ 127) when it is written, and the float32 scale is kept beside it, as four
more bytes of the same cache row (the cache's last axis is ``head_dim + 4``), so the
shared model writes and reads values and scales together through its ``kv_codec``
hook (:class:`Int8KVCodec`) and no other array has to follow the cache. A value's
error is at most 1/254 of its token's largest. Scales fixed per slot from the prompt
were tried first and lost greedy agreement within 3-4 tokens on SmolLM2: a short
prompt under-samples the range of later keys (docs/decisions.md). Prefill runs in the
compute dtype, so prefixes (and portable prefixes exported from them) are never
quantized; insert encodes them into the slot.

A file's GGUF blocks (without option ``quantize``) are kept as they are, not
requantized (:func:`block_arrays`, from the core's exact split,
:mod:`polyengine.models.int_blocks`): the 4-bit formats (Q4_0, Q4_1, Q4_K) as
``<name>.qweight4``, their ``q`` in [0, 15] two to a byte (uint8 ``[out, in / 2]``,
weight ``2j`` in the low nibble, ``2j + 1`` in the high), with ``.scale`` (one per 32
weights) and, for Q4_1/Q4_K, ``.offset``: the weight is ``(q - 8) * scale`` (Q4_0) or
``q * scale + offset`` (GGUF's own formulas; a K format's scale is ``d`` times the
sub-block's scale, its offset ``-dmin`` times its min); every other block format (Q8_0,
Q5_0, Q5_1, Q5_K, Q6_K) as ``<name>.qweight``, its int8 values, with ``.scale`` per group
(32 weights, Q6_K's 16) and, for Q5_1/Q5_K, ``.offset``. In float32 each is the exact
dequantization; in bfloat16 the scale and the product round to it. Four bits are
unpacked inside the step (a mask and a shift XLA fuses into the product), not held as
``jnp.int4``: JAX 0.10 has int4 arrays on the CPU, but the model is the shared torch
forward traced by torchax, and torchax 0.0.13 has no torch dtype for ``jnp.int4``
("Attempting to convert unknown type"), so an int4 array cannot enter it.

The error bounds that ``tests/test_tpu_jax_quant.py`` asserts, and docs/tpu_jax.md
states, were measured on the default model.
"""

from __future__ import annotations

__all__ = ["KV_MODES", "KV_SCALE_BYTES", "int8_linear", "block_arrays", "Int8KVCodec", "kv_encode",
           "kv_decode"]

from polyengine.backends.tpu_jax.footprint import KV_SCALE_BYTES

KV_MODES = ("", "int8")
# KV_SCALE_BYTES (footprint.py): the float32 scale of each (position, KV head), stored as
# int8 bytes after the values.


def block_arrays(weight, name: str) -> dict:
    """A 2-D GGUF record in a block format (as stored) as this backend's host arrays
    under ``name`` (see the module docstring); NumPy, one tensor at a time. The record's
    file pages then leave the process's resident memory (``Weight.release_pages``)."""
    import numpy as np

    from polyengine.models.int_blocks import FOUR_BIT_FORMATS, split_blocks

    values, scale, offset = split_blocks(weight)
    weight.release_pages()
    if weight.format in FOUR_BIT_FORMATS:
        q = (values + np.int8(8) if weight.format == "Q4_0" else values).astype(np.uint8)  # [0, 15]
        out = {name + ".qweight4": q[:, 0::2] | (q[:, 1::2] << 4), name + ".scale": scale}
    else:
        out = {name + ".qweight": values, name + ".scale": scale}
    if offset is not None:
        out[name + ".offset"] = offset
    return out


def int8_linear(t, x, name):
    """The shared model's ``linear`` hook for int8 and 4-bit weights (torch code, traced
    by torchax): ``<name>.qweight`` times ``.scale`` (per channel or per group, plus
    ``.offset`` where a file's blocks have one), or ``.qweight4``'s unpacked nibbles
    times ``.scale`` (minus 8, or plus ``.offset``); a
    matrix without either (a file's blocks of a format kept as floats) is a plain product."""
    import torch
    import torch.nn.functional as F

    bias = t.get(name + ".bias")
    offset = t.get(name + ".offset")  # a file's Q4_1/Q4_K/Q5_1/Q5_K blocks
    if name + ".qweight4" in t:
        packed, scale = t[name + ".qweight4"], t[name + ".scale"]
        rows = packed.shape[0]
        q = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(rows, -1, 32).to(x.dtype)  # (out, blocks, 32)
        if offset is None:  # Q4_0
            w = (q - 8) * scale.to(x.dtype)[:, :, None]
        else:  # Q4_1, Q4_K
            w = q * scale.to(x.dtype)[:, :, None] + offset.to(x.dtype)[:, :, None]
        y = F.linear(x, w.reshape(rows, -1))
        return y if bias is None else y + bias
    if name + ".qweight" not in t:
        weight = t.get(name + ".weight")
        if weight is None and name == "lm_head":  # tied: the embedding table
            weight = t["model.embed_tokens.weight"]
        return F.linear(x, weight, bias)
    q, scale = t[name + ".qweight"], t[name + ".scale"]
    if scale.dim() == 1:
        y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
    else:
        group = q.shape[1] // scale.shape[1]
        w = q.to(x.dtype).reshape(q.shape[0], -1, group) * scale.to(x.dtype)[:, :, None]
        if offset is not None:
            w = w + offset.to(x.dtype)[:, :, None]
        y = F.linear(x, w.reshape(q.shape))
    return y if bias is None else y + bias


def kv_encode(x):
    """K or V ``(..., head_dim)`` -> int8 ``(..., head_dim + 4)``: the values rounded
    against their own absmax / 127, then the float32 scale's bytes (JAX)."""
    import jax.numpy as jnp
    from jax import lax

    xf = x.astype(jnp.float32)
    scale = jnp.abs(xf).max(axis=-1, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(xf / scale), -127, 127).astype(jnp.int8)
    return jnp.concatenate([q, lax.bitcast_convert_type(scale, jnp.int8).reshape(x.shape[:-1] + (KV_SCALE_BYTES,))], axis=-1)


def kv_decode(stored, dtype):
    """:func:`kv_encode`'s inverse (up to the rounding), in ``dtype`` (JAX)."""
    import jax.numpy as jnp
    from jax import lax

    scale = lax.bitcast_convert_type(stored[..., -KV_SCALE_BYTES:], jnp.float32)  # (...,)
    return (stored[..., :-KV_SCALE_BYTES].astype(jnp.float32) * scale[..., None]).astype(dtype)


class Int8KVCodec:
    """The shared model's ``kv_codec`` for the int8 cache: torch tensors in and out
    (under torchax), the work done by :func:`kv_encode`/:func:`kv_decode` in JAX."""

    def __init__(self, dtype):
        self.dtype = dtype  # the JAX compute dtype

    def encode(self, which, layer, new, rows):
        from torchax.interop import call_jax

        return call_jax(kv_encode, new)

    def decode(self, which, layer, stored, rows):
        import functools

        from torchax.interop import call_jax

        return call_jax(functools.partial(kv_decode, dtype=self.dtype), stored)
