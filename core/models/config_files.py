"""Reading a :class:`~polyengine.models.config.ModelConfig` from a file: an HF
``config.json`` (plus ``generation_config.json``) or GGUF metadata.

Every value goes through :class:`~polyengine.models.metadata.Fields`: counts are
integers within :mod:`polyengine.limits` (so a config claiming ten million layers is
refused before anything is sized from it), numbers are finite, flags are ``true`` or
``false`` (never the string ``"no"``), token ids are integers inside the vocabulary,
and nested settings are objects. A bad value is a :class:`ModelConfigError` naming the
file, the key, the allowed form and what was found.

Decisions (see also :mod:`polyengine.models.config`):
- Keys absent from ``config.json`` (or ``null``) take transformers' defaults (RMS eps
  1e-6; Llama BOS 1 / EOS 2), so the same file means the same model on both sides.
- ``pad_token_id`` must be an integer when present; one outside the vocabulary (old
  conversions write -1) is dropped, since nothing in polyengine pads with it.
- From GGUF, Llama 3.1-style scaling is recognised from the ``rope_freqs`` tensor;
  YaRN and other scalings are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError

from polyengine.errors import ModelConfigError
from polyengine.limits import MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_INTERMEDIATE, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB
from polyengine.models.metadata import Fields, read_json

if TYPE_CHECKING:  # pragma: no cover
    from polyengine.models.config import ModelConfig, RopeScaling

__all__ = ["config_from_hf", "config_from_file", "config_from_gguf", "validation_errors"]

_SUPPORTED_ROPE = ("default", "linear", "llama3")


def validation_errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())


def _build(values: dict[str, Any], source: str) -> "ModelConfig":
    from polyengine.models.config import ModelConfig

    try:
        return ModelConfig(**values)
    except ValidationError as exc:
        raise ModelConfigError(f"{source}: {validation_errors(exc)}") from None


def _token_ids(f: Fields, key: str, vocab: int, default: tuple[int, ...] = ()) -> list[int]:
    """One id or a list of ids, each inside the vocabulary (``default`` when absent)."""
    value = f.integers(key, None, min=0, max=vocab - 1, single=True)
    return list(default) if value is None else value


# -- HF config.json -------------------------------------------------------------------------


def config_from_hf(hf: Any, *, source: str = "config.json") -> "ModelConfig":
    """Build from an HF ``config.json`` dict; unsupported models are refused by name."""
    from polyengine.models.config import SUPPORTED_ARCHITECTURES

    if not isinstance(hf, dict):
        raise ModelConfigError(f"{source}: expected a JSON object, got {type(hf).__name__}")
    f = Fields(hf, source)
    model_type = f.string("model_type", None)
    archs = f.strings("architectures", [])
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
    missing = [k for k in required if not f.has(k)]
    if missing:
        raise ModelConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
    act = f.string("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    if f.boolean("use_sliding_window", False):
        raise ModelConfigError(f"{source}: sliding-window attention is not supported yet")
    if f.number("partial_rotary_factor", 1.0, above=0.0, max=1.0) != 1.0:
        raise ModelConfigError(f"{source}: partial_rotary_factor != 1 is not supported")
    vocab = f.integer("vocab_size", min=1, max=MAX_VOCAB)
    hidden = f.integer("hidden_size", min=1, max=MAX_HIDDEN)
    heads = f.integer("num_attention_heads", min=1, max=MAX_HEADS)
    head_dim = f.integer("head_dim", None, min=2, max=MAX_HEAD_DIM)
    if head_dim is None:
        head_dim = hidden // heads
    theta, scaling = _rope_from_hf(f)
    # LlamaConfig's own defaults apply when a key is absent (BOS 1, EOS 2); Qwen2 has none.
    llama = model_type == "llama"
    pad = f.integer("pad_token_id", None)
    values = dict(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=f.integer("intermediate_size", min=1, max=MAX_INTERMEDIATE),
        num_hidden_layers=f.integer("num_hidden_layers", min=1, max=MAX_LAYERS),
        num_attention_heads=heads,
        num_key_value_heads=f.integer("num_key_value_heads", heads, min=1, max=heads),
        head_dim=head_dim,
        max_position_embeddings=f.integer("max_position_embeddings", 2048, min=1, max=MAX_POSITIONS),
        # transformers' default for both families when the key is absent.
        rms_norm_eps=f.number("rms_norm_eps", 1e-6, above=0.0, max=1.0),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=f.boolean("tie_word_embeddings", False),
        # Qwen2's modeling code always builds q/k/v biases and never an MLP bias,
        # whatever the config says; Llama's flags put a bias on all four projections.
        attention_bias=True if not llama else f.boolean("attention_bias", False),
        mlp_bias=False if not llama else f.boolean("mlp_bias", False),
        bos_token_id=f.integer("bos_token_id", 1 if llama and vocab > 1 else None, min=0, max=vocab - 1),
        eos_token_ids=tuple(dict.fromkeys(_token_ids(f, "eos_token_id", vocab, (2,) if llama and vocab > 2 else ()))),
        pad_token_id=pad if pad is not None and 0 <= pad < vocab else None,
    )
    return _build(values, source)


def config_from_file(path: str | Path) -> "ModelConfig":
    """Read a ``config.json``; a ``generation_config.json`` beside it adds its EOS ids
    (instruct checkpoints often list their end-of-turn token only there)."""
    path = Path(path)
    config = config_from_hf(read_json(path, what="config"), source=str(path))
    gen_path = path.with_name("generation_config.json")
    if gen_path.exists():  # present but not a plain file is refused by read_json, not ignored
        gen = read_json(gen_path, what="generation config")
        if not isinstance(gen, dict):
            raise ModelConfigError(f"{gen_path}: expected a JSON object, got {type(gen).__name__}")
        extra = _token_ids(Fields(gen, str(gen_path)), "eos_token_id", config.vocab_size)
        merged = config.eos_token_ids + tuple(i for i in dict.fromkeys(extra) if i not in config.eos_token_ids)
        config = config.model_copy(update={"eos_token_ids": merged})
    return config


def _rope_from_hf(f: Fields) -> "tuple[float, RopeScaling | None]":
    """Both spellings: ``rope_scaling`` + ``rope_theta`` (Llama 3 checkpoints, transformers
    4.x) and ``rope_parameters`` (transformers 5.x ``save_pretrained``)."""
    params = f.mapping("rope_parameters", {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ModelConfigError(f"{f.source}: per-layer-type rope_parameters are not supported")
    theta = f.number("rope_theta", 10000.0, above=0.0)
    if params:
        scaling = Fields(params, f.source, prefix="rope_parameters.")
        theta = scaling.number("rope_theta", theta, above=0.0)
    else:
        scaling = Fields(f.mapping("rope_scaling", {}), f.source, prefix="rope_scaling.")
    rope_type = scaling.string("rope_type", None) or scaling.string("type", None) or "default"
    if rope_type not in _SUPPORTED_ROPE:
        raise ModelConfigError(
            f"{f.source}: RoPE scaling type {rope_type!r} is not supported; supported: {', '.join(_SUPPORTED_ROPE)}"
        )
    if rope_type == "default":
        return theta, None
    keep = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    extra = sorted(k for k in scaling.data if k not in (*keep, "rope_type", "type", "rope_theta")
                   and scaling.data[k] is not None)
    if extra:
        raise ModelConfigError(f"{f.source}: unsupported RoPE scaling fields {extra} for type {rope_type!r}")
    values: dict[str, Any] = {"factor": scaling.number("factor", above=0.0)}
    for key in ("low_freq_factor", "high_freq_factor"):
        if scaling.has(key):
            values[key] = scaling.number(key, above=0.0)
    if scaling.has("original_max_position_embeddings"):
        values["original_max_position_embeddings"] = scaling.integer(
            "original_max_position_embeddings", min=1, max=MAX_POSITIONS)
    return theta, _rope_scaling(rope_type, values, f.source)


def _rope_scaling(rope_type: str, values: dict[str, Any], source: str) -> "RopeScaling":
    from polyengine.models.config import RopeScaling

    try:
        return RopeScaling(rope_type=rope_type, **values)
    except ValidationError as exc:
        raise ModelConfigError(f"{source}: bad RoPE scaling: {validation_errors(exc)}") from None


# -- GGUF metadata --------------------------------------------------------------------------


def config_from_gguf(
    metadata: dict[str, Any],
    *,
    tie_word_embeddings: bool,
    rope_freqs: np.ndarray | None = None,
    attention_bias: bool = False,
    mlp_bias: bool = False,
    source: str = "<gguf>",
) -> "ModelConfig":
    """Build from GGUF metadata (``{key: value}``, arrays as lists); see
    :meth:`ModelConfig.from_gguf` for what only the tensor table tells."""
    from polyengine.models.config import SUPPORTED_ARCHITECTURES

    a = Fields(metadata, source)
    arch = a.string("general.architecture", None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"{source}: unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    p = f"{arch}."
    hidden = a.integer(p + "embedding_length", min=1, max=MAX_HIDDEN)
    heads = a.integer(p + "attention.head_count", min=1, max=MAX_HEADS)
    head_dim = a.integer(p + "attention.key_length", 0, min=0, max=MAX_HEAD_DIM) or hidden // heads
    if a.integer(p + "attention.value_length", head_dim, min=1, max=MAX_HEAD_DIM) != head_dim:
        raise ModelConfigError(f"{source}: key and value head sizes differ; not supported")
    rotary = a.integer(p + "rope.dimension_count", head_dim, min=1, max=MAX_HEAD_DIM)
    if rotary != head_dim:
        raise ModelConfigError(f"{source}: partial RoPE ({rotary} of {head_dim} dims) is not supported")
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = a.integer(p + "vocab_size", None, min=1, max=MAX_VOCAB)
    if vocab is None:
        if not isinstance(tokens, list) or not tokens:
            raise ModelConfigError(f"{source}: GGUF metadata gives no vocabulary size ({p}vocab_size or tokenizer.ggml.tokens)")
        vocab = len(tokens)
        if vocab > MAX_VOCAB:
            raise ModelConfigError(f"{source}: tokenizer.ggml.tokens has {vocab:,} entries; at most {MAX_VOCAB:,} are accepted")
    theta = a.number(p + "rope.freq_base", 10000.0, above=0.0)
    scaling = _rope_from_gguf(a, arch, theta, head_dim, rope_freqs)
    t = "tokenizer.ggml."
    eos = [i for k in ("eos", "eot", "eom") for i in _token_ids(a, f"{t}{k}_token_id", vocab)]
    pad = a.integer(t + "padding_token_id", None)
    values = dict(
        model_type=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=a.integer(p + "feed_forward_length", min=1, max=MAX_INTERMEDIATE),
        num_hidden_layers=a.integer(p + "block_count", min=1, max=MAX_LAYERS),
        num_attention_heads=heads,
        num_key_value_heads=a.integer(p + "attention.head_count_kv", heads, min=1, max=heads),
        head_dim=head_dim,
        max_position_embeddings=a.integer(p + "context_length", 2048, min=1, max=MAX_POSITIONS),
        rms_norm_eps=a.number(p + "attention.layer_norm_rms_epsilon", 1e-6, above=0.0, max=1.0),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=arch == "qwen2" or attention_bias,
        mlp_bias=arch == "llama" and mlp_bias,
        bos_token_id=a.integer(t + "bos_token_id", None, min=0, max=vocab - 1),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        pad_token_id=pad if pad is not None and 0 <= pad < vocab else None,
    )
    return _build(values, source)


# llama.cpp's converter writes Llama 3.1-style scaling only as a tensor of divisors. We
# recognise it by trying the published Llama 3.x low/high factors (1, 4) with original
# contexts of 8192 (every Llama 3.x release) and other powers of two; any settings that
# reproduce the divisors give the same frequencies.
_LLAMA3_CANDIDATES = tuple(
    {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": n}
    for n in (8192, *(2**k for k in range(6, 21)))
)


def _rope_from_gguf(a: Fields, arch: str, theta: float, head_dim: int, rope_freqs: np.ndarray | None) -> "RopeScaling | None":
    from polyengine.models.config import ModelConfig, RopeScaling

    source = a.source
    kind = a.string(f"{arch}.rope.scaling.type", "none")
    factor = a.number(f"{arch}.rope.scaling.factor", None, above=0.0)
    if kind == "linear" and factor and factor != 1.0:
        if rope_freqs is not None:
            raise ModelConfigError(f"{source}: both linear RoPE scaling and rope_freqs present; not supported")
        return _rope_scaling("linear", {"factor": factor}, source)
    if kind not in ("none", "linear"):
        raise ModelConfigError(
            f"{source}: RoPE scaling type {kind!r} is not supported; supported: none, linear, llama3 (rope_freqs)"
        )
    if rope_freqs is None:
        return None
    divisors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if divisors.shape != (head_dim // 2,):
        raise ModelConfigError(f"{source}: rope_freqs has shape {divisors.shape}, expected ({head_dim // 2},)")
    if not np.all(np.isfinite(divisors)) or np.any(divisors <= 0):
        raise ModelConfigError(f"{source}: rope_freqs must hold finite positive divisors")
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
