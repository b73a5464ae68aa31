"""The shared torch forward as it was before it was split into blocks (issue 22), kept
verbatim as the baseline that ``tests/test_torch_model.py`` proves the block version
bit-exact against, for the Llama-family architectures both cover."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from polyengine.backends.torch_common.model import ATTENTION_IMPLS, KVCodec, TorchWeights

_HALF = (torch.float16, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight``, in float32 for half inputs (HF's order)."""
    dt = x.dtype
    xf = x.float() if dt in _HALF else x
    var = (xf * xf).mean(-1, keepdim=True)
    return (xf / torch.sqrt(var + eps)).to(dt) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _linear(t: dict[str, torch.Tensor], x: torch.Tensor, name: str) -> torch.Tensor:
    return F.linear(x, t[name + ".weight"], t.get(name + ".bias"))


@dataclass
class _Writes:
    """Where each token's K/V goes: flat (N,) cache rows and positions, pad tokens
    redirected (see :func:`_write_targets`)."""

    rows: torch.Tensor  # (N, 1) int64
    pos: torch.Tensor  # (N, 1) int64
    heads: torch.Tensor  # (1, kv_heads) int64
    live: torch.Tensor | None  # (N,) bool, None when every token writes
    anchor: torch.Tensor | None  # () int64: the first live token (0 if none)
    any_live: torch.Tensor | None  # () bool


def _write_targets(rows: torch.Tensor, positions: torch.Tensor, write_mask: torch.Tensor | None, kv_heads: int) -> _Writes:
    """Redirect pad tokens so that a scatter with them is a no-op.

    A pad token may not simply write its own (row, position): it could alias a live
    row. Dropping it needs a data-dependent shape, and writing back the old value
    races with a live token writing the same cell (duplicate scatter indices have no
    defined order). Instead every pad token takes the target *and the value* of one
    anchor token (the first live one): duplicates then all write the same bits, in
    any order. With no live token at all, the anchor writes its cell's old value.
    """
    b, t = positions.shape
    r = rows[:, None].expand(b, t).reshape(-1)  # (N,)
    p = positions.reshape(-1)  # (N,)
    heads = torch.arange(kv_heads, device=rows.device)[None, :]
    if write_mask is None:
        return _Writes(r[:, None], p[:, None], heads, None, None, None)
    live = write_mask.reshape(-1)
    anchor = torch.argmax(live.to(torch.int32))  # first maximum: the first live token
    r = torch.where(live, r, r[anchor])
    p = torch.where(live, p, p[anchor])
    return _Writes(r[:, None], p[:, None], heads, live, anchor, live.any())


def _write(cache: torch.Tensor, layer: int, w: _Writes, new: torch.Tensor, inplace: bool) -> torch.Tensor:
    """Scatter ``new`` (N, kv_heads, head_dim) into ``cache[layer]`` at ``w``'s targets."""
    if w.live is not None:
        old = cache[layer, w.rows[w.anchor, 0], :, w.pos[w.anchor, 0]]  # (kv_heads, head_dim)
        fill = torch.where(w.any_live, new[w.anchor], old)
        new = torch.where(w.live[:, None, None], new, fill)
    if inplace:
        cache[layer].index_put_((w.rows, w.heads, w.pos), new)
        return cache
    layer_idx = torch.full_like(w.rows, layer)
    return cache.index_put((layer_idx, w.rows, w.heads, w.pos), new)


def _attend(q, keys, vals, visible, scale, attention):
    """q (B, kv_heads, G*T, hd), keys/vals (B, kv_heads, S, hd), visible (B, 1, G*T, S)."""
    if attention == "sdpa":
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=visible, scale=scale)
    scores = (q @ keys.transpose(-1, -2)) * scale  # (B, kv_heads, G*T, S)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32 if q.dtype in _HALF else q.dtype)
    return probs.to(vals.dtype) @ vals


