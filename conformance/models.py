"""The test models: a few tiny Llama-family shapes made from a seed, no downloads.

Few on purpose, since a compiled backend pays for every new shape:

``mha_tied``     Llama 2 style: multi-head attention (4 heads, 4 KV heads), tied embeddings.
``gqa_llama3``   grouped-query attention (4 heads, 2 KV heads), untied, Llama 3.1 RoPE
                 scaling with ``original_max_position_embeddings=16`` so the scaling
                 changes short contexts too.
``odd_qwen2``    odd sizes (vocab 131, hidden 48, 6 heads of 8, 2 KV heads) and Qwen2's
                 q/k/v biases.

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

__all__ = ["MODEL_NAMES", "DEFAULT_MODEL", "MODEL_SEED", "TIE_IDS", "build_model", "eos_prompt"]

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
MODEL_NAMES: tuple[str, ...] = tuple(_SHAPES)


def _weights(config: ModelConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for name, shape in config.weight_shapes().items():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = 0.2 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)
        else:
            w = 0.1 * rng.standard_normal(shape)
        out[name] = w.astype(np.float32)
    return out


def _pick_eos(config: ModelConfig, weights: dict[str, np.ndarray]) -> list[tuple[list[int], int]]:
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
    if name not in _SHAPES:
        raise KeyError(f"unknown test model {name!r}; known: {', '.join(MODEL_NAMES)}")
    rng = np.random.default_rng([seed, MODEL_NAMES.index(name)])
    config = ModelConfig(max_position_embeddings=256, bos_token_id=1, **_SHAPES[name])
    weights = _weights(config, rng)
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    weights[head][list(TIE_IDS)] = 0.0
    eos = _pick_eos(config, weights)
    config = config.model_copy(update={"eos_token_ids": tuple(t for _, t in eos)})
    model = Model(config, weights, source=f"conformance:{name}:seed{seed}", is_random=True)
    for i, (prompt, _) in enumerate(eos):
        model.meta[f"eos_prompt_{i}"] = ",".join(map(str, prompt))
    return model


def eos_prompt(model: Model, which: int = 0) -> list[int]:
    """The prompt whose greedy first token is the model's EOS id number ``which``."""
    return [int(t) for t in model.meta[f"eos_prompt_{which}"].split(",")]
