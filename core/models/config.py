"""The Llama-family model configuration, read from HF ``config.json`` or GGUF metadata.

Covers Llama 2 and 3 (RoPE scaling in both the ``rope_scaling`` + ``rope_theta`` and
the transformers-5 ``rope_parameters`` spellings), SmolLM2, GQA, tied or untied
embeddings, and Qwen2's attention bias. Anything else is refused by name.

The config also owns what every backend must compute the same way: the expected
weight names and shapes, and the RoPE inverse frequencies.

Decisions:
- Keys absent from ``config.json`` take transformers' defaults (RMS eps 1e-6; Llama
  BOS 1 / EOS 2), so the same file means the same model on both sides.
- ``generation_config.json``'s EOS ids are appended to ``eos_token_ids``.
- Qwen2 always has q/k/v biases and no MLP bias, whatever its config says (as in
  transformers' modeling code).
- From GGUF, Llama 3.1-style scaling is recognised from the ``rope_freqs`` tensor;
  YaRN and other scalings are refused by name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from polyengine.errors import ModelConfigError

__all__ = ["ModelConfig", "RopeScaling", "SUPPORTED_ARCHITECTURES"]

# HF model_type -> the architectures (config.json "architectures") we accept for it.
SUPPORTED_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
}
_SUPPORTED_ROPE = ("default", "linear", "llama3")
_REQUIRED = object()


class RopeScaling(BaseModel):
    """RoPE frequency scaling. ``linear`` divides positions by ``factor``; ``llama3``
    is Llama 3.1's piecewise scaling of the inverse frequencies."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rope_type: Literal["linear", "llama3"]
    factor: float = Field(gt=0)
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
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
    vocab_size: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=2)
    max_position_embeddings: int = Field(2048, ge=1)
    rms_norm_eps: float = Field(1e-5, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
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
        """Build from an HF ``config.json`` dict; unsupported models are refused by name."""
        model_type = hf.get("model_type")
        archs = hf.get("architectures") or []
        if model_type not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(f"{k} ({'/'.join(v)})" for k, v in SUPPORTED_ARCHITECTURES.items())
            raise ModelConfigError(
                f"{source}: unsupported architecture {model_type!r}"
                f"{' (' + ', '.join(archs) + ')' if archs else ''}; supported: {supported}"
            )
        for arch in archs:
            if arch not in SUPPORTED_ARCHITECTURES[model_type]:
                raise ModelConfigError(
                    f"{source}: unsupported architecture {arch!r} for model_type {model_type!r}; "
                    f"supported: {', '.join(SUPPORTED_ARCHITECTURES[model_type])}"
                )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ModelConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        if hf.get("use_sliding_window"):
            raise ModelConfigError(f"{source}: sliding-window attention is not supported yet")
        if float(hf.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
            raise ModelConfigError(f"{source}: partial_rotary_factor != 1 is not supported")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        theta, scaling = _rope_from_hf(hf, source)
        # LlamaConfig's own defaults apply when a key is absent (BOS 1, EOS 2); Qwen2 has none.
        llama = model_type == "llama"
        eos_ids = _ids(hf.get("eos_token_id", 2 if llama else None))
        values = dict(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            # transformers' default for both families when the key is absent.
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2's modeling code always builds q/k/v biases and never an MLP bias,
            # whatever the config says; Llama's flags put a bias on all four projections.
            attention_bias=True if not llama else bool(hf.get("attention_bias", False)),
            mlp_bias=False if not llama else bool(hf.get("mlp_bias", False)),
            bos_token_id=hf.get("bos_token_id", 1 if llama else None),
            eos_token_ids=eos_ids,
            pad_token_id=hf.get("pad_token_id"),
        )
        try:
            return cls(**values)
        except ValidationError as exc:
            raise ModelConfigError(f"{source}: {_errors(exc)}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read a ``config.json``; a ``generation_config.json`` beside it adds its EOS ids
        (instruct checkpoints often list their end-of-turn token only there)."""
        path = Path(path)
        config = cls.from_hf(_read_json(path), source=str(path))
        gen_path = path.with_name("generation_config.json")
        if gen_path.is_file():
            extra = _ids(_read_json(gen_path).get("eos_token_id"))
            merged = config.eos_token_ids + tuple(i for i in extra if i not in config.eos_token_ids)
            config = config.model_copy(update={"eos_token_ids": merged})
        return config

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
        arch = metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"{source}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def key(name: str, default: Any = _REQUIRED) -> Any:
            value = metadata.get(f"{arch}.{name}", default)
            if value is _REQUIRED:
                raise ModelConfigError(f"{source}: GGUF metadata lacks {arch}.{name}")
            return value

        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", 0)) or hidden // heads
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise ModelConfigError(f"{source}: key and value head sizes differ; not supported")
        rotary = int(key("rope.dimension_count", head_dim))
        if rotary != head_dim:
            raise ModelConfigError(f"{source}: partial RoPE ({rotary} of {head_dim} dims) is not supported")
        tokens = metadata.get("tokenizer.ggml.tokens")
        vocab = key("vocab_size", None) or (len(tokens) if tokens is not None else None)
        if vocab is None:
            raise ModelConfigError(f"{source}: GGUF metadata gives no vocabulary size")
        theta = float(key("rope.freq_base", 10000.0))
        scaling = _rope_from_gguf(metadata, arch, theta, head_dim, rope_freqs, source)
        eos = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        values = dict(
            model_type=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            max_position_embeddings=int(key("context_length", 2048)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=tie_word_embeddings,
            attention_bias=arch == "qwen2" or attention_bias,
            mlp_bias=arch == "llama" and mlp_bias,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
            pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
        )
        try:
            return cls(**values)
        except ValidationError as exc:
            raise ModelConfigError(f"{source}: {_errors(exc)}") from None

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
        return sum(math.prod(s) for s in self.weight_shapes().values())

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


def _rope_from_hf(hf: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """Both spellings: ``rope_scaling`` + ``rope_theta`` (Llama 3 checkpoints, transformers
    4.x) and ``rope_parameters`` (transformers 5.x ``save_pretrained``)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise ModelConfigError(f"{source}: per-layer-type rope_parameters are not supported")
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = dict(hf.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in _SUPPORTED_ROPE:
        raise ModelConfigError(
            f"{source}: RoPE scaling type {rope_type!r} is not supported; supported: {', '.join(_SUPPORTED_ROPE)}"
        )
    if rope_type == "default":
        return float(theta), None
    keep = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    extra = sorted(k for k in scaling if k not in keep and scaling[k] is not None)
    if extra:
        raise ModelConfigError(f"{source}: unsupported RoPE scaling fields {extra} for type {rope_type!r}")
    try:
        return float(theta), RopeScaling(rope_type=rope_type, **{k: scaling[k] for k in keep if k in scaling})
    except ValidationError as exc:
        raise ModelConfigError(f"{source}: bad RoPE scaling: {_errors(exc)}") from None


# llama.cpp's converter writes Llama 3.1-style scaling only as a tensor of divisors. We
# recognise it by trying the published Llama 3.x low/high factors (1, 4) with original
# contexts of 8192 (every Llama 3.x release) and other powers of two; any settings that
# reproduce the divisors give the same frequencies.
_LLAMA3_CANDIDATES = tuple(
    {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": n}
    for n in (8192, *(2**k for k in range(6, 21)))
)


def _rope_from_gguf(
    metadata: dict[str, Any], arch: str, theta: float, head_dim: int, rope_freqs: np.ndarray | None, source: str
) -> RopeScaling | None:
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor and float(factor) != 1.0:
        if rope_freqs is not None:
            raise ModelConfigError(f"{source}: both linear RoPE scaling and rope_freqs present; not supported")
        return RopeScaling(rope_type="linear", factor=float(factor))
    if kind not in ("none", "linear"):
        raise ModelConfigError(
            f"{source}: RoPE scaling type {kind!r} is not supported; supported: none, linear, llama3 (rope_freqs)"
        )
    if rope_freqs is None:
        return None
    divisors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if divisors.shape != (head_dim // 2,):
        raise ModelConfigError(f"{source}: rope_freqs has shape {divisors.shape}, expected ({head_dim // 2},)")
    if np.all(divisors == 1.0):
        return None
    base = ModelConfig.model_construct(rope_theta=theta, head_dim=head_dim, rope_scaling=None).rope_inv_freq()
    for params in _LLAMA3_CANDIDATES:
        scaling = RopeScaling(rope_type="llama3", factor=float(divisors.max()), **params)
        trial = ModelConfig.model_construct(rope_theta=theta, head_dim=head_dim, rope_scaling=scaling)
        if np.allclose(base / trial.rope_inv_freq(), divisors, rtol=1e-5, atol=0):
            return scaling
    raise ModelConfigError(
        f"{source}: rope_freqs does not match Llama 3 scaling with any known settings "
        f"(max divisor {divisors.max():g}); custom per-frequency RoPE factors are not supported"
    )


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"{path}: cannot read config: {exc}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
