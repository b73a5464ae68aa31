"""Every supported architecture declared once: what a ``model_type`` fixes about a
model, whichever file it is read from.

Both config readers (HF ``config.json`` and GGUF metadata,
:mod:`polyengine.models.config_files`) look the architecture up here and then only read
numbers: which activation it uses, whether it has q/k norms, biases, sliding windows
(and how its layers alternate), Gemma's norm and scaling features, soft-cap defaults,
experts, long-RoPE. A feature a reader cannot find in its file comes from this table,
never from a ``model_type in (...)`` test of its own. Adding an architecture is a row
here plus the forward's blocks (``ModelConfig``'s features), not an edit in each reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Architecture", "TABLE", "by_gguf_name"]


@dataclass(frozen=True)
class Architecture:
    """What one ``model_type`` fixes. ``hf_classes``: the ``architectures`` entries of
    its config.json; ``gguf``: llama.cpp's ``general.architecture`` name (None: not
    read from GGUF)."""

    model_type: str
    hf_classes: tuple[str, ...]
    gguf: str | None = None
    activations: tuple[str, ...] = ("silu",)  # hidden_act values accepted, the default first
    tied_by_default: bool = False  # tie_word_embeddings when the file does not say
    qk_norm: bool = False  # per-head RMSNorm of q and k
    # q/k/v(/o) biases: always there (Qwen2's modeling code), as the file's flag says, or never
    attention_bias: Literal["always", "flag", "never"] = "never"
    mlp_bias_flag: bool = False  # the file's mlp_bias is honoured (else no MLP bias)
    llama_token_defaults: bool = False  # BOS 1 / EOS 2 when the file names none (LlamaConfig's)
    # sliding windows: none; every layer when a window is set; Qwen's use_sliding_window
    # from max_window_layers on; every ``global_every``-th layer global (Gemma)
    sliding: Literal["none", "all", "qwen", "alternating"] = "none"
    global_every: int = 0
    gemma: bool = False  # RMSNorm +1 offset, embedding scale, sandwich norms, query pre-attention scalar
    attn_softcap: float | None = None  # HF default of attn_logit_softcapping
    final_softcap: float | None = None  # HF default of final_logit_softcapping
    local_rope_theta: float | None = None  # the local layers' RoPE base (Gemma 3)
    experts: Literal["none", "mixtral", "qwen3_moe"] = "none"
    long_rope: bool = False  # Phi-3's long-RoPE scaling is accepted


_ROWS = (
    Architecture("llama", ("LlamaForCausalLM",), gguf="llama", attention_bias="flag", mlp_bias_flag=True,
                 llama_token_defaults=True),
    Architecture("qwen2", ("Qwen2ForCausalLM",), gguf="qwen2", attention_bias="always", sliding="qwen"),
    Architecture("qwen3", ("Qwen3ForCausalLM",), gguf="qwen3", qk_norm=True, attention_bias="flag", sliding="qwen"),
    Architecture("mistral", ("MistralForCausalLM",), sliding="all"),
    Architecture("gemma2", ("Gemma2ForCausalLM",), gguf="gemma2", activations=("gelu_tanh", "silu"), tied_by_default=True,
                 sliding="alternating", global_every=2, gemma=True, attn_softcap=50.0, final_softcap=30.0),
    Architecture("gemma3_text", ("Gemma3ForCausalLM",), gguf="gemma3", activations=("gelu_tanh", "silu"), tied_by_default=True,
                 qk_norm=True, sliding="alternating", global_every=6, gemma=True, local_rope_theta=10000.0),
    Architecture("phi3", ("Phi3ForCausalLM",), gguf="phi3", sliding="all", long_rope=True),
    Architecture("mixtral", ("MixtralForCausalLM",), sliding="all", experts="mixtral"),
    Architecture("qwen3_moe", ("Qwen3MoeForCausalLM",), gguf="qwen3moe", qk_norm=True, attention_bias="flag",
                 sliding="qwen", experts="qwen3_moe"),
    Architecture("nanochat", ("GPT",), activations=("relu2",)),
)

TABLE: dict[str, Architecture] = {a.model_type: a for a in _ROWS}


def by_gguf_name(name: str, *, experts: bool) -> Architecture | None:
    """The architecture of a GGUF file's ``general.architecture`` (llama.cpp writes
    Mixtral as ``llama`` with experts)."""
    if name == "llama" and experts:
        return TABLE["mixtral"]
    return next((a for a in _ROWS if a.gguf == name), None)
