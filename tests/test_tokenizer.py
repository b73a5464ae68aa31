"""Tokenizer: ids and text identical to transformers, and streaming that never cuts a character.

Oracles: transformers' tokenizer for the real SmolLM2 GGUF (cached, see
test_models_oracle.py), for an HF folder, and for a synthetic SentencePiece GGUF.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polyengine.errors import ModelConfigError
from polyengine.models import Tokenizer
from polyengine.models.gguf_io import read_gguf
from polyengine.models.presets import byte_tokenizer
from polyengine.models.tokenizer import BYTE_TO_UNICODE
from test_models_oracle import CORPUS, CONVERSATIONS

# -- the real default model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(default_gguf) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_gguf(default_gguf).metadata, source=str(default_gguf))


def test_ids_equal_transformers(smol, smollm2_oracle):
    for text, want, want_framed in zip(CORPUS, smollm2_oracle["ids"], smollm2_oracle["ids_framed"]):
        assert smol.encode(text) == want, text
        assert smol.encode(text, add_special_tokens=True) == want_framed, text


def test_decode_equals_transformers(smol, smollm2_oracle):
    for ids, want in zip(smollm2_oracle["ids"], smollm2_oracle["decoded"]):
        assert smol.decode(ids) == want
    for ids, want, want_skip in zip(
        smollm2_oracle["random_ids"], smollm2_oracle["random_decoded"], smollm2_oracle["random_decoded_skip"]
    ):
        assert smol.decode(ids) == want, ids
        assert smol.decode(ids, skip_special_tokens=True) == want_skip, ids


def test_special_tokens_of_the_default_model(smol, smollm2_oracle):
    assert smol.bos_token_id == smollm2_oracle["bos_token_id"] == 1
    assert smol.eos_token_ids == (smollm2_oracle["eos_token_id"],) == (2,)  # <|im_end|>, also end of turn
    assert smol.vocab_size == smollm2_oracle["vocab_size"] == 49152
    assert set(smollm2_oracle["all_special_ids"]) <= smol.special_token_ids
    assert not smol.add_bos
    assert smol.token_to_id("<|im_end|>") == 2 and smol.id_to_token(2) == "<|im_end|>"
    assert smol.token_to_id("no such token") is None and smol.id_to_token(10**6) is None
    assert smol.encode("x<|im_end|>y") == [smol.encode("x")[0], 2, smol.encode("y")[0]]


def test_hf_folder_equals_transformers(smol, tmp_path):
    """The same vocabulary written as tokenizer.json must tokenize, frame, decode and
    render chats as transformers' AutoTokenizer does: once with the GGUF's framing (none),
    once with a BOS post-processor; ``add_bos_token`` in the config is ignored by both."""
    transformers = pytest.importorskip("transformers")
    smol.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>", "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True,
                      "lstrip": False, "rstrip": False, "normalized": False, "single_word": False},
        "unk_token": "<|endoftext|>", "add_bos_token": True, "clean_up_tokenization_spaces": False,
    }))
    (tmp_path / "chat_template.jinja").write_text(smol.chat_template)
    for framed in (False, True):
        if framed:
            raw = json.loads((tmp_path / "tokenizer.json").read_text())
            raw["post_processor"] = {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
            }
            (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
        ours = Tokenizer.from_pretrained(tmp_path)
        hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
        assert ours.add_bos == framed and ours.bos_token_id == hf.bos_token_id == 1
        assert ours.eos_token_ids == (hf.eos_token_id,) == (2,)
        for text in CORPUS:
            assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text
            assert ours.encode(text, add_special_tokens=True) == hf.encode(text), text
        for messages, gen in CONVERSATIONS:
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen
            )


def test_chat_template_from_tokenizer_config(tmp_path):
    tok = byte_tokenizer()
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}<|im_end|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|eos|>", "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}],
    }))
    loaded = Tokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == template
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]<|im_end|>"
    assert not loaded.add_bos  # tokenizer.json's post-processor is kept when the config is silent


def test_unreadable_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelConfigError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


# -- a SentencePiece ("llama") GGUF vocabulary -----------------------------------------------


def spm_vocab():
    """A small SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, scored pieces,
    a control <|eot_id|> and a user-defined <think>."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-():;\"", "é", "日", "本",
              "▁t", "he", "▁the", "▁a", "in", "er", "an", "▁w", "or", "ld", "▁wor", "▁world", "ll", "▁h", "▁he",
              "▁hell", "▁hello", "▁H", "▁Hello", "on", "▁o", "▁of", "▁an", "▁and", "▁i", "▁in", "▁is", "ing",
              "▁th", "▁to", "re", "▁re", "at", "▁at", "es", "en", "▁b", "▁be", "▁c", "▁ca", "▁caf", "▁café",
              "▁日", "▁日本", "▁▁", "▁▁▁▁", "de", "▁de", "▁def", "▁f", "()", "):", "▁1", "12", "▁12"]
    tokens += pieces + ["<|eot_id|>", "<think>"]
    types += [1] * len(pieces) + [3, 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0, 0.0]
    return tokens, types, scores


