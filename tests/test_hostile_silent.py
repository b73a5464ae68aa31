"""Hostile inputs, class "silent acceptance": inputs that used to be taken as something
else (an empty model path as the current directory, a context length of 0 as "the
default", the string "no" as true, NaN weights as a sampling problem) are refused with
an error that names them.
"""

from __future__ import annotations

import json

import numpy as np

from hostile_files import F32, U32, tiny_gguf_tensors, tiny_hf_config, write_hf_folder, write_tiny_gguf
from hostile_plugins import polyengine
from hostile_runner import case, check, run_cases
from polyengine.errors import ModelConfigError, ModelNotFound, NumericalError, WeightsError


def _load(path):
    from polyengine.models import load_model

    return load_model(str(path))


@case(ModelNotFound, "empty", seconds=5)
def an_empty_model_path(tmp):
    import os

    os.chdir(write_hf_folder(tmp / "m"))  # a loadable model in the current directory must not be picked
    _load("")


@case(ModelNotFound, "empty", seconds=5)
def a_blank_model_path_to_llm(tmp):
    import polyengine as pe

    pe.LLM("   ", "reference")


@case(ModelConfigError, "tie_word_embeddings", "true or false")
def tie_word_embeddings_spelled_no(tmp):
    _load(write_hf_folder(tmp / "m", config={**tiny_hf_config(), "tie_word_embeddings": "no"}))


@case(ModelConfigError, "attention_bias", "true or false")
def attention_bias_spelled_as_a_number(tmp):
    _load(write_hf_folder(tmp / "m", config={**tiny_hf_config(), "attention_bias": 0}))


@case(WeightsError, "model.layers.1.mlp.up_proj.weight", "NaN")
def nan_weights_in_safetensors(tmp):
    from polyengine.models.presets import preset_config, random_weights

    weights = random_weights(preset_config("tiny"))
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    _load(write_hf_folder(tmp / "m", weights=weights))


@case(WeightsError, "output_norm.weight", "infinite")
def infinite_weights_in_gguf(tmp):
    tensors, data = tiny_gguf_tensors()
    name, ne, t, off = next(x for x in tensors if x[0] == "output_norm.weight")
    data = bytearray(data)
    data[off : off + 4] = np.array([np.inf], "<f4").tobytes()
    _load(write_tiny_gguf(tmp / "m.gguf", tensors=tensors, data=bytes(data)))


@case(ModelConfigError, "tokenizer", "vocab_size", "288")
def a_tokenizer_larger_than_the_embeddings(tmp):
    tokens = [f"<t{i}>" for i in range(400)]
    from hostile_files import ARR, I32, STR

    _load(write_tiny_gguf(tmp / "m.gguf", kv={"tokenizer.ggml.tokens": (ARR, (STR, tokens)),
                                               "tokenizer.ggml.token_type": (ARR, (I32, [1] * 400)),
                                               "llama.vocab_size": (U32, 288)}))


@case(WeightsError, "llama.block_count", "twice")
def a_gguf_key_given_twice(tmp):
    from hostile_files import gguf_bytes, tiny_gguf_kv

    tensors, data = tiny_gguf_tensors()
    items = list(tiny_gguf_kv().items()) + [("llama.block_count", (U32, 3))]
    (tmp / "m.gguf").write_bytes(gguf_bytes(items, tensors, data))
    _load(tmp / "m.gguf")


@case(WeightsError, "model.norm.weight", "twice")
def a_safetensors_tensor_given_twice(tmp):
    folder = write_hf_folder(tmp / "m")
    raw = (folder / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8 : 8 + n].decode()
    entry = json.dumps({"model.norm.weight": json.loads(header)["model.norm.weight"]})[1:-1]
    doubled = header[:-1] + ", " + entry + "}"
    (folder / "model.safetensors").write_bytes(len(doubled).to_bytes(8, "little") + doubled.encode() + raw[8 + n :])
    _load(folder)


