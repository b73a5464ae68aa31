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
from polyengine.models.architectures import TABLE, Architecture, by_gguf_name
from polyengine.limits import MAX_EXPERTS, MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_INTERMEDIATE, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB
from polyengine.models.metadata import Fields, read_json, shown

if TYPE_CHECKING:  # pragma: no cover
    from polyengine.models.config import ModelConfig, RopeScaling

__all__ = ["config_from_hf", "config_from_file", "config_from_gguf", "validation_errors", "GGUF_ARCHITECTURES"]

_SUPPORTED_ROPE = ("default", "linear", "llama3", "longrope")


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
    if model_type == "nanochat":
        return _build({**_nanochat_fields(f), "model_type": "nanochat"}, source)
    arch = TABLE[model_type]
    hf_names = {ours: hf for hf, ours in _ACTIVATIONS.items()}
    act = f.string("hidden_activation", None) if arch.gemma else None
    act = act or f.string("hidden_act", hf_names[arch.activations[0]])
    if _ACTIVATIONS.get(act) not in arch.activations:
        raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported for {model_type} (only "
                               f"{' or '.join(hf_names[a] for a in arch.activations)})")
    if f.number("partial_rotary_factor", 1.0, above=0.0, max=1.0) != 1.0:
        raise ModelConfigError(f"{source}: partial_rotary_factor != 1 is not supported")
    if f.boolean("use_bidirectional_attention", False):
        raise ModelConfigError(f"{source}: bidirectional attention (an encoder variant) is not supported")
    vocab = f.integer("vocab_size", min=1, max=MAX_VOCAB)
    hidden = f.integer("hidden_size", min=1, max=MAX_HIDDEN)
    heads = f.integer("num_attention_heads", min=1, max=MAX_HEADS)
    layers = f.integer("num_hidden_layers", min=1, max=MAX_LAYERS)
    head_dim = f.integer("head_dim", None, min=2, max=MAX_HEAD_DIM)
    if head_dim is None:
        head_dim = hidden // heads
    theta, scaling, local_theta = _rope_from_hf(f, arch)
    # LlamaConfig's own defaults apply when a key is absent (BOS 1, EOS 2); Qwen2 has none.
    llama = arch.llama_token_defaults
    pad = f.integer("pad_token_id", None)
    values = dict(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=f.integer("intermediate_size", min=1, max=MAX_INTERMEDIATE),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=f.integer("num_key_value_heads", heads, min=1, max=heads),
        head_dim=head_dim,
        max_position_embeddings=f.integer("max_position_embeddings", 2048, min=1, max=MAX_POSITIONS),
        # transformers' default for both families when the key is absent.
        rms_norm_eps=f.number("rms_norm_eps", 1e-6, above=0.0, max=1.0),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        tie_word_embeddings=f.boolean("tie_word_embeddings", arch.tied_by_default),
        # Qwen2's modeling code always builds q/k/v biases and never an MLP bias,
        # whatever the config says; Llama's flags put a bias on all four projections.
        attention_bias=arch.attention_bias == "always" or (
            arch.attention_bias == "flag" and f.boolean("attention_bias", False)),
        mlp_bias=arch.mlp_bias_flag and f.boolean("mlp_bias", False),
        bos_token_id=f.integer("bos_token_id", 1 if llama and vocab > 1 else None, min=0, max=vocab - 1),
        eos_token_ids=tuple(dict.fromkeys(_token_ids(f, "eos_token_id", vocab, (2,) if llama and vocab > 2 else ()))),
        pad_token_id=pad if pad is not None and 0 <= pad < vocab else None,
        hidden_act=_ACTIVATIONS[act],
        qk_norm=arch.qk_norm,
        **_window_fields(f, arch, layers),
        **_gemma_fields(f, arch),
        **_moe_fields(f, arch, layers),
    )
    return _build(values, source)


