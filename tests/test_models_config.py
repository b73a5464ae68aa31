"""ModelConfig against transformers: the same config.json must mean the same model.

Each case is written as a real checkpoint writes it (Llama 2, Llama 3.1 in both RoPE
spellings, SmolLM2, Qwen2.5, explicit head_dim, keys left to defaults) and read by
both sides: fields, RoPE inverse frequencies and every weight name and shape (from a
transformers model built on the meta device, so nothing is allocated).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from polyengine.models.config_files import config_from_hf, config_from_file, config_from_gguf
from polyengine.errors import ModelConfigError
from polyengine.models import ModelConfig, RopeScaling

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": None, "pretraining_tp": 1, "torch_dtype": "float16",
}
_LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "attention_bias": False, "mlp_bias": False,
}
_LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA31_OLD = {**_LLAMA31, "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_SCALING, "rope_type": "llama3"}}
LLAMA31_NEW = {**_LLAMA31, "rope_parameters": {**_LLAMA3_SCALING, "rope_type": "llama3", "rope_theta": 500000.0}}
LINEAR_OLD_KEY = {**LLAMA2_7B, "num_hidden_layers": 2, "rope_scaling": {"type": "linear", "factor": 2.0}}
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536, "is_llama_config": True, "max_position_embeddings": 8192, "mlp_bias": False,
    "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 49152,
}
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21, "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936,
}
HEAD_DIM = {**LLAMA2_7B, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 100, "attention_bias": True, "mlp_bias": True}
DEFAULTS = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4}

CASES = {
    "llama2-7b": LLAMA2_7B,
    "llama3.1-8b-rope_scaling": LLAMA31_OLD,
    "llama3.1-8b-rope_parameters": LLAMA31_NEW,
    "linear-old-type-key": LINEAR_OLD_KEY,
    "smollm2-135m": SMOLLM2_135M,
    "qwen2.5-0.5b": QWEN25_05B,
    "explicit-head_dim-and-biases": HEAD_DIM,
    "transformers-defaults": DEFAULTS,
}


def _hf_config(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return transformers.AutoConfig.from_pretrained(tmp_path)


def _ours(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return config_from_file(tmp_path / "config.json")


@pytest.mark.parametrize("case", list(CASES))
def test_fields_match_transformers(tmp_path, case):
    raw = CASES[case]
    ours, hf = _ours(tmp_path, raw), _hf_config(tmp_path, raw)
    assert ours.model_type == hf.model_type
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                  "bos_token_id", "pad_token_id"):
        assert getattr(ours, field) == getattr(hf, field), field
    hf_head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert ours.head_dim == hf_head_dim
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    eos = hf.eos_token_id if isinstance(hf.eos_token_id, list) else [hf.eos_token_id]
    assert list(ours.eos_token_ids) == [e for e in eos if e is not None]


@pytest.mark.parametrize("case", list(CASES))
def test_weight_names_and_shapes_match_transformers(tmp_path, case):
    hf = _hf_config(tmp_path, CASES[case])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if hf.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    assert _ours(tmp_path, CASES[case]).weight_shapes() == shapes


@pytest.mark.parametrize("case", list(CASES))
def test_rope_inverse_frequencies_match_transformers(tmp_path, case):
    hf = _hf_config(tmp_path, CASES[case])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    rotary = type(model.model.rotary_emb)(config=hf)
    assert rotary.attention_scaling == 1.0
    ours = _ours(tmp_path, CASES[case]).rope_inv_freq()
    # transformers computes in float32: agree to float32 rounding.
    np.testing.assert_allclose(ours, rotary.inv_freq.double().numpy(), rtol=2e-6, atol=0)


def test_both_rope_spellings_give_the_same_config(tmp_path):
    old = config_from_hf(LLAMA31_OLD)
    new = config_from_hf(LLAMA31_NEW)
    assert old == new
    assert old.rope_scaling == RopeScaling(rope_type="llama3", **_LLAMA3_SCALING)


def test_to_hf_round_trips_and_transformers_reads_it(tmp_path):
    for raw in (LLAMA31_NEW, QWEN25_05B, HEAD_DIM, SMOLLM2_135M):
        ours = config_from_hf(raw)
        assert config_from_hf(ours.to_hf()) == ours
        assert _ours(tmp_path, ours.to_hf()) == ours
        hf = _hf_config(tmp_path, ours.to_hf())
        assert hf.num_key_value_heads == ours.num_key_value_heads


def test_qwen2_always_has_qkv_bias_and_no_mlp_bias():
    cfg = config_from_hf({**QWEN25_05B, "attention_bias": False, "mlp_bias": True})
    assert cfg.attention_bias and not cfg.mlp_bias
    shapes = cfg.weight_shapes()
    assert "model.layers.0.self_attn.q_proj.bias" in shapes
    assert "model.layers.0.self_attn.o_proj.bias" not in shapes


def test_generation_config_adds_eos_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**SMOLLM2_135M, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5], "bos_token_id": 1}))
    assert config_from_file(tmp_path / "config.json").eos_token_ids == (2, 5)


@pytest.mark.parametrize(
    "raw, words",
    [
        ({**LLAMA2_7B, "model_type": "gemma", "architectures": ["GemmaForCausalLM"]},
         ["'gemma'", "GemmaForCausalLM", "llama", "gemma2", "qwen3_moe"]),
        ({**LLAMA2_7B, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, ["'gpt2'", "supported"]),
        ({**LLAMA2_7B, "architectures": ["LlamaForSequenceClassification"]}, ["LlamaForSequenceClassification"]),
        ({**LLAMA2_7B, "hidden_act": "gelu"}, ["gelu"]),
        ({**QWEN25_05B, "use_sliding_window": True, "layer_types": ["sliding"]}, ["layer_types"]),
        ({**LLAMA2_7B, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
          "moe_intermediate_size": 8, "mlp_only_layers": [0]}, ["mlp_only_layers"]),
        ({**LLAMA2_7B, "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "hidden_activation": "gelu"},
         ["gelu"]),
        ({**LLAMA2_7B, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, ["dynamic", "llama3"]),
        ({**LLAMA2_7B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["yarn"]),
        ({**LLAMA2_7B, "num_key_value_heads": 5}, ["multiple"]),
        ({k: v for k, v in LLAMA2_7B.items() if k != "hidden_size"}, ["hidden_size"]),
    ],
)
def test_refusals_name_the_problem(raw, words):
    with pytest.raises(ModelConfigError) as info:
        config_from_hf(raw, source="cfg.json")
    for word in words:
        assert word in str(info.value)


def test_unreadable_config_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="config.json"):
        config_from_file(tmp_path / "config.json")


# -- GGUF metadata ---------------------------------------------------------------------

GGUF_META = {
    "general.architecture": "llama",
    "llama.context_length": 8192,
    "llama.embedding_length": 576,
    "llama.feed_forward_length": 1536,
    "llama.block_count": 30,
    "llama.attention.head_count": 9,
    "llama.attention.head_count_kv": 3,
    "llama.rope.freq_base": 100000.0,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.rope.dimension_count": 64,
    "tokenizer.ggml.tokens": ["a"] * 49152,
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
    "tokenizer.ggml.eot_token_id": 7,
}


def test_from_gguf_metadata():
    cfg = config_from_gguf(GGUF_META, tie_word_embeddings=True)
    want = config_from_hf(SMOLLM2_135M)
    assert cfg.model_copy(update={"eos_token_ids": (2,)}) == want
    assert cfg.eos_token_ids == (2, 7)


def test_from_gguf_linear_scaling_and_refusals():
    lin = config_from_gguf(
        {**GGUF_META, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, tie_word_embeddings=False
    )
    assert lin.rope_scaling == RopeScaling(rope_type="linear", factor=4.0)
    with pytest.raises(ModelConfigError, match="yarn"):
        config_from_gguf({**GGUF_META, "llama.rope.scaling.type": "yarn"}, tie_word_embeddings=True)
    with pytest.raises(ModelConfigError, match="'falcon'.*llama"):
        config_from_gguf({**GGUF_META, "general.architecture": "falcon"}, tie_word_embeddings=True)
    with pytest.raises(ModelConfigError, match="llama.block_count"):
        config_from_gguf({k: v for k, v in GGUF_META.items() if k != "llama.block_count"}, tie_word_embeddings=True)
    with pytest.raises(ModelConfigError, match="partial RoPE"):
        config_from_gguf({**GGUF_META, "llama.rope.dimension_count": 32}, tie_word_embeddings=True)


def test_from_gguf_recognises_llama3_rope_freqs():
    want = config_from_hf(LLAMA31_OLD)
    base = want.model_copy(update={"rope_scaling": None}).rope_inv_freq()
    divisors = (base / want.rope_inv_freq()).astype(np.float32)  # what llama.cpp's converter stores
    meta = {
        "general.architecture": "llama", "llama.embedding_length": 4096, "llama.feed_forward_length": 14336,
        "llama.block_count": 32, "llama.attention.head_count": 32, "llama.attention.head_count_kv": 8,
        "llama.rope.freq_base": 500000.0, "llama.vocab_size": 128256, "llama.context_length": 131072,
    }
    got = config_from_gguf(meta, tie_word_embeddings=False, rope_freqs=divisors)
    assert got.rope_scaling == want.rope_scaling
    with pytest.raises(ModelConfigError, match="rope_freqs"):
        config_from_gguf(meta, tie_word_embeddings=False, rope_freqs=divisors[::-1].copy())
    assert config_from_gguf(meta, tie_word_embeddings=False, rope_freqs=np.ones(64)).rope_scaling is None
