"""Safetensors folders against transformers' own ``save_pretrained`` output.

Tiny random Llama and Qwen2 models are saved by transformers in float32, float16 and
bfloat16 (and sharded); loading them must give exactly the saved values (widened to
float32, which is exact for both half formats). Broken checkpoints must fail with a
WeightsError naming the file and the tensor.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct

import numpy as np
import pytest

from polyengine.models.config_files import config_from_file
from polyengine.errors import WeightsError
from polyengine.models import ModelConfig, load_model
from polyengine.models.safetensors_io import read_safetensors_header, widen_bf16

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
st_numpy = pytest.importorskip("safetensors.numpy")


def _tiny(kind: str, tie: bool, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **common, head_dim=8,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():  # HF initialises biases to zero; make them visible
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model.eval()


def _expected(model, tie: bool) -> dict[str, np.ndarray]:
    out = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if tie:
        out.pop("lm_head.weight")
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: (folder, expected float32 weights)} for each saved variant."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    llama = _tiny("llama", tie=False)
    for dtype in ("float32", "float16", "bfloat16"):
        m = llama.to(getattr(torch, dtype))
        m.save_pretrained(root / f"llama-{dtype}")
        out[f"llama-{dtype}"] = (root / f"llama-{dtype}", _expected(m, tie=False))
    llama = llama.float()
    llama.save_pretrained(root / "llama-sharded", max_shard_size="20KB")
    out["llama-sharded"] = (root / "llama-sharded", _expected(llama, tie=False))
    qwen = _tiny("qwen2", tie=True).to(torch.bfloat16)
    qwen.save_pretrained(root / "qwen2-bf16-tied")
    out["qwen2-bf16-tied"] = (root / "qwen2-bf16-tied", _expected(qwen, tie=True))
    return out


def _copy(saved, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(saved[name][0], dst)
    return dst


@pytest.mark.parametrize("name", ["llama-float32", "llama-float16", "llama-bfloat16", "llama-sharded", "qwen2-bf16-tied"])
def test_weights_equal_what_transformers_saved(saved, name):
    folder, expected = saved[name]
    model = load_model(folder)
    stored = {"float16": "F16", "bfloat16": "BF16", "bf16": "BF16"}.get(name.split("-")[1], "F32")
    assert set(model.weights) == set(expected)
    for key, want in expected.items():
        record = model.records[key]
        assert record.format == stored and not record.data.flags.writeable  # the file's own dtype, mapped
        got = model.weights[key]
        assert got.dtype == (np.float16 if stored == "F16" else np.float32) and type(got) is np.ndarray
        np.testing.assert_array_equal(got, want, err_msg=key)
    widened = load_model(folder, dtype="float32")  # the option: every tensor float32 at load, held
    for key, want in expected.items():
        assert widened.records[key].format == "F32" and widened.records[key].data.flags.writeable
        np.testing.assert_array_equal(widened.weights[key], want, err_msg=key)
    assert model.config == config_from_file(folder / "config.json")
    assert not model.is_random and model.source == str(folder)


def test_sharded_save_really_is_sharded(saved):
    folder = saved["llama-sharded"][0]
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 2


def test_qwen2_biases_and_tied_head(saved):
    model = load_model(saved["qwen2-bf16-tied"][0])
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert "lm_head.weight" not in model.weights
    assert np.abs(model.weights["model.layers.1.self_attn.k_proj.bias"]).max() > 0


def test_bf16_widening_is_exact():
    x = np.array([1.0, -2.5, 3.140625, np.inf, -0.0, 1e-40], dtype=np.float32)
    bf16 = torch.from_numpy(x).to(torch.bfloat16)
    np.testing.assert_array_equal(widen_bf16(bf16.view(torch.uint16).numpy()), bf16.float().numpy())


def test_float16_output(saved):
    folder, expected = saved["llama-bfloat16"]
    model = load_model(folder, dtype="float16")
    for key, want in expected.items():
        assert model.weights[key].dtype == np.float16
        np.testing.assert_array_equal(model.weights[key], want.astype(np.float16))


def test_old_rope_spelling_written_by_hand(saved, tmp_path):
    folder = _copy(saved, "llama-float32", tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = params
    (folder / "config.json").write_text(json.dumps(raw))
    assert load_model(folder).config == load_model(saved["llama-float32"][0]).config


def test_progress_reports_every_tensor(saved):
    calls = []
    folder, expected = saved["llama-sharded"]
    load_model(folder, progress=lambda done, total, what: calls.append((done, total, what)))
    assert [c[0] for c in calls] == list(range(1, len(expected) + 1))
    assert {c[1] for c in calls} == {len(expected)} and {c[2] for c in calls} == set(expected)


def test_missing_tokenizer_loads_with_a_warning(saved, caplog):
    with caplog.at_level(logging.WARNING):
        model = load_model(saved["llama-float32"][0])
    assert model.tokenizer is None and "tokenizer.json" in caplog.text


# -- broken checkpoints --------------------------------------------------------------------


def _rewrite(folder, edit):
    """Rewrite model.safetensors (float32) after ``edit(dict_of_arrays)``."""
    path = folder / "model.safetensors"
    tensors = dict(st_numpy.load_file(path))
    edit(tensors)
    st_numpy.save_file(tensors, path)
    return path


def test_truncated_file_names_file_and_tensor(saved, tmp_path):
    folder = _copy(saved, "llama-float32", tmp_path)
    path = folder / "model.safetensors"
    last = max(read_safetensors_header(path).values(), key=lambda e: e.end).name
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10)
    with pytest.raises(WeightsError, match="truncated") as info:
        load_model(folder)
    assert info.value.file == str(path) and info.value.tensor == last


def test_truncated_header(saved, tmp_path):
    folder = _copy(saved, "llama-float32", tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(WeightsError, match="header") as info:
        load_model(folder)
    assert info.value.file == str(path)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(WeightsError, match="too short"):
        load_model(folder)


def test_corrupt_header(saved, tmp_path):
    folder = _copy(saved, "llama-float32", tmp_path)
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"\xff" * 8
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="corrupt"):
        load_model(folder)


def test_inconsistent_offsets(saved, tmp_path):
    folder = _copy(saved, "llama-float32", tmp_path)
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header["model.norm.weight"]["shape"] = [31]
    blob = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(blob) == n
    path.write_bytes(raw[:8] + blob + raw[8 + n :])
    with pytest.raises(WeightsError) as info:
        load_model(folder)
    assert info.value.tensor == "model.norm.weight" and "bytes" in str(info.value)


def test_missing_tensor(saved, tmp_path):
    folder = _copy(saved, "llama-float32", tmp_path)
    path = _rewrite(folder, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(WeightsError, match="missing") as info:
        load_model(folder)
    assert info.value.tensor == "model.norm.weight" and info.value.file == str(path)


def test_missing_head_of_untied_model(saved, tmp_path):
    folder = _copy(saved, "llama-float32", tmp_path)
    _rewrite(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(WeightsError) as info:
        load_model(folder)
    assert info.value.tensor == "lm_head.weight"


def test_extra_tensor_but_rotary_buffers_are_ignored(saved, tmp_path):
    folder = _copy(saved, "llama-float32", tmp_path)
    _rewrite(folder, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}))
    load_model(folder)
    path = _rewrite(folder, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.ones(4, np.float32)}))
    with pytest.raises(WeightsError, match="unexpected") as info:
        load_model(folder)
    assert info.value.tensor == "model.layers.0.mlp.extra.weight" and info.value.file == str(path)


def test_wrong_shape(saved, tmp_path):
    folder = _copy(saved, "llama-float32", tmp_path)
    path = _rewrite(folder, lambda t: t.update({"model.norm.weight": np.ones(31, np.float32)}))
    with pytest.raises(WeightsError, match=r"shape \(31,\), expected \(32,\)") as info:
        load_model(folder)
    assert info.value.tensor == "model.norm.weight" and info.value.file == str(path)


def test_tied_checkpoint_with_a_stored_head_drops_it(saved, tmp_path):
    folder = _copy(saved, "llama-float32", tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": True}))
    model = load_model(folder)
    assert "lm_head.weight" not in model.weights
    assert np.shares_memory(model.lm_head, model.records["model.embed_tokens.weight"].data)  # the one table


def test_unsupported_dtype(saved, tmp_path):
    folder = _copy(saved, "llama-float32", tmp_path)
    _rewrite(folder, lambda t: t.update({"model.norm.weight": np.ones(32, np.int64)}))
    with pytest.raises(WeightsError, match="I64") as info:
        load_model(folder)
    assert info.value.tensor == "model.norm.weight"


def test_missing_shard(saved, tmp_path):
    folder = _copy(saved, "llama-sharded", tmp_path)
    victim = sorted(folder.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(WeightsError, match="missing") as info:
        load_model(folder)
    assert info.value.file == str(victim)


def test_pickle_checkpoints_are_refused(tmp_path, saved):
    folder = _copy(saved, "llama-float32", tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(WeightsError, match="pickle"):
        load_model(folder)
