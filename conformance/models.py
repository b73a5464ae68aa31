"""The test models: tiny models of every supported architecture, made from a seed, no
downloads.

Few on purpose, since a compiled backend pays for every new shape; one per
architecture (``ARCHITECTURE_MODELS``), two layers each, so the numerics layer checks a
backend on every architecture it declares:

``mha_tied``     Llama 2 style: multi-head attention (4 heads, 4 KV heads), tied embeddings.
``gqa_llama3``   grouped-query attention (4 heads, 2 KV heads), untied, Llama 3.1 RoPE
                 scaling with ``original_max_position_embeddings=16`` so the scaling
                 changes short contexts too.
``odd_qwen2``    odd sizes (vocab 131, hidden 48, 6 heads of 8, 2 KV heads) and Qwen2's
                 q/k/v biases.
``qwen3``        per-head q/k RMSNorm.
``mistral``      sliding-window attention, window 5 (shorter than most test prompts).
``gemma2``       sliding (window 6) and global layers alternating, attention and final
                 soft-caps small enough to bite (3 and 5), query scale 24^-1/2,
                 offset norms, sandwich norms, GeGLU, scaled embeddings.
``gemma3``       Gemma 3: sliding then global layer (window 5), q/k norm, local RoPE
                 base 10^4 beside global 10^6.
``phi3``         long-RoPE with ``original_max_position_embeddings=32`` (long factors
                 at the suite's cache lengths) and an attention factor.
``mixtral``      4 experts, top 2, renormalised.
``qwen3_moe``    4 experts of width 32, top 2, not renormalised, q/k norm.
``nanochat``     nanochat's GPT: squared ReLU, parameter-free norms, embedding norm,
                 QK norm, logit soft-cap 15, its rotary convention.

One quantized model (``QUANTIZED_MODELS``), run by the layers that judge numerics
(numerics and differential) and no others, since its architecture is llama's and
the protocol is what the other layers check:

``quant_mixed``  Llama shape with every row a multiple of 256 (hidden 256, MLP 512,
                 GQA 4/2 heads of 64, untied), each matrix in a GGUF block format as
                 in-memory records (``quantized_records``), the eight formats rotated
                 over the matrices so each appears: layer ``i``'s q, k, v, o, gate, up,
                 down in ``BLOCK_FORMATS[(j + i) % 8]`` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
                 Q4_K, Q5_K, Q6_K), the embedding Q4_K, the LM head Q6_K; the input
                 norms BF16, the post-attention norms F16, the final norm F32. A
                 backend reads the records through ``Model.weight(name, its
                 weight_formats)``, which converts the formats it does not declare one
                 tensor at a time; the reference dequantizes the same blocks exactly
                 (float64), so the model is judged with the normal float tolerances.
                 The weights' scales follow the fan-in (0.8 / sqrt(fan-in) for
                 projections, 1.6 / sqrt(hidden) for embedding and LM head: the
                 tables' 0.1 and 0.2 at width 64), so its logits are as spread as the
                 others'.

Weights are float32 normals. The scales are chosen so the logits are neither flat nor
one-hot: projections std 0.1, embeddings and LM head std 0.2 give logits of std ~1.6
and a top-1 probability of ~0.1-0.2, so sampled streams explore while greedy has few
near-ties. Norm weights are ``1 + 0.1 * N(0, 1)`` so they matter.

Each model has two EOS ids, picked, not fixed: each is the greedy first token of one of
a few fixed candidate prompts (a clear winner), so the ``min_tokens``/``ignore_eos``
checks have prompts whose greedy continuation really is an EOS, and a backend that
masks only the first EOS id is seen.

Exact ties: the LM-head rows of :data:`TIE_IDS` are zero (for the tied model, their
embeddings too), so those two tokens' logits are exactly 0 in any precision and any
kernel; with a logit_bias that lifts both to the top, the tie rules (lowest id first)
are exercised exactly, not up to rounding.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from polyengine.models import Model, ModelConfig, RopeScaling
from polyengine.models.blocks import BLOCK_FORMATS

__all__ = ["MODEL_NAMES", "QUANTIZED_MODELS", "ALL_MODEL_NAMES", "DEFAULT_MODEL", "MODEL_SEED", "TIE_IDS",
           "ARCHITECTURE_MODELS", "build_model", "eos_prompt", "architecture_of", "mixed_formats"]

MODEL_SEED = 20240611
DEFAULT_MODEL = "mha_tied"
# Candidate prompts for the EOS trick; the first whose greedy token wins by a clear margin.
_EOS_CANDIDATES = (
    [3, 9, 4, 7], [5, 11, 13, 2, 8], [17, 6, 1, 12], [10, 20, 30], [8, 8, 19, 4, 4], [21, 2, 14], [6, 6, 6, 9, 1],
    [12, 30, 5, 5], [2, 19, 27], [15, 3, 22, 9],
)
# Two ids below every test vocabulary whose logits are exactly 0 (zero LM-head rows).
TIE_IDS = (37, 38)
_EOS_MARGIN = 0.5  # log-prob gap of the greedy EOS over the runner-up, in every dtype

_SHAPES: dict[str, dict] = {
    "mha_tied": dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        tie_word_embeddings=True,
    ),
    "gqa_llama3": dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=112,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling=RopeScaling(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
    "odd_qwen2": dict(
        model_type="qwen2", vocab_size=131, hidden_size=48, intermediate_size=80,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
        tie_word_embeddings=False, attention_bias=True, rms_norm_eps=1e-6,
    ),
}
_rng = np.random.default_rng(31)
_GQA = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
_SHAPES.update({
    "qwen3": dict(model_type="qwen3", **_GQA, tie_word_embeddings=True, qk_norm=True, rope_theta=1000000.0,
                  rms_norm_eps=1e-6),
    "mistral": dict(model_type="mistral", **_GQA, tie_word_embeddings=False, sliding_window=5),
    "gemma2": dict(model_type="gemma2", **_GQA, tie_word_embeddings=True, hidden_act="gelu_tanh", norm_offset=1.0,
                   embed_scale=True, sandwich_norms=True, sliding_window=6,
                   layer_types=("sliding_attention", "full_attention"), attn_logit_softcapping=3.0,
                   final_logit_softcapping=5.0, query_pre_attn_scalar=24.0, rms_norm_eps=1e-6),
    "gemma3": dict(model_type="gemma3_text", **_GQA, tie_word_embeddings=True, hidden_act="gelu_tanh",
                   norm_offset=1.0, embed_scale=True, sandwich_norms=True, qk_norm=True, sliding_window=5,
                   layer_types=("sliding_attention", "full_attention"), query_pre_attn_scalar=16.0,
                   rope_theta=1000000.0, rope_local_theta=10000.0, rms_norm_eps=1e-6),
    "phi3": dict(model_type="phi3", **_GQA, tie_word_embeddings=False,
                 rope_scaling=RopeScaling(rope_type="longrope", original_max_position_embeddings=32,
                                          short_factor=tuple(1.0 + _rng.random(8)),
                                          long_factor=tuple(1.0 + 3.0 * _rng.random(8)))),
    "mixtral": dict(model_type="mixtral", **{**_GQA, "intermediate_size": 48}, tie_word_embeddings=False,
                    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    "qwen3_moe": dict(model_type="qwen3_moe", **_GQA, tie_word_embeddings=False, qk_norm=True, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=False, moe_intermediate_size=32, rms_norm_eps=1e-6),
    "nanochat": dict(model_type="nanochat", **{**_GQA, "intermediate_size": 256}, hidden_act="relu2", qk_norm=True,
                     norm_weights=False, embed_norm=True, final_logit_softcapping=15.0,
                     rms_norm_eps=float(np.finfo(np.float32).eps)),
})
MODEL_NAMES: tuple[str, ...] = tuple(_SHAPES)
# Quantized models: the numerics and differential layers run them (models of a shape above,
# stored in block formats; the protocol and the sampler are the float models' to check).
_QUANTIZED_SHAPES: dict[str, dict] = {
    "quant_mixed": dict(model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                        tie_word_embeddings=False),
}
QUANTIZED_MODELS: tuple[str, ...] = tuple(_QUANTIZED_SHAPES)
ALL_MODEL_NAMES: tuple[str, ...] = MODEL_NAMES + QUANTIZED_MODELS
# One test model per architecture (the suite checks a backend on each it declares).
ARCHITECTURE_MODELS: dict[str, str] = {"llama": "mha_tied", "qwen2": "odd_qwen2", "qwen3": "qwen3",
                                       "mistral": "mistral", "gemma2": "gemma2", "gemma3_text": "gemma3",
                                       "phi3": "phi3", "mixtral": "mixtral", "qwen3_moe": "qwen3_moe",
                                       "nanochat": "nanochat"}


def architecture_of(name: str) -> str:
    """The model_type of test model ``name`` (without building it)."""
    return {**_SHAPES, **_QUANTIZED_SHAPES}[name].get("model_type", "llama")


_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")


def mixed_formats(config: ModelConfig) -> dict[str, str]:
    """``quant_mixed``'s storage: weight name -> format (see the module docstring)."""
    out = {"model.embed_tokens.weight": "Q4_K", "lm_head.weight": "Q6_K", "model.norm.weight": "F32"}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = "BF16"
        out[p + "post_attention_layernorm.weight"] = "F16"
        for j, proj in enumerate(_PROJECTIONS):
            out[f"{p}{proj}.weight"] = BLOCK_FORMATS[(j + i) % len(BLOCK_FORMATS)]
    return out


