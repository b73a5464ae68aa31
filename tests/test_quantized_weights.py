"""Quantized weights as model data: block formats dequantized exactly by our own code
(checked against gguf-py's independent implementation and against blocks worked out by
hand), records memory-mapped and never widened at load, per-tensor conversion for
backends that do not compute on a format, tiny quantized models that every format loads
and that the reference and cuda_torch (through the conversion) generate on alike.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from polyengine.models import load_model
from polyengine.models.blocks import BLOCK_FORMATS, EXACT_FLOAT32, FORMATS, dequantize_blocks, quantize_blocks
from polyengine.models.quant_presets import QUANT_FORMATS, quantized_config, quantized_model_file
from polyengine.models.presets import random_weights

gguf = pytest.importorskip("gguf")


def _random_blocks(fmt: str, n: int, seed: int) -> np.ndarray:
    """Random bytes with every f16 field finite (each block's f16 fields sit at even
    offsets; clearing bit 6 of every odd byte keeps |value| < 2)."""
    raw = np.random.default_rng(seed).integers(0, 256, size=(n, FORMATS[fmt].nbytes), dtype=np.uint8)
    raw[:, 1::2] &= 0xBF
    return raw


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_dequantization_equals_gguf_py_on_random_blocks(fmt):
    raw = _random_blocks(fmt, 512, seed=len(fmt) * 7 + FORMATS[fmt].ggml_type)
    ours = dequantize_blocks(fmt, raw)  # float64, exact
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(ours.shape)  # float32
    assert np.isfinite(ours).all()
    if fmt in EXACT_FLOAT32:  # one product of <= 19 bits: float32 holds it, so both are exact
        np.testing.assert_array_equal(ours, theirs.astype(np.float64))
        np.testing.assert_array_equal(dequantize_blocks(fmt, raw, np.float32), theirs)
    else:  # gguf-py rounds its float32 products and sums: within 2 float32 ulps of the exact value
        np.testing.assert_allclose(theirs, ours, rtol=2.5e-7, atol=1e-30)
        np.testing.assert_array_equal(dequantize_blocks(fmt, raw, np.float32), ours.astype(np.float32))


def _f16(x: float) -> list[int]:
    return list(np.array([x], "<f2").view(np.uint8))


def test_hand_computed_blocks():
    # Q8_0: d = 0.5, q = -16..15 -> w = q / 2
    q = np.arange(-16, 16, dtype=np.int8)
    raw = np.array([_f16(0.5) + list(q.view(np.uint8))], np.uint8)
    np.testing.assert_array_equal(dequantize_blocks("Q8_0", raw)[0], q / 2)
    # Q4_0: d = 2, byte j = low (j % 16) | high 15 - (j % 16): weights j and j + 16
    nib = np.arange(16, dtype=np.uint8)
    raw = np.array([_f16(2.0) + list(nib | ((15 - nib) << 4))], np.uint8)
    np.testing.assert_array_equal(dequantize_blocks("Q4_0", raw)[0], 2.0 * (np.concatenate([nib, 15 - nib]) - 8.0))
    # Q4_1: d = 0.25, m = -1
    raw = np.array([_f16(0.25) + _f16(-1.0) + list(nib | ((15 - nib) << 4))], np.uint8)
    np.testing.assert_array_equal(dequantize_blocks("Q4_1", raw)[0], 0.25 * np.concatenate([nib, 15 - nib]) - 1.0)
    # Q5_0: qh = bit j set for odd j: odd weights get +16; d = 1
    qh = sum(1 << j for j in range(1, 32, 2))
    raw = np.array([_f16(1.0) + list(np.array([qh], "<u4").view(np.uint8)) + list(nib | (nib << 4))], np.uint8)
    want = np.concatenate([nib, nib]).astype(float) + 16 * (np.arange(32) % 2) - 16
    np.testing.assert_array_equal(dequantize_blocks("Q5_0", raw)[0], want)
    # Q5_1: same bits, d = 0.5, m = 3
    raw = np.array([_f16(0.5) + _f16(3.0) + list(np.array([qh], "<u4").view(np.uint8)) + list(nib | (nib << 4))],
                   np.uint8)
    np.testing.assert_array_equal(dequantize_blocks("Q5_1", raw)[0], 0.5 * (want + 16) + 3.0)
    # Q4_K: d = 1, dmin = 0.5; sub-block s has scale s + 1 and min 2 s (s >= 4 use the
    # split 4 + 2 bit encoding); every nibble 3 -> w = (s + 1) * 3 - 0.5 * 2 s
    sc, mn = np.arange(1, 9), 2 * np.arange(8)
    packed = [0] * 12
    for j in range(4):
        packed[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6)
        packed[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6)
        packed[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4)
    raw = np.array([_f16(1.0) + _f16(0.5) + packed + [0x33] * 128], np.uint8)
    want = np.repeat((sc * 3 - 0.5 * mn).astype(float), 32)
    np.testing.assert_array_equal(dequantize_blocks("Q4_K", raw)[0], want)
    # Q5_K: the same header, fifth bits set for sub-blocks 0 and 7 only -> +16 there
    raw = np.array([_f16(1.0) + _f16(0.5) + packed + [0x81] * 32 + [0x33] * 128], np.uint8)
    bonus = np.repeat(np.array([16, 0, 0, 0, 0, 0, 0, 16]) * sc, 32)
    np.testing.assert_array_equal(dequantize_blocks("Q5_K", raw)[0], want + bonus)
    # Q6_K: d = 0.5, scale i = i - 8 per 16 weights, every stored 6-bit value 33 (q = 1):
    # low nibble 1 everywhere, high 2 bits 2 everywhere (0b10 in each of the 4 slots)
    scales = np.arange(-8, 8, dtype=np.int8)
    raw = np.array([[0x11] * 128 + [0xAA] * 64 + list(scales.view(np.uint8)) + _f16(0.5)], np.uint8)
    np.testing.assert_array_equal(dequantize_blocks("Q6_K", raw)[0], np.repeat(0.5 * scales.astype(float), 16))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_quantizer_writes_valid_blocks(fmt):
    """Our quantizer's blocks read back (by us and by gguf-py alike) within a step of the input."""
    x = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    raw = quantize_blocks(fmt, x)
    back = dequantize_blocks(fmt, raw.reshape(-1, FORMATS[fmt].nbytes)).reshape(x.shape)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(x.shape)
    np.testing.assert_allclose(theirs, back, rtol=2.5e-7, atol=1e-30)
    levels = {"Q8_0": 127, "Q6_K": 31, "Q5_0": 15, "Q5_1": 31, "Q5_K": 31}.get(fmt, 7)
    assert np.abs(back - x).max() < 2.5 * np.abs(x).max() / levels


