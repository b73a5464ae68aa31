"""The model configuration, read from HF ``config.json``, GGUF metadata or a nanochat
checkpoint's metadata: one pydantic model for every supported architecture.

Architectures (``model_type``): Llama 2/3 and SmolLM2 (``llama``), Qwen2 (q/k/v
biases), Qwen3 (per-head q/k RMSNorm), Mistral (sliding-window attention), Gemma 2
and Gemma 3 (``gemma2``, ``gemma3_text``: embedding scaling, RMSNorm with a +1 offset,
GeGLU, sandwich norms, alternating local sliding-window and global layers, attention
and final logit soft-capping, query pre-attention scaling; Gemma 3's q/k norm and its
own RoPE base for local layers), Phi-3 (fused QKV and gate/up projections, split when
loaded; long-RoPE scaling), Mixtral and Qwen3-MoE (top-k routed experts), and
nanochat's GPT (``nanochat``: squared-ReLU MLP, QK norm, parameter-free RMSNorm, a norm
after the embedding, untied head, logit soft-capping, its rotary convention).
Anything else is refused by name.

An architecture is not a switch in the backends: it is a set of the *features* below
(``hidden_act``, ``qk_norm``, ``norm_offset``, ``sliding_window``/``layer_types``,
``num_experts``, ...), each of which changes one block of the forward. The config also
owns what every backend must compute the same way: the expected weight names and
shapes, the RoPE tables (per layer kind), the attention scale and each layer's window.

Reading one from a file (every value validated and bounded) is
:mod:`polyengine.models.config_files`; the sizes are bounded here too
(:mod:`polyengine.limits`), so no config, however it was made, describes a model whose
tensor list alone would fill memory.

Decisions:
- ``generation_config.json``'s EOS ids are appended to ``eos_token_ids``.
- Qwen2 always has q/k/v biases and no MLP bias, whatever its config says (as in
  transformers' modeling code).
- A sliding window of ``w`` lets the query at position ``p`` see keys ``p - w < s <= p``
  (transformers' convention).
- Long-RoPE (Phi-3) picks its long or short factors once per engine, from the context
  the engine is built for (``context > original_max_position_embeddings``: long), as
  llama.cpp does, rather than per sequence as transformers does (which would change
  the RoPE of tokens already cached).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from polyengine.models.architectures import TABLE
from polyengine.limits import (MAX_EXPERTS, MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_INTERMEDIATE, MAX_LAYERS,
                               MAX_POSITIONS, MAX_ROPE_ATTENTION_FACTOR, MAX_ROPE_FACTOR, MAX_SOFTCAP, MAX_VOCAB,
                               MIN_QUERY_PRE_ATTN_SCALAR, MIN_ROPE_FACTOR, MIN_ROPE_THETA)

__all__ = ["ModelConfig", "RopeScaling", "SUPPORTED_ARCHITECTURES", "ARCHITECTURES", "LLAMA_FAMILY"]

# HF model_type -> the architectures (config.json "architectures") we accept for it
# (declared with every other per-architecture feature in polyengine.models.architectures).
SUPPORTED_ARCHITECTURES = {a.model_type: a.hf_classes for a in TABLE.values()}
# Every model_type the loader accepts; what a backend may declare (Capabilities.architectures).
ARCHITECTURES: tuple[str, ...] = tuple(SUPPORTED_ARCHITECTURES)
# The architectures every backend ran before the others existed: a backend that declares
# nothing is taken to support these.
LLAMA_FAMILY: tuple[str, ...] = ("llama", "qwen2")

LayerType = Literal["full_attention", "sliding_attention"]


class RopeScaling(BaseModel):
    """RoPE frequency scaling. ``linear`` divides positions by ``factor``; ``llama3``
    is Llama 3.1's piecewise scaling of the inverse frequencies; ``longrope`` (Phi-3)
    divides each frequency by its own factor (``short_factor`` or ``long_factor``) and
    scales cos/sin by ``attention_factor``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rope_type: Literal["linear", "llama3", "longrope"]
    factor: float = Field(1.0, ge=MIN_ROPE_FACTOR, le=MAX_ROPE_FACTOR, allow_inf_nan=False)
    low_freq_factor: float | None = Field(None, ge=MIN_ROPE_FACTOR, le=MAX_ROPE_FACTOR, allow_inf_nan=False)
    high_freq_factor: float | None = Field(None, ge=MIN_ROPE_FACTOR, le=MAX_ROPE_FACTOR, allow_inf_nan=False)
    original_max_position_embeddings: int | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float | None = Field(None, gt=0, le=MAX_ROPE_ATTENTION_FACTOR, allow_inf_nan=False)

    @model_validator(mode="after")
    def _fields(self) -> "RopeScaling":
        need = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}.get(self.rope_type, ())
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise ValueError(f"{self.rope_type} rope scaling needs {missing}")
        for key in ("short_factor", "long_factor"):
            values = getattr(self, key)
            if values is not None and not all(MIN_ROPE_FACTOR <= v <= MAX_ROPE_FACTOR for v in values):
                raise ValueError(f"{key} must hold factors in [{MIN_ROPE_FACTOR:g}, {MAX_ROPE_FACTOR:g}] (larger "
                                 f"or smaller ones overflow float32 in the RoPE tables)")
        return self


