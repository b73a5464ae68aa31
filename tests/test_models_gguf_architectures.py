"""GGUF files of every architecture llama.cpp writes, read back exactly.

Each conformance test model (conformance/models.py) is written the way llama.cpp's
converter lays it out, in float32: its architecture name (Mixtral as ``llama`` with
experts), its tensor names (Gemma's sandwich norms, q/k norms), Gemma's norms stored
as ``1 + w``, Llama-family Q/K rows permuted, Phi-3's fused ``attn_qkv`` and
``ffn_up`` (gate rows then up rows) and long-RoPE factor tensors, experts stacked
``(experts, out, in)``. Reading must give the model's own weights bit for bit (Gemma's norms to one float32
ulp of 1, through ``1 + w``) and a
config that computes the same thing (compared field by field). What llama.cpp fixes in
code (Gemma 3's local RoPE base and layer pattern, Gemma's query scale = head_dim) is
written to match. The real Gemma 3 270M file is tests/test_gemma3_real.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyengine.conformance.models import build_model
from polyengine.models import load_model
from polyengine.models.presets import SPECIAL_TOKENS
from polyengine.models.tokenizer import BYTE_TO_UNICODE

from test_models_gguf import _HF_TO_GGUF, _HF_TO_GGUF_LAYER, permute_rows

gguf = pytest.importorskip("gguf")

ARCH = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "mixtral": "llama",
        "qwen3_moe": "qwen3moe"}
GEMMA_NORMS = {"post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
QK_NORMS = {"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}


def _tensors(model) -> dict[str, np.ndarray]:
    """llama.cpp's tensors for ``model`` (see the module docstring)."""
    c, w = model.config, model.weights
    out: dict[str, np.ndarray] = {}
    for name, arr in w.items():
        if name in _HF_TO_GGUF:
            out[_HF_TO_GGUF[name]] = arr + np.float32(c.norm_offset) if name.endswith("norm.weight") else arr
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}."
        if ".experts." in rest:
            continue  # stacked below
        if rest == "mlp.gate.weight":
            out[blk + "ffn_gate_inp.weight"] = arr
            continue
        if c.model_type == "phi3" and rest in ("self_attn.q_proj.weight", "mlp.gate_proj.weight"):
            p = f"model.layers.{layer}."
            out[blk + "attn_qkv.weight" if "q_proj" in rest else blk + "ffn_up.weight"] = (
                np.concatenate([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]) if "q_proj" in rest
                else np.concatenate([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]))
            continue
        if c.model_type == "phi3" and rest in ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.up_proj.weight"):
            continue
        table = {**_HF_TO_GGUF_LAYER, **QK_NORMS, **(GEMMA_NORMS if c.sandwich_norms else {})}
        if rest.endswith("norm.weight"):
            arr = arr + np.float32(c.norm_offset)
        if c.model_type == "mixtral" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            arr = permute_rows(arr, c.num_attention_heads if "q_proj" in rest else c.num_key_value_heads)
        out[blk + table[rest]] = arr
    for layer in range(c.num_hidden_layers if c.num_experts else 0):
        p = f"model.layers.{layer}.mlp.experts."
        for proj, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            out[f"blk.{layer}.ffn_{short}_exps.weight"] = np.stack([w[f"{p}{j}.{proj}.weight"]
                                                                   for j in range(c.num_experts)])
    if c.rope_scaling is not None and c.rope_scaling.rope_type == "longrope":
        out["rope_factors_short.weight"] = np.asarray(c.rope_scaling.short_factor, np.float32)
        out["rope_factors_long.weight"] = np.asarray(c.rope_scaling.long_factor, np.float32)
    return out


def _write(path, model) -> None:
    c = model.config
    arch = ARCH[c.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    if c.sliding_window is not None:
        w.add_sliding_window(c.sliding_window)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(c, key) is not None:
            getattr(w, f"add_{key}")(getattr(c, key))
    if c.num_experts:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if c.model_type == "qwen3_moe":
            w.add_expert_feed_forward_length(c.expert_size)
            w.add_expert_weights_norm(c.norm_topk_prob)
    if c.rope_scaling is not None and c.rope_scaling.rope_type == "longrope":
        w.add_rope_scaling_orig_ctx_len(c.rope_scaling.original_max_position_embeddings)
        w.add_rope_scaling_attn_factors(c.rope_attention_factor())
    tokens = [BYTE_TO_UNICODE[b] for b in range(256)][: c.vocab_size]  # the test models have 256 ids
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges([])
    for name, arr in _tensors(model).items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# The fields a GGUF cannot carry: token ids (the test vocabulary has none), and the
# query scale llama.cpp derives from head_dim for Gemma (the test Gemma 2 sets another).
_NOT_IN_GGUF = {"bos_token_id", "eos_token_ids", "pad_token_id", "query_pre_attn_scalar"}


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"])
def test_gguf_reads_back_exactly(name, tmp_path):
    model = build_model(name)
    if name == "gemma3":  # llama.cpp's Gemma 3: every 6th layer global, local base 10^4, query scale head_dim
        c = model.config.model_copy(update={"layer_types": ("sliding_attention", "sliding_attention")})
        model = type(model)(c, model.weights, source=model.source)
    path = tmp_path / f"{name}.gguf"
    _write(path, model)
    got = load_model(path)
    assert sorted(got.weights) == sorted(model.weights)
    for key, value in model.weights.items():
        if model.config.norm_offset and key.endswith("norm.weight"):  # stored as float32(1 + w): one ulp of 1
            np.testing.assert_allclose(got.weights[key], value, rtol=0, atol=2**-23, err_msg=f"{name}: {key}")
        else:
            np.testing.assert_array_equal(got.weights[key], value, err_msg=f"{name}: {key}")
    want = model.config.model_dump(exclude=_NOT_IN_GGUF)
    have = got.config.model_dump(exclude=_NOT_IN_GGUF)
    assert have.pop("rms_norm_eps") == pytest.approx(want.pop("rms_norm_eps"), rel=1e-7)  # a float32 in GGUF
    if name == "phi3":  # the factors went through float32 tensors
        for key in ("short_factor", "long_factor"):
            np.testing.assert_allclose(have["rope_scaling"].pop(key), want["rope_scaling"].pop(key), rtol=1e-7)
        have["rope_scaling"].pop("attention_factor"), want["rope_scaling"].pop("attention_factor")
        assert got.config.rope_attention_factor() == pytest.approx(model.config.rope_attention_factor(), rel=1e-7)
    assert have == want
    if model.config.query_pre_attn_scalar is not None:
        assert got.config.query_pre_attn_scalar == model.config.head_dim
