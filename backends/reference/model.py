"""The Llama-family forward pass in plain NumPy, written to be read, not to be fast.

One function runs ``B`` sequences that each append ``T`` tokens to their own KV cache:
prefill is ``B=1``, a decode step is ``T=1`` over the occupied slots. Projections and
the MLP are batched over all rows (one read of the weights per step); attention runs
row by row over exactly that row's cache, so no row can see another's keys.

Conventions are HF's: ``[out, in]`` weights, RMSNorm ``x / sqrt(mean(x^2) + eps) * w``,
rotate-half RoPE with ``angle = position * inv_freq``, GQA head ``h`` reading KV head
``h // (heads / kv_heads)``, SiLU-gated MLP. K is cached after RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from polyengine.models import Model, ModelConfig


@dataclass
class ReferenceParams:
    """The weights in the compute dtype, plus the RoPE frequencies."""

    config: ModelConfig
    dtype: np.dtype
    w: dict[str, np.ndarray]
    lm_head: np.ndarray  # (vocab, hidden)
    inv_freq: np.ndarray  # (head_dim // 2,) float64

    @classmethod
    def from_model(cls, model: Model, dtype: np.dtype) -> "ReferenceParams":
        w = {name: np.asarray(t, dtype=dtype) for name, t in model.weights.items()}
        head = w["model.embed_tokens.weight"] if model.config.tie_word_embeddings else w["lm_head.weight"]
        return cls(model.config, np.dtype(dtype), w, head, model.config.rope_inv_freq())


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * weight


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE. x: (N, heads, head_dim); positions: (N,)."""
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]  # (N, head_dim/2)
    cos = np.concatenate([np.cos(angles), np.cos(angles)], axis=-1)[:, None, :].astype(x.dtype)
    sin = np.concatenate([np.sin(angles), np.sin(angles)], axis=-1)[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _linear(p: ReferenceParams, x: np.ndarray, name: str) -> np.ndarray:
    y = x @ p.w[name + ".weight"].T
    bias = p.w.get(name + ".bias")
    return y if bias is None else y + bias


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def forward(
    p: ReferenceParams,
    tokens: np.ndarray,  # (B, T) int
    starts: np.ndarray,  # (B,) cache position of each row's first new token
    k_caches: list[np.ndarray],  # B arrays (layers, kv_heads, S, head_dim), written in place
    v_caches: list[np.ndarray],
) -> np.ndarray:
    """Append ``tokens`` to each row's cache and return the logits (B, T, vocab)."""
    c = p.config
    b, t = tokens.shape
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    group = nh // nkv
    positions = (starts[:, None] + np.arange(t)[None, :]).reshape(-1)  # (B*T,)
    x = p.w["model.embed_tokens.weight"][tokens.reshape(-1)]  # (B*T, hidden)
    scale = 1.0 / np.sqrt(hd)
    for layer in range(c.num_hidden_layers):
        pre = f"model.layers.{layer}."
        h = rms_norm(x, p.w[pre + "input_layernorm.weight"], c.rms_norm_eps)
        q = _linear(p, h, pre + "self_attn.q_proj").reshape(b * t, nh, hd)
        k = _linear(p, h, pre + "self_attn.k_proj").reshape(b * t, nkv, hd)
        v = _linear(p, h, pre + "self_attn.v_proj").reshape(b * t, nkv, hd)
        q = rope(q, positions, p.inv_freq)
        k = rope(k, positions, p.inv_freq)
        attn = np.empty((b, t, nh, hd), dtype=x.dtype)
        for row in range(b):
            s0 = int(starts[row])
            end = s0 + t
            rows = slice(row * t, (row + 1) * t)
            k_caches[row][layer, :, s0:end] = k[rows].transpose(1, 0, 2)
            v_caches[row][layer, :, s0:end] = v[rows].transpose(1, 0, 2)
            keys = np.repeat(k_caches[row][layer, :, :end], group, axis=0)  # (nh, end, hd)
            vals = np.repeat(v_caches[row][layer, :, :end], group, axis=0)
            qr = q[rows].transpose(1, 0, 2)  # (nh, T, hd)
            scores = qr @ keys.transpose(0, 2, 1) * scale  # (nh, T, end)
            # query i sits at position s0 + i and may see keys 0 .. s0 + i
            causal = np.arange(end)[None, :] > (s0 + np.arange(t))[:, None]
            scores = np.where(causal[None], -np.inf, scores)
            scores = scores - scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            attn[row] = (probs @ vals).transpose(1, 0, 2)  # (T, nh, hd)
        x = x + _linear(p, attn.reshape(b * t, nh * hd), pre + "self_attn.o_proj")
        h = rms_norm(x, p.w[pre + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = _silu(_linear(p, h, pre + "mlp.gate_proj"))
        x = x + _linear(p, gate * _linear(p, h, pre + "mlp.up_proj"), pre + "mlp.down_proj")
    x = rms_norm(x, p.w["model.norm.weight"], c.rms_norm_eps)
    return (x @ p.lm_head.T).reshape(b, t, -1)