def _fan_in_scaled(weights: dict[str, np.ndarray], config: ModelConfig) -> None:
    """Rescale the tables' width-64 weights to this model's widths (projections by
    fan-in, embedding and LM head by hidden size), in place."""
    for name, w in weights.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            w *= np.float32(np.sqrt(64 / config.hidden_size))
        elif name.endswith("_proj.weight"):
            w *= np.float32(np.sqrt(64 / w.shape[1]))


def _weights(config: ModelConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for name, shape in config.weight_shapes().items():
        if name.endswith("norm.weight"):  # (offset + w) near 1, not exactly
            w = 1.0 - config.norm_offset + 0.1 * rng.standard_normal(shape)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = 0.2 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)
        else:
            w = 0.1 * rng.standard_normal(shape)
        out[name] = w.astype(np.float32)
    return out


def _pick_eos(config: ModelConfig, weights) -> list[tuple[list[int], int]]:
    """Two candidate prompts whose greedy tokens win clearly and differ, with those tokens."""
    # Deferred import: the pytest plugin imports nothing of the suite until a test runs.
    from polyengine.conformance.oracle import reference_logits
    from polyengine.sampling import raw_logprobs

    model = Model(config, weights, source="conformance:eos-probe", is_random=True)
    found: list[tuple[list[int], int]] = []
    for prompt in _EOS_CANDIDATES:
        logits = reference_logits(model, prompt)
        lp = np.sort(raw_logprobs(logits))
        token = int(np.argmax(logits))
        if lp[-1] - lp[-2] >= _EOS_MARGIN and token not in TIE_IDS and token not in [t for _, t in found]:
            found.append((list(prompt), token))
            if len(found) == 2:
                return found
    raise RuntimeError(f"fewer than two EOS candidate prompts have distinct clear greedy winners for {config}")  # suite bug