def forward(
    weights: TorchWeights,
    tokens: torch.Tensor,  # (B, T) int
    positions: torch.Tensor,  # (B, T) int64, absolute position of each token
    k_cache: torch.Tensor,  # (layers, rows, kv_heads, S, head_dim)
    v_cache: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,  # (B,) int64 cache row of each batch row; None: row b
    write_mask: torch.Tensor | None = None,  # (B, T) bool, False for pad tokens
    logits_at: torch.Tensor | None = None,  # (B,) int64 index into T
    kv_len: int | None = None,  # static bound on the attended cache positions
    attention: str = "sdpa",
    inplace: bool = False,
    linear: Callable[[dict[str, torch.Tensor], torch.Tensor, str], torch.Tensor] | None = None,
    kv_codec: KVCodec | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``tokens`` through the model, writing their K/V; returns
    ``(logits, k_cache, v_cache)``, logits ``(B, vocab)`` with ``logits_at`` else
    ``(B, T, vocab)``.

    Requirements the caller keeps (no check can run inside without a host sync):
    live tokens' positions lie in ``[0, S)`` and below ``weights.max_positions``; no
    two live tokens write the same (row, position); every live query's position is
    below ``kv_len``; a row's cache holds its own K/V at every position below each
    of its queries (a prefix inserted there, earlier steps, or this call). Pad tokens
    may carry any position (their RoPE index is clamped) and their logits are garbage.
    ``rows=None`` means batch row b uses cache row b (needs ``B == cache rows``) and
    saves a gather of the cache rows every layer.

    ``linear(tensors, x, name)`` replaces every projection and the LM head (``name``
    without ``.weight``; the head is ``"lm_head"`` even when tied), so an engine can
    route them to its own kernels or quantized weights; None is ``F.linear`` on the
    HF weights. ``kv_codec`` (:class:`KVCodec`) encodes K/V before they are written and
    decodes what attention reads, for caches stored in another dtype; None stores
    them as computed.

    ``causal=True`` promises that batch row b's queries sit at positions ``0..T-1`` and
    its cache holds nothing before them (a prefill from scratch, ``kv_len == T``): SDPA
    then runs in its causal mode, which skips the masked half of the scores instead of
    computing them under an explicit mask (half the attention work at long prompts).
    """
    if attention not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
    c = weights.config
    t = weights.tensors
    b, seq = tokens.shape
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    group = nh // nkv
    n_layers, n_rows, _, cache_len, _ = k_cache.shape
    kv_len = cache_len if kv_len is None else int(kv_len)
    if not 1 <= kv_len <= cache_len:
        raise ValueError(f"kv_len {kv_len} must lie in [1, {cache_len}] (the cache length)")
    if causal and kv_len != seq:
        raise ValueError(f"causal=True needs kv_len == T (queries at 0..T-1): kv_len {kv_len}, T {seq}")
    if rows is None and b != n_rows:
        raise ValueError(f"rows=None needs one batch row per cache row: batch {b}, cache rows {n_rows}")
    device = tokens.device

    table_pos = positions.clamp(0, t["rope.cos"].shape[0] - 1)
    cos = t["rope.cos"][table_pos]  # (B, T, hd/2)
    sin = t["rope.sin"][table_pos]
    cos = torch.cat([cos, cos], dim=-1)[:, :, None, :]  # (B, T, 1, hd)
    sin = torch.cat([sin, sin], dim=-1)[:, :, None, :]

    # Key s is visible to a query at position p iff s <= p: the cache index is the
    # position, and each row reads only its own cache row, so rows never mix.
    key_pos = torch.arange(kv_len, device=device)
    visible = key_pos[None, None, :] <= positions[:, :, None]  # (B, T, kv_len)
    # Queries are grouped per KV head as (group, T) so K/V are never repeated.
    visible = visible.repeat(1, group, 1)[:, None]  # (B, 1, G*T, kv_len)

    cache_rows = rows if rows is not None else torch.arange(b, device=device)
    writes = _write_targets(cache_rows, positions, write_mask, nkv)
    scale = 1.0 / math.sqrt(hd)
    fused_qkv = "model.layers.0.self_attn.qkv_proj.weight" in t or "model.layers.0.self_attn.qkv_proj.qweight" in t
    fused_mlp = "model.layers.0.mlp.gate_up_proj.weight" in t or "model.layers.0.mlp.gate_up_proj.qweight" in t
    lin = linear or _linear

    x = F.embedding(tokens, t["model.embed_tokens.weight"])  # (B, T, H)
    for layer in range(n_layers):
        pre = f"model.layers.{layer}."
        h = rms_norm(x, t[pre + "input_layernorm.weight"], c.rms_norm_eps)
        if fused_qkv:
            q, k, v = lin(t, h, pre + "self_attn.qkv_proj").split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        else:
            q = lin(t, h, pre + "self_attn.q_proj")
            k = lin(t, h, pre + "self_attn.k_proj")
            v = lin(t, h, pre + "self_attn.v_proj")
        q = q.reshape(b, seq, nh, hd)
        k = k.reshape(b, seq, nkv, hd)
        q = q * cos + _rotate_half(q) * sin  # (B, T, nh, hd)
        k = k * cos + _rotate_half(k) * sin  # (B, T, nkv, hd)

        k_new, v_new = k.reshape(b * seq, nkv, hd), v.reshape(b * seq, nkv, hd)
        if kv_codec is not None:
            k_new = kv_codec.encode("k", layer, k_new, writes.rows[:, 0])
            v_new = kv_codec.encode("v", layer, v_new, writes.rows[:, 0])
        k_cache = _write(k_cache, layer, writes, k_new, inplace)
        v_cache = _write(v_cache, layer, writes, v_new, inplace)
        if rows is None:
            keys = k_cache[layer, :, :, :kv_len]  # (B, nkv, kv_len, hd), a view
            vals = v_cache[layer, :, :, :kv_len]
        else:
            keys = k_cache[layer, rows, :, :kv_len]  # gathered copy
            vals = v_cache[layer, rows, :, :kv_len]
        if kv_codec is not None:
            keys = kv_codec.decode("k", layer, keys, cache_rows)
            vals = kv_codec.decode("v", layer, vals, cache_rows)

        if causal and attention == "sdpa":
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, is_causal=True, scale=scale,
                                                 enable_gqa=group > 1)  # (B, nh, T, hd)
            out = out.transpose(1, 2).reshape(b, seq, nh * hd)
        else:
            qg = q.reshape(b, seq, nkv, group, hd).permute(0, 2, 3, 1, 4).reshape(b, nkv, group * seq, hd)
            out = _attend(qg, keys, vals, visible, scale, attention)  # (B, nkv, G*T, hd)
            out = out.reshape(b, nkv, group, seq, hd).permute(0, 3, 1, 2, 4).reshape(b, seq, nh * hd)
        x = x + lin(t, out, pre + "self_attn.o_proj")

        h = rms_norm(x, t[pre + "post_attention_layernorm.weight"], c.rms_norm_eps)
        if fused_mlp:
            gate, up = lin(t, h, pre + "mlp.gate_up_proj").chunk(2, dim=-1)
        else:
            gate = lin(t, h, pre + "mlp.gate_proj")
            up = lin(t, h, pre + "mlp.up_proj")
        x = x + lin(t, F.silu(gate) * up, pre + "mlp.down_proj")

    if logits_at is not None:
        x = x[torch.arange(b, device=device), logits_at]  # (B, H)
    x = rms_norm(x, t["model.norm.weight"], c.rms_norm_eps)
    if linear is None:
        logits = F.linear(x, t.get("lm_head.weight", t["model.embed_tokens.weight"]))  # (B, [T,] vocab)
    else:
        logits = linear(t, x, "lm_head")
    if logits.dtype in _HALF:
        logits = logits.float()
    return logits, k_cache, v_cache
