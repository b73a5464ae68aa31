"""GGUF reading: tiny files written with the gguf package, and the real default model.

Tiny models are written the way llama.cpp's converter writes them (Q/K rows permuted
for ``llama``, not for ``qwen2``), in several tensor types; reading them back must give
``gguf.quants.dequantize`` of the stored bytes with the permutation undone, and for
F32 exactly the original weights. The real SmolLM2 file must equal transformers' own
GGUF load bit for bit. Truncated, corrupt and unsupported files must say what is wrong.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from polyengine.errors import WeightsError
from polyengine.models import ModelConfig, load_model
from polyengine.models.gguf_io import read_gguf, unpermute_rows
from polyengine.models.presets import SPECIAL_TOKENS, preset_config, random_weights
from polyengine.models.tokenizer import BYTE_TO_UNICODE

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}

BYTE_TOKENS = [BYTE_TO_UNICODE[b] for b in range(256)] + list(SPECIAL_TOKENS)


def gguf_name(hf: str) -> str:
    if hf in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[rest]}"


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation (the inverse of what the reader undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode_tensor(w: np.ndarray, qtype) -> tuple[np.ndarray, object]:
    """(array to hand GGUFWriter.add_tensor, raw_dtype); K-quants get random block bytes
    because the gguf package cannot quantize them."""
    if qtype == Q.F32:
        return w.astype(np.float32), None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    try:
        return gguf.quants.quantize(w.astype(np.float32), qtype), qtype
    except NotImplementedError:
        shape = gguf.quants.quant_shape_to_byte_shape(w.shape, qtype)
        raw = np.random.default_rng(w.size).integers(0, 256, size=shape, dtype=np.uint8)
        # Every block (all have even sizes) keeps its float16 scales at even offsets;
        # clearing bit 6 of each odd byte keeps those scales finite (|d| < 2).
        raw[..., 1::2] &= 0xBF
        return raw, qtype


def write_gguf(
    path: Path,
    config: ModelConfig,
    weights: dict[str, np.ndarray],
    *,
    types=None,
    arch: str | None = None,
    tokens: list[str] | None = None,
    token_types: list[int] | None = None,
    tokenizer_model: str = "gpt2",
    scores: list[float] | None = None,
    pre: str | None = "default",
    extra_meta=None,
    extra_tensors=None,
    skip=(),
) -> dict[str, np.ndarray]:
    """Write ``weights`` as llama.cpp would; returns the expected HF weights on reading
    (dequantized stored bytes, permutation undone)."""
    arch = arch or config.model_type
    types = types or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    w.add_rope_dimension_count(config.head_dim)
    if config.rope_scaling is not None and config.rope_scaling.rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(config.rope_scaling.factor)
    tokens = tokens or BYTE_TOKENS + [f"[PAD{i}]" for i in range(config.vocab_size - len(BYTE_TOKENS))]
    w.add_tokenizer_model(tokenizer_model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types or [3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    if scores is not None:
        w.add_token_scores(scores)
    if tokenizer_model == "gpt2":
        w.add_token_merges([])
    for key, value in (extra_meta or {}).items():
        getattr(w, key)(value)
    expected = {}
    for name, arr in weights.items():
        if name in skip:
            continue
        qtype = types.get(name, Q.F32)
        stored = arr
        heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
        permuted = [h for p, h in heads.items() if f".{p}." in name]
        if arch == "llama" and permuted:
            stored = permute_rows(arr, permuted[0])
        data, raw = encode_tensor(stored, qtype)
        w.add_tensor(gguf_name(name), data, raw_dtype=raw)
        back = gguf.quants.dequantize(data, raw or qtype).reshape(arr.shape)
        expected[name] = unpermute_rows(back, permuted[0]) if arch == "llama" and permuted else back
    for name, data in (extra_tensors or {}).items():
        if isinstance(data, tuple):
            w.add_tensor(name, data[0], raw_dtype=data[1])
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _tiny_config(name="tiny-gqa", **update) -> ModelConfig:
    base = preset_config(name)
    return base.model_copy(update={"vocab_size": len(BYTE_TOKENS), **update})


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    config = _tiny_config()
    weights = random_weights(config, seed=3)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    types = {
        "model.embed_tokens.weight": Q.Q8_0,
        "model.layers.0.self_attn.q_proj.weight": Q.Q4_0,
        "model.layers.0.self_attn.k_proj.weight": Q.Q4_1,
        "model.layers.0.self_attn.v_proj.weight": Q.Q5_0,
        "model.layers.0.self_attn.o_proj.weight": Q.Q5_1,
        "model.layers.0.mlp.gate_proj.weight": Q.F16,
        "model.layers.0.mlp.up_proj.weight": Q.BF16,
        "model.layers.1.self_attn.q_proj.weight": Q.F16,
        "model.layers.1.self_attn.k_proj.weight": Q.Q8_0,
    }
    expected = write_gguf(path, config, weights, types=types)
    return path, config, weights, expected, types


def test_tiny_gguf_reads_back_dequantized_and_unpermuted(tiny_file):
    path, config, weights, expected, types = tiny_file
    model = load_model(path)
    # GGUF stores the epsilon as float32.
    eps = float(np.float32(config.rms_norm_eps))
    assert model.config == config.model_copy(
        update={"eos_token_ids": (), "bos_token_id": None, "pad_token_id": None, "rms_norm_eps": eps}
    )
    assert all(type(a) is np.ndarray for a in model.weights.values())
    assert set(model.weights) == set(weights)
    for name, want in expected.items():
        np.testing.assert_array_equal(model.weights[name], want, err_msg=name)
        if name not in types:  # stored as F32: the permutation round trip is exact
            np.testing.assert_array_equal(model.weights[name], weights[name], err_msg=name)
    q = model.weights["model.layers.0.self_attn.q_proj.weight"]
    assert np.abs(q - weights["model.layers.0.self_attn.q_proj.weight"]).max() < 0.01  # Q4_0 error, not a row mix-up
    assert model.meta["format"] == "gguf" and "Q4_0 x1" in model.meta["quantization"]
    assert model.tokenizer is not None and model.tokenizer.decode(model.tokenizer.encode("héllo")) == "héllo"


def test_float16_output_and_progress(tiny_file):
    path, _, _, expected, _ = tiny_file
    calls = []
    model = load_model(path, dtype="float16", progress=lambda done, total, what: calls.append((done, total, what)))
    assert [c[0] for c in calls] == list(range(1, len(expected) + 1)) and {c[2] for c in calls} == set(expected)
    for name, want in expected.items():
        assert model.weights[name].dtype == np.float16
        np.testing.assert_array_equal(model.weights[name], want.astype(np.float16))


def test_k_quants(tmp_path):
    # K-quant blocks are 256 wide, so rows must be multiples of 256.
    config = ModelConfig(vocab_size=len(BYTE_TOKENS), hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
    weights = random_weights(config, seed=1)
    kinds = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.Q4_K, Q.Q6_K]
    mats = [n for n, a in weights.items() if a.ndim == 2]
    types = dict(zip(mats, kinds))
    expected = write_gguf(tmp_path / "k.gguf", config, weights, types=types)
    model = load_model(tmp_path / "k.gguf")
    for name, want in expected.items():
        np.testing.assert_array_equal(model.weights[name], want, err_msg=f"{name} {types.get(name)}")
    assert "Q6_K x2" in model.meta["quantization"]


def test_qwen2_is_not_permuted(tmp_path):
    config = _tiny_config("tiny-qwen2")
    weights = random_weights(config, seed=2)
    write_gguf(tmp_path / "q.gguf", config, weights)
    model = load_model(tmp_path / "q.gguf")
    assert model.config.model_type == "qwen2" and model.config.attention_bias
    for name, want in weights.items():
        np.testing.assert_array_equal(model.weights[name], want, err_msg=name)


def test_llama3_rope_freqs_and_untied_head(tmp_path):
    config = _tiny_config("tiny-llama3")
    weights = random_weights(config, seed=4)
    plain = config.model_copy(update={"rope_scaling": None})
    divisors = (plain.rope_inv_freq() / config.rope_inv_freq()).astype(np.float32)
    write_gguf(tmp_path / "l3.gguf", config, weights, extra_tensors={"rope_freqs.weight": divisors})
    model = load_model(tmp_path / "l3.gguf")
    assert model.config.rope_scaling == config.rope_scaling
    assert not model.config.tie_word_embeddings and "rope_freqs.weight" not in model.weights
    np.testing.assert_array_equal(model.weights["lm_head.weight"], weights["lm_head.weight"])


def test_llama_with_biases_permutes_q_and_k_biases_too(tmp_path):
    config = _tiny_config(attention_bias=True, mlp_bias=True)
    weights = random_weights(config, seed=5)
    write_gguf(tmp_path / "b.gguf", config, weights)
    model = load_model(tmp_path / "b.gguf")
    assert model.config.attention_bias and model.config.mlp_bias
    for name, want in weights.items():
        np.testing.assert_array_equal(model.weights[name], want, err_msg=name)


def test_linear_rope_scaling_metadata(tmp_path):
    config = _tiny_config("tiny-deep")
    write_gguf(tmp_path / "lin.gguf", config, random_weights(config))
    assert read_gguf(tmp_path / "lin.gguf").config().rope_scaling == config.rope_scaling


def test_conversion_is_tensor_by_tensor(tmp_path):
    """Peak memory stays near the final weights (not twice): false-failure chance nil,
    the bound has ~25% slack over one tensor's temporaries."""
    config = ModelConfig(vocab_size=len(BYTE_TOKENS), hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    weights = random_weights(config)
    path = tmp_path / "m.gguf"
    write_gguf(path, config, weights, types={n: Q.Q8_0 for n, a in weights.items() if a.ndim == 2})
    final = sum(a.nbytes for a in weights.values())
    del weights
    g = read_gguf(path)
    tracemalloc.start()
    try:
        out = g.load_weights()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(a.nbytes for a in out.values()) == final
    assert peak < 1.5 * final, (peak, final)


# -- broken files --------------------------------------------------------------------------


def test_truncated_data_names_the_tensor(tiny_file, tmp_path):
    src = tiny_file[0]
    path = tmp_path / "cut.gguf"
    path.write_bytes(src.read_bytes()[:-100])
    last = max(read_gguf(src).tensors.values(), key=lambda t: t.offset).name
    with pytest.raises(WeightsError, match="truncated") as info:
        load_model(path)
    assert info.value.file == str(path) and info.value.tensor == last


def test_a_file_cut_after_its_header_was_read_names_the_tensor(tiny_file, tmp_path):
    """Records are views of one mapping of the whole file, made at the first record: a
    file that shrank between reading its header and its tensors is refused, not read short."""
    path = tmp_path / "shrinks.gguf"
    path.write_bytes(tiny_file[0].read_bytes())
    g = read_gguf(path)
    last = max(g.tensors.values(), key=lambda t: t.offset)
    with open(path, "r+b") as f:
        f.truncate(last.offset + last.nbytes - 10)
    with pytest.raises(WeightsError, match="truncated") as info:
        g.load_records()
    assert info.value.tensor == last.name


def test_records_share_one_mapping_and_known_formats_need_no_gguf_package(tiny_file):
    """One mapping per file (not one a tensor), and a file of the formats polyengine reads
    itself loads without importing the gguf package (~50 ms of every load)."""
    import subprocess
    import sys

    records = read_gguf(tiny_file[0]).load_records()
    bases = {id(_root(w.data)) for w in records.values() if w.data.base is not None and w.format != "F32"}
    assert len(bases) <= 1
    code = ("import sys; from polyengine.models import load_model; load_model(sys.argv[1]); "
            "print('gguf' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_file[0])], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def _root(a):
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


@pytest.mark.parametrize("keep", [3, 30, 400, 5000])
def test_truncated_header(tiny_file, tmp_path, keep):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_file[0].read_bytes()[:keep])
    with pytest.raises(WeightsError, match="truncated|too short") as info:
        load_model(path)
    assert info.value.file == str(path)


def test_bad_magic_and_version(tiny_file, tmp_path):
    data = bytearray(tiny_file[0].read_bytes())
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUX" + data[4:])
    with pytest.raises(WeightsError, match="not a GGUF file"):
        load_model(path)
    data[4:8] = (9).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="version 9"):
        load_model(path)