@lru_cache(maxsize=None)
def build_model(name: str, seed: int = MODEL_SEED) -> Model:
    """The named test model, deterministic in ``seed`` (cached: models are read-only).

    ``model.meta["eos_prompt_0"]``/``["eos_prompt_1"]`` hold the prompts (comma-separated
    ids) whose greedy first tokens are the model's two EOS ids.
    """
    shapes = {**_SHAPES, **_QUANTIZED_SHAPES}
    if name not in shapes:
        raise KeyError(f"unknown test model {name!r}; known: {', '.join(ALL_MODEL_NAMES)}")
    rng = np.random.default_rng([seed, ALL_MODEL_NAMES.index(name)])
    config = ModelConfig(max_position_embeddings=256, bos_token_id=1, **shapes[name])
    weights = _weights(config, rng)
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    weights[head][list(TIE_IDS)] = 0.0  # zero rows stay exactly zero in every block format
    if name in _QUANTIZED_SHAPES:
        from polyengine.models.quant_presets import quantized_records

        _fan_in_scaled(weights, config)
        weights = quantized_records(weights, mixed_formats(config))
    eos = _pick_eos(config, weights)
    config = config.model_copy(update={"eos_token_ids": tuple(t for _, t in eos)})
    model = Model(config, weights, source=f"conformance:{name}:seed{seed}", is_random=True)
    for i, (prompt, _) in enumerate(eos):
        model.meta[f"eos_prompt_{i}"] = ",".join(map(str, prompt))
    return model


def eos_prompt(model: Model, which: int = 0) -> list[int]:
    """The prompt whose greedy first token is the model's EOS id number ``which``."""
    return [int(t) for t in model.meta[f"eos_prompt_{which}"].split(",")]
