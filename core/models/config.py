"""The Llama-family model configuration, read from HF ``config.json`` or GGUF metadata.

Covers Llama 2 and 3 (RoPE scaling in both the ``rope_scaling`` + ``rope_theta`` and
the transformers-5 ``rope_parameters`` spellings), SmolLM2, GQA, tied or untied
embeddings, and Qwen2's attention bias. Anything else is refused by name.

The config also owns what every backend must compute the same way: the expected
weight names and shapes, and the RoPE inverse frequencies.

Reading one from a file (every value validated and bounded) is
:mod:`polyengine.models.config_files`; the sizes are bounded here too
(:mod:`polyengine.limits`), so no config, however it was made, describes a model whose
tensor list alone would fill memory.

Decisions:
- ``generation_config.json``'s EOS ids are appended to ``eos_token_ids``.
- Qwen2 always has q/k/v biases and no MLP bias, whatever its config says (as in
  transformers' modeling code).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from polyengine.limits import MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_INTERMEDIATE, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB

__all__ = ["ModelConfig", "RopeScaling", "SUPPORTED_ARCHITECTURES"]

# HF model_type -> the architectures (config.json "architectures") we accept for it.
SUPPORTED_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
}


class RopeScaling(BaseModel):
    """RoPE frequency scaling. ``linear`` divides positions by ``factor``; ``llama3``
    is Llama 3.1's piecewise scaling of the inverse frequencies."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rope_type: Literal["linear", "llama3"]
    factor: float = Field(gt=0, allow_inf_nan=False)
    low_freq_factor: float | None = Field(None, gt=0, allow_inf_nan=False)
    high_freq_factor: float | None = Field(None, gt=0, allow_inf_nan=False)
    original_max_position_embeddings: int | None = None

    @model_validator(mode="after")
    def _llama3_fields(self) -> "RopeScaling":
        if self.rope_type == "llama3":
            need = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
            missing = [k for k in need if getattr(self, k) is None]
            if missing:
                raise ValueError(f"llama3 rope scaling needs {missing}")
        return self


class ModelConfig(BaseModel):
    """A decoder-only Llama-family model's shape and numerics."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_type: Literal["llama", "qwen2"] = "llama"
    vocab_size: int = Field(ge=1, le=MAX_VOCAB)
    hidden_size: int = Field(ge=1, le=MAX_HIDDEN)
    intermediate_size: int = Field(ge=1, le=MAX_INTERMEDIATE)
    num_hidden_layers: int = Field(ge=1, le=MAX_LAYERS)
    num_attention_heads: int = Field(ge=1, le=MAX_HEADS)
    num_key_value_heads: int = Field(ge=1, le=MAX_HEADS)
    head_dim: int = Field(ge=2, le=MAX_HEAD_DIM)
    max_position_embeddings: int = Field(2048, ge=1, le=MAX_POSITIONS)
    rms_norm_eps: float = Field(1e-5, gt=0, allow_inf_nan=False)
    rope_theta: float = Field(10000.0, gt=0, allow_inf_nan=False)
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @model_validator(mode="after")
    def _shapes(self) -> "ModelConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        return self

    # -- construction -----------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
        """Build from an HF ``config.json`` dict; unsupported models and malformed values
        are refused by name (:mod:`polyengine.models.config_files`)."""
        from polyengine.models.config_files import config_from_hf

        return config_from_hf(hf, source=source)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read a ``config.json``; a ``generation_config.json`` beside it adds its EOS ids
        (instruct checkpoints often list their end-of-turn token only there)."""
        from polyengine.models.config_files import config_from_file

        return config_from_file(path)

    @classmethod
    def from_gguf(
        cls,
        metadata: dict[str, Any],
        *,
        tie_word_embeddings: bool,
        rope_freqs: np.ndarray | None = None,
        attention_bias: bool = False,
        mlp_bias: bool = False,
        source: str = "<gguf>",
    ) -> "ModelConfig":
        """Build from GGUF metadata (``{key: value}``, arrays as lists).

        What only the tensor table tells: ``tie_word_embeddings`` (the file lacks
        ``output.weight``), ``rope_freqs`` (the ``rope_freqs.weight`` tensor that llama.cpp
        writes instead of metadata for Llama 3.1-style scaling: per-frequency divisors),
        and whether a ``llama`` file has attention/MLP biases (``qwen2`` always has q/k/v ones).
        """
        from polyengine.models.config_files import config_from_gguf

        return config_from_gguf(metadata, tie_word_embeddings=tie_word_embeddings, rope_freqs=rope_freqs,
                                attention_bias=attention_bias, mlp_bias=mlp_bias, source=source)

    def to_hf(self) -> dict[str, Any]:
        """An HF ``config.json`` dict (``rope_scaling`` + ``rope_theta`` spelling)."""
        arch = SUPPORTED_ARCHITECTURES[self.model_type][0]
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
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.model_dump(exclude_none=True),
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = self.mlp_bias
        return out

    # -- what backends share ----------------------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def has_bias(self, proj: str) -> bool:
        """Whether ``self_attn.<proj>`` has a bias (Qwen2: q/k/v only)."""
        if not self.attention_bias:
            return False
        return proj != "o_proj" or self.model_type == "llama"

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the model needs, HF names and layouts (``[out, in]``)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
        proj_out = {"q_proj": (self.q_size, h), "k_proj": (self.kv_size, h), "v_proj": (self.kv_size, h), "o_proj": (h, self.q_size)}
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            for proj, shape in proj_out.items():
                shapes[p + f"self_attn.{proj}.weight"] = shape
                if self.has_bias(proj):
                    shapes[p + f"self_attn.{proj}.bias"] = (shape[0],)
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
            if self.mlp_bias:
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
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        return v * h + h + self.num_hidden_layers * (2 * h + attn + mlp) + (0 if self.tie_word_embeddings else v * h)

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        return 2 * self.num_hidden_layers * self.kv_size * itemsize

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse RoPE frequencies, float64, shape (head_dim // 2,), scaling applied.

        ``linear`` scaling is folded in here (dividing the frequencies equals dividing
        the positions), so every backend only needs ``angle = position * inv_freq``.
        """
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        s = self.rope_scaling
        if s is None:
            return inv
        if s.rope_type == "linear":
            return inv / s.factor
        old = float(s.original_max_position_embeddings)
        low_wavelen = old / s.low_freq_factor
        high_wavelen = old / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)
