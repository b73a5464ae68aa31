"""Hostile model files built on the fly: a raw GGUF writer and an HF folder writer.

Both write exactly the bytes they are told to, valid or not (``gguf.GGUFWriter`` and
``safetensors`` refuse to write most of what a hostile file holds: string alignments,
zero head counts, absurd counts). Each starts from a small valid model (the
``random:tiny`` preset's shape and weights, a byte-level tokenizer and a chat
template), so a test changes one thing and every other part of the file stays good.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from polyengine.models.presets import CHAT_TEMPLATE, SPECIAL_TOKENS, preset_config, random_weights
from polyengine.models.tokenizer import BYTE_TO_UNICODE, byte_level_tokenizer

__all__ = [
    "U8", "I8", "U16", "I16", "U32", "I32", "F32", "BOOL", "STR", "ARR", "U64", "I64", "F64",
    "gguf_bytes", "tiny_gguf_kv", "tiny_gguf_tensors", "write_tiny_gguf",
    "safetensors_bytes", "tiny_hf_config", "write_hf_folder",
]

# GGUF metadata value types.
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
        U64: "<Q", I64: "<q", F64: "<d"}
_GGML_F32 = 0

_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}


def _gguf_name(hf: str) -> str:
    if hf in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[rest]}"


def _string(s: str | bytes) -> bytes:
    raw = s.encode("utf-8", "surrogatepass") if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype: int, value: Any) -> bytes:
    if vtype == STR:
        return _string(value)
    if vtype == ARR:  # value = (element type, list of elements) or (element type, count, raw bytes)
        etype, items = value[0], value[1]
        if len(value) == 3:
            return struct.pack("<IQ", etype, items) + value[2]
        return struct.pack("<IQ", etype, len(items)) + b"".join(_value(etype, v) for v in items)
    return struct.pack(_FMT[vtype], value)


def gguf_bytes(
    kv: dict[str, tuple[int, Any]] | list[tuple[str, tuple[int, Any]]],
    tensors: list[tuple[str, list[int], int, int]],
    data: bytes,
    *,
    version: int = 3,
    alignment: int = 32,
    n_kv: int | None = None,
    n_tensors: int | None = None,
) -> bytes:
    """A GGUF file: ``kv`` maps keys to ``(value type, value)`` (a list of pairs may
    repeat a key); ``tensors`` lists
    ``(name, ne, ggml type, offset)``; ``data`` is placed at the aligned data start.
    ``n_kv``/``n_tensors`` override the counts in the header (to lie about them)."""
    items = list(kv.items()) if isinstance(kv, dict) else list(kv)
    out = bytearray(b"GGUF")
    out += struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                       len(items) if n_kv is None else n_kv)
    for key, (vtype, value) in items:
        out += _string(key) + struct.pack("<I", vtype) + _value(vtype, value)
    for name, ne, ggml_type, offset in tensors:
        out += _string(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        out += struct.pack("<IQ", ggml_type, offset)
    out += b"\0" * (-len(out) % alignment)
    return bytes(out + data)


BYTE_TOKENS = [BYTE_TO_UNICODE[b] for b in range(256)] + list(SPECIAL_TOKENS)


def tiny_gguf_kv(config=None) -> dict[str, tuple[int, Any]]:
    """Valid metadata of the ``random:tiny`` shape with a byte-level (gpt2) tokenizer."""
    c = config or preset_config("tiny")
    tokens = BYTE_TOKENS + [f"[PAD{i}]" for i in range(c.vocab_size - len(BYTE_TOKENS))]
    return {
        "general.architecture": (STR, "llama"),
        "general.alignment": (U32, 32),
        "llama.block_count": (U32, c.num_hidden_layers),
        "llama.context_length": (U32, c.max_position_embeddings),
        "llama.embedding_length": (U32, c.hidden_size),
        "llama.feed_forward_length": (U32, c.intermediate_size),
        "llama.attention.head_count": (U32, c.num_attention_heads),
        "llama.attention.head_count_kv": (U32, c.num_key_value_heads),
        "llama.attention.layer_norm_rms_epsilon": (F32, c.rms_norm_eps),
        "llama.rope.freq_base": (F32, c.rope_theta),
        "tokenizer.ggml.model": (STR, "gpt2"),
        "tokenizer.ggml.pre": (STR, "default"),
        "tokenizer.ggml.tokens": (ARR, (STR, tokens)),
        "tokenizer.ggml.token_type": (ARR, (I32, [3 if t in SPECIAL_TOKENS else 1 for t in tokens])),
        "tokenizer.ggml.merges": (ARR, (STR, [])),
        "tokenizer.ggml.bos_token_id": (U32, 256),
        "tokenizer.ggml.eos_token_id": (U32, 257),
        "tokenizer.chat_template": (STR, CHAT_TEMPLATE),
    }


def tiny_gguf_tensors(config=None, *, seed: int = 0) -> tuple[list[tuple[str, list[int], int, int]], bytes]:
    """The tiny model's weights as F32 GGUF tensors (Q/K left unpermuted: random
    weights need no converter permutation to be valid) and their packed data."""
    c = config or preset_config("tiny")
    tensors, data = [], bytearray()
    for name, arr in random_weights(c, seed=seed).items():
        data += b"\0" * (-len(data) % 32)
        tensors.append((_gguf_name(name), list(reversed(arr.shape)), _GGML_F32, len(data)))
        data += np.ascontiguousarray(arr, dtype="<f4").tobytes()
    return tensors, bytes(data)


def write_tiny_gguf(path: Path, *, kv: dict | None = None, drop: tuple[str, ...] = (),
                    tensors=None, data: bytes | None = None, **header: Any) -> Path:
    """The tiny GGUF with ``kv`` entries replacing (or adding to) the valid metadata and
    the keys in ``drop`` removed; ``header`` goes to :func:`gguf_bytes`."""
    meta = tiny_gguf_kv()
    meta.update(kv or {})
    for key in drop:
        meta.pop(key, None)
    if tensors is None or data is None:
        t, d = tiny_gguf_tensors()
        tensors = t if tensors is None else tensors
        data = d if data is None else data
    path.write_bytes(gguf_bytes(meta, tensors, data, **header))
    return path


# -- HF folders ---------------------------------------------------------------------------


def safetensors_bytes(arrays: dict[str, np.ndarray], *, header: dict | None = None, raw_header: bytes | None = None) -> bytes:
    """A safetensors file of float32 ``arrays``; ``header`` entries replace the computed
    ones (or add more), ``raw_header`` replaces the JSON header's bytes outright."""
    entries, data = {}, bytearray()
    for name, arr in arrays.items():
        raw = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        entries[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    entries.update(header or {})
    head = raw_header if raw_header is not None else json.dumps(entries).encode()
    return struct.pack("<Q", len(head)) + head + bytes(data)


def tiny_hf_config() -> dict[str, Any]:
    """The ``random:tiny`` preset as an HF ``config.json`` dict."""
    return preset_config("tiny").to_hf()


def write_hf_folder(
    folder: Path,
    *,
    config: dict | str | None = None,
    weights: dict[str, np.ndarray] | None = None,
    shards: dict[str, list[str]] | None = None,
    index: dict | str | None = None,
    tokenizer: bool = True,
    tokenizer_config: dict | str | None = None,
) -> Path:
    """An HF folder of the tiny model. ``config``/``index``/``tokenizer_config`` given as
    text are written verbatim. ``shards`` maps shard file names to the tensors they
    hold (then ``index`` defaults to the matching ``model.safetensors.index.json``)."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_hf_config() if config is None else config
    (folder / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    arrays = weights if weights is not None else random_weights(preset_config("tiny"))
    if shards is None:
        (folder / "model.safetensors").write_bytes(safetensors_bytes(arrays))
    else:
        for fname, names in shards.items():
            (folder / fname).parent.mkdir(parents=True, exist_ok=True)
            (folder / fname).write_bytes(safetensors_bytes({n: arrays[n] for n in names}))
        if index is None:
            index = {"weight_map": {n: f for f, names in shards.items() for n in names}}
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    if tokenizer:
        (folder / "tokenizer.json").write_text(byte_level_tokenizer(SPECIAL_TOKENS).to_str())
        tc = tokenizer_config if tokenizer_config is not None else {
            "bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": CHAT_TEMPLATE}
        (folder / "tokenizer_config.json").write_text(tc if isinstance(tc, str) else json.dumps(tc))
    return folder
