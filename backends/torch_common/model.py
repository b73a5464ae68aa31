"""The forward pass of every supported architecture as one functional PyTorch function
of small blocks.

Shared by the torch backends (``cuda_torch`` eager or compiled, ``tpu_jax`` through
torchax, ``neuron`` through torch.export/AOTInductor). It covers every model the core's
loader accepts (docs/models.md): Llama 2/3 and SmolLM2 (GQA, RoPE scaling
none/linear/llama3), Qwen2's biases, Qwen3's q/k norm, Mistral's sliding window, Gemma
2/3 (scaled embeddings, offset and sandwich norms, GeGLU, local/global layers with their
own RoPE tables, soft-caps, query scale), Phi-3's long-RoPE, Mixtral's and Qwen3-MoE's
routed experts, nanochat's GPT (squared ReLU, parameter-free norms); tied and untied
heads. Each feature is data of the ``ModelConfig`` read by the one block it changes. It knows
nothing about slots, buckets, requests or sampling: an engine decides which cache row
each batch row uses, pads to its buckets and samples the logits (:mod:`.sampling`).

API
---
``TorchWeights.from_model(model, *, device=None, dtype=torch.float32, fuse_qkv=False,
fuse_gate_up=False, max_positions=None, skip=frozenset())``
    The model's weights as torch tensors (HF names) plus RoPE cos/sin tables.
    ``weights.tensors`` is a plain dict (a pytree for torch and JAX alike); rebuild
    with ``TorchWeights(config, tensors)``.

``StepSpec(kv_len=None, attention="sdpa", causal=False, inplace=False, linear=None, kv_codec=None, moe="gather", causal_attention=None, causal_tail=False)``
    The static choices of a forward (frozen, hashable): an engine builds one per bucket
    and keeps it; a traced backend compiles one program per spec and shape.

``forward(weights, spec, tokens, positions, k_cache, v_cache, *, rows=None, write_mask=None,
logits_at=None, page_table=None) -> (logits, k_cache, v_cache)``
    Appends ``tokens`` (B, T) at ``positions`` (B, T) to cache rows ``rows`` (B,) and
    returns their logits. Caches are ``[layers, rows, kv_heads, S, head_dim]`` with
    cache index == absolute position. A query at position p sees keys at positions
    <= p of its own cache row only (and < ``spec.kv_len``). ``write_mask`` (B, T) False
    marks pad tokens: they never change the cache. ``logits_at`` (B,) picks one token
    per row, so prefill computes (B, vocab), not (B, T, vocab). It is the embedding,
    then per layer :func:`attention_block` (which uses :func:`kv_write` and
    :func:`kv_read`) and :func:`mlp_block`, then :func:`lm_head`: small blocks an
    architecture changes one at a time.

``KVCodec``
    The optional ``kv_codec`` of a spec: how K/V are stored in a cache of another
    dtype (e.g. int8 with per-row scales): ``encode`` before each cache write,
    ``decode`` after each cache read. None stores them as computed.

``StepModule(weights, spec=StepSpec())``
    ``forward`` as an ``nn.Module`` with the weights as buffers (no copies), for
    ``torch.export.export``, AOTInductor and ``torchax.interop.JittableModule``.

Conventions are HF's and the reference backend's (backends/reference/model.py):
``[out, in]`` weights, rotate-half RoPE with ``angle = position * inv_freq`` from
``ModelConfig.rope_tables()`` (per layer kind), K cached after RoPE, GQA head h reading
KV head ``h // (heads / kv_heads)``. The cache keeps every position; a sliding layer
masks keys older than its window.

Numerics: RMSNorm runs in float32 for float16/bfloat16 activations (HF's
LlamaRMSNorm: the mean of squares overflows fp16 and loses bf16's few mantissa bits),
then casts back before the weight multiply; float32/float64 run in their own dtype.
The RoPE tables are computed in float64 on the host exactly as the reference does and
cast once to the compute dtype, so positions never lose precision to a float32
``position * inv_freq``. Logits come back in float32 for half dtypes, else in the
compute dtype.

Static shapes: nothing in ``forward`` depends on tensor values on the host (no
``.item()``, no data-dependent shapes or branches); Python-level choices depend only
on shapes, dict keys and the static arguments, so ``torch.export`` and torchax trace it.

Cache updates: out of place by default (``index_put`` on the whole cache, one layer
at a time: caches in, caches out, as JAX needs; XLA and Inductor turn the scatter on
a donated buffer into an in-place write, while eager torch copies the cache once per
layer). ``inplace=True`` uses ``index_put_`` and returns the same tensors, for eager
CUDA/CPU.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from polyengine.models import Model, ModelConfig

from polyengine.backends.torch_common.options import ATTENTION_IMPLS

__all__ = [
    "TorchWeights", "StepSpec", "forward", "residual_stream", "final_norm", "attention_block", "mlp_block", "kv_write", "kv_read", "lm_head", "StepModule",
    "KVCodec", "CastKVCodec", "rms_norm", "ATTENTION_IMPLS", "MOE_IMPLS", "PAGE_LAYOUTS", "moe_block",
]

MOE_IMPLS = ("gather", "sparse")
PAGE_LAYOUTS = ("pages", "heads")  # a layer's pool: [pages, kv_heads, ...] or [kv_heads, pages, ...]
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, eq=False)
class TorchWeights:
    """A model's weights for :func:`forward`: static config plus a dict of tensors.

    ``tensors`` holds HF-named tensors (``model.layers.{i}.self_attn.q_proj.weight``
    ...), no ``lm_head.weight`` when the embeddings are tied (one tensor, not two
    pytree leaves), fused ``self_attn.qkv_proj.*`` / ``mlp.gate_up_proj.*`` instead of
    the separate projections when built with ``fuse_qkv`` / ``fuse_gate_up``, and
    ``rope.cos`` / ``rope.sin`` of shape ``(max_positions, head_dim // 2)``.
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]

    @classmethod
    def from_model(
        cls,
        model: Model,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        fuse_qkv: bool = False,
        fuse_gate_up: bool = False,
        max_positions: int | None = None,
        skip: frozenset[str] = frozenset(),
    ) -> "TorchWeights":
        """Wrap ``model.weights`` without a second host copy.

        Each array (a float32/float16 record as it is, any other format converted to
        float32 as it is read, one tensor at a time) goes through ``torch.from_numpy``
        (shares memory) and at most one ``.to(device, dtype)``: on CPU in float32 that is
        no copy at all, elsewhere one copy into the target. Fusing costs one host concatenation per fused matrix
        (the fused tensor is new memory; the Model's arrays stay as they are).
        ``max_positions`` sizes the RoPE tables (default: the model's
        ``max_position_embeddings``; an engine passes its cache length). ``skip``: weights
        the engine keeps in another form (int8 copies) and does not want here; every other
        weight must be present (one an engine released raises its WeightsError here).
        """
        c = model.config
        src = model.weights  # the float view: each read converts one record (not kept by the Model)
        model.require(n for n in c.weight_shapes() if n not in skip)  # a released weight says why, up front
        device = torch.device(device) if device is not None else torch.device("cpu")

        def put(arr: np.ndarray) -> torch.Tensor:
            if any(stride < 0 for stride in arr.strides):
                arr = np.ascontiguousarray(arr)  # torch.from_numpy refuses negative strides
            with warnings.catch_warnings():
                # Read-only arrays (memory-mapped files) are fine: nothing writes weights.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                t = torch.from_numpy(arr)
            return t.to(device=device, dtype=dtype)

        out: dict[str, torch.Tensor] = {}
        fused: dict[str, tuple[str, ...]] = {}
        for layer in range(c.num_hidden_layers):
            p = f"model.layers.{layer}."
            if fuse_qkv:
                fused[p + "self_attn.qkv_proj"] = tuple(p + f"self_attn.{n}_proj" for n in "qkv")
            if fuse_gate_up and c.mlp_gated and not c.num_experts:
                fused[p + "mlp.gate_up_proj"] = (p + "mlp.gate_proj", p + "mlp.up_proj")
        parts = {name for group in fused.values() for name in group}
        for name in src:
            if name.rsplit(".", 1)[0] not in parts and name not in skip and ".mlp.experts." not in name:
                out[name] = put(src[name])
        for target, group in fused.items():
            for kind in ("weight", "bias"):
                if f"{group[0]}.{kind}" in src:
                    out[f"{target}.{kind}"] = put(np.concatenate([src[f"{g}.{kind}"] for g in group]))
        for layer in range(c.num_hidden_layers if c.num_experts else 0):
            p = f"model.layers.{layer}.mlp.experts."
            for proj in ("gate_proj", "up_proj", "down_proj"):  # one (experts, out, in) tensor per projection
                out[p + proj + ".weight"] = put(np.stack([src[f"{p}{j}.{proj}.weight"] for j in range(c.num_experts)]))
        n = max_positions or c.max_position_embeddings
        for kind, (cos, sin) in c.rope_tables(n).items():
            prefix = "rope" if kind == "global" else "rope_local"
            out[prefix + ".cos"] = torch.from_numpy(cos).to(device=device, dtype=dtype)
            out[prefix + ".sin"] = torch.from_numpy(sin).to(device=device, dtype=dtype)
        return cls(c, out)

    @property
    def dtype(self) -> torch.dtype:
        return self._reference.dtype

    @property
    def device(self) -> torch.device:
        return self._reference.device

    @property
    def _reference(self) -> torch.Tensor:
        # the RoPE tables are made in the compute dtype on the device; the embedding table
        # may be held elsewhere by an engine (StepSpec.embed)
        return self.tensors.get("model.embed_tokens.weight", self.tensors["rope.cos"])

    @property
    def max_positions(self) -> int:
        return int(self.tensors["rope.cos"].shape[0])

    def new_cache(self, rows: int, length: int, *, lazy: bool = False,
                  dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed K and V caches ``[layers, rows, kv_heads, length, head_dim]`` of
        ``dtype`` (default: the compute dtype); with ``lazy``, on a Linux host, backed by
        pages made on first write and given back per row (:mod:`.hostmem`)."""
        c = self.config
        shape = (c.num_hidden_layers, rows, c.num_key_value_heads, length, c.head_dim)
        dtype = dtype or self.dtype
        if lazy:
            from polyengine.backends.torch_common.hostmem import new_cache_tensor

            return (new_cache_tensor(shape, dtype, self.device), new_cache_tensor(shape, dtype, self.device))
        return (torch.zeros(shape, dtype=dtype, device=self.device),
                torch.zeros(shape, dtype=dtype, device=self.device))


class KVCodec(Protocol):
    """How a cache stores K/V when its dtype is not the compute dtype (``forward``'s
    ``kv_codec``). ``which`` is ``"k"`` or ``"v"``; ``rows`` are the cache rows."""

    def encode(self, which: str, layer: int, new: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``new`` (N, kv_heads, head_dim) written to cache ``rows`` (N,) -> the cache's dtype."""
        ...

    def decode(self, which: str, layer: int, stored: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``stored`` (B, kv_heads, S, head_dim) read from cache ``rows`` (B,) -> compute dtype."""
        ...


@dataclass(frozen=True)
class CastKVCodec:
    """K/V kept at a narrower float type than the compute dtype (``kv``: bfloat16 or
    float16): written rounded to ``kv`` and stored as ``store`` (``kv`` itself for
    cuda_torch's caches, a prefill's own included, so a prefix holds exactly the values,
    and the bytes, the decode cache will; a wider ``store`` keeps the rounded values at
    the wider type), read back widened to ``compute``."""

    kv: torch.dtype
    store: torch.dtype
    compute: torch.dtype

    def encode(self, which: str, layer: int, new: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return new.to(self.kv).to(self.store)

    def decode(self, which: str, layer: int, stored: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return stored.to(self.compute)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * (offset + weight)`` (no weight: parameter-free), in
    float32 for half inputs (HF's order: cast back, then the weight)."""
    dt = x.dtype
    xf = x.float() if dt in _HALF else x
    var = (xf * xf).mean(-1, keepdim=True)
    y = (xf / torch.sqrt(var + eps)).to(dt)
    if weight is None:
        return y
    return y * (weight + offset) if offset else y * weight


def _norm(weights: "TorchWeights", x: torch.Tensor, name: str) -> torch.Tensor:
    """The model's RMSNorm ``name`` (without ``.weight``): its weight, offset and eps."""
    c = weights.config
    return rms_norm(x, weights.tensors.get(name + ".weight"), c.rms_norm_eps, c.norm_offset)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _linear(t: dict[str, torch.Tensor], x: torch.Tensor, name: str) -> torch.Tensor:
    return F.linear(x, t[name + ".weight"], t.get(name + ".bias"))


@dataclass(frozen=True)
class StepSpec:
    """The static choices of a forward: what its program depends on besides its inputs'
    shapes. An engine builds one per bucket (and keeps it), a traced backend compiles
    one program per spec and shape, and every choice a caller has is here, not in a
    switch inside the forward.

    ``kv_len``: static bound on the attended cache positions (None: the whole cache).
    ``attention``: ``"sdpa"`` or ``"eager"``. ``causal``: the call is a prefill from
    scratch (batch row b's queries at positions ``0..T-1``, nothing cached before them,
    ``kv_len == T``), so SDPA runs in its causal mode and skips the masked half.
    ``inplace``: cache writes with ``index_put_`` (eager CUDA/CPU) instead of out of
    place (caches in, caches out, as JAX and export need). ``linear(tensors, x, name)``
    replaces every projection and the LM head (``name`` without ``.weight``; the head is
    ``"lm_head"`` even when tied), so an engine routes them to its own kernels or int8
    weights; None is ``F.linear``. ``kv_codec`` (:class:`KVCodec`) encodes K/V before
    they are written and decodes what attention reads; None stores them as computed.
    ``moe`` (mixture-of-experts models): how routed experts run, each only on the
    tokens routed to it. ``"sparse"`` groups the tokens per expert (shapes depend on
    the routing: eager torch only); ``"gather"`` gathers each token's k experts'
    weights and multiplies them batched (static shapes, for traced programs; it reads
    ``tokens x k`` expert matrices, so it suits decode steps and small prefills).
    ``embed(tensors, tokens)``: replaces the embedding lookup (an engine that keeps the
    table in another form, such as a GGUF file's blocks); returns (B, T, hidden).
    ``causal_attention(q, keys, vals, scale, start)``: with ``causal`` or ``causal_tail``,
    replaces the attention of layers without a window or soft-cap (an engine's own
    kernel): ``q`` (B, T, heads, head_dim) after RoPE at positions ``start..start + T - 1``
    in every batch row, ``keys``/``vals`` (B, kv_heads, start + T, head_dim) as decoded
    from the cache; query t attends keys ``0..start + t``; returns (B, T, heads *
    head_dim). ``start`` is 0 with ``causal``, ``kv_len - T`` with ``causal_tail``.
    ``causal_tail``: the call continues a prefix (a chunked prefill's later piece, a
    prefix-cache hit): batch row b's queries sit at positions ``kv_len - T..kv_len - 1``,
    the last T positions the call attends, so it is causal from an offset, the same in
    every row. Only ``causal_attention`` uses it; without one (and on windowed or
    soft-capped layers) such a call runs the general masked attention, as any other. The
    offset is ``kv_len - T``, not a field, so one spec serves every prefix length.
    ``page_layout`` (paged caches): ``"pages"``, each layer's pool ``[pages, kv_heads,
    page_size, head_dim]``, or ``"heads"``, ``[kv_heads, pages, page_size, head_dim]``
    (the layout of a kernel that reads one KV head's pages at a time, such as JAX's Pallas
    paged attention). ``paged_attention(q, k_pool, v_pool, pages, lengths, scale,
    softcap)``: with a page table and one query per row, replaces the attention of layers
    without a window (an engine's paged kernel): ``q`` (B, heads, head_dim) after RoPE,
    the layer's pools as stored (``page_layout``), ``pages`` (B, P) the rows' page ids,
    ``lengths`` (B,) int32 the keys each row attends (``0..length - 1``), ``softcap`` None
    or the config's; returns (B, heads, head_dim). Not with ``kv_codec``.
    """

    kv_len: int | None = None
    attention: str = "sdpa"
    causal: bool = False
    inplace: bool = False
    linear: Callable[[dict[str, torch.Tensor], torch.Tensor, str], torch.Tensor] | None = None
    kv_codec: KVCodec | None = None
    moe: str = "gather"
    causal_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, int], torch.Tensor] | None = None
    causal_tail: bool = False
    embed: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor] | None = None
    page_layout: str = "pages"
    paged_attention: Callable[..., torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")
        if self.page_layout not in PAGE_LAYOUTS:
            raise ValueError(f"page_layout must be one of {PAGE_LAYOUTS}, got {self.page_layout!r}")
        if self.paged_attention is not None and self.kv_codec is not None:
            raise ValueError("paged_attention reads the pools as stored: not with a kv_codec")
        if self.moe not in MOE_IMPLS:
            raise ValueError(f"moe must be one of {MOE_IMPLS}, got {self.moe!r}")
        if self.causal and self.causal_tail:
            raise ValueError("causal (queries from position 0) and causal_tail (queries continuing a prefix) "
                             "exclude each other")

    @property
    def project(self) -> Callable[[dict[str, torch.Tensor], torch.Tensor, str], torch.Tensor]:
        return self.linear or _linear


@dataclass
class _Writes:
    """Where each token's K/V goes: flat (N,) cache rows and positions, pad tokens
    redirected (see :func:`_write_targets`)."""

    rows: torch.Tensor  # (N, 1) int64
    pos: torch.Tensor  # (N, 1) int64
    heads: torch.Tensor  # (1, kv_heads) int64
    live: torch.Tensor | None  # (N,) bool, None when every token writes
    anchor: torch.Tensor | None  # (1,) int64: the first live token (0 if none)
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
    # (1,), not a 0-dim index: eager torch turns a 0-dim index into a Python int, a device sync.
    anchor = torch.argmax(live.to(torch.int32), dim=0, keepdim=True)  # first maximum: the first live token
    r = torch.where(live, r, r[anchor])
    p = torch.where(live, p, p[anchor])
    return _Writes(r[:, None], p[:, None], heads, live, anchor, live.any())


def _write(cache: torch.Tensor, layer: int, w: _Writes, new: torch.Tensor, inplace: bool,
           heads_first: bool = False) -> torch.Tensor:
    """Scatter ``new`` (N, kv_heads, head_dim) into ``cache[layer]`` at ``w``'s targets
    (``heads_first``: a page pool in the ``"heads"`` layout, kv_heads before pages)."""
    if w.live is not None:
        rows_first = cache[layer].transpose(0, 1) if heads_first else cache[layer]  # a view
        old = rows_first[w.rows[w.anchor, 0], :, w.pos[w.anchor, 0]]  # (1, kv_heads, head_dim)
        fill = torch.where(w.any_live, new[w.anchor], old)
        new = torch.where(w.live[:, None, None], new, fill)
    index = (w.heads, w.rows, w.pos) if heads_first else (w.rows, w.heads, w.pos)
    if inplace:
        cache[layer].index_put_(index, new)
        return cache
    layer_idx = torch.full_like(w.rows, layer)
    return cache.index_put((layer_idx, *index), new)


def _attend(q, keys, vals, visible, scale, attention, softcap=None):
    """q (B, kv_heads, G*T, hd), keys/vals (B, kv_heads, S, hd), visible (B, 1, G*T, S).
    A soft-cap (``cap * tanh(scores / cap)``, Gemma 2) needs the scores: eager then."""
    if attention == "sdpa" and softcap is None:
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=visible, scale=scale)
    scores = (q @ keys.transpose(-1, -2)) * scale  # (B, kv_heads, G*T, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32 if q.dtype in _HALF else q.dtype)
    return probs.to(vals.dtype) @ vals


