"""Hostile inputs, class "malformed metadata": every value read from a model file is
validated into ModelConfigError / WeightsError naming the file, the key and the
allowed form, never a raw ZeroDivisionError, ValueError, TypeError or RecursionError.

Each case writes one bad HF folder or GGUF file (everything else valid) and loads it
in a child process under a memory limit; the last case loads a good model in the same
process to show nothing was left broken.
"""

from __future__ import annotations

import json
from pathlib import Path

from hostile_files import ARR, BOOL, F32, I32, STR, U32, U64, tiny_hf_config, write_hf_folder, write_tiny_gguf
from hostile_runner import case, check, run_cases
from polyengine.errors import ModelConfigError, WeightsError


def _load(path: Path) -> None:
    from polyengine.models import load_model

    load_model(str(path))


def _hf(tmp: Path, **changes) -> None:
    cfg = tiny_hf_config()
    cfg.update(changes)
    _load(write_hf_folder(tmp / "m", config=cfg))


def _gguf(tmp: Path, **kv) -> None:
    _load(write_tiny_gguf(tmp / "m.gguf", kv=kv))


# -- HF config.json -------------------------------------------------------------------------


@case(ModelConfigError, "config.json", "num_attention_heads", "from 1")
def hf_zero_heads(tmp):
    _hf(tmp, num_attention_heads=0, head_dim=None)


@case(ModelConfigError, "config.json", "rope_scaling", "object")
def hf_rope_scaling_is_a_string(tmp):
    _hf(tmp, rope_scaling="linear")


@case(ModelConfigError, "config.json", "rope_scaling", "object")
def hf_rope_scaling_is_a_list(tmp):
    _hf(tmp, rope_scaling=[["rope_type", "linear"]])


@case(ModelConfigError, "config.json", "eos_token_id", "integer")
def hf_eos_is_text(tmp):
    _hf(tmp, eos_token_id="abc")


@case(ModelConfigError, "config.json", "eos_token_id", "integer")
def hf_eos_list_holds_a_float(tmp):
    _hf(tmp, eos_token_id=[257, 2.5])


@case(ModelConfigError, "config.json", "hidden_size", "integer")
def hf_hidden_size_is_text(tmp):
    _hf(tmp, hidden_size="64")


@case(ModelConfigError, "config.json", "rope_theta", "number")
def hf_rope_theta_is_text(tmp):
    _hf(tmp, rope_theta="big")


@case(ModelConfigError, "config.json", "partial_rotary_factor", "number")
def hf_partial_rotary_is_text(tmp):
    _hf(tmp, partial_rotary_factor="half")


@case(ModelConfigError, "config.json", "nested", "32")
def hf_deeply_nested_json(tmp):
    deep = "[" * 100_000 + "]" * 100_000
    _load(write_hf_folder(tmp / "m", config=json.dumps(tiny_hf_config())[:-1] + f', "x": {deep}}}'))


@case(ModelConfigError, "config.json", "rope_scaling", "factor")
def hf_rope_factor_is_text(tmp):
    _hf(tmp, rope_scaling={"rope_type": "linear", "factor": "two"})


@case(ModelConfigError, "config.json", "max_position_embeddings", "integer")
def hf_positions_is_a_float(tmp):
    _hf(tmp, max_position_embeddings=1e30)


