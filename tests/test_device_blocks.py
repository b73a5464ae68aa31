"""The device backends on GGUF blocks (issue 37, item 3): the core's exact split of
every block format into integers, group scales and offsets, cuda_torch's products on torch's int4 op and
on int8 values with block scales (each against the float64 product of the exactly
dequantized blocks), greedy decoding on tiny quantized models equal to the reference
oracle on the same blocks, and the formats each backend declares."""

from __future__ import annotations

import numpy as np
import pytest

from polyengine.models.blocks import dequantize_blocks, quantize_blocks
from polyengine.models.int_blocks import FOUR_BIT_FORMATS, GROUP, INT_BLOCK_FORMATS, OFFSET_FORMATS, split_blocks
from polyengine.models.weights import Weight

FORMATS = INT_BLOCK_FORMATS  # every GGUF block format


def _record(fmt: str, rows: int = 48, cols: int = 256, seed: int = 0) -> Weight:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    w[0, :32] += 3.0  # one block far from the rest: per-block scales must stay per block
    return Weight(fmt, (rows, cols), quantize_blocks(fmt, w), name=f"test.{fmt}")


def _exact(record: Weight) -> np.ndarray:
    raw = np.ascontiguousarray(record.rows()).reshape(-1, record.info.nbytes)
    return dequantize_blocks(record.format, raw).reshape(record.shape)  # float64, exact


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_split_is_the_exact_dequantization_bit_for_bit_in_float32(fmt):
    record = _record(fmt)
    values, scale, offset = split_blocks(record)
    groups = 256 // GROUP[fmt]
    assert values.dtype == np.int8 and scale.shape == (48, groups) and scale.dtype == np.float32
    assert (offset is not None) == (fmt in OFFSET_FORMATS)
    w = (values.reshape(48, groups, -1).astype(np.float32) * scale[:, :, None])
    if offset is not None:
        assert offset.shape == scale.shape
        w = w + offset[:, :, None]
    want = _exact(record).astype(np.float32)  # the exact value rounded once
    np.testing.assert_array_equal(w.reshape(48, 256), want)
    # A permuted (strided) view of the rows splits like the rows themselves.
    view = record.permute_rows(4)
    np.testing.assert_array_equal(split_blocks(view)[0], values.reshape(4, 6, 2, 256).swapaxes(1, 2).reshape(48, 256))