def test_corrupt_metadata_type(tiny_file, tmp_path):
    data = bytearray(tiny_file[0].read_bytes())
    # The first key is general.architecture (a string, type 8); make its type unknown.
    key = b"general.architecture"
    at = data.index(key) + len(key)
    assert data[at:at + 4] == (8).to_bytes(4, "little")
    data[at:at + 4] = (99).to_bytes(4, "little")
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="unknown metadata value type 99"):
        load_model(path)


def test_unsupported_architecture(tmp_path):
    config = _tiny_config()
    write_gguf(tmp_path / "x.gguf", config, random_weights(config), arch="gptneox")
    with pytest.raises(WeightsError, match="'gptneox'.*llama, qwen2"):
        load_model(tmp_path / "x.gguf")


def test_unsupported_quantization_type(tmp_path):
    config = _tiny_config()
    weights = random_weights(config)
    name = "model.layers.0.mlp.down_proj.weight"
    shape = gguf.quants.quant_shape_to_byte_shape(weights[name].shape, Q.Q8_1)
    raw = np.zeros(shape, dtype=np.uint8)
    write_gguf(tmp_path / "x.gguf", config, weights, skip={name},
               extra_tensors={"blk.0.ffn_down.weight": (raw, Q.Q8_1)})
    with pytest.raises(WeightsError, match="Q8_1 is not supported.*supported: .*Q4_K") as info:
        load_model(tmp_path / "x.gguf")
    assert info.value.tensor == "blk.0.ffn_down.weight"