class ModelConfig(BaseModel):
    """A decoder-only model's shape and numerics (see the module docstring for the features)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_type: Literal[ARCHITECTURES] = "llama"  # type: ignore[valid-type]
    vocab_size: int = Field(ge=1, le=MAX_VOCAB)
    hidden_size: int = Field(ge=1, le=MAX_HIDDEN)
    intermediate_size: int = Field(ge=1, le=MAX_INTERMEDIATE)
    num_hidden_layers: int = Field(ge=1, le=MAX_LAYERS)
    num_attention_heads: int = Field(ge=1, le=MAX_HEADS)
    num_key_value_heads: int = Field(ge=1, le=MAX_HEADS)
    head_dim: int = Field(ge=2, le=MAX_HEAD_DIM)
    max_position_embeddings: int = Field(2048, ge=1, le=MAX_POSITIONS)
    rms_norm_eps: float = Field(1e-5, gt=0, allow_inf_nan=False)
    rope_theta: float = Field(10000.0, ge=MIN_ROPE_THETA, allow_inf_nan=False)
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # -- architecture features (each changes one block of the forward) -------------------
    # MLP activation: "silu" and "gelu_tanh" gate (act(gate) * up); "relu2" is ungated
    # (relu(up)^2, nanochat).
    hidden_act: Literal["silu", "gelu_tanh", "relu2"] = "silu"
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3, nanochat)
    norm_weights: bool = True  # False: every RMSNorm is parameter-free (nanochat)
    norm_offset: float = Field(0.0, ge=0, le=1)  # norms multiply by (norm_offset + weight): Gemma's 1
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    embed_norm: bool = False  # an RMSNorm right after the embedding (nanochat)
    sandwich_norms: bool = False  # norms after attention and MLP too, and before the MLP (Gemma 2/3)
    sliding_window: int | None = Field(None, ge=1)  # keys a sliding layer's query sees, itself included
    layer_types: tuple[LayerType, ...] | None = None  # per layer; None: all sliding when sliding_window is set
    attn_logit_softcapping: float | None = Field(None, gt=0, le=MAX_SOFTCAP, allow_inf_nan=False)
    final_logit_softcapping: float | None = Field(None, gt=0, le=MAX_SOFTCAP, allow_inf_nan=False)
    # scale = its ** -0.5 (Gemma)
    query_pre_attn_scalar: float | None = Field(None, ge=MIN_QUERY_PRE_ATTN_SCALAR, allow_inf_nan=False)
    rope_local_theta: float | None = Field(None, ge=MIN_ROPE_THETA, allow_inf_nan=False)  # sliding layers' RoPE base (Gemma 3)
    num_experts: int = Field(0, ge=0, le=MAX_EXPERTS)  # > 0: every MLP is a routed mixture of experts
    num_experts_per_tok: int = Field(0, ge=0, le=MAX_EXPERTS)
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities (Mixtral always does)
    moe_intermediate_size: int | None = Field(None, ge=1, le=MAX_INTERMEDIATE)  # each expert's; None: intermediate_size

    @model_validator(mode="after")
    def _shapes(self) -> "ModelConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types lists {len(self.layer_types)} layers, the model has "
                                 f"{self.num_hidden_layers}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must lie in 1..num_experts "
                             f"({self.num_experts})")
        s = self.rope_scaling
        if s is not None and s.rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(getattr(s, key)) != self.head_dim // 2:
                    raise ValueError(f"rope_scaling.{key} has {len(getattr(s, key))} factors, expected head_dim/2 "
                                     f"= {self.head_dim // 2}")
        return self

    # -- construction -----------------------------------------------------------------
    # A ModelConfig is data: reading one from a file is polyengine.models.config_files
    # (config_from_hf, config_from_file, config_from_gguf, build_config), which imports
    # this module, never the other way round.

    def truncated(self, layers: int) -> "ModelConfig":
        """This config with its first ``layers`` layers (a self-speculation draft)."""
        types = None if self.layer_types is None else self.layer_types[:layers]
        return self.model_copy(update={"num_hidden_layers": layers, "layer_types": types})

    # -- what backends share ----------------------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def mlp_gated(self) -> bool:
        """Whether the MLP has a gate projection (all but the squared-ReLU MLP)."""
        return self.hidden_act != "relu2"

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def is_llama_family(self) -> bool:
        """Whether the model is a plain Llama-family forward (Llama, Qwen2 and Mistral
        without a window): what host kernels written for Llama may compute."""
        return (self.hidden_act == "silu" and not self.qk_norm and self.norm_weights and not self.norm_offset
                and not self.embed_scale and not self.embed_norm and not self.sandwich_norms
                and self.sliding_window is None and self.attn_logit_softcapping is None
                and self.final_logit_softcapping is None and self.query_pre_attn_scalar is None
                and self.rope_local_theta is None and not self.num_experts and self.model_type != "nanochat"
                and (self.rope_scaling is None or self.rope_scaling.rope_type != "longrope"))

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to the whole context)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_rope(self, layer: int) -> str:
        """Which RoPE table layer ``layer`` uses: ``"local"`` (Gemma 3's sliding layers,
        their own base) or ``"global"``."""
        return "local" if self.rope_local_theta is not None and self.layer_window(layer) is not None else "global"

    @property
    def attention_scale(self) -> float:
        """What q·k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def has_bias(self, proj: str) -> bool:
        """Whether ``self_attn.<proj>`` has a bias (Qwen2: q/k/v only)."""
        if not self.attention_bias:
            return False
        return proj != "o_proj" or self.model_type == "llama"

    @property
    def head_weight(self) -> str:
        """The tensor the LM head multiplies by: the embedding table of a tied model, else
        ``lm_head.weight`` (the one place this is chosen)."""
        return "model.embed_tokens.weight" if self.tie_word_embeddings else "lm_head.weight"

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model needs, HF names and layouts (``[out, in]``). Experts are
        ``mlp.experts.{j}.{gate,up,down}_proj.weight`` with the router ``mlp.gate.weight``
        (Qwen3-MoE's names; Mixtral's are renamed when loaded)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        norm = {} if not self.norm_weights else {"model.norm.weight": (h,)}
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), **norm}
        proj_out = {"q_proj": (self.q_size, h), "k_proj": (self.kv_size, h), "v_proj": (self.kv_size, h), "o_proj": (h, self.q_size)}
        layer_norms = ["input_layernorm", "post_attention_layernorm"]
        if self.sandwich_norms:
            layer_norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}."
            if self.norm_weights:
                for n in layer_norms:
                    shapes[p + n + ".weight"] = (h,)
            for proj, shape in proj_out.items():
                shapes[p + f"self_attn.{proj}.weight"] = shape
                if self.has_bias(proj):
                    shapes[p + f"self_attn.{proj}.bias"] = (shape[0],)
            if self.qk_norm and self.norm_weights:
                shapes[p + "self_attn.q_norm.weight"] = (self.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (self.head_dim,)
            if self.num_experts:
                e = self.expert_size
                shapes[p + "mlp.gate.weight"] = (self.num_experts, h)
                for j in range(self.num_experts):
                    shapes[p + f"mlp.experts.{j}.gate_proj.weight"] = (e, h)
                    shapes[p + f"mlp.experts.{j}.up_proj.weight"] = (e, h)
                    shapes[p + f"mlp.experts.{j}.down_proj.weight"] = (h, e)
                continue
            if self.mlp_gated:
                shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
            if self.mlp_bias:
                if self.mlp_gated:
                    shapes[p + "mlp.gate_proj.bias"] = (i,)
                shapes[p + "mlp.up_proj.bias"] = (i,)
                shapes[p + "mlp.down_proj.bias"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (v, h)
        return shapes

    def num_parameters(self) -> int:
        """The number of weights, by arithmetic: no name is built, so this is cheap for
        any config (the loader sizes its memory check with it before anything else)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.q_size, self.kv_size
        biases = (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("o_proj", h))
        attn = 2 * h * q + 2 * h * kv + sum(out for proj, out in biases if self.has_bias(proj))
        if self.qk_norm and self.norm_weights:
            attn += 2 * self.head_dim
        if self.num_experts:
            mlp = self.num_experts * (h + 3 * h * self.expert_size)
        else:
            gates = 3 if self.mlp_gated else 2
            mlp = gates * h * i + (((gates - 1) * i + h) if self.mlp_bias else 0)
        norms = (4 if self.sandwich_norms else 2) * h if self.norm_weights else 0
        final = h if self.norm_weights else 0
        return v * h + final + self.num_hidden_layers * (norms + attn + mlp) + (0 if self.tie_word_embeddings else v * h)

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        return 2 * self.num_hidden_layers * self.kv_size * itemsize

    def rope_inv_freq(self, *, local: bool = False, context: int | None = None) -> np.ndarray:
        """Inverse RoPE frequencies, float64, shape (head_dim // 2,), scaling applied.

        ``linear`` scaling is folded in here (dividing the frequencies equals dividing
        the positions), so every backend only needs ``angle = position * inv_freq``.
        ``local``: the table of Gemma 3's sliding layers (``rope_local_theta``, unscaled).
        ``context``: the longest sequence the caller runs (long-RoPE picks its factors
        by it; default ``max_position_embeddings``). nanochat rotates by ``-angle``
        (its convention), which is the rotate-half RoPE with negated frequencies.
        """
        dim = self.head_dim
        theta = self.rope_local_theta if local and self.rope_local_theta is not None else self.rope_theta
        inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        if self.model_type == "nanochat":
            return -inv
        s = self.rope_scaling
        if s is None or local:
            return inv
        if s.rope_type == "linear":
            return inv / s.factor
        if s.rope_type == "longrope":
            long = (context or self.max_position_embeddings) > s.original_max_position_embeddings
            return inv / np.asarray(s.long_factor if long else s.short_factor, dtype=np.float64)
        old = float(s.original_max_position_embeddings)
        low_wavelen = old / s.low_freq_factor
        high_wavelen = old / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)

    def rope_attention_factor(self) -> float:
        """What long-RoPE multiplies cos and sin by (1 otherwise): transformers' default,
        ``sqrt(1 + ln(scale) / ln(original))`` with ``scale = max / original`` positions."""
        s = self.rope_scaling
        if s is None or s.rope_type != "longrope":
            return 1.0
        if s.attention_factor is not None:
            return s.attention_factor
        scale = self.max_position_embeddings / s.original_max_position_embeddings
        return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(s.original_max_position_embeddings))

    def rope_tables(self, positions: int, *, context: int | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``{"global": (cos, sin)}`` (plus ``"local"`` for Gemma 3), float64
        ``(positions, head_dim // 2)``: ``cos(p * inv_freq)`` times the attention factor.
        Every backend builds its tables from here, in float64, then casts once.
        ``context`` defaults to ``positions``."""
        context = context or positions
        p = np.arange(positions, dtype=np.float64)[:, None]
        out = {}
        kinds = ("global", "local") if self.rope_local_theta is not None else ("global",)
        for kind in kinds:
            angles = p * self.rope_inv_freq(local=kind == "local", context=context)[None, :]
            factor = self.rope_attention_factor() if kind == "global" else 1.0
            out[kind] = (np.cos(angles) * factor, np.sin(angles) * factor)
        return out

    def to_hf(self) -> dict[str, Any]:
        """An HF ``config.json`` dict (``rope_scaling`` + ``rope_theta`` spelling) that
        :meth:`from_hf` reads back to this config (nanochat: the same keys, its own type)."""
        arch = SUPPORTED_ARCHITECTURES[self.model_type][0]
        s = self.rope_scaling
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if s is None else s.model_dump(exclude_none=True),
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "relu2": "relu2"}[self.hidden_act],
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = self.mlp_bias
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
            if self.model_type in ("qwen2", "qwen3", "qwen3_moe"):
                out["use_sliding_window"] = True
        if self.layer_types is not None:
            out["layer_types"] = list(self.layer_types)
        for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.rope_local_theta is not None:
            out["rope_local_base_freq"] = self.rope_local_theta
        if s is not None and s.rope_type == "longrope":
            out["original_max_position_embeddings"] = s.original_max_position_embeddings
        if self.num_experts:
            key = "num_local_experts" if self.model_type == "mixtral" else "num_experts"
            out.update({key: self.num_experts, "num_experts_per_tok": self.num_experts_per_tok})
            if self.model_type == "qwen3_moe":
                out.update(norm_topk_prob=self.norm_topk_prob, moe_intermediate_size=self.expert_size)
        return out