def _product_case(torch, fmt: str):
    """A block matrix of ``fmt``, x (3, 5, 256), x @ W.T in float64 of the exactly
    dequantized blocks, and sum |x| |w| (what a float dot product's rounding is bounded by)."""
    record = _record(fmt)
    exact = _exact(record)
    x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(1))
    x64 = x.double().numpy()
    return record, x, x64 @ exact.T, np.abs(x64) @ np.abs(exact).T


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_torch_block_products_match_float64_of_the_exact_blocks(fmt):
    """Each device form (torch's int4 op where it runs, int8 values with block scales
    everywhere) against x @ W.T in float64 of the exactly dequantized blocks: relative
    to sum |x| |w| (what the rounding of a float32 or bfloat16 dot product is bounded by)."""
    torch = pytest.importorskip("torch")
    from polyengine.backends.torch_common.blocks import block_linear, int4_runs, pack_matrix, packed_bytes

    record, x, want, scale = _product_case(torch, fmt)
    cpu = torch.device("cpu")
    forms = [False, True] if int4_runs(fmt, record.shape, cpu, torch.float32) else [True]
    assert forms == ([False, True] if fmt in FOUR_BIT_FORMATS else [True])  # Q4_0/Q4_1/Q4_K run on the int4 op here
    for force_int8 in forms:
        for dtype, bound in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
            t = pack_matrix(record, "m", device=cpu, dtype=dtype, force_int8=force_int8)
            assert ("m.qvalues" in t) == force_int8 and ("m.int4" in t) != force_int8
            assert ("m.qoffset" in t) == (force_int8 and fmt in OFFSET_FORMATS)
            if force_int8 == (fmt not in FOUR_BIT_FORMATS):  # the form the engine picks: what its memory check counts
                assert sum(v.numel() * v.element_size() for v in t.values()) == packed_bytes(fmt, record.shape, cpu, dtype)
            got = block_linear(t, x.to(dtype), "m").double().numpy()
            err = np.abs(got - want) / scale
            assert err.max() < bound, (fmt, dtype, force_int8, err.max())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_torch_block_products_on_a_gpu(fmt):
    """The same products on CUDA: Q4_0/Q4_1/Q4_K on ``_convert_weight_to_int4pack`` /
    ``_weight_int4pack_mm`` in bfloat16 (the op's one type there), every format as int8
    values with block scales in float32, bfloat16 and float16, each against float64 of
    the exactly dequantized blocks under the CPU test's bounds; the packed bytes are
    what the memory check counts (``packed_bytes``)."""
    torch = pytest.importorskip("torch")
    from polyengine.backends.torch_common.blocks import block_linear, int4_runs, pack_matrix, packed_bytes

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    record, x, want, scale = _product_case(torch, fmt)
    cuda = torch.device("cuda")
    assert int4_runs(fmt, record.shape, cuda, torch.bfloat16) == (fmt in FOUR_BIT_FORMATS)
    assert not any(int4_runs(fmt, record.shape, cuda, d) for d in (torch.float32, torch.float16))
    cases = [(torch.bfloat16, 2e-2, False)] if fmt in FOUR_BIT_FORMATS else []
    cases += [(torch.float32, 1e-6, True), (torch.bfloat16, 2e-2, True), (torch.float16, 2e-3, True)]
    for dtype, bound, force_int8 in cases:
        t = pack_matrix(record, "m", device=cuda, dtype=dtype, force_int8=force_int8)
        assert ("m.qvalues" in t) == force_int8 and ("m.int4" in t) != force_int8
        assert all(v.device.type == "cuda" for v in t.values())
        if not force_int8:
            assert sum(v.numel() * v.element_size() for v in t.values()) == packed_bytes(fmt, record.shape, cuda, dtype)
        got = block_linear(t, x.to(device=cuda, dtype=dtype), "m").double().cpu().numpy()
        err = np.abs(got - want) / scale
        assert err.max() < bound, (fmt, dtype, force_int8, err.max())


@pytest.mark.parametrize("fmt", FORMATS)
def test_tpu_jax_block_products_match_float64_of_the_exact_blocks(fmt):
    """tpu_jax's host arrays of a file's blocks (int8, or 4-bit two to a byte) through its
    ``linear`` hook, run eagerly in torch (torchax traces the same code): float32 within
    rounding of the float64 product of the exactly dequantized blocks; the 4-bit form
    is half the int8 bytes."""
    torch = pytest.importorskip("torch")
    from polyengine.backends.tpu_jax.footprint import block_bytes
    from polyengine.backends.tpu_jax.quantize import block_arrays, int8_linear

    record = _record(fmt)
    exact = _exact(record)
    arrays = block_arrays(record, "m")
    assert sum(a.nbytes for a in arrays.values()) == block_bytes(fmt, record.shape)
    assert ("m.qweight4" in arrays) == (fmt in FOUR_BIT_FORMATS) and ("m.offset" in arrays) == (fmt in OFFSET_FORMATS)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(2))
    got = int8_linear({k: torch.from_numpy(v) for k, v in arrays.items()}, x, "m").double().numpy()
    x64 = x.double().numpy()
    err = np.abs(got - x64 @ exact.T) / (np.abs(x64) @ np.abs(exact).T)
    assert err.max() < 1e-6, err.max()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from polyengine.models.quant_presets import quantized_model_file

    where = tmp_path_factory.mktemp("device-blocks")
    return {fmt: quantized_model_file(fmt, where) for fmt in FORMATS}


def _greedy(model, backend, options=None, tokens=8, **config):
    import polyengine as pe

    llm = pe.LLM(model, backend=backend, max_slots=2, max_cache_length=64, max_prefill_length=32,
                 options=options or {}, **config)
    greedy = pe.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=True, top_logprobs=2)
    out = llm.generate(["hello", "the blocks"], greedy)
    return llm, [o.outputs[0] for o in out]