def _nanochat_fields(f: Fields) -> dict[str, Any]:
    """nanochat's GPT written as an HF-style config (what :meth:`ModelConfig.to_hf` writes
    for it): its fixed features, the sizes from the file."""
    from polyengine.models.nanochat import nanochat_features

    vocab = f.integer("vocab_size", min=1, max=MAX_VOCAB)
    heads = f.integer("num_attention_heads", min=1, max=MAX_HEADS)
    hidden = f.integer("hidden_size", min=1, max=MAX_HIDDEN)
    return dict(
        vocab_size=vocab, hidden_size=hidden, num_attention_heads=heads,
        intermediate_size=f.integer("intermediate_size", 4 * hidden, min=1, max=MAX_INTERMEDIATE),
        num_hidden_layers=f.integer("num_hidden_layers", min=1, max=MAX_LAYERS),
        num_key_value_heads=f.integer("num_key_value_heads", heads, min=1, max=heads),
        head_dim=f.integer("head_dim", hidden // heads, min=2, max=MAX_HEAD_DIM),
        max_position_embeddings=f.integer("max_position_embeddings", 2048, min=1, max=MAX_POSITIONS),
        rope_theta=f.number("rope_theta", 10000.0, above=0.0),
        bos_token_id=f.integer("bos_token_id", None, min=0, max=vocab - 1),
        eos_token_ids=tuple(dict.fromkeys(_token_ids(f, "eos_token_id", vocab))),
        **nanochat_features(),
    )


_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _window_fields(f: Fields, arch: Architecture, layers: int) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types``, as transformers reads them per family:
    Mistral, Mixtral and Phi-3 slide every layer when ``sliding_window`` is set; Qwen2/3
    only with ``use_sliding_window`` (layers from ``max_window_layers`` on); Gemma by
    ``layer_types`` (or its alternation: every 2nd layer global in Gemma 2, every
    ``sliding_window_pattern``-th in Gemma 3)."""
    window = f.integer("sliding_window", None, min=1, max=MAX_POSITIONS)
    if arch.sliding == "qwen" and not f.boolean("use_sliding_window", False):
        return {}
    if window is None or arch.sliding == "none":
        if window is not None:
            raise ModelConfigError(f"{f.source}: sliding_window is not a {arch.model_type} setting; use model_type "
                                   f"'mistral'")
        return {}
    types = f.strings("layer_types", None)
    if types is not None:
        bad = sorted(set(types) - {"full_attention", "sliding_attention"})
        if bad or len(types) != layers:
            raise ModelConfigError(f"{f.source}: layer_types must list full_attention/sliding_attention for each of "
                                   f"the {layers} layers; got {shown(types)}")
    elif arch.sliding == "alternating":
        pattern = f.integer("sliding_window_pattern", arch.global_every, min=1, max=MAX_LAYERS)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    elif arch.sliding == "qwen":
        start = f.integer("max_window_layers", layers, min=0, max=MAX_LAYERS)
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    return {"sliding_window": window, "layer_types": None if types is None else tuple(types)}


def _gemma_fields(f: Fields, arch: Architecture) -> dict[str, Any]:
    if not arch.gemma:
        return {}
    return dict(
        norm_offset=1.0, embed_scale=True, sandwich_norms=True,
        query_pre_attn_scalar=f.number("query_pre_attn_scalar", 256.0, above=0.0),
        attn_logit_softcapping=f.number("attn_logit_softcapping", arch.attn_softcap, above=0.0),
        final_logit_softcapping=f.number("final_logit_softcapping", arch.final_softcap, above=0.0),
    )


def _moe_fields(f: Fields, arch: Architecture, layers: int) -> dict[str, Any]:
    if arch.experts == "none":
        return {}
    experts = f.integer("num_local_experts", None, min=1, max=MAX_EXPERTS)
    if experts is None:
        experts = f.integer("num_experts", min=1, max=MAX_EXPERTS)
    out = dict(num_experts=experts, num_experts_per_tok=f.integer("num_experts_per_tok", 2, min=1, max=experts))
    if arch.experts == "mixtral":
        return {**out, "norm_topk_prob": True}  # Mixtral always renormalises the top-k weights
    if f.integer("decoder_sparse_step", 1, min=1, max=MAX_LAYERS) != 1 or f.integers("mlp_only_layers", [], min=0):
        raise ModelConfigError(f"{f.source}: Qwen3-MoE with dense layers (decoder_sparse_step != 1 or "
                               f"mlp_only_layers) is not supported")
    return {**out, "norm_topk_prob": f.boolean("norm_topk_prob", False),
            "moe_intermediate_size": f.integer("moe_intermediate_size", min=1, max=MAX_INTERMEDIATE)}


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


def _rope_from_hf(f: Fields, arch: Architecture) -> "tuple[float, RopeScaling | None, float | None]":
    """Both spellings: ``rope_scaling`` + ``rope_theta`` (Llama 3 checkpoints, transformers
    4.x) and ``rope_parameters`` (transformers 5.x ``save_pretrained``), whose Gemma 3
    form is one entry per layer type. Returns the theta, the scaling and the local
    layers' theta (Gemma 3's ``rope_local_base_freq``)."""
    params = f.mapping("rope_parameters", {})
    local = None
    if arch.local_rope_theta is not None:
        local = f.number("rope_local_base_freq", arch.local_rope_theta, above=0.0)
    if params and all(isinstance(v, dict) for v in params.values()):
        if local is None or set(params) - {"full_attention", "sliding_attention"}:
            raise ModelConfigError(f"{f.source}: per-layer-type rope_parameters are only supported for Gemma 3")
        sliding = Fields(params.get("sliding_attention", {}), f.source, prefix="rope_parameters.sliding_attention.")
        if (sliding.string("rope_type", None) or "default") != "default":
            raise ModelConfigError(f"{f.source}: RoPE scaling of sliding layers is not supported")
        local = sliding.number("rope_theta", local, above=0.0)
        f = Fields({**f.data, "rope_parameters": params.get("full_attention", {})}, f.source)
        params = f.mapping("rope_parameters", {})
    theta = f.number("rope_theta", 10000.0, above=0.0)
    if params:
        scaling = Fields(params, f.source, prefix="rope_parameters.")
        theta = scaling.number("rope_theta", theta, above=0.0)
    else:
        scaling = Fields(f.mapping("rope_scaling", {}), f.source, prefix="rope_scaling.")
    rope_type = scaling.string("rope_type", None) or scaling.string("type", None) or "default"
    if rope_type == "su" and arch.long_rope:
        rope_type = "longrope"  # Phi-3's early configs name long-RoPE "su"
    if rope_type not in _SUPPORTED_ROPE or (rope_type == "longrope" and not arch.long_rope):
        raise ModelConfigError(
            f"{f.source}: RoPE scaling type {rope_type!r} is not supported for {arch.model_type}; supported: "
            f"{', '.join(_SUPPORTED_ROPE[:3])}, and longrope for phi3"
        )
    if rope_type == "default":
        return theta, None, local
    keep = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "short_factor",
            "long_factor", "attention_factor")
    extra = sorted(k for k in scaling.data if k not in (*keep, "rope_type", "type", "rope_theta", "partial_rotary_factor")
                   and scaling.data[k] is not None)
    if extra:
        raise ModelConfigError(f"{f.source}: unsupported RoPE scaling fields {extra} for type {rope_type!r}")
    values: dict[str, Any] = {}
    if rope_type != "longrope" or scaling.has("factor"):
        values["factor"] = scaling.number("factor", above=0.0)
    for key in ("low_freq_factor", "high_freq_factor", "attention_factor"):
        if scaling.has(key):
            values[key] = scaling.number(key, above=0.0)
    for key in ("short_factor", "long_factor"):
        if scaling.has(key):
            values[key] = tuple(scaling.numbers(key))
    original = scaling.integer("original_max_position_embeddings", None, min=1, max=MAX_POSITIONS)
    if original is None and rope_type == "longrope":  # Phi-3 keeps it at the top level
        original = f.integer("original_max_position_embeddings", None, min=1, max=MAX_POSITIONS)
    if original is not None:
        values["original_max_position_embeddings"] = original
    return theta, _rope_scaling(rope_type, values, f.source), local


def _rope_scaling(rope_type: str, values: dict[str, Any], source: str) -> "RopeScaling":
    from polyengine.models.config import RopeScaling

    try:
        return RopeScaling(rope_type=rope_type, **values)
    except ValidationError as exc:
        raise ModelConfigError(f"{source}: bad RoPE scaling: {validation_errors(exc)}") from None


# -- GGUF metadata --------------------------------------------------------------------------


# llama.cpp's architecture names -> our model_type (``llama`` files with experts are Mixtral).
GGUF_ARCHITECTURES = {a.gguf: a.model_type for a in TABLE.values() if a.gguf}


def config_from_gguf(
    metadata: dict[str, Any],
    *,
    tie_word_embeddings: bool,
    rope_freqs: np.ndarray | None = None,
    attention_bias: bool = False,
    mlp_bias: bool = False,
    source: str = "<gguf>",
    rope_factors: tuple[np.ndarray, np.ndarray] | None = None,
) -> "ModelConfig":
    """Build from GGUF metadata (``{key: value}``, arrays as lists); see
    :meth:`ModelConfig.from_gguf` for what only the tensor table tells.

    What llama.cpp fixes in code rather than in the file is fixed the same way here:
    Gemma 3's local layers use RoPE base 10000 and every 6th layer is global; Gemma's
    query scale is ``head_dim ** -0.5``."""
    a = Fields(metadata, source)
    arch = a.string("general.architecture", None)
    if arch not in GGUF_ARCHITECTURES:
        raise ModelConfigError(
            f"{source}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
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
    layers = a.integer(p + "block_count", min=1, max=MAX_LAYERS)
    experts = a.integer(p + "expert_count", 0, min=0, max=MAX_EXPERTS)
    features_of = by_gguf_name(arch, experts=bool(experts))
    model_type = features_of.model_type
    theta = a.number(p + "rope.freq_base", 10000.0, above=0.0)
    max_positions = a.integer(p + "context_length", 2048, min=1, max=MAX_POSITIONS)
    if features_of.long_rope and rope_factors is not None:
        scaling = _longrope_from_gguf(a, arch, head_dim, rope_factors, max_positions)
    else:
        scaling = _rope_from_gguf(a, arch, theta, head_dim, rope_freqs)
    t = "tokenizer.ggml."
    eos = [i for k in ("eos", "eot", "eom") for i in _token_ids(a, f"{t}{k}_token_id", vocab)]
    pad = a.integer(t + "padding_token_id", None)
    features = _gguf_features(a, p, features_of, head_dim, layers, experts)
    values = dict(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=a.integer(p + "feed_forward_length", min=1, max=MAX_INTERMEDIATE),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=a.integer(p + "attention.head_count_kv", heads, min=1, max=heads),
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rms_norm_eps=a.number(p + "attention.layer_norm_rms_epsilon", 1e-6, above=0.0, max=1.0),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=features_of.attention_bias == "always" or (features_of.attention_bias == "flag" and attention_bias),
        mlp_bias=features_of.mlp_bias_flag and mlp_bias,
        bos_token_id=a.integer(t + "bos_token_id", None, min=0, max=vocab - 1),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        pad_token_id=pad if pad is not None and 0 <= pad < vocab else None,
        **features,
    )
    return _build(values, source)


def _gguf_features(a: Fields, p: str, arch: Architecture, head_dim: int, layers: int, experts: int) -> dict[str, Any]:
    """What the architecture fixes, with the numbers a GGUF file gives for it. As in
    llama.cpp's code: Gemma's query scale is ``head_dim ** -0.5`` and its soft-caps are
    only what the file says."""
    window = a.integer(p + "attention.sliding_window", None, min=1, max=MAX_POSITIONS)
    features: dict[str, Any] = {"hidden_act": arch.activations[0], "qk_norm": arch.qk_norm}
    if window is not None and arch.sliding in ("all", "alternating"):
        every = arch.global_every
        types = None if not every else tuple("sliding_attention" if (i + 1) % every else "full_attention"
                                             for i in range(layers))
        features.update(sliding_window=window, layer_types=types)
    if arch.gemma:
        features.update(
            norm_offset=1.0, embed_scale=True, sandwich_norms=True, query_pre_attn_scalar=float(head_dim),
            attn_logit_softcapping=a.number(p + "attn_logit_softcapping", None, above=0.0),
            final_logit_softcapping=a.number(p + "final_logit_softcapping", None, above=0.0),
        )
    if arch.local_rope_theta is not None:
        features["rope_local_theta"] = arch.local_rope_theta
    if experts:
        features.update(num_experts=experts,
                        num_experts_per_tok=a.integer(p + "expert_used_count", min=1, max=experts),
                        norm_topk_prob=arch.experts == "mixtral" or a.boolean(p + "expert_weights_norm", False))
        if arch.experts == "qwen3_moe":
            features["moe_intermediate_size"] = a.integer(p + "expert_feed_forward_length", min=1, max=MAX_INTERMEDIATE)
    return features


def _longrope_from_gguf(a: Fields, arch: str, head_dim: int, factors: tuple[np.ndarray, np.ndarray],
                        max_positions: int) -> "RopeScaling":
    """Phi-3's long-RoPE: the factors are tensors, the original context and the attention
    factor metadata."""
    short, long = (np.asarray(x, dtype=np.float64).reshape(-1) for x in factors)
    for name, arr in (("rope_factors_short", short), ("rope_factors_long", long)):
        if arr.shape != (head_dim // 2,):
            raise ModelConfigError(f"{a.source}: {name} has shape {arr.shape}, expected ({head_dim // 2},)")
    values: dict[str, Any] = {
        "short_factor": tuple(float(x) for x in short), "long_factor": tuple(float(x) for x in long),
        "original_max_position_embeddings": a.integer(f"{arch}.rope.scaling.original_context_length", min=1,
                                                      max=MAX_POSITIONS),
    }
    attn = a.number(f"{arch}.rope.scaling.attn_factor", None, above=0.0)
    if attn is not None:
        values["attention_factor"] = attn
    return _rope_scaling("longrope", values, a.source)


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
