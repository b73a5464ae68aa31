"""The forward pass of every supported architecture in plain NumPy, written to be read,
not to be fast.

One function runs ``B`` sequences that each append ``T`` tokens to their own KV cache:
prefill is ``B=1``, a decode step is ``T=1`` over the occupied slots. Projections and
the MLP are batched over all rows (one read of the weights per step); attention runs
row by row over exactly that row's cache, so no row can see another's keys.

Conventions are HF's: ``[out, in]`` weights, RMSNorm ``x / sqrt(mean(x^2) + eps) *
(offset + w)`` (no weight for parameter-free norms), rotate-half RoPE with ``angle =
position * inv_freq`` (per layer kind, cos and sin times the config's attention
factor), GQA head ``h`` reading KV head ``h // (heads / kv_heads)``. K is cached after
RoPE. What an architecture changes is data of the :class:`ModelConfig`, read where it
acts: the embedding (scale, norm), each layer's norms (sandwich), the attention (q/k
norm, window, scale, soft-cap), the MLP (activation, gating, routed experts) and the
head (soft-cap). Experts run only on the tokens routed to them.

The cache keeps every position (the full length) and a sliding layer masks the keys
older than its window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from polyengine.models import Model, ModelConfig
from polyengine.models.blocks import FORMATS


@dataclass
class ReferenceParams:
    """The weights in the compute dtype (dequantized exactly from their records), plus the
    RoPE frequencies per layer kind."""

    config: ModelConfig
    dtype: np.dtype
    w: dict[str, np.ndarray]
    lm_head: np.ndarray  # (vocab, hidden)
    inv_freq: dict[str, np.ndarray]  # "global"/"local" -> (head_dim // 2,) float64
    rope_factor: float  # long-RoPE's cos/sin factor (1 otherwise)

    @classmethod
    def from_model(cls, model: Model, dtype: np.dtype, *, context: int | None = None,
                   formats: tuple[str, ...] = tuple(FORMATS)) -> "ReferenceParams":
        """``context``: the longest sequence this engine runs (long-RoPE picks its factors by it).
        Each weight is read in one of ``formats`` (the engine's ``weight_formats``: every
        block format) and dequantized exactly: float64 holds every block format's values
        exactly, float32 gets them rounded once; so a quantized model is judged like any other."""
        c = model.config
        w = {name: model.weight(name, formats).to_float(dtype) for name in model.records}
        head = w[c.head_weight]
        inv = {"global": c.rope_inv_freq(context=context), "local": c.rope_inv_freq(local=True, context=context)}
        return cls(c, np.dtype(dtype), w, head, inv, c.rope_attention_factor())


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float, offset: float = 0.0) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True)
    y = x / np.sqrt(var + eps)
    return y if weight is None else y * (offset + weight)


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, factor: float = 1.0) -> np.ndarray:
    """Rotate-half RoPE. x: (N, heads, head_dim); positions: (N,)."""
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]  # (N, head_dim/2)
    cos = (np.concatenate([np.cos(angles), np.cos(angles)], axis=-1) * factor)[:, None, :].astype(x.dtype)
    sin = (np.concatenate([np.sin(angles), np.sin(angles)], axis=-1) * factor)[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _linear(p: ReferenceParams, x: np.ndarray, name: str) -> np.ndarray:
    y = x @ p.w[name + ".weight"].T
    bias = p.w.get(name + ".bias")
    return y if bias is None else y + bias


def _norm(p: ReferenceParams, x: np.ndarray, name: str) -> np.ndarray:
    c = p.config
    return rms_norm(x, p.w.get(name + ".weight"), c.rms_norm_eps, c.norm_offset)


def _act(c: ModelConfig, x: np.ndarray) -> np.ndarray:
    if c.hidden_act == "silu":
        return x / (1.0 + np.exp(-x))
    if c.hidden_act == "gelu_tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return np.square(np.maximum(x, 0))  # relu2: nanochat's squared ReLU


def _softcap(x: np.ndarray, cap: float | None) -> np.ndarray:
    return x if cap is None else cap * np.tanh(x / cap)


def _mlp(p: ReferenceParams, h: np.ndarray, pre: str) -> np.ndarray:
    """A dense MLP: ``down(act(gate(h)) * up(h))``, or ``down(relu(up(h))^2)`` ungated."""
    c = p.config
    if c.mlp_gated:
        inner = _act(c, _linear(p, h, pre + "gate_proj")) * _linear(p, h, pre + "up_proj")
    else:
        inner = _act(c, _linear(p, h, pre + "up_proj"))
    return _linear(p, inner, pre + "down_proj")


def _moe(p: ReferenceParams, h: np.ndarray, pre: str) -> np.ndarray:
    """Routed experts: softmax over the router's logits, the top ``k`` per token (ties to
    the lower expert id), their probabilities renormalised when the model says so; each
    expert runs on the tokens routed to it only."""
    c = p.config
    logits = _linear(p, h, pre + "gate")  # (N, experts)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, : c.num_experts_per_tok]  # (N, k)
    weights = np.take_along_axis(probs, top, axis=-1)
    if c.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    out = np.zeros_like(h)
    for e in range(c.num_experts):
        rows, slot = np.nonzero(top == e)
        if rows.size:
            y = _mlp(p, h[rows], f"{pre}experts.{e}.")
            out[rows] += weights[rows, slot][:, None] * y
    return out


def _attention(p: ReferenceParams, layer: int, h: np.ndarray, positions: np.ndarray, starts: np.ndarray, t: int,
               k_caches: list[np.ndarray], v_caches: list[np.ndarray]) -> np.ndarray:
    c = p.config
    b = len(starts)
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    group = nh // nkv
    pre = f"model.layers.{layer}.self_attn."
    q = _linear(p, h, pre + "q_proj").reshape(b * t, nh, hd)
    k = _linear(p, h, pre + "k_proj").reshape(b * t, nkv, hd)
    v = _linear(p, h, pre + "v_proj").reshape(b * t, nkv, hd)
    if c.qk_norm:
        q = _norm(p, q, pre + "q_norm")
        k = _norm(p, k, pre + "k_norm")
    inv = p.inv_freq[c.layer_rope(layer)]
    factor = p.rope_factor if c.layer_rope(layer) == "global" else 1.0
    q = rope(q, positions, inv, factor)
    k = rope(k, positions, inv, factor)
    window = c.layer_window(layer)
    attn = np.empty((b, t, nh, hd), dtype=h.dtype)
    for row in range(b):
        s0 = int(starts[row])
        end = s0 + t
        rows = slice(row * t, (row + 1) * t)
        k_caches[row][layer, :, s0:end] = k[rows].transpose(1, 0, 2)
        v_caches[row][layer, :, s0:end] = v[rows].transpose(1, 0, 2)
        keys = np.repeat(k_caches[row][layer, :, :end], group, axis=0)  # (nh, end, hd)
        vals = np.repeat(v_caches[row][layer, :, :end], group, axis=0)
        qr = q[rows].transpose(1, 0, 2)  # (nh, T, hd)
        scores = _softcap(qr @ keys.transpose(0, 2, 1) * c.attention_scale, c.attn_logit_softcapping)  # (nh, T, end)
        # query i sits at position s0 + i and may see keys s with s <= s0 + i (and, in a
        # sliding layer, s0 + i - s < window)
        distance = (s0 + np.arange(t))[:, None] - np.arange(end)[None, :]
        hidden = (distance < 0) if window is None else (distance < 0) | (distance >= window)
        scores = np.where(hidden[None], -np.inf, scores)
        scores = scores - scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        attn[row] = (probs @ vals).transpose(1, 0, 2)  # (T, nh, hd)
    return _linear(p, attn.reshape(b * t, nh * hd), pre + "o_proj")


def forward(
    p: ReferenceParams,
    tokens: np.ndarray,  # (B, T) int
    starts: np.ndarray,  # (B,) cache position of each row's first new token
    k_caches: list[np.ndarray],  # B arrays (layers, kv_heads, S, head_dim), written in place
    v_caches: list[np.ndarray],
) -> np.ndarray:
    """Append ``tokens`` to each row's cache and return the logits (B, T, vocab)."""
    x = hidden_states(p, tokens, starts, k_caches, v_caches)
    return _softcap(x @ p.lm_head.T, p.config.final_logit_softcapping)