def _same_tokens(ref, got, what, gap=1e-3):
    """Equal greedy tokens, up to the first near tie of the reference (a top-2 gap under
    ``gap``, after which the two may part by float noise, as the conformance suite allows)."""
    for r, g in zip(ref, got):
        for step, top in enumerate(r.top_logprobs):
            assert g.token_ids[step] == r.token_ids[step], (what, step, r.token_ids, g.token_ids)
            first, second = sorted(top.values(), reverse=True)
            if first - second < gap:
                break


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_torch_decodes_quantized_models_like_the_oracle(files, fmt):
    """cuda_torch's stand-in on the blocks (Q4_0/Q4_1/Q4_K on the int4 op, the others
    int8 values + group scales) gives the reference's greedy tokens; the engine holds
    every projection in its block form, and the Model still holds the file's blocks."""
    pytest.importorskip("torch")
    from polyengine.models import load_model

    model = load_model(files[fmt])
    _, ref = _greedy(model, "reference")
    llm, got = _greedy(model, "cuda_torch", {"device": "cpu"})
    _same_tokens(ref, got, fmt)
    engine = llm.engine
    assert set(engine.capabilities.weight_formats) >= set(FORMATS)
    on_int4 = 15 if fmt in FOUR_BIT_FORMATS else 0  # 7 projections x 2 layers + the untied head
    assert engine.speed_paths()["weights"].startswith(f"{on_int4} matrices on torch's int4 op"), engine.speed_paths()
    tensors = engine.load_params().tensors
    down = "model.layers.1.mlp.down_proj"
    form = ".int4" if fmt in FOUR_BIT_FORMATS else ".qvalues"
    assert down + form in tensors and down + ".weight" not in tensors, sorted(tensors)[:8]
    assert "lm_head" + form in tensors
    assert (down + ".qoffset" in tensors) == (form == ".qvalues" and fmt in OFFSET_FORMATS)
    assert model.formats[fmt] == 16


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_torch_decodes_quantized_models_like_the_oracle_on_a_gpu(files, fmt):
    """The stand-in test above on CUDA. float32: every block matrix as int8 values with
    block scales (the int4 op is bfloat16-only there), the reference's greedy tokens up
    to its first near tie. bfloat16: Q4_0/Q4_1/Q4_K on ``_weight_int4pack_mm``, the same
    tokens up to the reference's first gap under 0.1 (bfloat16 logits move by about
    1e-2 on these models)."""
    torch = pytest.importorskip("torch")
    from polyengine.models import load_model

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = load_model(files[fmt])
    _, ref = _greedy(model, "reference")
    for dtype, gap in (("float32", 1e-3), ("bfloat16", 0.1)):
        llm, got = _greedy(model, "cuda_torch", {"device": "cuda"}, dtype=dtype)
        _same_tokens(ref, got, (fmt, dtype), gap=gap)
        engine = llm.engine
        assert engine.torch_device.type == "cuda" and engine.dtype == dtype
        on_int4 = 15 if fmt in FOUR_BIT_FORMATS and dtype == "bfloat16" else 0
        assert engine.speed_paths()["weights"].startswith(f"{on_int4} matrices on torch's int4 op"), \
            engine.speed_paths()
        form = ".int4" if on_int4 else ".qvalues"
        tensor = engine.load_params().tensors["model.layers.1.mlp.down_proj" + form]
        assert tensor.device.type == "cuda"


_TPU_SHARDED = r"""
import json, sys
import numpy as np
import polyengine as pe
from polyengine.models import load_model

out = {}
for fmt, path in json.loads(sys.argv[1]).items():
    model = load_model(path)
    greedy = pe.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2)
    runs = {}
    for backend, options in (("reference", {}), ("tpu_jax", {"tensor_parallel": 2, "data_parallel": 1})):
        llm = pe.LLM(model, backend=backend, max_slots=2, max_cache_length=64, max_prefill_length=32, options=options)
        res = llm.generate(["hello", "the blocks"], greedy)
        runs[backend] = [(o.outputs[0].token_ids, [sorted(t.values(), reverse=True) for t in o.outputs[0].top_logprobs])
                         for o in res]
        if backend == "tpu_jax":
            params = llm.engine.load_params()
            pre = "model.layers.0.self_attn.q_proj"
            q = params[pre + ".qweight4"] if pre + ".qweight4" in params else params[pre + ".qweight"]
            out.setdefault("layout", {})[fmt] = {
                "dtype": str(q.dtype), "devices": len(q.sharding.device_set), "spec": str(q.sharding.spec),
                "shard": list(q.addressable_shards[0].data.shape), "shape": list(q.shape),
                "offset": pre + ".offset" in params, "float": pre + ".weight" in params,
                "formats": list(llm.engine.capabilities.weight_formats), "weights": llm.engine.speed_paths()["weights"]}
    out[fmt] = runs
print(json.dumps(out))
"""