def _is_file_map(arr: np.ndarray) -> bool:
    """Whether ``arr`` is a view of a memory-mapped file (its base chain ends in an mmap)."""
    import mmap

    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, mmap.mmap)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {fmt: quantized_model_file(fmt, root) for fmt in ("F16", "BF16", *QUANT_FORMATS)}


def test_records_are_the_files_blocks_never_copied(files):
    model = load_model(files["Q4_K"])
    assert model.formats == {"Q4_K": 16, "F32": 5}
    for name, record in model.records.items():
        assert not record.data.flags.writeable and _is_file_map(record.data), name
    q = model.records["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (256, 256) and q.data.ndim == 4  # the Q/K permutation: a strided view of whole block rows
    assert model.stored_bytes == sum(r.nbytes for r in model.records.values()) < 8 * 2**20
    assert model.conversion_bytes() == 4 * sum(np.prod(r.shape) for r in model.records.values() if r.format == "Q4_K")
    # The float view converts on read (not kept): equal to the exact dequantization,
    # rounded once; the reference's float64 conversion keeps it exact.
    exact = dequantize_blocks("Q4_K", q.rows().reshape(-1, 144)).reshape(256, 256)
    np.testing.assert_array_equal(model.weights[q.name and "model.layers.0.self_attn.q_proj.weight"],
                                  exact.astype(np.float32))
    np.testing.assert_array_equal(q.to_float(np.float64), exact)
    # A backend that computes on floats only gets the tensor converted, alone.
    converted = model.weight("model.layers.0.mlp.up_proj.weight")
    assert converted.format == "F32" and converted.shape == (512, 256)
    assert model.weight("model.layers.0.mlp.up_proj.weight", ("Q4_K",)) is model.records[
        "model.layers.0.mlp.up_proj.weight"]


def test_in_memory_quantized_records_equal_the_files(files):
    """quantized_records (no file, HF row order) gives the same weights as the GGUF file
    (Q/K permuted by the writer, unpermuted by the reader)."""
    from polyengine.models import Model
    from polyengine.models.quant_presets import quantized_records

    config = quantized_config()
    memory = Model(config, quantized_records(random_weights(config, seed=0), "Q5_K"))
    loaded = load_model(files["Q5_K"])
    assert memory.formats == loaded.formats == {"Q5_K": 16, "F32": 5}
    for name in config.weight_shapes():
        np.testing.assert_array_equal(memory.weights[name], loaded.weights[name], err_msg=name)


def test_every_format_loads_and_is_close_to_its_source(files):
    source = random_weights(quantized_config(), seed=0)
    for fmt, path in files.items():
        model = load_model(path)
        assert set(model.formats) == {fmt, "F32"}, fmt
        for name, want in source.items():
            got = model.weights[name]
            assert np.abs(got - want).max() < 0.02, (fmt, name)  # the format's error, not a row mix-up


@pytest.mark.slow
def test_reference_and_torch_backends_generate_alike_on_every_format(files):
    """The reference on the exactly dequantized blocks (float64) and the torch backends
    on the CPU (cpu, and cuda_torch's device path on its CPU stand-in), each reading the
    blocks through its declared weight_formats (computed on, or converted one tensor at a
    time), give the same greedy tokens, for every format."""
    import polyengine as pe

    pytest.importorskip("torch")
    greedy = pe.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2)
    for fmt, path in files.items():
        model = load_model(path)
        got = {}
        for backend, options in (("reference", {}), ("cpu", {}), ("cuda_torch", {"device": "cpu"})):
            llm = pe.LLM(model, backend=backend, max_slots=1, max_cache_length=64, max_prefill_length=32,
                         options=options)
            got[backend] = llm.generate(["hello"], greedy)[0].outputs[0]
        ref = got.pop("reference")
        assert len(ref.token_ids) == 8
        for step, top in enumerate(ref.top_logprobs):
            for backend, out in got.items():
                assert out.token_ids[step] == ref.token_ids[step], (fmt, backend, step, ref.token_ids, out.token_ids)
            first, second = sorted(top.values(), reverse=True)
            if first - second < 1e-3:  # a near tie (F16's file has one of 1e-4): later steps may part by float noise
                break
        assert model.formats[fmt] == 16  # still the file's blocks: nothing widened into the Model