def hidden_states(p: ReferenceParams, tokens: np.ndarray, starts: np.ndarray, k_caches: list[np.ndarray],
                  v_caches: list[np.ndarray]) -> np.ndarray:
    """As :func:`forward`, but the hidden states after the final norm (B, T, hidden):
    the LM head's input, and what embeddings pool."""
    c = p.config
    b, t = tokens.shape
    positions = (starts[:, None] + np.arange(t)[None, :]).reshape(-1)  # (B*T,)
    x = p.w["model.embed_tokens.weight"][tokens.reshape(-1)]  # (B*T, hidden)
    if c.embed_scale:
        x = x * np.asarray(math.sqrt(c.hidden_size), dtype=x.dtype)
    if c.embed_norm:
        x = rms_norm(x, None, c.rms_norm_eps)
    for layer in range(c.num_hidden_layers):
        pre = f"model.layers.{layer}."
        h = _norm(p, x, pre + "input_layernorm")
        out = _attention(p, layer, h, positions, starts, t, k_caches, v_caches)
        if c.sandwich_norms:
            out = _norm(p, out, pre + "post_attention_layernorm")
        x = x + out
        h = _norm(p, x, pre + ("pre_feedforward_layernorm" if c.sandwich_norms else "post_attention_layernorm"))
        out = _moe(p, h, pre + "mlp.") if c.num_experts else _mlp(p, h, pre + "mlp.")
        if c.sandwich_norms:
            out = _norm(p, out, pre + "post_feedforward_layernorm")
        x = x + out
    return _norm(p, x, "model.norm").reshape(b, t, -1)
