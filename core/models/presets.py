"""Random-weight presets: tiny models for tests, real shapes for benchmarks.

``random:<preset>`` names a shape; the weights are drawn from a seed, so the same name
and seed give the same model on every machine. Each tensor gets its own generator
seeded by ``(seed, crc32(name))``: a tensor's values do not depend on which others
exist or in what order they are drawn.

Initialisation: projections, embeddings and biases ~ N(0, 0.02); RMSNorm weights
1 + N(0, 0.05), not exactly 1, so a backend that ignores the norm weight (or mixes two
up) produces different logits instead of passing by luck. Biases are random, not zero,
for the same reason.

Random presets carry a byte-level tokenizer: 256 byte tokens (id = byte value) plus
the specials below, and a small chat template, so every text round-trips and the
whole CLI works. Presets whose vocabulary is larger than the tokenizer (the benchmark
shapes) may sample ids the tokenizer cannot spell; those decode to nothing.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable

import numpy as np

from polyengine.errors import ModelConfigError
from polyengine.models.config import ModelConfig, RopeScaling
from polyengine.models.tokenizer import Tokenizer, byte_level_tokenizer

__all__ = ["PRESETS", "SPECIAL_TOKENS", "CHAT_TEMPLATE", "TEMPLATE_TAIL", "list_presets", "preset_config", "random_weights", "byte_tokenizer"]

SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|system_start|>",
    "<|system_end|>",
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
)

# nanochat's conversation format after the system and user turns (shared with its own
# template in polyengine.models.nanochat): assistant and tool turns, the generation prompt.
TEMPLATE_TAIL = (
    "{% elif message['role'] == 'assistant' %}<|assistant_start|>{{ message['content'] }}<|assistant_end|>"
    "{% elif message['role'] == 'tool' %}<|output_start|>{{ message['content'] }}<|output_end|>"
    "{% else %}{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant_start|>{% endif %}"
)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system_start|>{{ message['content'] }}<|system_end|>"
    "{% elif message['role'] == 'user' %}<|user_start|>{{ message['content'] }}<|user_end|>"
) + TEMPLATE_TAIL

_SPECIAL_ID = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}
_TINY_VOCAB = 288  # >= 256 bytes + the specials, a multiple of 32
_LLAMA3_ROPE = dict(low_freq_factor=1.0, high_freq_factor=4.0)
_GEMMA = dict(rms_norm_eps=1e-6, hidden_act="gelu_tanh", norm_offset=1.0, embed_scale=True, sandwich_norms=True,
              query_pre_attn_scalar=256.0, tie_word_embeddings=True)

# name -> (description, config fields)
PRESETS: dict[str, tuple[str, dict]] = {
    "tiny": (
        "2 layers, MHA 4 heads, tied embeddings (tests)",
        dict(vocab_size=_TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=512,
             tie_word_embeddings=True),
    ),
    "tiny-gqa": (
        "2 layers, GQA 4/2 heads, tied embeddings (tests)",
        dict(vocab_size=_TINY_VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
             rope_theta=100000.0, tie_word_embeddings=True),
    ),
    "tiny-llama3": (
        "2 layers, GQA 4/1, Llama 3 RoPE scaling, untied embeddings (tests)",
        dict(vocab_size=_TINY_VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
             rope_theta=500000.0,
             rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, original_max_position_embeddings=128, **_LLAMA3_ROPE),
             tie_word_embeddings=False),
    ),
    "tiny-qwen2": (
        "2 layers, GQA 4/2, q/k/v biases (Qwen2), untied embeddings (tests)",
        dict(model_type="qwen2", vocab_size=_TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
             rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=True),
    ),
    "tiny-deep": (
        "4 layers, GQA 8/2, head_dim 8, linear RoPE scaling (tests)",
        dict(vocab_size=_TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
             rope_scaling=RopeScaling(rope_type="linear", factor=2.0), tie_word_embeddings=False),
    ),
    "smollm2-135m": (
        "SmolLM2-135M shape: 30 layers, hidden 576, GQA 9/3, tied (benchmarks)",
        dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
             rope_theta=100000.0, tie_word_embeddings=True),
    ),
    "llama-1b": (
        "Llama-3.2-1B shape: 16 layers, hidden 2048, GQA 32/8, tied, Llama 3 RoPE (benchmarks)",
        dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
             rope_theta=500000.0,
             rope_scaling=RopeScaling(rope_type="llama3", factor=32.0, original_max_position_embeddings=8192, **_LLAMA3_ROPE),
             tie_word_embeddings=True),
    ),
    "llama-7b": (
        "Llama-2-7B shape: 32 layers, hidden 4096, MHA 32 heads, untied (benchmarks)",
        dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=4096,
             tie_word_embeddings=False),
    ),
    "llama-8b": (
        "Llama-3.1-8B shape: 32 layers, hidden 4096, GQA 32/8, untied, Llama 3 RoPE (benchmarks)",
        dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
             rope_theta=500000.0,
             rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, original_max_position_embeddings=8192, **_LLAMA3_ROPE),
             tie_word_embeddings=False),
    ),
    # Other architectures at a real model's shape (benchmarks; random weights where no
    # real file is at hand). The larger ones are refused by the memory check on small hosts.
    "qwen3-0.6b": (
        "Qwen3-0.6B shape: 28 layers, hidden 1024, GQA 16/8, head_dim 128, q/k norm, tied (benchmarks)",
        dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
             rope_theta=1000000.0, rms_norm_eps=1e-6, qk_norm=True, tie_word_embeddings=True),
    ),
    "mistral-7b": (
        "Mistral-7B-v0.1 shape: 32 layers, hidden 4096, GQA 32/8, sliding window 4096 (benchmarks)",
        dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
             sliding_window=4096),
    ),
    "gemma2-2b": (
        "Gemma-2-2B shape: 26 layers, hidden 2304, GQA 8/4, head_dim 256, local/global, soft-caps (benchmarks)",
        dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
             num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192, **_GEMMA,
             sliding_window=4096, layer_types=tuple("sliding_attention" if (i + 1) % 2 else "full_attention"
                                                    for i in range(26)),
             attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    ),
    "gemma3-270m": (
        "Gemma-3-270M shape: 18 layers, hidden 640, GQA 4/1, head_dim 256, 5 local : 1 global (benchmarks)",
        dict(model_type="gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048,
             num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
             max_position_embeddings=32768, **_GEMMA, qk_norm=True, sliding_window=512,
             layer_types=tuple("sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(18)),
             rope_theta=1000000.0, rope_local_theta=10000.0),
    ),
    "phi3-mini": (
        "Phi-3-mini-4k shape: 32 layers, hidden 3072, MHA 32 heads, sliding window 2047 (benchmarks)",
        dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=32, head_dim=96, max_position_embeddings=4096,
             sliding_window=2047),
    ),
    "mixtral-8x7b": (
        "Mixtral-8x7B shape: 32 layers, hidden 4096, 8 experts top 2 (benchmarks; 47B parameters)",
        dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
             rope_theta=1000000.0, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    ),
    "qwen3-moe-small": (
        "Qwen3-MoE layout at 0.4B: 8 layers, hidden 1024, 32 experts of 384, top 4, q/k norm (benchmarks)",
        dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
             num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
             max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, qk_norm=True, num_experts=32,
             num_experts_per_tok=4, moe_intermediate_size=384, norm_topk_prob=True),
    ),
    "nanochat-d20": (
        "nanochat d20 shape: 20 layers, hidden 1280, 10 heads, vocab 65536 (benchmarks)",
        dict(model_type="nanochat", vocab_size=65536, hidden_size=1280, intermediate_size=5120, num_hidden_layers=20,
             num_attention_heads=10, num_key_value_heads=10, head_dim=128, max_position_embeddings=2048,
             hidden_act="relu2", qk_norm=True, norm_weights=False, embed_norm=True, final_logit_softcapping=15.0,
             rms_norm_eps=float(np.finfo(np.float32).eps)),
    ),
}


def list_presets() -> dict[str, str]:
    """``{"random:<name>": description}`` for every random-weight preset."""
    out = {}
    for name, (desc, _) in PRESETS.items():
        params = preset_config(name).num_parameters()
        size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M" if params >= 1e6 else f"{params / 1e3:.0f}K"
        out[f"random:{name}"] = f"{desc}, {size} params"
    return out


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ModelConfigError(f"no random preset {name!r}; presets: {', '.join('random:' + n for n in PRESETS)}")
    fields = dict(PRESETS[name][1])
    fields.setdefault("rms_norm_eps", 1e-5)
    return ModelConfig(
        bos_token_id=_SPECIAL_ID["<|bos|>"],
        eos_token_ids=(_SPECIAL_ID["<|eos|>"], _SPECIAL_ID["<|assistant_end|>"]),
        pad_token_id=_SPECIAL_ID["<|pad|>"],
        **fields,
    )


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def random_weights(
    config: ModelConfig,
    *,
    seed: int = 0,
    dtype: str | np.dtype = "float32",
    progress: Callable[[int, int, str], None] | None = None,
) -> dict[str, np.ndarray]:
    """Deterministic random weights for ``config`` (see the module docstring)."""
    dt = np.dtype(dtype)
    shapes = config.weight_shapes()
    out: dict[str, np.ndarray] = {}
    for done, (name, shape) in enumerate(shapes.items(), 1):
        rng = np.random.default_rng((seed, zlib.crc32(name.encode())))
        # float32 draws are about twice as fast as float64, which matters for the 8B shape.
        w = rng.standard_normal(math.prod(shape), dtype=np.float32).reshape(shape)
        if _is_norm(name):  # (offset + w) near 1: Gemma's norms store w around 0
            w *= np.float32(0.05)
            w += np.float32(1.0 - config.norm_offset)
        else:
            w *= np.float32(0.02)
        out[name] = w if dt == np.float32 else w.astype(dt)
        if progress is not None:
            progress(done, len(shapes), name)
    return out


def byte_tokenizer() -> Tokenizer:
    """The random presets' tokenizer: bytes 0..255, then :data:`SPECIAL_TOKENS` from 256."""
    backend = byte_level_tokenizer(SPECIAL_TOKENS)
    return Tokenizer(
        backend,
        special_tokens={"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"},
        chat_template=CHAT_TEMPLATE,
        source="byte-level (random preset)",
    )
