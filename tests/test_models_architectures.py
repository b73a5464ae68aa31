"""Every architecture against transformers: random-weight models written by
``save_pretrained`` load with weights equal to transformers' own, and the reference
backend's prefill logits are within float tolerance of transformers' forward.

Tiny configs of transformers' own config classes, with the features made to bite:
windows shorter than the prompt, soft-caps small enough to act, random norm weights
and biases (transformers initialises norms to 1 and biases to 0), Phi-3's long-RoPE
with a short original context (long factors past it, short ones within). Tolerance:
relative L2 per logits row <= 1e-4 (float32 torch against float64 NumPy; measured
~1e-6). Engine-level agreement on each architecture (greedy tokens of every backend
equal to the reference's) is the conformance suite's numerics layer.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from polyengine.models.config_files import config_from_hf  # noqa: E402
from polyengine.models import load_model  # noqa: E402
from polyengine.backends.reference.model import ReferenceParams, forward  # noqa: E402

TOL = 1e-4
COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.5, 2.0, 1.2], long_factor=[2.0, 3.0, 4.0, 5.0],
                original_max_position_embeddings=16)

CONFIGS = {
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, tie_word_embeddings=True)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON, sliding_window=5)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **COMMON, sliding_window=6, attn_logit_softcapping=3.0, final_logit_softcapping=5.0, query_pre_attn_scalar=24)),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **COMMON, sliding_window=5, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8)),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **{**COMMON, "num_key_value_heads": 4}, rope_parameters={**LONGROPE, "rope_theta": 10000.0},
        original_max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=False)),
}


def _hf(name: str):
    torch.manual_seed(0)
    model = CONFIGS[name]()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):  # transformers initialises them to 1 (Gemma: 0)
                p.add_(0.1 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.1)
    model.config._attn_implementation = "eager"  # soft-caps and windows exactly as written
    return model.float().eval()


def _expected(hf, config) -> dict[str, np.ndarray]:
    """transformers' state dict in polyengine's names: fused projections split, experts
    one matrix per projection per expert."""
    out = {}
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy()
        if name.endswith("qkv_proj.weight"):
            q, kv = config.q_size, config.kv_size
            pre = name[: -len("qkv_proj.weight")]
            out.update({pre + "q_proj.weight": a[:q], pre + "k_proj.weight": a[q:q + kv], pre + "v_proj.weight": a[q + kv:]})
        elif name.endswith("mlp.gate_up_proj.weight"):
            pre = name[: -len("gate_up_proj.weight")]
            i = config.intermediate_size
            out.update({pre + "gate_proj.weight": a[:i], pre + "up_proj.weight": a[i:]})
        elif name.endswith("experts.gate_up_proj"):
            pre, e = name[: -len("gate_up_proj")], config.expert_size
            for j in range(a.shape[0]):
                out[f"{pre}{j}.gate_proj.weight"], out[f"{pre}{j}.up_proj.weight"] = a[j, :e], a[j, e:]
        elif name.endswith("experts.down_proj"):
            pre = name[: -len("down_proj")]
            for j in range(a.shape[0]):
                out[f"{pre}{j}.down_proj.weight"] = a[j]
        else:
            out[name] = a
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in out.items()}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    hf = _hf(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return request.param, hf, load_model(folder)


def test_weights_equal_transformers(pair):
    name, hf, model = pair
    want = _expected(hf, model.config)
    assert sorted(model.weights) == sorted(want), name
    for key, value in want.items():
        np.testing.assert_array_equal(model.weights[key], value, err_msg=f"{name}: {key}")


def _logits(model, tokens, context):
    c = model.config
    params = ReferenceParams.from_model(model, np.dtype(np.float64), context=context)
    shape = (c.num_hidden_layers, c.num_key_value_heads, context, c.head_dim)
    return forward(params, np.array([tokens]), np.array([0]), [np.zeros(shape)], [np.zeros(shape)])[0]


def _rel(a, b):
    return (np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)).max()


def test_prefill_logits_match_transformers(pair):
    """40 tokens: past every window, and past Phi-3's original context (long factors)."""
    name, hf, model = pair
    tokens = np.random.default_rng(3).integers(1, model.config.vocab_size, 40)
    with torch.no_grad():
        want = hf(torch.tensor([tokens.tolist()])).logits[0].double().numpy()
    assert _rel(_logits(model, tokens, 64), want) <= TOL, name


def test_phi3_short_factors_within_the_original_context():
    """Phi-3 within its original context uses the short factors (as transformers does
    for a sequence that short, and polyengine for an engine of that context)."""
    hf = _hf("phi3")
    from polyengine.models import Model, ModelConfig

    config = config_from_hf(hf.config.to_dict())
    model = Model(config, _expected(hf, config))
    tokens = np.arange(3, 15)
    with torch.no_grad():
        want = hf(torch.tensor([tokens.tolist()])).logits[0].double().numpy()
    assert _rel(_logits(model, tokens, 16), want) <= TOL
    assert _rel(_logits(model, tokens, 64), want) > 1e-3  # the long factors really differ
