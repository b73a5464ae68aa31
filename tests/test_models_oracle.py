"""transformers' view of the real default model, computed once and cached.

Loading SmolLM2's GGUF in transformers takes ~30 s (it dequantizes to float32 through accelerate), so the
``smollm2_oracle`` fixture (conftest.py) computes everything the Model I/O tests
compare against in one go: token ids for a varied corpus, decodes, chat renders, the
config, and a digest of every weight tensor. The result is kept in pytest's cache
(``.pytest_cache``), keyed by the GGUF file's size and mtime, the transformers version
and the inputs below, so later sessions skip the load. ``POLYENGINE_ORACLE_REFRESH=1``
forces a recomputation.

This module also holds the few tests of the oracle machinery itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import numpy as np

ORACLE_VERSION = 3

CORPUS = [
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "tabs\tand\t\tmore\t\t\ttabs",
    "line one\nline two\n\nline four\r\nwindows\r\n",
    "\n\n\n",
    "    indented code\n        deeper",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "import numpy as np\nprint(np.arange(10).reshape(2, 5))",
    "Digits 0 1 12 123 1234 12345 3.14159 -42 1e-10 0x1F",
    "2024-11-29 17:35:00 +0100",
    "café naïve façade résumé Ångström",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Ωμέγα Привет мир مرحبا שלום",
    "emoji 😀🤖 flags 🏳️‍🌈 family 👨‍👩‍👧 skin 👍🏽",
    "math ∑∫√∞ ≤ ≥ ≠ arrows → ← ⇒",
    "I'm sure they've said we'll do it, didn't they? It's John's.",
    "CAPS and MiXeD CaSe words",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "special tokens mid text <|endoftext|> and <|im_end|>twice<|im_end|>",
    "not quite special <|im_start and im_end|>",
    "<repo_name>polyengine<file_sep>core/models/tokenizer.py",
    "a" * 64,
    "ab " * 20,
    "",
    " ",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "zero\u200bwidth\u200djoiner",
    "combining e\u0301 vs é",
    "ＦＵＬＬＷＩＤＴＨ",
    "URLs https://example.com/path?q=1&x=y#frag and emails a.b@c.org",
    '{"json": [1, 2.5, null, true], "nested": {"k": "v"}}',
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "What is the capital of France? Answer in one sentence.",
]

CONVERSATIONS = [
    ([{"role": "user", "content": "What is the capital of France?"}], True),
    ([{"role": "user", "content": "What is the capital of France?"}], False),
    (
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Unicode: café 日本 😀 and <b>html</b> & \"quotes\""},
        ],
        True,
    ),
    ([{"role": "user", "content": "  spaces  \n\n newlines \t"}, {"role": "assistant", "content": "ok"}], False),
]


def random_id_sequences(vocab_size: int, n: int = 60) -> list[list[int]]:
    """Seeded id sequences for decode checks; many land inside multi-byte characters."""
    rng = random.Random(1234)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(n)]


def _key(path: Path) -> str:
    import transformers

    st = path.stat()
    payload = json.dumps(
        [ORACLE_VERSION, str(path), st.st_size, st.st_mtime_ns, transformers.__version__, CORPUS, CONVERSATIONS]
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def digest(arr: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(arr, dtype=np.float32).tobytes(), digest_size=16).hexdigest()


def compute(path: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    seqs = random_id_sequences(len(tok))
    out = {
        "ids": [tok.encode(s, add_special_tokens=False) for s in CORPUS],
        "ids_framed": [tok.encode(s) for s in CORPUS],
        "decoded": [tok.decode(tok.encode(s, add_special_tokens=False)) for s in CORPUS],
        "random_ids": seqs,
        "random_decoded": [tok.decode(s) for s in seqs],
        "random_decoded_skip": [tok.decode(s, skip_special_tokens=True) for s in seqs],
        "chats": [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=g) for m, g in CONVERSATIONS],
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "all_special_ids": sorted(tok.all_special_ids),
        "vocab_size": len(tok),
    }
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    c = model.config
    out["config"] = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_parameters["rope_theta"],
        "tie_word_embeddings": bool(c.tie_word_embeddings),
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
    }
    state = model.state_dict()
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out["weights"] = {name: [list(t.shape), digest(t.detach().float().numpy())] for name, t in state.items()}
    del model, state
    return out


def smollm2_oracle(path: Path, cache) -> dict:
    """The oracle for the GGUF at ``path``, from ``cache`` (pytest's) when still valid."""
    key = _key(path)
    entry = cache.get("polyengine/smollm2-oracle", None) if cache is not None else None
    if entry and entry.get("key") == key and not os.environ.get("POLYENGINE_ORACLE_REFRESH"):
        return entry["value"]
    value = compute(path)
    if cache is not None:
        cache.set("polyengine/smollm2-oracle", {"key": key, "value": value})
    return value


def test_oracle_key_tracks_the_inputs(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF")
    k1 = _key(f)
    CORPUS.append("extra")
    try:
        assert _key(f) != k1
    finally:
        CORPUS.pop()
    assert _key(f) == k1


def test_digest_is_bitwise():
    a = np.array([0.0, 1.0], dtype=np.float32)
    assert digest(a) == digest(a.copy())
    assert digest(a) != digest(np.array([-0.0, 1.0], dtype=np.float32))