@case(ModelConfigError, "generation_config.json", "eos_token_id", "integer")
def hf_generation_config_eos_is_a_dict(tmp):
    folder = write_hf_folder(tmp / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": {"a": 1}}))
    _load(folder)


@case(ModelConfigError, "tokenizer_config.json", "chat_template", "string")
def hf_chat_template_is_a_number(tmp):
    _load(write_hf_folder(tmp / "m", tokenizer_config={"chat_template": 12}))


@case(ModelConfigError, "config.json", "JSON object")
def hf_config_is_a_list(tmp):
    _load(write_hf_folder(tmp / "m", config="[1, 2]"))


@case(ModelConfigError, "config.json", "NaN")
def hf_config_with_nan(tmp):
    _load(write_hf_folder(tmp / "m", config=json.dumps(tiny_hf_config())[:-1] + ', "rms_norm_eps": NaN}'))


# -- GGUF metadata --------------------------------------------------------------------------


@case(ModelConfigError, "m.gguf", "llama.attention.head_count", "from 1")
def gguf_zero_heads(tmp):
    _gguf(tmp, **{"llama.attention.head_count": (U32, 0)})


@case(WeightsError, "m.gguf", "general.alignment", "integer")
def gguf_alignment_is_a_string(tmp):
    _gguf(tmp, **{"general.alignment": (STR, "32")})


@case(WeightsError, "m.gguf", "general.alignment", "power of two")
def gguf_alignment_is_zero(tmp):
    _gguf(tmp, **{"general.alignment": (U32, 0)})


@case(ModelConfigError, "m.gguf", "llama.embedding_length", "integer")
def gguf_embedding_length_is_a_string(tmp):
    _gguf(tmp, **{"llama.embedding_length": (STR, "64")})


@case(ModelConfigError, "m.gguf", "llama.rope.freq_base", "number")
def gguf_rope_base_is_an_array(tmp):
    _gguf(tmp, **{"llama.rope.freq_base": (ARR, (F32, [1.0, 2.0]))})


@case(ModelConfigError, "m.gguf", "tokenizer.ggml.eos_token_id", "integer")
def gguf_eos_is_a_string(tmp):
    _gguf(tmp, **{"tokenizer.ggml.eos_token_id": (STR, "abc")})


@case(ModelConfigError, "m.gguf", "tokenizer.ggml.bos_token_id", "from 0 to 287")
def gguf_bos_out_of_vocab(tmp):
    _gguf(tmp, **{"tokenizer.ggml.bos_token_id": (U64, 2**40)})


@case(ModelConfigError, "m.gguf", "tokenizer.ggml.tokens", "strings")
def gguf_tokens_are_numbers(tmp):
    _gguf(tmp, **{"tokenizer.ggml.tokens": (ARR, (I32, list(range(288))))})


@case(ModelConfigError, "m.gguf", "tokenizer.ggml.merges", "strings")
def gguf_merges_are_numbers(tmp):
    _gguf(tmp, **{"tokenizer.ggml.merges": (ARR, (I32, [1, 2]))})


@case(ModelConfigError, "m.gguf", "tokenizer.ggml.token_type", "integers")
def gguf_token_types_are_strings(tmp):
    _gguf(tmp, **{"tokenizer.ggml.token_type": (ARR, (STR, ["x"] * 288))})


@case(ModelConfigError, "m.gguf", "tokenizer.chat_template", "string")
def gguf_template_is_a_number(tmp):
    _gguf(tmp, **{"tokenizer.chat_template": (U32, 7)})


@case(ModelConfigError, "m.gguf", "tokenizer.ggml.add_bos_token", "true or false")
def gguf_add_bos_is_a_string(tmp):
    _gguf(tmp, **{"tokenizer.ggml.add_bos_token": (STR, "no")})


@case(WeightsError, "m.gguf", "general.architecture", "string")
def gguf_architecture_is_a_number(tmp):
    _gguf(tmp, **{"general.architecture": (U32, 1)})


@case(ModelConfigError, "m.gguf", "llama.rope.scaling.factor", "number")
def gguf_rope_factor_is_a_string(tmp):
    _gguf(tmp, **{"llama.rope.scaling.type": (STR, "linear"), "llama.rope.scaling.factor": (STR, "x")})


@case(ModelConfigError, "m.gguf", "llama.attention.layer_norm_rms_epsilon", "number")
def gguf_eps_is_a_bool(tmp):
    _gguf(tmp, **{"llama.attention.layer_norm_rms_epsilon": (BOOL, True)})


@case(None)
def a_good_model_still_loads_and_runs(tmp):
    import polyengine

    llm = polyengine.LLM(str(write_tiny_gguf(tmp / "ok.gguf")), "reference", max_cache_length=64)
    out = llm.generate(["hello"], {"max_tokens": 4, "seed": 3})[0]
    assert len(out.token_ids) == 4


def test_malformed_metadata_ends_in_typed_errors_naming_file_and_key(tmp_path):
    results = run_cases(__name__.rpartition(".")[2], tmp_path)
    problems = check(__name__.rpartition(".")[2], results)
    assert not problems, "\n".join(problems)
