"""Every limit polyengine enforces on untrusted input, in one place.

Model files, chat templates, prompts and plugins come from people the user may not
trust (see ``docs/security.md``). Each size, count and time taken from them is checked
against one of these limits *before* it is used to allocate, loop or wait, so a small
hostile input cannot take all memory or hours of CPU. The values are generous for
every real model seen so far (the largest real value of each is noted) and far below
what would hurt a machine.

The modules that enforce them import them from here; ``docs/security.md`` lists them
with their values.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "MAX_JSON_BYTES", "MAX_TOKENIZER_JSON_BYTES", "MAX_JSON_DEPTH", "MAX_SCHEMA_DEPTH", "json_depth",
    "MAX_SOFTCAP", "MIN_ROPE_FACTOR", "MAX_ROPE_FACTOR", "MAX_ROPE_ATTENTION_FACTOR", "MIN_ROPE_THETA",
    "MIN_QUERY_PRE_ATTN_SCALAR",
    "MAX_LAYERS", "MAX_HIDDEN", "MAX_INTERMEDIATE", "MAX_HEADS", "MAX_HEAD_DIM", "MAX_VOCAB", "MAX_POSITIONS", "MAX_EXPERTS",
    "MAX_GGUF_TENSORS", "MAX_GGUF_METADATA", "MAX_GGUF_KEY_BYTES", "MAX_GGUF_STRING_BYTES",
    "MAX_GGUF_ARRAY", "MAX_GGUF_ARRAY_TOTAL", "MAX_GGUF_NESTING", "MAX_GGUF_ALIGNMENT", "MAX_TENSOR_DIMS",
    "MAX_SAFETENSORS_HEADER", "MAX_TOKEN_CHARS", "MAX_SENTENCEPIECE_SPLITS",
    "MAX_TEMPLATE_BYTES", "MAX_RENDERED_CHARS", "MAX_TEMPLATE_VALUE_ITEMS", "RENDER_SECONDS",
    "MAX_TEXT_CHARS", "PROMPT_CHARS_PER_TOKEN", "MAX_CHAT_LINE_CHARS",
    "MAX_STOP_STRINGS", "MAX_STOP_CHARS", "MAX_STOP_TOKEN_IDS", "MAX_LOGIT_BIAS",
    "MAX_PREFIX_BYTES", "DEFAULT_CONTEXT_LENGTH",
    "PLUGIN_TIMEOUT_ENV", "DEFAULT_PLUGIN_SECONDS", "MAX_PLUGIN_OUTPUT_CHARS", "plugin_seconds",
]

# -- JSON metadata (config.json, generation_config.json, tokenizer_config.json,
#    special_tokens_map.json, model.safetensors.index.json) -------------------------------
MAX_JSON_BYTES = 16 * 1024**2  # real ones: under 1 MiB (a tokenizer_config with a big template)
MAX_TOKENIZER_JSON_BYTES = 128 * 1024**2  # tokenizer.json; largest real: ~33 MB (Gemma 3)
MAX_JSON_DEPTH = 32  # real configs nest 3-5 levels

# JSON a request carries (a response_format or tool schema, a grammar's %json): checked
# iteratively before anything walks it recursively (json.dumps, pydantic, llguidance).
# Real schemas nest well under 20 containers (each schema level is two: properties, name).
MAX_SCHEMA_DEPTH = 64

# -- model shape (HF config.json and GGUF metadata alike) -------------------------------------
MAX_LAYERS = 1024  # largest real: 126 (Llama 3.1 405B)
MAX_HIDDEN = 65536  # largest real: 16384-25600
MAX_INTERMEDIATE = 262144  # largest real: 53248
MAX_HEADS = 1024  # query heads; largest real: 128
MAX_HEAD_DIM = 1024  # largest real: 256
MAX_VOCAB = 4_194_304  # 2**22; largest real: 262144 (Gemma 3)
MAX_POSITIONS = 16_777_216  # 2**24; largest real: 10485760 (Llama 4 Scout)
MAX_EXPERTS = 1024  # experts per MoE layer; largest real: 384 (Kimi K2)

# -- numerics a config sets: bounded where a larger (or smaller) value overflows float32,
#    or float16, in what is computed from it (NaN logits, then a request sampling garbage)
MAX_SOFTCAP = 1e4  # attn/final_logit_softcapping: cap * tanh(x / cap) is NaN once cap is inf; real: 30, 50
MIN_ROPE_FACTOR, MAX_ROPE_FACTOR = 1e-3, 1e4  # RoPE scaling factors divide frequencies; real: 1-64
MAX_ROPE_ATTENTION_FACTOR = 100.0  # long-RoPE scales q.k by its square; real: ~1.2 (Phi-3)
MIN_ROPE_THETA = 1.0  # below 1, theta ** (-2i/d) grows without bound; real: 1e4-5e8
MIN_QUERY_PRE_ATTN_SCALAR = 1.0  # the attention scale is its ** -0.5; real: 144, 256 (Gemma)

# -- GGUF header ------------------------------------------------------------------------------
MAX_GGUF_TENSORS = 65536  # largest real: a few thousand
MAX_GGUF_METADATA = 65536  # metadata items; real files: 20-60
MAX_GGUF_KEY_BYTES = 65535  # the GGUF specification's own bound
MAX_GGUF_STRING_BYTES = 64 * 1024**2  # one string value (old converters embed a whole tokenizer.json)
MAX_GGUF_ARRAY = 4_194_304  # elements of one array (the vocabulary and merges are the big ones)
MAX_GGUF_ARRAY_TOTAL = 8_388_608  # elements of all arrays together: bounds the Python objects built
MAX_GGUF_NESTING = 4  # arrays of arrays; real files have none
MAX_GGUF_ALIGNMENT = 1 << 20  # general.alignment must be a power of two up to this (real: 32)
MAX_TENSOR_DIMS = 8  # GGUF allows 4; safetensors checkpoints use 1-2 for these models

# -- safetensors ------------------------------------------------------------------------------
MAX_SAFETENSORS_HEADER = 100 * 1024**2  # real headers are well under 1 MiB

# -- tokenizers built from GGUF metadata -----------------------------------------------------
MAX_TOKEN_CHARS = 1024  # one vocabulary entry; real ones: under 256
# SentencePiece vocabularies carry no merge list; deriving one looks at every split of every
# piece. Real vocabularies need under 2 million splits.
MAX_SENTENCEPIECE_SPLITS = 16_777_216

# -- chat templates ---------------------------------------------------------------------------
MAX_TEMPLATE_BYTES = 1024**2  # template source; real ones: under 64 KiB
MAX_RENDERED_CHARS = 4 * 1024**2  # what one render may produce (the tokenizer's own bound)
MAX_TEMPLATE_VALUE_ITEMS = 1024**2  # a list, tuple or dict a template builds
RENDER_SECONDS = 5.0  # compile and render; real templates take milliseconds

# -- prompts ----------------------------------------------------------------------------------
MAX_TEXT_CHARS = 4 * 1024**2  # one text the tokenizer encodes (~0.7 GB and ~5 s at the bound)
# A prompt longer than this many characters per position the engine accepts cannot fit
# (tokens average ~4 characters); it is refused before tokenizing.
PROMPT_CHARS_PER_TOKEN = 32
MAX_CHAT_LINE_CHARS = 1024**2  # one line typed into `polyengine chat`

# -- request lists (SamplingParams): every one is checked at every step or slot -------------
# Stop strings are matched against each new piece of text of every sample, so their
# number and length cost every step of the request (OpenAI allows 4, vLLM any).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # one stop string
MAX_STOP_TOKEN_IDS = 1024  # a set looked up per token
MAX_LOGIT_BIAS = 1024  # entries; each becomes a row of the slot's bias table

# -- portable prefixes (bytes from another host) ----------------------------------------------
MAX_PREFIX_BYTES = 16 * 1024**3  # a serialized prefix read with PortablePrefix.from_bytes/load

# -- settings every entry point shares ---------------------------------------------------------
# The context length (prompt + completion per request) when nobody chose one: the Python
# API (EngineConfig, create_engine), the command line and the server all take it from
# here, lowered to the model's max_position_embeddings when that is smaller.
DEFAULT_CONTEXT_LENGTH = 2048

# -- plugins ----------------------------------------------------------------------------------
PLUGIN_TIMEOUT_ENV = "POLYENGINE_PLUGIN_TIMEOUT"
# Importing one plugin, one hook call, one probe (plugins must import nothing heavy).
DEFAULT_PLUGIN_SECONDS = 10.0
MAX_PLUGIN_OUTPUT_CHARS = 2000  # of a plugin's captured output quoted in its error


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of decoded JSON (dicts and lists; iterative, so a deep value cannot
    overflow the stack), counting up to ``limit + 1`` at most."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def plugin_seconds() -> float:
    """The bound on one plugin import, hook or probe: ``POLYENGINE_PLUGIN_TIMEOUT`` seconds
    when it is set to a positive number, else :data:`DEFAULT_PLUGIN_SECONDS`."""
    raw = os.environ.get(PLUGIN_TIMEOUT_ENV, "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_PLUGIN_SECONDS
    return value if 0 < value < float("inf") else DEFAULT_PLUGIN_SECONDS
