"""transformers as the test oracle: tiny random HF models and their polyengine twins."""

from __future__ import annotations

import numpy as np

from polyengine.models.config_files import config_from_hf
from polyengine.models import Model, ModelConfig

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# A few shapes: MHA + tied (Llama 2 style), GQA + llama3 rope + untied, Qwen2 biases, odd sizes.
SHAPES = {
    "llama2": dict(kind="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3": dict(kind="llama", hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                   rope_parameters=LLAMA3_ROPE),
    "qwen2": dict(kind="qwen2", hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False),
}


def hf_model(shape: str, vocab: int = 131, seed: int = 0):
    """A tiny random transformers model (float32, eval mode) of the named shape."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = dict(SHAPES[shape])
    kind = spec.pop("kind")
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, **spec)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    with torch.no_grad():  # HF inits biases to zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model.float().eval()


def polyengine_twin(hf) -> Model:
    cfg = config_from_hf(hf.config.to_dict())
    weights = {k: v.detach().float().numpy().copy() for k, v in hf.state_dict().items()}
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return Model(cfg, weights, source=f"hf-random:{hf.config.model_type}")


def hf_logits(hf, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = hf(torch.tensor([list(tokens)]))
    return out.logits[0].double().numpy()


def hf_greedy(hf, tokens, n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = hf.generate(
            torch.tensor([list(tokens)]), max_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0, min_new_tokens=n,
        )
    return out[0, len(tokens):].tolist()


def rel_l2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Relative L2 error per row."""
    a, b = np.atleast_2d(a), np.atleast_2d(b)
    return np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1), 1e-30)
