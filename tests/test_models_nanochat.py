"""nanochat checkpoints: the torch-free restricted reader, the tokenizer conversion, and
a folder as nanochat writes it loading and generating (with the calculator tool).

nanochat's own forward is not run here: ``pip download --no-deps nanochat`` (0.1.2)
fails to build on this machine and its model code imports its training stack, so the
architecture is checked against the reference (backends/reference/model.py), whose
nanochat features each follow nanochat's first ``gpt.py`` (see core/models/nanochat.py),
and every backend is checked against the reference by the suite's ``nanochat`` model.
"""

from __future__ import annotations

import json
import pickle
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyengine.errors import WeightsError  # noqa: E402
from polyengine.models import load_model  # noqa: E402
from polyengine.models.nanochat import NANOCHAT_SPECIALS, read_tiktoken_pickle, read_torch_state_dict  # noqa: E402

META = {"sequence_len": 64, "vocab_size": 300, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32}


def _state(seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, v, kv = META["n_embd"], META["vocab_size"], META["n_kv_head"] * 8
    out = {"transformer.wte.weight": torch.randn(v, h, generator=g), "lm_head.weight": 0.2 * torch.randn(v, h, generator=g)}
    for i in range(META["n_layer"]):
        p = f"transformer.h.{i}."
        for name, shape in (("attn.c_q", (h, h)), ("attn.c_k", (kv, h)), ("attn.c_v", (kv, h)),
                            ("attn.c_proj", (h, h)), ("mlp.c_fc", (4 * h, h)), ("mlp.c_proj", (h, 4 * h))):
            out[f"_orig_mod.{p}{name}.weight"] = 0.2 * torch.randn(*shape, generator=g)
    return {k: t.to(dtype) for k, t in out.items()}


class _FakeEncoding:
    """Pickles as tiktoken's Encoding does (its state through __getstate__)."""

    def __init__(self, state):
        self.state = state

    def __getstate__(self):
        return self.state


def _tokenizer_pickle(path):
    ranks = {bytes([b]): b for b in range(256)}
    for pair in (b"th", b"he", b"the", b" t", b" the"):
        ranks[pair] = len(ranks)
    specials = {t: 261 + i for i, t in enumerate(NANOCHAT_SPECIALS)}
    module = types.ModuleType("tiktoken.core")
    _FakeEncoding.__module__, _FakeEncoding.__qualname__, _FakeEncoding.__name__ = "tiktoken.core", "Encoding", "Encoding"
    module.Encoding = _FakeEncoding
    parent = types.ModuleType("tiktoken")
    parent.core = module
    saved = {k: sys.modules.get(k) for k in ("tiktoken", "tiktoken.core")}
    sys.modules.update({"tiktoken": parent, "tiktoken.core": module})
    try:
        pattern = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
        path.write_bytes(pickle.dumps(_FakeEncoding({"name": "nanochat", "pat_str": pattern, "mergeable_ranks": ranks,
                                                     "special_tokens": specials})))
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


@pytest.fixture
def folder(tmp_path):
    torch.save(_state(), tmp_path / "model_000100.pt")
    torch.save(_state(1), tmp_path / "model_000050.pt")
    (tmp_path / "meta_000100.json").write_text(json.dumps({"model_config": META, "step": 100}))
    _tokenizer_pickle(tmp_path / "tokenizer.pkl")
    return tmp_path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_restricted_reader_equals_torch_load(tmp_path, dtype):
    state = _state(dtype=dtype)
    state["strided"] = torch.arange(12.0).reshape(3, 4).t()  # a non-contiguous tensor
    torch.save(state, tmp_path / "m.pt")
    got = read_torch_state_dict(tmp_path / "m.pt")
    want = torch.load(tmp_path / "m.pt", weights_only=True)
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        np.testing.assert_array_equal(got[k], t.float().numpy(), err_msg=k)


def test_reader_refuses_other_globals(tmp_path):
    torch.save({"w": torch.zeros(2), "extra": {1, 2}, "fn": print}, tmp_path / "bad.pt")
    with pytest.raises(WeightsError, match="refuses to unpickle"):
        read_torch_state_dict(tmp_path / "bad.pt")


def test_tokenizer_pickle_is_read_without_tiktoken(folder):
    state = read_tiktoken_pickle(folder / "tokenizer.pkl")
    assert state["mergeable_ranks"][b" the"] == 260 and state["special_tokens"]["<|bos|>"] == 261


def test_checkpoint_folder_loads_and_generates(folder):
    from polyengine import LLM, SamplingParams

    model = load_model(folder)
    c = model.config
    assert (c.model_type, c.hidden_act, c.norm_weights, c.qk_norm, c.final_logit_softcapping) == (
        "nanochat", "relu2", False, True, 15.0)
    np.testing.assert_array_equal(model.weights["model.layers.1.mlp.up_proj.weight"],
                                  _state()["_orig_mod.transformer.h.1.mlp.c_fc.weight"].numpy())  # the highest step
    tok = model.tokenizer
    assert tok.encode(" the the") == [260, 260]
    assert tok.decode(tok.encode("héllo the world")) == "héllo the world"
    prompt = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert prompt == "<|bos|><|user_start|>be brief\n\nhi<|user_end|><|assistant_start|>"
    ids = {tok.token_to_id(t) for t in ("<|assistant_end|>", "<|bos|>")}
    assert ids <= set(model.eos_token_ids)
    llm = LLM(model=model, backend="reference", max_cache_length=64, max_prefill_length=32)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.outputs[0].token_ids
    # nanochat's tool tokens turn the calculator on: a call is answered with forced tokens.
    assert llm.tools is not None
    row = llm.tools.new_row()
    for t in tok.encode("<|python_start|>6*7<|python_end|>"):
        row.step(t)
    forced = []
    while row.pending:
        forced.append(row.step(0)[0])
    assert tok.decode(forced) == "<|output_start|>42<|output_end|>"


def test_later_nanochat_checkpoints_are_refused(folder):
    (folder / "meta_000100.json").write_text(json.dumps({"model_config": {**META, "window_pattern": "SSSL"}}))
    with pytest.raises(Exception, match="later nanochat"):
        load_model(folder)
