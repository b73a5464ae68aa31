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

A file's GGUF blocks (Q8_0, Q4_0, Q4_1; without option ``quantize``) take the same
form without requantizing: the core splits each block exactly into its integers and
its f16 scale (and Q4_1's offset, ``<name>.offset``), so ``qweight * scale + offset``
in float32 is the exact dequantization (:mod:`polyengine.models.int_blocks`), and in
bfloat16 the scale and the product round to it. Q4_0 is kept as int8 (values in
[-8, 7]), not ``jnp.int4``: JAX 0.10 has int4 arrays on the CPU, but the model is the
shared torch forward traced by torchax, and torchax 0.0.13 has no torch dtype for
``jnp.int4`` ("Attempting to convert unknown type"), so an int4 array cannot enter it.

The error bounds that ``tests/test_tpu_jax_quant.py`` asserts, and docs/tpu_jax.md
states, were measured on the default model.
"""

from __future__ import annotations

__all__ = ["KV_MODES", "KV_SCALE_BYTES", "int8_linear", "Int8KVCodec", "kv_encode", "kv_decode"]

from polyengine.backends.tpu_jax.footprint import KV_SCALE_BYTES

KV_MODES = ("", "int8")
# KV_SCALE_BYTES (footprint.py): the float32 scale of each (position, KV head), stored as
# int8 bytes after the values.


def int8_linear(t, x, name):
    """The shared model's ``linear`` hook for int8 weights (torch code, traced by torchax):
    ``<name>.qweight`` times ``.scale`` (per channel or per block), plus ``.offset`` per
    block where there is one (GGUF's Q4_1); a matrix without ``qweight`` (a file's
    blocks of a format kept as floats) is a plain product."""
    import torch.nn.functional as F

    bias = t.get(name + ".bias")
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
        offset = t.get(name + ".offset")
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