def test_missing_extra_and_misshapen_tensors(tmp_path):
    config = _tiny_config()
    weights = random_weights(config)
    write_gguf(tmp_path / "a.gguf", config, weights, skip={"model.norm.weight"})
    with pytest.raises(WeightsError, match="missing") as info:
        load_model(tmp_path / "a.gguf")
    assert info.value.tensor == "model.norm.weight"
    write_gguf(tmp_path / "b.gguf", config, weights, extra_tensors={"blk.0.attn_gizmo.weight": np.ones(4, np.float32)})
    with pytest.raises(WeightsError, match="unexpected") as info:
        load_model(tmp_path / "b.gguf")
    assert info.value.tensor == "blk.0.attn_gizmo.weight"
    write_gguf(tmp_path / "c.gguf", config, weights, skip={"model.norm.weight"},
               extra_tensors={"output_norm.weight": np.ones(7, np.float32)})
    with pytest.raises(WeightsError, match=r"shape \(7,\)") as info:
        load_model(tmp_path / "c.gguf")
    assert info.value.tensor == "output_norm.weight"


# -- the real default model ------------------------------------------------------------------


def test_default_model_config_matches_transformers(default_gguf, smollm2_oracle):
    cfg = read_gguf(default_gguf).config()
    for key, value in smollm2_oracle["config"].items():
        if key == "eos_token_id":
            assert cfg.eos_token_ids == (value,)
        else:
            assert getattr(cfg, key) == value, key


def test_default_model_weights_equal_transformers_bit_for_bit(default_gguf, smollm2_oracle):
    from test_models_oracle import digest

    model = load_model(default_gguf)
    want = smollm2_oracle["weights"]
    assert set(model.weights) == set(want)
    wrong_shape = [n for n, (shape, _) in want.items() if list(model.weights[n].shape) != shape]
    assert not wrong_shape
    different = [n for n, (_, d) in want.items() if digest(model.weights[n]) != d]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"
    assert model.meta["quantization"] == "Q4_1 x210, F32 x61, Q8_0 x1"