SPM_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|eot_id|>{% endfor %}"


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory):
    from polyengine.models import ModelConfig
    from polyengine.models.presets import random_weights
    from test_models_gguf import write_gguf

    tokens, types, scores = spm_vocab()
    cfg = ModelConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    write_gguf(path, cfg, random_weights(cfg), tokens=tokens, token_types=types, scores=scores,
               tokenizer_model="llama", pre=None,
               extra_meta={"add_bos_token_id": 1, "add_eos_token_id": 2, "add_unk_token_id": 0,
                           "add_chat_template": SPM_TEMPLATE})
    return path


@pytest.fixture(scope="module")
def spm(spm_file) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_gguf(spm_file).metadata)


SPM_CORPUS = CORPUS + ["Hello world", " hello  the world", "<s>x</s><|eot_id|><think>y", "The Of AND 12 123 1.5"]


def test_sentencepiece_gguf_equals_transformers(spm, spm_file):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(spm_file.parent, gguf_file=spm_file.name)
    for text in SPM_CORPUS:
        ids = spm.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert spm.encode(text, add_special_tokens=True) == hf.encode(text), text
        assert spm.decode(ids) == hf.decode(ids), text
        assert spm.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
    assert spm.add_bos and spm.bos_token_id == hf.bos_token_id == 1
    assert spm.eos_token_ids == (2, spm.token_to_id("<|eot_id|>"))  # </s>, and the template's end of turn
    msgs = [{"role": "user", "content": "hi"}]
    assert spm.apply_chat_template(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_unsupported_gguf_tokenizer_model():
    with pytest.raises(ModelConfigError, match="'bert'.*gpt2"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ModelConfigError, match="tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})


def test_end_of_turn_tokens_come_from_the_template():
    tok = byte_tokenizer()
    assert tok.eos_token_ids == (tok.token_to_id("<|eos|>"), tok.token_to_id("<|assistant_end|>"))
    plain = Tokenizer(tok.backend, special_tokens={"eos_token": "<|eos|>"}, chat_template="{{ messages }}")
    assert plain.eos_token_ids == (tok.token_to_id("<|eos|>"),)


def test_byte_tokenizer_round_trips_anything():
    tok = byte_tokenizer()
    text = "héllo 日本 😀\n\t<|user_start|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[:1] == [ord("h")] and tok.token_to_id("<|user_start|>") in ids
    assert tok.encode("x", add_special_tokens=True) == [ord("x")]
    assert tok.id_to_token(ord("A")) == BYTE_TO_UNICODE[ord("A")]


# -- streaming -------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids, prompt=()):
    d = tok.detokenizer(prompt)
    pieces = [d.push(i) for i in ids]
    assert not any(p.endswith("\ufffd") for p in pieces), pieces
    return "".join(pieces) + d.flush()


_BYTES = byte_tokenizer()


@given(st.lists(st.integers(0, _BYTES.vocab_size - 1), max_size=40), st.lists(st.integers(0, 300), max_size=6))
def test_stream_byte_tokenizer(ids, prompt):
    prompt = [p for p in prompt if p < _BYTES.vocab_size]
    assert _stream(_BYTES, ids) == _BYTES.decode(ids)
    head = _BYTES.decode(prompt)
    if not head.endswith("\ufffd"):
        assert _stream(_BYTES, ids, prompt) == _BYTES.decode(prompt + ids)[len(head):]


def test_stream_holds_a_split_character():
    tok = _BYTES
    d = tok.detokenizer()
    bytes_ = "日".encode()
    assert [d.push(b) for b in bytes_] == ["", "", "日"]
    assert d.push(ord("!")) == "!" and d.flush() == ""
    d = tok.detokenizer()
    assert d.push(bytes_[0]) == "" and d.flush() == "\ufffd"


@pytest.fixture(scope="module")
def smol_stream_ids(smol):
    # Single-byte tokens (the byte alphabet) cut characters apart; mix them with random ids.
    ids = [smol.token_to_id(c) for c in BYTE_TO_UNICODE.values()]
    return sorted(i for i in ids if i is not None)


def test_stream_default_model(smol, smol_stream_ids):
    @given(st.lists(st.one_of(st.sampled_from(smol_stream_ids), st.integers(0, smol.vocab_size - 1)), max_size=30))
    def check(ids):
        assert _stream(smol, ids) == smol.decode(ids)

    check()


def test_stream_sentencepiece_byte_fallback(spm):
    @given(st.lists(st.one_of(st.integers(3, 258), st.integers(0, spm.vocab_size - 1)), max_size=30))
    def check(ids):
        assert _stream(spm, ids) == spm.decode(ids)

    check()
    d = spm.detokenizer()
    e_acute = [spm.token_to_id(f"<0x{b:02X}>") for b in "é".encode()]
    assert [d.push(i) for i in e_acute] == ["", ""]  # held until the byte run ends
    assert d.push(spm.token_to_id("▁the")) == "é the"
    assert spm.detokenizer(spm.encode("say")).push(spm.token_to_id("▁the")) == " the"  # prompt context keeps the space