_PEAK = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    from polyengine.models import load_model
    from polyengine.models.quantize import quantize_model

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    path, dtype = sys.argv[1], (None if sys.argv[2] == "stored" else sys.argv[2])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts here: what the imports held is not counted
    base = status("VmRSS")
    model = load_model(path, dtype=dtype)
    loaded = status("VmHWM") - base
    copies = quantize_model(model, "int8-block32")
    print(json.dumps({"load": loaded, "quantize": status("VmHWM") - base, "params": model.config.num_parameters(),
                      "int8": sum(a.nbytes for a in copies.values())}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS from /proc/self/status")
def test_loading_and_int8_requantization_never_hold_a_float32_model(tmp_path):
    """A Q4_K file of 31M parameters (125 MB as float32, 18 MB as blocks), loaded and then
    requantized to int8-block32 in a fresh process: the peak RSS growth of the whole
    process (VmHWM, restarted after the imports; the file's mapped pages count) stays
    at the file for the load (measured 22 MiB), and at the file plus the int8 copies
    (1.125 bytes a weight) plus one converted matrix for the requantization (measured 69
    MiB, 0.57x the float32 model; 78 MiB before the converted matrices' memory was
    handed back as they went).
    Widening at load (the option) holds it all, which shows the measurement can fail.
    (Building an engine on the reference backend is not measured: it widens every
    weight to its float64 compute dtype by design, the oracle's one job being exactness.)"""
    from polyengine.models.presets import preset_config
    from polyengine.models.quant_presets import write_llama_gguf

    config = preset_config("tiny").model_copy(update=dict(
        hidden_size=1024, intermediate_size=2560, num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=4,
        head_dim=64, tie_word_embeddings=True))
    path = write_llama_gguf(tmp_path / "q4k.gguf", config, random_weights(config, seed=2), "Q4_K")
    runs = {}
    for dtype in ("stored", "float32"):
        out = subprocess.run([sys.executable, "-c", _PEAK, str(path), dtype], capture_output=True, text=True,
                             timeout=300, check=True)
        runs[dtype] = json.loads(out.stdout)
    stored, file_bytes = runs["stored"], path.stat().st_size
    float32_model = 4 * stored["params"]
    mib = 2**20
    assert float32_model > 120 * mib and file_bytes < 0.15 * float32_model, (float32_model, file_bytes)
    largest = 4 * config.hidden_size * config.intermediate_size  # one converted float32 matrix
    assert stored["load"] < file_bytes + 8 * mib, runs  # the records are the file's pages, nothing widened
    # one converted matrix at a time, its memory handed back before the next (quantize.replace_matrices)
    # (and its chunked temporaries: measured 3 MiB; 22 MiB more before it was handed back as it went)
    assert stored["quantize"] < stored["load"] + stored["int8"] + largest + 6 * mib, runs
    assert runs["float32"]["load"] > float32_model, runs


def test_non_finite_scales_are_refused_at_load_and_formats_are_declared(files, tmp_path):
    """An infinite f16 scale in one block is found at load (without widening the tensor)
    and named; Capabilities.weight_formats takes known formats only, the reference's are all."""
    from polyengine.errors import WeightsError
    from polyengine.models.gguf_io import read_gguf
    from polyengine.protocol import Capabilities

    bad = tmp_path / "bad.gguf"
    data = bytearray(files["Q6_K"].read_bytes())
    t = read_gguf(files["Q6_K"]).tensors["blk.1.ffn_down.weight"]
    data[t.offset + 5 * 210 + 208: t.offset + 5 * 210 + 210] = np.array([np.inf], "<f2").tobytes()  # block 5's d
    bad.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="blk.1.ffn_down.weight.*infinite|infinite.*blk.1.ffn_down.weight"):
        load_model(bad)
    with pytest.raises(ValueError, match="unknown formats"):
        Capabilities(dtypes=("float32",), weight_formats=("F32", "Q9_9"))
    assert Capabilities(dtypes=("float32",)).weight_formats == ("F64", "F32", "F16", "BF16")
    from polyengine.backends.reference.engine import ReferenceEngine
    from polyengine.engine import EngineConfig

    engine = ReferenceEngine(load_model(files["Q4_0"]), EngineConfig(max_slots=1, max_cache_length=32))
    assert set(engine.capabilities.weight_formats) == set(FORMATS)