@pytest.mark.slow
def test_tpu_jax_decodes_quantized_models_like_the_oracle_sharded_on_two_devices(files):
    """tpu_jax on two CPU devices (tensor_parallel=2): Q8_0 and Q6_K matrices as int8
    values with group scales (32 and 16 weights), Q4_1 and Q4_K as 4-bit values two to a
    byte with group scales and offsets, sharded like the float matrices (output rows
    split over tp), give the reference's greedy tokens on the same blocks."""
    pytest.importorskip("jax")
    import json
    import os
    import subprocess
    import sys

    # Q4_0 is Q4_1's path without offsets, Q5_x int8 values with offsets (their products:
    # the test above).
    tpu_formats = ("Q8_0", "Q4_1", "Q4_K", "Q6_K")
    paths = {fmt: str(files[fmt]) for fmt in tpu_formats}
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _TPU_SHARDED, json.dumps(paths)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for fmt in tpu_formats:
        lay = out["layout"][fmt]
        four = fmt in FOUR_BIT_FORMATS
        assert lay["dtype"] == ("uint8" if four else "int8") and not lay["float"], lay
        assert lay["offset"] == (fmt in OFFSET_FORMATS) and lay["shape"][1] == (128 if four else 256), lay
        assert lay["devices"] == 2 and lay["shard"] == [lay["shape"][0] // 2, lay["shape"][1]], lay
        assert set(FORMATS) <= set(lay["formats"])
        layers = 7 * 2 + 1  # seven projections a layer and the untied head, each in the file's format
        assert lay["weights"].startswith(f"{layers if four else 0} matrices as 4-bit values two to a byte (Q4_0/"
                                         f"Q4_1/Q4_K), {0 if four else layers} as int8 values"), lay["weights"]
        ref, got = out[fmt]["reference"], out[fmt]["tpu_jax"]
        for (r_tokens, r_top), (g_tokens, _) in zip(ref, got):
            for step, top in enumerate(r_top):
                assert g_tokens[step] == r_tokens[step], (fmt, step, r_tokens, g_tokens)
                if top[0] - top[1] < 1e-3:
                    break


def test_backends_verbose_names_what_each_backend_computes_on_and_converts_without_torch_or_jax():
    """The weights row comes from each spec's torch-free table: listing it imports
    neither torch nor jax, and it names the formats computed on and those converted."""
    import json
    import subprocess
    import sys

    code = ("import json, sys\nfrom polyengine.cli import _weights_row\n"
            "from polyengine.discovery import list_backends\n"
            "rows = {b.name: _weights_row(b) for b in list_backends()}\n"
            "print(json.dumps({'rows': rows, 'heavy': [m for m in ('torch', 'jax') if m in sys.modules]}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rows = out["rows"]
    assert out["heavy"] == []
    for name in ("cuda_torch", "tpu_jax"):
        assert rows[name].startswith("computes on Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K blocks and the float "
                                     "formats as stored; converts GGUF's other types to float32"), rows[name]
    assert rows["neuron"].startswith("computes on the float formats as stored; converts Q8_0, Q4_0, Q4_1, Q5_0"), rows
    assert rows["reference"].startswith("computes on Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K blocks"), rows


def test_a_bad_weight_formats_table_is_reported_in_the_row_and_the_cli_prints_it(capsys, monkeypatch):
    import json

    import polyengine
    from polyengine import BackendSpec, Probe, hookimpl, register_plugin
    from polyengine.cli import main
    from polyengine.plugins import reset_registry

    class Odd:
        @hookimpl
        def polyengine_backends(self):
            ok = lambda: Probe(True, False, "always")  # noqa: E731
            return [BackendSpec(name="odd_formats", description="a table naming an unknown format",
                                protocol_version=polyengine.PROTOCOL_VERSION, probe=ok, factory="x.y:z",
                                diagnose=lambda: {}, weight_formats="polyengine.models.int_blocks:__all__")]

    monkeypatch.setenv("POLYENGINE_BACKENDS", "reference,odd_formats")
    reset_registry()
    register_plugin(Odd(), "odd")
    try:
        assert main(["backends", "--verbose", "--json"]) == 0
        rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
        assert rows["odd_formats"]["weights"].startswith("error: its weight_formats table names unknown formats")
        assert main(["backends", "--verbose"]) == 0
        assert "  weight formats: computes on Q8_0, Q4_0" in capsys.readouterr().out
    finally:
        reset_registry()


def _load_test_file(tmp_path, fmt: str):
    """A Llama GGUF of 13M parameters (54 MB as float32), every matrix in ``fmt``: large
    enough that a float32 model stands well above one tensor in a load's peak."""
    from polyengine.models.presets import preset_config, random_weights
    from polyengine.models.quant_presets import write_llama_gguf

    config = preset_config("tiny").model_copy(update=dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        head_dim=64, tie_word_embeddings=True))
    return write_llama_gguf(tmp_path / f"{fmt.lower()}.gguf", config, random_weights(config, seed=3), fmt)


_LOAD_PEAK = r"""
import json, sys, tracemalloc
import torch
from polyengine.models import load_model
from polyengine.backends.torch_common.model import TorchWeights
model = load_model(sys.argv[1])
largest = max(4 * w.num_rows * w.shape[-1] for w in model.records.values())
tracemalloc.start()
w = TorchWeights.from_model(model, dtype=torch.bfloat16)
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"peak": peak, "largest": largest, "float32_model": 4 * model.config.num_parameters(),
                  "dtype": str(w.tensors["model.layers.0.mlp.down_proj.weight"].dtype)}))
"""


@pytest.mark.slow
def test_neuron_loads_a_quantized_model_one_tensor_at_a_time(tmp_path):
    """neuron declares the float formats only, and its weights come from
    TorchWeights.from_model, which converts one record at a time: loading a Q8_0 model
    of 13M parameters (54 MB as float32) in bfloat16 (the Neuron path's dtype) holds
    about one float32 tensor plus the conversion's chunked float64 temporaries (2 MiB
    each) of NumPy memory, far below the float32 model."""
    pytest.importorskip("torch")
    import json
    import subprocess
    import sys

    from polyengine.backends.neuron.plugin import WEIGHT_FORMATS
    from polyengine.models.blocks import FLOAT_FORMATS

    assert WEIGHT_FORMATS == FLOAT_FORMATS
    path = _load_test_file(tmp_path, "Q8_0")
    proc = subprocess.run([sys.executable, "-c", _LOAD_PEAK, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["dtype"] == "torch.bfloat16"
    assert out["peak"] < out["largest"] + 8 * 2**20 < 0.3 * out["float32_model"], out


_TPU_JAX_LOAD = r"""
import json, sys, tracemalloc
import polyengine
# imported before the trace starts (load_params imports them on first use): their modules'
# allocations are not the weights'
import torch
from polyengine.backends.torch_common.model import TorchWeights
from polyengine.models import load_model
model = load_model(sys.argv[1])
engine = polyengine.create_engine("tpu_jax", model=model, config=dict(max_slots=1, max_cache_length=64,
                                                                      dtype="bfloat16"))
largest = max(4 * w.num_rows * w.shape[-1] for w in model.records.values())
tracemalloc.start()
params = engine.load_params()
peak = tracemalloc.get_traced_memory()[1]
down = params["model.layers.0.mlp.down_proj.weight"]
print(json.dumps({"peak": peak, "largest": largest, "float32_model": 4 * model.config.num_parameters(),
                  "dtype": str(down.dtype), "format": model.records["model.layers.0.mlp.down_proj.weight"].format}))
"""


@pytest.mark.slow
def test_tpu_jax_loads_a_bfloat16_model_one_tensor_at_a_time(tmp_path):
    """tpu_jax makes each float weight in the compute dtype as it reads it: loading a BF16
    model of 13M parameters (54 MB as float32) in bfloat16 holds about one float32
    tensor of NumPy memory at a time (the record's conversion), far below the float32
    model it made first before (every weight widened, then narrowed on the way to the
    mesh)."""
    pytest.importorskip("jax")
    import json
    import subprocess
    import sys

    path = _load_test_file(tmp_path, "BF16")
    proc = subprocess.run([sys.executable, "-c", _TPU_JAX_LOAD, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["format"] == "BF16" and out["dtype"] == "bfloat16", out
    assert out["peak"] < out["largest"] + 8 * 2**20 < 0.3 * out["float32_model"], out