@case(ModelConfigError, "layer_norm_rms_epsilon", "finite")
def an_infinite_norm_epsilon(tmp):
    _load(write_tiny_gguf(tmp / "m.gguf", kv={"llama.attention.layer_norm_rms_epsilon": (F32, float("inf"))}))


@case(NumericalError, "NaN", "not the sampling parameters")
def nan_logits_are_not_blamed_on_min_tokens(tmp):
    import polyengine as pe
    from polyengine.models import Model

    good = _load("random:tiny")
    weights = dict(good.weights)
    weights["model.norm.weight"] = np.full_like(weights["model.norm.weight"], np.nan)  # built in memory: no file check
    llm = pe.LLM(Model(good.config, weights, good.tokenizer), "reference", max_cache_length=64)
    llm.generate(["hi"], {"max_tokens": 4, "min_tokens": 2})


@case(None)
def good_files_still_load(tmp):
    assert _load(write_tiny_gguf(tmp / "m.gguf")).config.num_hidden_layers == 2
    assert _load(write_hf_folder(tmp / "hf")).config.tie_word_embeddings is True


def test_bad_values_are_refused_not_reinterpreted(tmp_path):
    results = run_cases(__name__.rpartition(".")[2], tmp_path)
    problems = check(__name__.rpartition(".")[2], results)
    assert not problems, "\n".join(problems)


def test_cli_refuses_what_it_used_to_reinterpret(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # the current directory must never be taken for --model ""
    for args, words in (
        (["--model", ""], ["empty", "--model"]),
        (["--context-length", "0"], ["--context-length", "at least 2"]),
        (["--context-length", "-4"], ["--context-length"]),
        (["--max-tokens", "0"], ["max_tokens"]),
        (["--temperature", "nan"], ["temperature"]),
        (["--top-k", "-1"], ["top_k"]),
        (["--seed", "-1"], ["seed"]),
    ):
        full = ["--model", "random:tiny", *args] if "--model" not in args else args
        proc = polyengine(tmp_path, "generate", "--backend", "reference", *full, "--max-tokens"
                          if "--max-tokens" not in args else "--raw", *(["2"] if "--max-tokens" not in args else []),
                          "hi", env={"PWD": str(tmp_path)})
        assert proc.returncode in (1, 2), (args, proc.stderr)
        assert "Traceback" not in proc.stderr, (args, proc.stderr)
        for word in words:
            assert word in proc.stderr, (args, word, proc.stderr)


def test_cli_engine_flags_reach_the_engine_or_are_refused_by_name(tmp_path):
    """``--option KEY=VALUE`` and ``--prefill-buckets`` (generate, chat, serve): the
    value reaches the backend (the startup report names the forced path), an option the
    backend lacks is refused with its option list, and a malformed flag is a usage error."""
    base = ["generate", "--model", "random:tiny", "--raw", "--max-tokens", "2"]
    proc = polyengine(tmp_path, *base, "--backend", "cpu", "--option", "isa=scalar", "-v", "hi")
    assert proc.returncode == 0, proc.stderr
    assert "isa: scalar (forced by option isa" in proc.stderr
    proc = polyengine(tmp_path, *base, "--backend", "cpu", "--option", "isa_level=scalar", "hi")
    assert proc.returncode == 1 and "unknown option(s) ['isa_level']" in proc.stderr and "isa (default" in proc.stderr
    proc = polyengine(tmp_path, *base, "--backend", "reference", "--context-length", "16", "--prefill-buckets", "8,16",
                      "hi there friend")
    assert proc.returncode == 0, proc.stderr
    proc = polyengine(tmp_path, *base, "--backend", "reference", "--prefill-buckets", "4", "hi")
    assert proc.returncode == 1 and "largest prefill bucket (4) must cover max_prefill_length" in proc.stderr
    for flag, value, words in (("--option", "isa", "KEY=VALUE"), ("--prefill-buckets", "8,x", "comma-separated"),
                               ("--prefill-buckets", ",", "at least one")):
        proc = polyengine(tmp_path, *base, "--backend", "reference", flag, value, "hi")
        assert proc.returncode == 2 and words in proc.stderr, (flag, value, proc.stderr)