@dataclass
class _Call:
    """What every layer of one forward call shares: its shapes, the RoPE rows of its
    positions (per table), which cache positions each query sees (per window), and
    where its K/V go."""

    batch: int
    seq: int
    kv_len: int
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "global"/"local" -> cos, sin (B, T, 1, head_dim)
    visible: dict[int | None, torch.Tensor]  # window (None: full) -> (B, 1, G*T, kv_len) bool
    rows: torch.Tensor | None  # (B,) cache row of each batch row; None: row b
    cache_rows: torch.Tensor  # (B,) the same, always a tensor
    writes: _Writes
    page_table: torch.Tensor | None = None  # (B, pages) int64: paged caches, batch row b's page ids
    pages: torch.Tensor | None = None  # (B, ceil(kv_len / page_size)): the page ids attention reads
    heads_first: bool = False  # paged caches in the "heads" layout (StepSpec.page_layout)
    lengths: torch.Tensor | None = None  # (B,) int32 keys each row attends (for StepSpec.paged_attention)


def _call(weights: TorchWeights, spec: StepSpec, positions: torch.Tensor, rows: torch.Tensor | None,
          write_mask: torch.Tensor | None, cache_len: int, page_table: torch.Tensor | None = None,
          page_size: int = 0) -> _Call:
    c, t = weights.config, weights.tensors
    b, seq = positions.shape
    group = c.num_attention_heads // c.num_key_value_heads
    kv_len = cache_len if spec.kv_len is None else int(spec.kv_len)
    if not 1 <= kv_len <= cache_len:
        raise ValueError(f"kv_len {kv_len} must lie in [1, {cache_len}] (the cache length)")
    if spec.causal and kv_len != seq:
        raise ValueError(f"causal=True needs kv_len == T (queries at 0..T-1): kv_len {kv_len}, T {seq}")
    if spec.causal_tail and kv_len <= seq:
        raise ValueError(f"causal_tail=True needs kv_len > T (queries at kv_len-T..kv_len-1 after a prefix): "
                         f"kv_len {kv_len}, T {seq}")
    device = positions.device
    table_pos = positions.clamp(0, t["rope.cos"].shape[0] - 1)
    rope = {}
    for kind, prefix in (("global", "rope"), ("local", "rope_local")):
        if prefix + ".cos" in t:
            cos, sin = t[prefix + ".cos"][table_pos], t[prefix + ".sin"][table_pos]  # (B, T, hd/2)
            rope[kind] = (torch.cat([cos, cos], dim=-1)[:, :, None, :], torch.cat([sin, sin], dim=-1)[:, :, None, :])
    # Key s is visible to a query at position p iff s <= p (and p - s < window in a
    # sliding layer): the cache index is the position, and each row reads only its own
    # cache row, so rows never mix. The cache keeps every position; windows only mask.
    key_pos = torch.arange(kv_len, device=device)
    distance = positions[:, :, None] - key_pos[None, None, :]  # (B, T, kv_len)
    visible = {}
    for window in {c.layer_window(layer) for layer in range(c.num_hidden_layers)}:
        seen = distance >= 0 if window is None else (distance >= 0) & (distance < window)
        # Queries are grouped per KV head as (group, T) so K/V are never repeated.
        visible[window] = seen.repeat(1, group, 1)[:, None]
    cache_rows = rows if rows is not None else torch.arange(b, device=device)
    writes = _write_targets(cache_rows, positions, write_mask, c.num_key_value_heads)
    if page_table is not None:
        # Position p of batch row b lives at offset p % page_size of page page_table[b, p // page_size].
        # Pad tokens were redirected to the anchor's (row, position) above, so they land on its
        # page and offset with its value: the no-op holds in pages too.
        writes.rows = page_table[writes.rows, writes.pos // page_size]
        writes.pos = writes.pos % page_size
    paged = {}
    if page_table is not None:
        paged = dict(page_table=page_table, pages=page_table[:, : -(-kv_len // page_size)],
                     heads_first=spec.page_layout == "heads")
        if spec.paged_attention is not None and seq == 1:  # keys 0..the query's position
            paged["lengths"] = (positions[:, 0] + 1).clamp(1, kv_len).to(torch.int32)
    return _Call(batch=b, seq=seq, kv_len=kv_len, rope=rope, visible=visible, rows=rows, cache_rows=cache_rows,
                 writes=writes, **paged)


def attention_block(weights: TorchWeights, spec: StepSpec, call: _Call, layer: int, h: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Self-attention of layer ``layer`` on the normed hidden states ``h`` (B, T, H):
    projections, the per-head q/k norm (Qwen3, Gemma 3, nanochat), RoPE (the layer's
    table), the KV write (through the codec), attention over the slot's own cache row up
    to ``kv_len`` (masked to the layer's window; scaled and soft-capped as the config
    says), the output projection. Returns ``(out, k_cache, v_cache)``."""
    c, t, lin = weights.config, weights.tensors, spec.project
    b, seq = call.batch, call.seq
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    group = nh // nkv
    pre = f"model.layers.{layer}.self_attn."
    if pre + "qkv_proj.weight" in t or pre + "qkv_proj.qweight" in t:
        q, k, v = lin(t, h, pre + "qkv_proj").split([c.q_size, c.kv_size, c.kv_size], dim=-1)
    else:
        q, k, v = lin(t, h, pre + "q_proj"), lin(t, h, pre + "k_proj"), lin(t, h, pre + "v_proj")
    q = q.reshape(b, seq, nh, hd)
    k = k.reshape(b, seq, nkv, hd)
    if c.qk_norm:
        q, k = _norm(weights, q, pre + "q_norm"), _norm(weights, k, pre + "k_norm")
    cos, sin = call.rope[c.layer_rope(layer)]
    q = q * cos + _rotate_half(q) * sin  # (B, T, nh, hd)
    k = k * cos + _rotate_half(k) * sin  # (B, T, nkv, hd)

    k_cache, v_cache = kv_write(spec, call, layer, k.reshape(b * seq, nkv, hd), v.reshape(b * seq, nkv, hd),
                                k_cache, v_cache)
    scale, window, softcap = c.attention_scale, c.layer_window(layer), c.attn_logit_softcapping
    if call.lengths is not None and window is None:
        # The engine's kernel reads the pages in place (no gathered copy of each row's K/V).
        out = spec.paged_attention(q[:, 0], k_cache[layer], v_cache[layer], call.pages, call.lengths, scale, softcap)
        return lin(t, out.reshape(b, 1, nh * hd), pre + "o_proj"), k_cache, v_cache
    keys, vals = kv_read(spec, call, layer, k_cache, v_cache)

    if (spec.causal or spec.causal_tail) and spec.causal_attention is not None and window is None and softcap is None:
        out = spec.causal_attention(q, keys, vals, scale, call.kv_len - seq)  # (B, T, nh * hd)
    elif spec.causal and spec.attention == "sdpa" and window is None and softcap is None:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, is_causal=True, scale=scale,
                                             enable_gqa=group > 1)  # (B, nh, T, hd)
        out = out.transpose(1, 2).reshape(b, seq, nh * hd)
    else:
        qg = q.reshape(b, seq, nkv, group, hd).permute(0, 2, 3, 1, 4).reshape(b, nkv, group * seq, hd)
        out = _attend(qg, keys, vals, call.visible[window], scale, spec.attention, softcap)  # (B, nkv, G*T, hd)
        out = out.reshape(b, nkv, group, seq, hd).permute(0, 3, 1, 2, 4).reshape(b, seq, nh * hd)
    return lin(t, out, pre + "o_proj"), k_cache, v_cache


def kv_write(spec: StepSpec, call: _Call, layer: int, k_new: torch.Tensor, v_new: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one layer's new K/V (N, kv_heads, head_dim) at the call's targets (pad tokens
    redirected so they change nothing), encoded by the spec's codec."""
    if spec.kv_codec is not None:
        k_new = spec.kv_codec.encode("k", layer, k_new, call.writes.rows[:, 0])
        v_new = spec.kv_codec.encode("v", layer, v_new, call.writes.rows[:, 0])
    return (_write(k_cache, layer, call.writes, k_new, spec.inplace, call.heads_first),
            _write(v_cache, layer, call.writes, v_new, spec.inplace, call.heads_first))


def kv_read(spec: StepSpec, call: _Call, layer: int, k_cache: torch.Tensor,
            v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values (B, kv_heads, kv_len, head_dim) each batch row attends to: a
    view of the cache when batch row b is cache row b, else a gather (of the row's pages,
    in order, when the caches are page pools); decoded."""
    if call.page_table is not None:
        keys = _gather_pages(k_cache[layer], call.pages, call.kv_len, call.heads_first)
        vals = _gather_pages(v_cache[layer], call.pages, call.kv_len, call.heads_first)
    elif call.rows is None:
        keys = k_cache[layer, :, :, : call.kv_len]  # a view
        vals = v_cache[layer, :, :, : call.kv_len]
    else:
        keys = k_cache[layer, call.rows, :, : call.kv_len]  # gathered copy
        vals = v_cache[layer, call.rows, :, : call.kv_len]
    if spec.kv_codec is not None:
        keys = spec.kv_codec.decode("k", layer, keys, call.cache_rows)
        vals = spec.kv_codec.decode("v", layer, vals, call.cache_rows)
    return keys, vals


def _gather_pages(pool: torch.Tensor, pages: torch.Tensor, length: int, heads_first: bool = False) -> torch.Tensor:
    """One layer's pool (pages, kv_heads, page_size, head_dim), or (kv_heads, pages, ...)
    with ``heads_first``, read through ``pages`` (B, P): each row's first ``length``
    positions as (B, kv_heads, length, head_dim), a copy."""
    b, p = pages.shape
    ps, hd = pool.shape[2:]
    if heads_first:
        out = pool[:, pages].transpose(0, 1)  # (B, kv_heads, P, page_size, head_dim)
    else:
        out = pool[pages].transpose(1, 2)  # (B, P, kv_heads, ...) -> (B, kv_heads, P, ...)
    return out.reshape(b, out.shape[1], p * ps, hd)[:, :, :length]


def _act(config: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    if config.hidden_act == "silu":
        return F.silu(x)
    if config.hidden_act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return torch.square(F.relu(x))  # relu2: nanochat's squared ReLU


def mlp_block(weights: TorchWeights, spec: StepSpec, layer: int, h: torch.Tensor) -> torch.Tensor:
    """The MLP of layer ``layer`` on the normed hidden states ``h``: gated
    (``down(act(gate) * up)``: SiLU, or GeGLU for Gemma), ungated squared ReLU
    (nanochat), or routed experts (:func:`moe_block`)."""
    c, t, lin = weights.config, weights.tensors, spec.project
    if c.num_experts:
        return moe_block(weights, spec, layer, h)
    pre = f"model.layers.{layer}.mlp."
    if not c.mlp_gated:
        return lin(t, _act(c, lin(t, h, pre + "up_proj")), pre + "down_proj")
    if pre + "gate_up_proj.weight" in t or pre + "gate_up_proj.qweight" in t:
        gate, up = lin(t, h, pre + "gate_up_proj").chunk(2, dim=-1)
    else:
        gate, up = lin(t, h, pre + "gate_proj"), lin(t, h, pre + "up_proj")
    return lin(t, _act(c, gate) * up, pre + "down_proj")


def moe_block(weights: TorchWeights, spec: StepSpec, layer: int, h: torch.Tensor) -> torch.Tensor:
    """Routed experts (Mixtral, Qwen3-MoE): the router's softmax (float32 for half
    dtypes), the top ``k`` experts per token, their probabilities renormalised when the
    config says so; each token runs its k experts only (``spec.moe`` says how)."""
    c, t = weights.config, weights.tensors
    pre = f"model.layers.{layer}.mlp."
    shape = h.shape
    x = h.reshape(-1, shape[-1])  # (N, H)
    logits = F.linear(x, t[pre + "gate.weight"])  # (N, E)
    probs = torch.softmax(logits.float() if logits.dtype in _HALF else logits, dim=-1)
    top_p, top_e = torch.topk(probs, c.num_experts_per_tok, dim=-1)  # (N, k)
    if c.norm_topk_prob:
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    top_p = top_p.to(x.dtype)
    gate_w, up_w, down_w = (t[pre + f"experts.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj"))
    if spec.moe == "gather":
        # Each (token, choice) pair multiplies its own expert's matrices: static shapes.
        g = torch.einsum("nh,nkih->nki", x, gate_w[top_e])  # (N, k, I)
        u = torch.einsum("nh,nkih->nki", x, up_w[top_e])
        y = torch.einsum("nki,nkhi->nkh", _act(c, g) * u, down_w[top_e])  # (N, k, H)
        return (y * top_p[..., None]).sum(dim=1).reshape(shape)
    out = torch.zeros_like(x)
    for e in range(c.num_experts):
        rows, choice = torch.nonzero(top_e == e, as_tuple=True)
        if rows.numel():
            xe = x[rows]
            y = F.linear(_act(c, F.linear(xe, gate_w[e])) * F.linear(xe, up_w[e]), down_w[e])
            out.index_add_(0, rows, y * top_p[rows, choice][:, None])
    return out.reshape(shape)


def final_norm(weights: TorchWeights, x: torch.Tensor) -> torch.Tensor:
    """The model's final norm (``model.norm``) of the residual stream."""
    return _norm(weights, x, "model.norm")


def lm_head(weights: TorchWeights, spec: StepSpec, x: torch.Tensor) -> torch.Tensor:
    """The final norm and the LM head (the tied embeddings when there is no head):
    logits in float32 for half dtypes, else in the compute dtype; soft-capped when the
    config says so (Gemma 2, nanochat)."""
    c, t = weights.config, weights.tensors
    x = final_norm(weights, x)
    if spec.linear is None:
        logits = F.linear(x, t[weights.config.head_weight])  # (B, [T,] vocab)
    else:
        logits = spec.linear(t, x, "lm_head")
    logits = logits.float() if logits.dtype in _HALF else logits
    cap = c.final_logit_softcapping
    return logits if cap is None else cap * torch.tanh(logits / cap)


def forward(
    weights: TorchWeights,
    spec: StepSpec,
    tokens: torch.Tensor,  # (B, T) int
    positions: torch.Tensor,  # (B, T) int64, absolute position of each token
    k_cache: torch.Tensor,  # (layers, rows, kv_heads, S, head_dim)
    v_cache: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,  # (B,) int64 cache row of each batch row; None: row b
    write_mask: torch.Tensor | None = None,  # (B, T) bool, False for pad tokens
    logits_at: torch.Tensor | None = None,  # (B,) int64 index into T
    page_table: torch.Tensor | None = None,  # (B, pages) int64: the caches are page pools
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``tokens`` through the model under ``spec``, writing their K/V; returns
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

    Paged caches: with ``page_table`` (B, P), ``k_cache``/``v_cache`` are page pools
    ``[layers, pages, kv_heads, page_size, head_dim]`` (``[layers, kv_heads, pages, ...]``
    with ``spec.page_layout == "heads"``) and batch row b's position p lives
    at offset ``p % page_size`` of page ``page_table[b, p // page_size]`` (``rows`` must be
    None: the table says where each row's K/V are). The caller keeps each live token's
    page written by that row alone (copy on write is the engine's, before the call);
    attention gathers the first ``ceil(kv_len / page_size)`` pages of each row.
    """
    x, k_cache, v_cache = residual_stream(weights, spec, tokens, positions, k_cache, v_cache, rows=rows,
                                          write_mask=write_mask, page_table=page_table)
    if logits_at is not None:
        x = x[torch.arange(tokens.shape[0], device=tokens.device), logits_at]  # (B, H)
    return lm_head(weights, spec, x), k_cache, v_cache


def residual_stream(
    weights: TorchWeights, spec: StepSpec, tokens: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, *, rows: torch.Tensor | None = None, write_mask: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`forward` up to the final norm: ``(x, k_cache, v_cache)``, x the residual
    stream after the last layer (B, T, hidden); :func:`final_norm` of it is what the LM
    head reads and what embeddings pool."""
    c, t = weights.config, weights.tensors
    b = tokens.shape[0]
    if page_table is not None:
        if rows is not None or page_table.shape[0] != b:
            raise ValueError(f"paged caches take one page-table row per batch row and no rows: batch {b}, "
                             f"page table {tuple(page_table.shape)}, rows {'given' if rows is not None else 'None'}")
        ps = k_cache.shape[3]
        call = _call(weights, spec, positions, None, write_mask, page_table.shape[1] * ps, page_table, ps)
    elif rows is None and b != k_cache.shape[1]:
        raise ValueError(f"rows=None needs one batch row per cache row: batch {b}, cache rows {k_cache.shape[1]}")
    else:
        call = _call(weights, spec, positions, rows, write_mask, k_cache.shape[3])

    x = F.embedding(tokens, t["model.embed_tokens.weight"]) if spec.embed is None else spec.embed(t, tokens)
    if c.embed_scale:  # Gemma: times sqrt(hidden), rounded to the compute dtype as transformers does
        x = x * x.new_full((), math.sqrt(c.hidden_size))  # an op, not a constant: export lifts no tensor
    if c.embed_norm:  # nanochat
        x = rms_norm(x, None, c.rms_norm_eps)
    sandwich = c.sandwich_norms
    for layer in range(k_cache.shape[0]):
        pre = f"model.layers.{layer}."
        out, k_cache, v_cache = attention_block(weights, spec, call, layer, _norm(weights, x, pre + "input_layernorm"),
                                                k_cache, v_cache)
        x = x + (_norm(weights, out, pre + "post_attention_layernorm") if sandwich else out)
        out = mlp_block(weights, spec, layer, _norm(weights, x, pre + (
            "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm")))
        x = x + (_norm(weights, out, pre + "post_feedforward_layernorm") if sandwich else out)
    return x, k_cache, v_cache


class StepModule(torch.nn.Module):
    """:func:`forward` as a module: weights registered as buffers (shared, not copied),
    the static choices (a :class:`StepSpec`) fixed at construction.

    ``module(tokens, positions, k_cache, v_cache, rows=None, write_mask=None,
    logits_at=None)`` returns ``(logits, k_cache, v_cache)``. Export one module per
    bucket shape with ``torch.export.export(module, args)``.
    """

    def __init__(self, weights: TorchWeights, spec: StepSpec = StepSpec()):
        super().__init__()
        self.config = weights.config
        self.spec = spec
        # Buffer names may not contain dots; keep the HF name beside each one.
        self._names = {}
        for name, tensor in weights.tensors.items():
            buf = name.replace(".", "__")
            self.register_buffer(buf, tensor, persistent=False)
            self._names[buf] = name

    def weights(self) -> TorchWeights:
        return TorchWeights(self.config, {name: getattr(self, buf) for buf, name in self._names.items()})

    def forward(self, tokens, positions, k_cache, v_cache, rows=None, write_mask=None, logits_at=None):
        return forward(self.weights(), self.spec, tokens, positions, k_cache, v_cache, rows=rows,
                       write_mask=write_mask, logits_at=logits_at)
