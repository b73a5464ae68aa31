"""The cpu engine on a GGUF file's blocks (backends/cpu/blocks.py, csrc/gguf.h): the
projections, LM head and embedding table stay the Model's records, mapped from the file;
a decode on them equals the reference oracle computing on the same blocks; the options
that replace them requantize; the process never holds a float32 copy of the model.
The kernels themselves are tests/test_cpu_gguf_kernels.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.backends.cpu.engine import CpuEngine  # noqa: E402
from polyengine.driver import LLM  # noqa: E402
from polyengine.errors import FallbackWarning, InsufficientMemory, InvalidRequest, UnsupportedFeature  # noqa: E402
from polyengine.memory import simulated_limit  # noqa: E402
from polyengine.models import load_model  # noqa: E402
from polyengine.models.blocks import BLOCK_FORMATS  # noqa: E402
from polyengine.models.quant_presets import quantized_model_file  # noqa: E402

CFG = EngineConfig(max_slots=2, max_prefill_length=24, max_cache_length=64)
PROMPTS = [[1, 5, 9, 4, 2, 7], [3, 3, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quantized")
    return lambda fmt: quantized_model_file(fmt, folder)


def _tokens(model, backend, options=None):
    if backend == "reference":
        llm = LLM(model=model, backend="reference", max_slots=2, max_cache_length=64, max_prefill_length=24)
    else:
        llm = LLM.from_engine(CpuEngine(model, CFG.model_copy(update={"options": options or {}})), tools=False)
    return [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def oracle():
    cache = {}

    def get(model):
        # Keyed by the weights' fingerprint, not id(model): each test loads its own Model
        # and frees it, and CPython hands a freed object's id to the next one (CI once got
        # another format's tokens back from an id-keyed cache).
        key = model.fingerprint
        if key not in cache:
            cache[key] = _tokens(model, "reference")
        return cache[key]

    return get


def test_the_engine_reads_the_files_blocks_where_they_lie(files):
    model = load_model(files("Q4_K"))
    eng = CpuEngine(model, CFG)
    params = eng.load_params()
    c = model.config
    kept = set(eng.plan.block_weights)
    assert "model.embed_tokens.weight" in kept and "model.layers.0.self_attn.q_proj.weight" in kept
    assert c.head_weight in kept
    for name in kept:
        assert name not in params.tensors  # no float copy made
        blocks = eng._blocks[name]
        assert blocks.weight is model.records[name] and not blocks.weight.data.flags.writeable  # the map itself
    paths = eng.speed_paths()
    assert "GGUF blocks" in paths["weights"] and "Q4_K" in paths["weights"]
    assert paths["decode"].startswith("fused step") and eng._fused is not None  # the fused step on the blocks
    unfused = CpuEngine(model, CFG.model_copy(update={"options": {"int8_compute": "float"}}))
    assert unfused.plan.fused_decode is False and "int8_compute=float" in unfused.plan.unfused_why


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_greedy_decode_on_blocks_equals_the_oracle(files, oracle, fmt):
    """The default (int8x2 activations) on every format decodes as the reference, which
    dequantizes the same blocks exactly in float64."""
    model = load_model(files(fmt))
    assert _tokens(model, "cpu") == oracle(model)


@pytest.mark.parametrize("options", [{"int8_compute": "float"}, {"cpu_kernels": False}, {"isa": "avx2"},
                                     {"isa": "scalar"}, {"live_rows": False}, {"fused_decode": False},
                                     {"int8_compute": "int8x2", "kv_dtype": "bfloat16"}])
def test_every_path_on_blocks_decodes_the_same(files, oracle, options):
    from isa_paths import kernels_for

    if "isa" in options:
        kernels_for(options["isa"])  # skips where this CPU cannot execute it
    model = load_model(files("Q6_K"))
    if options.get("cpu_kernels") is False:
        with pytest.warns(FallbackWarning, match="cpu_kernels=False"):
            assert _tokens(model, "cpu", options) == oracle(model)
    else:
        assert _tokens(model, "cpu", options) == oracle(model)


def test_one_int8_row_is_within_its_bound(files, oracle):
    """int8_compute=int8 (one int8 row per 32 activations, as llama.cpp's Q8 pairing):
    the first step's log-probs stay within the activation bound of docs/cpu.md."""
    model = load_model(files("Q4_0"))
    sp = SamplingParams(temperature=0, max_tokens=1, logprobs=True, top_logprobs=5)
    ref = LLM(model=model, backend="reference", max_slots=2, max_cache_length=64, max_prefill_length=24)
    want = ref.generate(PROMPTS, sp)
    eng = CpuEngine(model, CFG.model_copy(update={"options": {"int8_compute": "int8"}}))
    assert eng.plan.block_activations == 1 and "one int8 row" in eng.speed_paths()["int8"]
    # prefill stays on int16 tiles where the library has them, not bfloat16 bands of
    # dequantized weights (which held a bfloat16 LM head: +580 MiB on a 1B file)
    assert eng.plan.block_tiles == eng.plan.kernels.gguf_tiles
    assert eng.plan.prefill_compute == torch.float32
    got = LLM.from_engine(eng, tools=False).generate(PROMPTS, sp)
    for g, w in zip(got, want):
        assert abs(g.outputs[0].logprobs[0] - w.outputs[0].logprobs[0]) < 0.05


@pytest.mark.parametrize(("options", "dtype", "kept"), [
    ({}, "float32", True),
    ({"quantize": "int8-block32"}, "float32", False),  # int8 copies requantized tensor by tensor
    ({"weight_dtype": "bfloat16"}, "float32", False),
    ({}, "bfloat16", False),  # bfloat16 compute: the torch forward on bfloat16 copies
])
def test_options_that_replace_the_blocks(files, options, dtype, kept):
    from polyengine.hostinfo import has_bf16_units

    if dtype == "bfloat16" and not has_bf16_units():
        pytest.skip("bfloat16 compute needs bfloat16 units on this CPU")
    model = load_model(files("Q8_0"))
    eng = CpuEngine(model, CFG.model_copy(update={"options": options, "dtype": dtype}))
    assert bool(eng.plan.block_weights) == kept
    if dtype == "float32":
        assert len(_tokens(model, "cpu", options)[0]) == 8


def test_int8_compute_on_block_weights(files):
    model = load_model(files("Q5_K"))
    for choice, rows in (("auto", 2), ("int8x2", 2), ("int8", 1), ("float", 0)):
        assert CpuEngine(model, CFG.model_copy(update={"options": {"int8_compute": choice}})).plan.block_activations == rows
    with pytest.raises(UnsupportedFeature, match="int8_compute"):
        CpuEngine(load_model("random:tiny-gqa"), CFG.model_copy(update={"options": {"int8_compute": "int8"}}))


_PEAK = textwrap.dedent("""
    import json, resource, sys
    import torch  # imported before the baseline: its libraries are not the model
    import polyengine
    from polyengine import LLM, SamplingParams
    def peak():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    base = peak()
    llm = LLM(model=sys.argv[1], backend="cpu", max_slots=1, max_cache_length=64, max_prefill_length=32)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    print(json.dumps({"growth": peak() - base, "tokens": len(out[0].outputs[0].token_ids)}))
""")


@pytest.mark.slow
def test_the_process_never_holds_a_float32_model(tmp_path):
    """A 4-bit file of ~110M weights (float32: ~440 MB) loads and generates on the cpu
    backend with a peak RSS growth well under the float32 model's size: the blocks are
    read where the file maps them, converted one band at a time."""
    from polyengine.models.presets import random_weights
    from polyengine.models.quant_presets import quantized_config, write_llama_gguf

    config = quantized_config().model_copy(update=dict(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=6, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64))
    rng = np.random.default_rng(0)
    weights = {name: (rng.standard_normal(shape, dtype=np.float32) * 0.02 if len(shape) == 2 else
                      np.ones(shape, np.float32)) for name, shape in config.weight_shapes().items()}
    path = write_llama_gguf(tmp_path / "q4_0.gguf", config, weights, "Q4_0")
    float32_bytes = sum(w.size for w in weights.values()) * 4
    del weights
    proc = subprocess.run([sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 4
    assert result["growth"] < 0.4 * float32_bytes, (result, float32_bytes)


@pytest.mark.parametrize("prefill_compute", ["float", "int16"])
def test_prefill_on_blocks_runs_the_kernels_up_to_their_row_limit(files, monkeypatch, prefill_compute):
    """A prefill of up to ``block_kernel_rows`` tokens multiplies on the int8 block
    kernels, a longer one on bands dequantized into torch's GEMM (prefill_compute float)
    or on int16 tiles (int16, the default where the kernels have them: from TILE_ROWS rows
    on; docs/cpu.md, "Prefill on block weights"), at the engine's limit and at a raised
    one; the prompt's prefix is the oracle's either way (greedy tokens equal)."""
    from polyengine.backends.cpu.kernels import BLOCK_KERNEL_ROWS, TILE_ROWS

    model = load_model(files("Q4_K"))
    cfg = EngineConfig(max_slots=2, max_prefill_length=100, max_cache_length=128,
                       options={"prefill_compute": prefill_compute, "repack_weights": False})  # the file's layout
    if prefill_compute == "int16":
        from isa_paths import kernels_for

        if not kernels_for("auto").gguf_tiles:
            pytest.skip("int16 tiles need AVX-512 VNNI (csrc/tile.h)")
    eng = CpuEngine(model, cfg)
    tiles = prefill_compute == "int16"
    assert eng.plan.block_tiles == tiles
    assert eng.block_kernel_rows == (TILE_ROWS - 1 if tiles else BLOCK_KERNEL_ROWS) and BLOCK_KERNEL_ROWS == 16
    eng.fused_prefill_rows = 0  # the torch forward's products (short prefills in the fused step: test_cpu_engine.py)
    calls = {"kernels": set(), "bands": set()}
    kernels = eng._kernels.gguf_linear
    monkeypatch.setattr(eng._kernels, "gguf_linear",
                        lambda x, *a, **k: calls["kernels"].add(x.numel() // x.shape[-1]) or kernels(x, *a, **k))
    if tiles:
        long = eng._kernels.gguf_tile_linear
        monkeypatch.setattr(eng._kernels, "gguf_tile_linear",
                            lambda x, *a, **k: calls["bands"].add(x.numel() // x.shape[-1]) or long(x, *a, **k))
    else:
        bands = eng._tiled_blocks.__call__
        monkeypatch.setattr(eng, "_tiled_blocks",
                            lambda x, *a, **k: calls["bands"].add(x.numel() // x.shape[-1]) or bands(x, *a, **k))
    ref = LLM(model=model, backend="reference", max_slots=2, max_cache_length=128, max_prefill_length=100)
    llm = LLM.from_engine(eng, tools=False)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    low = eng.block_kernel_rows
    for limit, n in ((low, low), (low, low + 1), (low, 40), (64, 40), (64, 64), (64, 65), (64, 90)):
        eng.block_kernel_rows = limit
        prompt = [3 + (7 * i + 11 * n + limit) % 200 for i in range(n)]  # no two share a head: no prefix-cache hit
        calls["kernels"].clear(), calls["bands"].clear()
        got = llm.generate([prompt], sp)[0].token_ids
        assert (n in calls["kernels"]) == (n <= limit) and (n in calls["bands"]) == (n > limit), (limit, n, calls)
        assert got == ref.generate([prompt], sp)[0].token_ids, (limit, n)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_K", "Q6_K", "Q8_0"])
def test_prefill_on_int16_tiles_equals_the_bands(files, fmt):
    """The default prefill on int16 tiles (where the kernels have them) against bands
    dequantized into torch's GEMM (prefill_compute float): a 40-token prompt's last
    logits within the int16 activations' bound (1e-4 of their spread) and the same
    greedy continuation."""
    from isa_paths import kernels_for

    if not kernels_for("auto").gguf_tiles:
        pytest.skip("int16 tiles need AVX-512 VNNI (csrc/tile.h)")
    model = load_model(files(fmt))
    cfg = EngineConfig(max_slots=1, max_prefill_length=64, max_cache_length=96)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = np.array([3 + (13 * i) % 250 for i in range(40)], dtype=np.int32)
    out = {}
    for choice in ("auto", "float"):
        eng = CpuEngine(model, cfg.model_copy(update={"options": {"prefill_compute": choice, "fused_prefill": False}}))
        assert eng.plan.block_tiles == (choice == "auto")
        prefix, _ = eng.prefill(params=eng.load_params(), tokens=prompt, sampling=sp)
        out[choice] = prefix.host_logits().astype(np.float64)
    spread = out["float"].max() - out["float"].min()
    assert np.abs(out["auto"] - out["float"]).max() < 1e-4 * spread
    assert int(out["auto"].argmax()) == int(out["float"].argmax())


def test_prefill_compute_int16_is_refused_where_it_cannot_run(files):
    """prefill_compute='int16' names what it needs: block weights (none on a float model,
    or under quantize) and the AVX-512 VNNI kernels (not the avx2 or scalar paths)."""
    with pytest.raises(UnsupportedFeature, match="prefill_compute='int16'.*block weights"):
        CpuEngine(load_model("random:tiny"), CFG.model_copy(update={"options": {"prefill_compute": "int16"}}))
    model = load_model(files("Q4_K"))
    with pytest.raises(UnsupportedFeature, match="prefill_compute='int16'.*AVX-512 VNNI"):
        CpuEngine(model, CFG.model_copy(update={"options": {"prefill_compute": "int16", "isa": "avx2"}}))
    eng = CpuEngine(model, CFG.model_copy(update={"options": {"isa": "avx2"}}))
    assert not eng.plan.block_tiles and "dequantized a band" in eng.speed_paths()["prefill"]
    # float activations asked for decode (int8_compute float): auto keeps prefill's float32 too
    assert not CpuEngine(model, CFG.model_copy(update={"options": {"int8_compute": "float"}})).plan.block_tiles


def test_a_decode_step_of_many_rows_on_int16_tiles_decodes_as_the_oracle(files):
    """Nine slots decoding at once: the fused step multiplies its rows on int16 tiles
    (TILE_ROWS rows and more, where the kernels have them), and every row's greedy tokens
    are the reference's."""
    model = load_model(files("Q5_K"))
    prompts = [[3 + (5 * i + 7 * j) % 200 for i in range(4 + j)] for j in range(9)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eng = CpuEngine(model, EngineConfig(max_slots=9, max_prefill_length=24, max_cache_length=64))
    llm = LLM.from_engine(eng, tools=False)
    ref = LLM(model=model, backend="reference", max_slots=9, max_cache_length=64, max_prefill_length=24)
    if eng.plan.block_tiles:
        assert eng._fused.dims.tile_rows == 8
    assert [c.token_ids for c in llm.generate(prompts, sp)] == [c.token_ids for c in ref.generate(prompts, sp)]


@pytest.mark.parametrize("isa", ["auto", "avx2"])
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_repacked_weights_decode_as_the_oracle(files, oracle, fmt, isa):
    """repack_weights: the block matrices copied sixteen rows interleaved (csrc/packed.h)
    serve the fused step's products and the LM head; greedy tokens are the reference's;
    on the 512-bit path (AVX-512 VNNI) and the 256-bit one (AVX2)."""
    from isa_paths import kernels_for

    if not kernels_for(isa).gguf_packed:
        pytest.skip(f"no packed products on the {isa} path of this CPU (AVX2 or AVX-512 VNNI)")
    model = load_model(files(fmt))
    eng = CpuEngine(model, CFG.model_copy(update={"options": {"repack_weights": True, "isa": isa}}))
    eng.load_params()
    assert all(b.packed is not None for b in eng._blocks.values() if b.format == fmt)
    assert any(p for p in eng._fused.layers[0].packed)
    assert "repack_weights" in eng.speed_paths()["weights"]
    assert _tokens(model, "cpu", {"repack_weights": True, "isa": isa}) == oracle(model)
    # a second engine of the same Model shares the copies (the file pages stay released)
    again = CpuEngine(model, CFG.model_copy(update={"options": {"repack_weights": True, "isa": isa}}))
    again.load_params()
    assert all(again._blocks[n].packed is b.packed for n, b in eng._blocks.items() if b.packed is not None)
    # the torch forward (the architectures outside the fused step) reads them too
    assert _tokens(model, "cpu", {"repack_weights": True, "fused_decode": False, "isa": isa}) == oracle(model)


@pytest.mark.parametrize("isa", ["auto", "avx2"])
@pytest.mark.parametrize("fmt", ["Q4_0", "Q5_K", "Q6_K"])
def test_repacked_rows_against_one_int8_row_serve_every_row_count(files, fmt, isa):
    """repack_weights with int8_compute=int8: every product reads the packed groups, a
    prefill's many rows and a nine-slot step too (no int16 tiles, no file-layout kernels),
    and stays within the one-int8-row bound of the oracle's log-probs; nine slots at once
    decode each prompt's greedy tokens as that prompt alone does (each row's products
    are summed in the same order whatever the rows beside it)."""
    from isa_paths import kernels_for

    if not kernels_for(isa).gguf_packed:
        pytest.skip(f"no packed products on the {isa} path of this CPU (AVX2 or AVX-512 VNNI)")
    model = load_model(files(fmt))
    options = {"repack_weights": True, "int8_compute": "int8", "isa": isa}
    config = EngineConfig(max_slots=9, max_prefill_length=40, max_cache_length=64)
    eng = CpuEngine(model, config.model_copy(update={"options": {**options, "fused_prefill": False}}))
    eng.load_params()
    assert eng.plan.packed_rows and eng._packed_rows and eng._fused.dims.tile_rows == 0
    assert "every product, prefill's too" in eng.speed_paths()["weights"]
    assert "repacked sixteen-row groups against one int8 row" in eng.speed_paths()["prefill"]
    kernels, rows = eng._kernels, []

    def refused(*args, **kwargs):
        raise AssertionError("a product left the packed groups")

    packed_linear = kernels.gguf_packed_linear

    def counted(x, *args, **kwargs):
        rows.append(x.numel() // x.shape[-1])
        return packed_linear(x, *args, **kwargs)

    kernels.gguf_tile_linear = kernels.gguf_linear = refused
    kernels.gguf_packed_linear = counted
    try:
        prompt = [[3 + (5 * i) % 200 for i in range(33)]]
        sp = SamplingParams(temperature=0, max_tokens=1, logprobs=True, top_logprobs=5)
        got = LLM.from_engine(eng, tools=False).generate(prompt, sp)
    finally:
        del kernels.gguf_tile_linear, kernels.gguf_linear, kernels.gguf_packed_linear
    assert max(rows) == 33  # the prompt's rows in one product
    ref = LLM(model=model, backend="reference", max_slots=2, max_cache_length=64, max_prefill_length=40)
    want = ref.generate(prompt, sp)
    assert abs(got[0].outputs[0].logprobs[0] - want[0].outputs[0].logprobs[0]) < 0.05
    prompts = [[3 + (5 * i + 7 * j) % 200 for i in range(4 + j)] for j in range(9)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    options["fused_prefill"] = False  # prompts batched or alone through one prefill path (the torch forward's)
    eng = CpuEngine(model, config.model_copy(update={"options": options}))
    got = [c.token_ids for c in LLM.from_engine(eng, tools=False).generate(prompts, sp)]
    alone = LLM.from_engine(CpuEngine(model, config.model_copy(update={"options": options, "max_slots": 1})),
                            tools=False)
    assert got == [alone.generate([p], sp)[0].outputs[0].token_ids for p in prompts]


def test_repacked_weights_with_many_rows_and_their_refusals(files, oracle, monkeypatch):
    """Nine slots at once multiply on int16 tiles filled from the repacked groups; the
    option is refused, naming why, without block weights, on the scalar path, and with
    float32 activations; its default, ``auto``, repacks wherever the rows run and is
    silent elsewhere; ``False`` keeps the file's layout."""
    from isa_paths import kernels_for

    model = load_model(files("Q4_K"))
    assert CpuEngine.OPTIONS["repack_weights"].default == "auto"
    assert CpuEngine(model, CFG).plan.repack == kernels_for("auto").gguf_packed
    assert not CpuEngine(model, CFG.model_copy(update={"options": {"repack_weights": False}})).plan.repack
    assert not CpuEngine(load_model("random:tiny"), CFG).plan.repack
    assert not CpuEngine(model, CFG.model_copy(update={"options": {"int8_compute": "float"}})).plan.repack
    # auto leaves Q8_0 in the file's layout under int8x2 (AUTO_REPACK_KEEPS): a mixed model
    # packs its other formats, a Q8_0 file none; one int8 row packs every format
    if kernels_for("auto").gguf_packed:
        from polyengine.conformance.models import build_model

        mixed = build_model("quant_mixed")
        eng = CpuEngine(mixed, CFG)
        assert eng.plan.repack and eng.plan.repack_kept == ("Q8_0",)
        assert "Q8_0 kept as mapped" in eng.speed_paths()["weights"]
        eng.load_params()
        assert {b.format for b in eng._blocks.values() if b.packed is None} == {"Q8_0"}
        assert _tokens(mixed, "cpu") == oracle(mixed)
        assert not CpuEngine(load_model(files("Q8_0")), CFG).plan.repack
        whole = CpuEngine(mixed, CFG.model_copy(update={"options": {"int8_compute": "int8"}})).plan
        assert whole.repack and whole.repack_kept == () and whole.packed_rows
        assert CpuEngine(mixed, CFG.model_copy(update={"options": {"repack_weights": True}})).plan.repack_kept == ()
    # auto and a copy that would not fit: the file's layout as mapped, said why; true refuses
    if kernels_for("auto").gguf_packed:
        fresh = load_model(files("Q4_K"))  # no copies made for this Model yet
        counted, check = [], CpuEngine.check_memory
        monkeypatch.setattr(CpuEngine, "check_memory",
                            lambda self, needs, **kw: counted.append(check(self, needs, **kw)) or counted[-1])
        CpuEngine(fresh, CFG.model_copy(update={"options": {"repack_weights": False}}))
        CpuEngine(fresh, CFG)  # built, not loaded: its check counts the copy, and nothing is copied yet
        without, with_copy = counted[-2:]
        assert with_copy > without
        with simulated_limit((without + with_copy) // 2):
            eng = CpuEngine(fresh, CFG)
            assert not eng.plan.repack
            assert "not repacked: the interleaved copy would not fit" in eng.speed_paths()["weights"]
            with pytest.raises(InsufficientMemory):
                CpuEngine(fresh, CFG.model_copy(update={"options": {"repack_weights": True}}))
        assert [c.token_ids for c in LLM.from_engine(eng, tools=False).generate(PROMPTS, GREEDY)] == oracle(fresh)
    for bad in (1, "on", None):
        with pytest.raises(InvalidRequest, match="repack_weights.*use one of 'auto', True, False"):
            CpuEngine(model, CFG.model_copy(update={"options": {"repack_weights": bad}}))
    with pytest.raises(UnsupportedFeature, match="repack_weights=True.*block weights"):
        CpuEngine(load_model("random:tiny"), CFG.model_copy(update={"options": {"repack_weights": True}}))
    with pytest.raises(UnsupportedFeature, match="repack_weights=True.*int8_compute='float'|repack_weights=True.*AVX2"):
        CpuEngine(model, CFG.model_copy(update={"options": {"repack_weights": True, "int8_compute": "float"}}))
    try:
        kernels_for("scalar")
    except pytest.skip.Exception:
        pass
    else:
        with pytest.raises(UnsupportedFeature, match="repack_weights=True.*AVX2 or AVX-512 VNNI"):
            CpuEngine(model, CFG.model_copy(update={"options": {"repack_weights": True, "isa": "scalar"}}))
        assert not CpuEngine(model, CFG.model_copy(update={"options": {"isa": "scalar"}})).plan.repack
    if not kernels_for("auto").gguf_packed:
        return
    prompts = [[3 + (5 * i + 7 * j) % 200 for i in range(4 + j)] for j in range(9)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    config = EngineConfig(max_slots=9, max_prefill_length=24, max_cache_length=64)
    eng = CpuEngine(model, config.model_copy(update={"options": {"repack_weights": True}}))
    ref = LLM(model=model, backend="reference", max_slots=9, max_cache_length=64, max_prefill_length=24)
    got = [c.token_ids for c in LLM.from_engine(eng, tools=False).generate(prompts, sp)]
    assert got == [c.token_ids for c in ref.generate(prompts, sp)]


def _vm_flags(ptr: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds address ``ptr``."""
    from polyengine.backends.torch_common.hostmem import mapping_fields

    return set(mapping_fields(ptr).get("VmFlags", "").split())


def test_repacked_weights_in_huge_pages(files, oracle, monkeypatch):
    """huge_pages (off by default): the repacked matrices share one map, advised
    MADV_HUGEPAGE (VmFlags 'hg'), each piece 64-byte aligned; the same bits as in 4 KiB
    pages (greedy tokens the oracle's, logits equal to huge_pages=False's); auto follows the
    host's THP mode and True refuses a host without it or an engine that repacks nothing."""
    from isa_paths import kernels_for

    from polyengine.backends.cpu import plan as cpu_plan
    from polyengine.backends.torch_common.hostmem import huge_pages_available

    if not kernels_for("auto").gguf_packed:
        pytest.skip("no packed products on this CPU (AVX2 or AVX-512 VNNI)")
    assert CpuEngine.OPTIONS["huge_pages"].default is False  # tried as the default, not kept (docs/cpu.md)
    model = load_model(files("Q4_K"))
    if huge_pages_available():
        eng = CpuEngine(model, CFG.model_copy(update={"options": {"huge_pages": True}}))
        assert eng.plan.huge_pages and "huge pages" in eng.speed_paths()["weights"]
        eng.load_params()
        packed = [b.packed for b in eng._blocks.values() if b.packed is not None]
        assert len(packed) > 1 and len({t.untyped_storage().data_ptr() for t in packed}) == 1
        assert all(t.data_ptr() % 64 == 0 for t in packed) and "hg" in _vm_flags(packed[0].data_ptr())
        assert [c.token_ids for c in LLM.from_engine(eng, tools=False).generate(PROMPTS, GREEDY)] == oracle(model)
        plain = CpuEngine(load_model(files("Q4_K")), CFG.model_copy(update={"options": {"huge_pages": False}}))
        plain.load_params()
        assert all("hg" not in _vm_flags(b.packed.data_ptr()) for b in plain._blocks.values() if b.packed is not None)
        sp = SamplingParams(temperature=0, max_tokens=1)
        logits = [e.prefill(params=e.load_params(), tokens=np.array(PROMPTS[0], dtype=np.int32), sampling=sp)[0]
                  .host_logits() for e in (eng, plain)]
        np.testing.assert_array_equal(logits[0], logits[1])
    auto = CFG.model_copy(update={"options": {"huge_pages": "auto"}})
    assert not CpuEngine(model, CFG).plan.huge_pages and CpuEngine(model, auto).plan.huge_pages == huge_pages_available()
    assert not CpuEngine(model, CFG.model_copy(update={"options": {"huge_pages": "auto", "repack_weights": False}})
                         ).plan.huge_pages
    with pytest.raises(UnsupportedFeature, match="huge_pages=True.*repack_weights"):
        CpuEngine(model, CFG.model_copy(update={"options": {"huge_pages": True, "repack_weights": False}}))
    monkeypatch.setattr(cpu_plan, "huge_pages_available", lambda: False)  # a host with THP "never"
    assert not CpuEngine(model, auto).plan.huge_pages
    with pytest.raises(UnsupportedFeature, match="huge_pages=True.*transparent huge pages"):
        CpuEngine(model, CFG.model_copy(update={"options": {"huge_pages": True}}))
    eng = CpuEngine(load_model(files("Q4_K")), auto)
    assert [c.token_ids for c in LLM.from_engine(eng, tools=False).generate(PROMPTS, GREEDY)] == oracle(model)
