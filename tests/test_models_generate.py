"""``polyengine generate --model <folder or .gguf>`` for every architecture, greedy
output equal to the reference backend's.

Each architecture's conformance test model is written as a user would bring it: a
GGUF file where llama.cpp has the architecture (tests/test_models_gguf_architectures.py
writes it), an HF folder (config.json + model.safetensors + tokenizer.json) for
Llama, Qwen2 and Mistral, a nanochat checkpoint folder for nanochat. The command runs
once per file (a subprocess, as users run it) on cpu, and the reference's tokens
come from the Python API. tpu_jax and neuron compile every model they meet (minutes
on two cores), so on them the same check runs when ``POLYENGINE_EVERY_BACKEND=1``;
their engines are checked on every architecture by the conformance suite's numerics
layer in CI either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyengine.conformance.models import ARCHITECTURE_MODELS, build_model  # noqa: E402
from polyengine.models import load_model  # noqa: E402
from polyengine.models.tokenizer import byte_level_tokenizer  # noqa: E402

from test_models_gguf_architectures import ARCH, _write  # noqa: E402

PROMPT = "hello, world"
STEPS = 6
HEAVY = ("tpu_jax", "neuron")


def _hf_folder(model, folder) -> None:
    """An HF folder of a test model: config.json, model.safetensors, a byte tokenizer."""
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(model.config.to_hf()))
    weights = {k: np.ascontiguousarray(v) for k, v in model.weights.items()}
    save_file(weights, str(folder / "model.safetensors"))
    tok = byte_level_tokenizer(())
    if model.config.vocab_size < 256:  # the bytes the model has ids for (ASCII fits in odd_qwen2's 131)
        from tokenizers import Tokenizer, decoders, pre_tokenizers
        from tokenizers.models import BPE

        from polyengine.models.tokenizer import BYTE_TO_UNICODE

        tok = Tokenizer(BPE(vocab={BYTE_TO_UNICODE[b]: b for b in range(model.config.vocab_size)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))


def _nanochat_folder(model, folder) -> None:
    from test_models_nanochat import _tokenizer_pickle

    folder.mkdir()
    c = model.config
    names = {"self_attn.q_proj": "attn.c_q", "self_attn.k_proj": "attn.c_k", "self_attn.v_proj": "attn.c_v",
             "self_attn.o_proj": "attn.c_proj", "mlp.up_proj": "mlp.c_fc", "mlp.down_proj": "mlp.c_proj"}
    state = {"transformer.wte.weight": model.weights["model.embed_tokens.weight"],
             "lm_head.weight": model.weights["lm_head.weight"]}
    for layer in range(c.num_hidden_layers):
        for hf, nc in names.items():
            state[f"transformer.h.{layer}.{nc}.weight"] = model.weights[f"model.layers.{layer}.{hf}.weight"]
    torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, folder / "model_000001.pt")
    meta = {"sequence_len": c.max_position_embeddings, "vocab_size": c.vocab_size, "n_layer": c.num_hidden_layers,
            "n_head": c.num_attention_heads, "n_kv_head": c.num_key_value_heads, "n_embd": c.hidden_size}
    (folder / "meta_000001.json").write_text(json.dumps({"model_config": meta}))
    _tokenizer_pickle(folder / "tokenizer.pkl")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """model_type -> the path a user would pass to --model."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for arch, name in ARCHITECTURE_MODELS.items():
        model = build_model(name)
        if arch in ARCH:
            out[arch] = root / f"{name}.gguf"
            _write(out[arch], model)
        elif arch == "nanochat":  # nanochat's tokenizer needs 256 bytes + 9 specials: a wider vocabulary
            from polyengine.models import Model
            from polyengine.models.presets import random_weights

            config = model.config.model_copy(update={"vocab_size": 288})
            out[arch] = root / name
            _nanochat_folder(Model(config, random_weights(config, seed=5)), out[arch])
        else:
            out[arch] = root / name
            _hf_folder(model, out[arch])
    return out


def _reference_tokens(path) -> list[int]:
    from polyengine import LLM, SamplingParams

    llm = LLM(model=load_model(path), backend="reference", max_slots=1, max_cache_length=64, max_prefill_length=32)
    prompt = llm.tokenizer.encode(PROMPT)
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))[0].outputs[0].token_ids


@pytest.mark.parametrize("backend", ["cpu", *HEAVY])
@pytest.mark.parametrize("arch", list(ARCHITECTURE_MODELS))
def test_generate_command_equals_the_reference(files, arch, backend, tmp_path):
    if backend in HEAVY and not os.environ.get("POLYENGINE_EVERY_BACKEND"):
        pytest.skip(f"{backend} compiles every model (minutes); set POLYENGINE_EVERY_BACKEND=1 to run it")
    path = files[arch]
    loaded = load_model(path)
    assert loaded.config.model_type == arch
    want = _reference_tokens(path)
    cmd = [sys.executable, "-m", "polyengine.cli", "generate", PROMPT, "--raw", "--model", str(path), "--backend",
           backend, "--temperature", "0", "--max-tokens", str(STEPS), "--json", "--context-length", "64"]
    env = {**os.environ, "POLYENGINE_NEURON_CACHE": str(tmp_path / "neuron"), "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)["token_ids"]
    # The command stops at an EOS; the reference ignored EOS, so compare what both produced.
    assert got == want[: len(got)] and got, (arch, backend, got, want)
