"""int8 weights and an int8 KV cache: how they are made, stored and read.

Weights (option ``quantize``): every projection and the LM head become ``<name>.qweight``
(int8, ``[out, in]``) and ``<name>.scale`` (float32): one scale per output channel
(``"int8"``, absmax / 127 of the row) or one per 32 weights of a row
(``"int8-block32"``; a matrix whose rows do not divide into blocks keeps per-channel
scales). The float matrices are dropped; the embedding table stays float (it is a
lookup). :func:`int8_linear` is the shared model's ``linear`` hook that reads them:
per channel, the product runs on the int8 matrix cast to the compute dtype and the
scale multiplies the output (so XLA can fuse the cast into the dot); blockwise, the
matrix is dequantized first. Accumulation is in the compute dtype.

KV cache (option ``kv_quantize="int8"``): K and V are stored as int8 with one scale
per (layer, slot, KV head), fixed when a prefix is inserted: the prefix's absmax times
:data:`KV_HEADROOM`, / 127. Tokens decoded later are rounded with the same scale and
clipped at +-127 (a key or value more than ``KV_HEADROOM`` times the prompt's largest
saturates). :class:`Int8KVCodec` is the shared model's ``kv_codec`` hook; the scales
ride in the decode state. Prefill runs in the compute dtype, so prefixes (and the
portable prefixes exported from them) are never quantized.

The error bounds that ``tests/test_tpu_jax_quant.py`` asserts, and docs/tpu_jax.md
states, were measured on the default model.
"""

from __future__ import annotations

import numpy as np

__all__ = ["WEIGHT_MODES", "KV_MODES", "KV_HEADROOM", "quantize_weights", "int8_linear", "Int8KVCodec", "kv_scales"]

# option value -> weights per scale (0: a whole row)
WEIGHT_MODES = {"": None, "int8": 0, "int8-block32": 32}
KV_MODES = ("", "int8")
# A decoded key/value may exceed the prompt's absmax by this factor before it clips;
# the price is log2(1.5) ~ 0.6 bit of resolution.
KV_HEADROOM = 1.5


def _quantize_matrix(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 of ``w`` (out, in): per row (group 0) or per ``group`` columns."""
    w = np.asarray(w, np.float32)
    if group and w.shape[1] % group == 0:
        blocks = w.reshape(w.shape[0], -1, group)
        scale = np.abs(blocks).max(axis=2) / 127.0  # (out, in/group)
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        q = np.clip(np.rint(blocks / scale[:, :, None]), -127, 127).astype(np.int8).reshape(w.shape)
        return q, scale
    scale = np.abs(w).max(axis=1) / 127.0  # (out,)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    return np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8), scale


def quantize_weights(tensors: dict[str, np.ndarray], mode: str) -> dict[str, np.ndarray]:
    """``tensors`` (HF names, host arrays) with every projection and the LM head as
    int8 ``qweight`` + ``scale``; the float projection matrices are left out."""
    group = WEIGHT_MODES[mode]
    out = {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight") or name == "lm_head.weight":
            base = name[: -len(".weight")]
            out[base + ".qweight"], out[base + ".scale"] = _quantize_matrix(w, group)
        else:
            out[name] = w
    if "lm_head.qweight" not in out:  # tied: the head reads the embedding table
        out["lm_head.qweight"], out["lm_head.scale"] = _quantize_matrix(tensors["model.embed_tokens.weight"], group)
    return out


def int8_linear(t, x, name):
    """The shared model's ``linear`` hook for int8 weights (torch code, traced by torchax)."""
    import torch.nn.functional as F

    q, scale, bias = t[name + ".qweight"], t[name + ".scale"], t.get(name + ".bias")
    if scale.dim() == 1:
        y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
    else:
        group = q.shape[1] // scale.shape[1]
        w = (q.to(x.dtype).reshape(q.shape[0], -1, group) * scale.to(x.dtype)[:, :, None]).reshape(q.shape)
        y = F.linear(x, w)
    return y if bias is None else y + bias


class Int8KVCodec:
    """The shared model's ``kv_codec`` for an int8 cache with per-(layer, slot, KV head)
    scales ``k_scale``/``v_scale`` (layers, slots, kv_heads) float32 (torch tensors
    under torchax)."""

    def __init__(self, k_scale, v_scale, dtype):
        self.scales = {"k": k_scale, "v": v_scale}
        self.dtype = dtype

    def encode(self, which, layer, new, rows):
        import torch

        s = self.scales[which][layer][rows]  # (N, kv_heads)
        q = torch.round(new.float() / s[:, :, None])
        return torch.clamp(q, -127, 127).to(torch.int8)

    def decode(self, which, layer, stored, rows):
        s = self.scales[which][layer][rows]  # (B, kv_heads)
        return stored.to(self.dtype) * s[:, :, None, None].to(self.dtype)


def kv_scales(prefix_kv, length):
    """Per-(layer, KV head) scales for a prefix's K or V (layers, kv_heads, T, head_dim)
    whose first ``length`` positions are live (JAX, inside the insert step)."""
    import jax.numpy as jnp

    live = (jnp.arange(prefix_kv.shape[2]) < length)[None, None, :, None]
    amax = jnp.where(live, jnp.abs(prefix_kv.astype(jnp.float32)), 0.0).max(axis=(2, 3))  # (layers, kv_heads)
    return jnp.where(amax > 0, amax * (KV_HEADROOM / 127.0), 1.0)
