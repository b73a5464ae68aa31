"""Tiny quantized models: Llama-shaped GGUF files with random weights in each block format.

A quantized model is a model like any other (the reference dequantizes its blocks
exactly), so tests and the conformance suite run these through every backend.
:func:`quantized_model_file` writes one file per format the way llama.cpp's converter
lays one out (llama.cpp's names, ``ne`` order, Q/K rows permuted per head), with the
random presets' byte-level tokenizer and chat template, and every matrix (embedding
and LM head included) in the format; norms stay F32, as llama.cpp keeps them.

The shape (:func:`quantized_config`) has every row length a multiple of 256, so the
K-quants (256-weight blocks) fit as well as the 32-weight formats. Blocks come from
:func:`polyengine.models.blocks.quantize_blocks`: valid, not optimal; values do not
matter for judging a backend against the reference on the same blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

from polyengine.models.blocks import BLOCK_FORMATS, FORMATS, quantize_blocks
from polyengine.models.config import ModelConfig
from polyengine.models.gguf_io import gguf_name, permute_rows
from polyengine.models.presets import CHAT_TEMPLATE, SPECIAL_TOKENS, preset_config, random_weights
from polyengine.models.tokenizer import BYTE_TO_UNICODE
from polyengine.models.weights import Weight

__all__ = ["QUANT_FORMATS", "quantized_config", "quantized_records", "write_llama_gguf", "quantized_model_file"]

QUANT_FORMATS = BLOCK_FORMATS  # Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K

def quantized_config() -> ModelConfig:
    """2 layers, hidden 256, MLP 512, GQA 4/2 heads of 64, untied head, the byte vocabulary."""
    return preset_config("tiny").model_copy(update=dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        tie_word_embeddings=False))


def quantized_records(weights: dict[str, np.ndarray], fmt: str | Mapping[str, str]) -> dict[str, Weight]:
    """``weights`` (HF names, float) as in-memory records (HF row order: no GGUF
    permutation). Pass the result to ``Model(config, records)``: a quantized model
    without a file (the conformance suite's way to build one from its own weights).

    ``fmt`` one format: every matrix whose rows divide into its blocks in it, the rest
    (norms, biases, matrices too narrow for the block) F32. ``fmt`` a mapping of names to
    formats (a mixed model, as the K-quant mixes of real files are): each named tensor in
    its format (a 1-D tensor in a float format only; a matrix whose rows do not divide
    into its blocks is a ValueError), every other one F32."""
    out: dict[str, Weight] = {}
    for name, arr in weights.items():
        arr = np.asarray(arr, np.float32)
        mixed = isinstance(fmt, Mapping)
        f = FORMATS[fmt.get(name, "F32") if mixed else fmt]
        fits = (arr.ndim == 2 or (mixed and f.is_float)) and arr.shape[-1] % f.block == 0
        if mixed and not fits:
            raise ValueError(f"{name}: a tensor of shape {arr.shape} cannot be stored as {f.name}")
        if not fits or f.name == "F32":
            out[name] = Weight.from_array(arr, name=name)
            continue
        raw = quantize_blocks(f.name, arr.reshape(-1, arr.shape[-1]))
        data = raw.reshape(arr.shape) if f.is_float else raw.reshape(*arr.shape[:-1], -1)
        out[name] = Weight(f.name, tuple(arr.shape), data, name=name)
    return out


def write_llama_gguf(path: str | Path, config: ModelConfig, weights: dict[str, np.ndarray], fmt: str) -> Path:
    """Write a ``llama`` GGUF of ``weights`` (HF names, float) with every matrix in ``fmt``
    and 1-D tensors in F32. ``config`` must be Llama-family without biases, its tokens
    the byte vocabulary of the random presets."""
    import gguf

    f = FORMATS[fmt]
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"polyengine tiny llama {fmt}")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    w.add_rope_dimension_count(config.head_dim)
    tokens = [BYTE_TO_UNICODE[b] for b in range(256)] + list(SPECIAL_TOKENS)
    tokens += [f"[PAD{i}]" for i in range(config.vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS or t.startswith("[PAD") else 1 for t in tokens])
    w.add_token_merges([])
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_ids[0])
    w.add_pad_token_id(config.pad_token_id)
    w.add_chat_template(CHAT_TEMPLATE)
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    for name, arr in weights.items():
        arr = np.asarray(arr, np.float32)
        for proj, n_head in heads.items():
            if f".{proj}." in name:
                arr = permute_rows(arr, n_head)
        if arr.ndim == 1:
            w.add_tensor(gguf_name(name), arr)
            continue
        if arr.shape[-1] % f.block:
            raise ValueError(f"{name}: rows of {arr.shape[-1]} do not divide into {fmt} blocks of {f.block}")
        raw = quantize_blocks(fmt, arr)
        if fmt in ("F32", "F16"):
            w.add_tensor(gguf_name(name), raw)
        else:
            w.add_tensor(gguf_name(name), raw.view(np.uint8), raw_dtype=gguf.GGMLQuantizationType(f.ggml_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantized_model_file(fmt: str, directory: str | Path, *, seed: int = 0) -> Path:
    """``directory/tiny-llama-<fmt>-s<seed>.gguf``, written on first use (a few hundred
    KB, under a second): the :func:`quantized_config` shape, random weights of ``seed``,
    every matrix in ``fmt``. Load it with ``load_model(path)``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")
    path = Path(directory) / f"tiny-llama-{fmt}-s{seed}.gguf"
    if not path.is_file():
        config = quantized_config()
        partial = path.with_suffix(".partial")
        write_llama_gguf(partial, config, random_weights(config, seed=seed), fmt)
        partial.replace(path)  # atomic: a reader never sees half a file
    return path
