"""cuda_torch's bfloat16 weights under float32 compute (option ``weight_dtype``): the
projections and the LM head stored as bfloat16, widened exactly in the products, on
every ISA path the host runs; the fused step, the torch forward on the kernels and the
torch forward without them compute the same function; the float32 matrices are not kept."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.backends.cpu.engine import CpuEngine  # noqa: E402
from polyengine.errors import UnsupportedFeature  # noqa: E402
from polyengine.hostinfo import cpu_flags  # noqa: E402
from polyengine.models import load_model  # noqa: E402
from polyengine.models.quantize import quantized_names, replaced_weights  # noqa: E402

from isa_paths import ISAS, kernels_for  # noqa: E402


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 3, 20])  # one row at a time, MB-row blocks, beyond MAX_ROWS
def test_bf16_products_are_float32_products_of_the_rounded_weights(isa, m):
    kernels = kernels_for(isa)
    g = torch.Generator().manual_seed(m)
    for n, k in ((37, 64), (24, 53)):  # rows off the tile, K off the vector width (the scalar tail)
        x, w, b = (torch.randn(*shape, generator=g) for shape in ((m, k), (n, k), (n,)))
        wb = w.to(torch.bfloat16)
        got = kernels.linear(x, wb, b)
        want = torch.nn.functional.linear(x.double(), wb.double(), b.double())
        np.testing.assert_allclose(got.double().numpy(), want.numpy(), atol=2e-5 * k ** 0.5, rtol=1e-5)
        # rounding the weights is what moves the result, not the products: far from float32's
        assert (got.double() - torch.nn.functional.linear(x.double(), w.double(), b.double())).abs().max() > 1e-4


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 3, 20])  # one row at a time, MB-row blocks, beyond MAX_ROWS
def test_bf16_activation_products_are_products_of_the_rounded_rows(isa, m):
    """bf16_compute "bf16": x rounded to bfloat16 (nearest even, torch's rounding), every
    product exact, summed in float32: vdpbf16ps where the path has AVX512-BF16."""
    kernels = kernels_for(isa)
    g = torch.Generator().manual_seed(100 + m)
    for n, k in ((37, 96), (24, 53)):  # K a multiple of the instruction's 32 pairs, and not
        x, w, b = (torch.randn(*shape, generator=g) for shape in ((m, k), (n, k), (n,)))
        wb = w.to(torch.bfloat16)
        got = kernels.linear(x, wb, b, bf16_activations=True)
        want = torch.nn.functional.linear(x.to(torch.bfloat16).double(), wb.double(), b.double())
        np.testing.assert_allclose(got.double().numpy(), want.numpy(), atol=2e-5 * k ** 0.5, rtol=1e-5)
        floats = kernels.linear(x, wb, b)  # float32 activations: another function
        assert (got - floats).abs().max() > 1e-4
    if isa in ("auto", "avx512") and "avx512_bf16" in cpu_flags():
        assert kernels.bf16_dot.startswith("avx512-bf16")
    elif isa in ("avx2", "scalar"):
        assert kernels.bf16_dot == "float32 fma"


def _engine(model, **options) -> CpuEngine:
    return CpuEngine(model, EngineConfig(max_slots=3, max_cache_length=128, options=options))


def _greedy(eng: CpuEngine, steps: int = 12):
    """Greedy decode of two prompts in slots 0 and 2 (a batch of two live rows); returns
    each slot's tokens and the log-probs of its top tokens at every step."""
    params, state = eng.load_params(), eng.init_decode_state()
    prompts = {0: [5, 17, 33, 2, 9, 41, 7], 2: [11, 3, 60]}
    tokens, lps = {}, {s: [] for s in prompts}
    for slot, prompt in prompts.items():
        prefix, _ = eng.prefill(params=params, tokens=prompt, sampling=SamplingParams(
            temperature=0, logprobs=True, top_logprobs=5, max_tokens=steps + 1))
        state = eng.insert(prefix, state, slot)
        tokens[slot] = [int(prefix.first_token)]
    for _ in range(steps):
        state, res = eng.generate(params, state)
        for slot in prompts:
            tokens[slot].append(int(res.tokens[slot, 0]))
            lps[slot].append(np.asarray(res.top_logprobs[slot, 0], np.float64))
    return tokens, {s: np.stack(v) for s, v in lps.items()}


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_weights_decode_alike_on_every_path_and_near_float32(isa):
    kernels_for(isa)  # skips a path this CPU cannot execute, naming the flags it lacks
    model = load_model("random:tiny-gqa")
    runs = {path: _greedy(_engine(model, weight_dtype="bfloat16", **opts)) for path, opts in (
        ("fused", {"isa": isa}), ("torch forward on the kernels", {"isa": isa, "fused_decode": False}),
        ("torch forward, no kernels", {"cpu_kernels": False}))}
    fused_tokens, fused_lps = runs["fused"]
    for path, (tokens, lps) in runs.items():
        assert tokens == fused_tokens, path
        for slot in lps:
            np.testing.assert_allclose(lps[slot], fused_lps[slot], atol=2e-4, err_msg=path)
    f32_tokens, f32_lps = _greedy(_engine(model, isa=isa))
    for slot in f32_lps:
        # the weights' rounding (2^-9 relative) moves log-probs by far less than the model's gaps
        np.testing.assert_allclose(fused_lps[slot], f32_lps[slot], atol=0.05)
        assert fused_tokens[slot][:8] == f32_tokens[slot][:8]
    assert not np.allclose(fused_lps[0], f32_lps[0], atol=1e-6)  # bfloat16 weights really were used


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_activations_decode_alike_fused_and_through_the_torch_forward(isa):
    kernels_for(isa)
    model = load_model("random:tiny-gqa")
    # the prompts prefilled by the torch forward in both (fused_prefill off): the decode steps compared
    fused = _greedy(_engine(model, weight_dtype="bfloat16", bf16_compute="bf16", isa=isa, fused_prefill=False))
    forward = _greedy(_engine(model, weight_dtype="bfloat16", bf16_compute="bf16", isa=isa, fused_decode=False))
    floats = _greedy(_engine(model, weight_dtype="bfloat16", isa=isa))
    assert fused[0] == forward[0]
    for slot in fused[1]:
        np.testing.assert_allclose(fused[1][slot], forward[1][slot], atol=2e-4)
        np.testing.assert_allclose(fused[1][slot], floats[1][slot], atol=0.05)  # bf16 rows: a small move
        assert fused[0][slot][:8] == floats[0][slot][:8]
    assert not np.allclose(fused[1][0], floats[1][0], atol=1e-6)  # the activations really were rounded


def test_bf16_weights_replace_the_float32_matrices():
    model = load_model("random:tiny-llama3", exclusive=True)
    eng = _engine(model, weight_dtype="bfloat16")
    t = eng.load_params().tensors
    names = quantized_names(model.config)
    for name, source in names:
        assert t[name + ".qweight"].dtype == torch.bfloat16
        assert name + ".scale" not in t
    for source in replaced_weights(model.config):
        assert source not in t and source not in model.weights  # neither the engine nor the Model keeps them
    assert "model.embed_tokens.weight" in model.weights  # the lookup table stays float32
    assert eng.speed_paths()["weights"].startswith("bfloat16")


def test_engines_of_one_exclusive_model_share_its_bf16_copies():
    """The float32 matrices of an exclusive Model are released once copied, so a second
    engine (another configuration, as `polyengine bench` builds per phase) must find the
    copies the first made, not read the released matrices (a WeightsError before)."""
    model = load_model("random:tiny-llama3", exclusive=True)
    first = _engine(model, weight_dtype="bfloat16").load_params().tensors
    second_eng = CpuEngine(model, EngineConfig(max_slots=3, max_cache_length=64,
                                                 options={"weight_dtype": "bfloat16", "fuse_projections": False}))
    second = second_eng.load_params().tensors
    name = "model.layers.0.mlp.down_proj.qweight"
    assert first[name].data_ptr() == second[name].data_ptr()  # shared, not copied again
    assert "model.layers.0.mlp.gate_up_proj.qweight" in first
    assert "model.layers.0.mlp.gate_up_proj.qweight" not in second
    tokens, _ = _greedy(second_eng, steps=3)
    assert all(len(t) == 4 for t in tokens.values())


def test_bf16_weights_are_refused_where_they_do_not_apply():
    model = load_model("random:tiny")
    for options, dtype, phrase in (({"quantize": "int8"}, "float32", "choose one of quantize and weight_dtype"),
                                   ({}, "bfloat16", "computes in bfloat16; use dtype float32"),
                                   ({"cpu_kernels": False, "bf16_compute": "bf16"}, "float32", "not used here")):
        with pytest.raises(UnsupportedFeature, match=phrase):
            CpuEngine(model, EngineConfig(max_slots=2, max_cache_length=64, dtype=dtype,
                                            options={"weight_dtype": "bfloat16", **options}))
    with pytest.raises(UnsupportedFeature, match="add weight_dtype='bfloat16'"):
        CpuEngine(model, EngineConfig(max_slots=2, max_cache_length=64, options={"bf16_compute": "bf16"}))
    # likewise the activations of int8 products without int8 weights (it was ignored)
    with pytest.raises(UnsupportedFeature, match="add quantize='int8'"):
        CpuEngine(model, EngineConfig(max_slots=2, max_cache_length=64, options={"int8_compute": "int8"}))


# -- prefill on bfloat16 operands (option prefill_compute) ------------------------------------


@pytest.mark.parametrize("mode", ["bfloat16", "int8", "int8-block32"])
def test_bf16_prefill_products_round_each_operand_once(mode, monkeypatch):
    """compute=bfloat16: x rounded to bfloat16; bfloat16 weights as they are, int8 ones
    widened (per-block scales applied in float32, then rounded once; per-row scales
    applied to the output); the product rounded to bfloat16; across bands of rows."""
    import polyengine.backends.cpu.int8 as int8_module
    from polyengine.backends.cpu.int8 import TiledInt8Linear, dequantize

    monkeypatch.setattr(int8_module, "_BAND_ELEMENTS", 1 << 16)  # bands of 682 rows: five, the last partial
    g = torch.Generator().manual_seed(3)
    m, n, k = 40, 3000, 96
    x, b = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    if mode == "bfloat16":
        q, scale = torch.randn(n, k, generator=g).to(torch.bfloat16), None
        w = q.double()
    else:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand((n,) if mode == "int8" else (n, k // 32), generator=g) * 0.01
        # per-row: the integer weights exactly (their scale is applied to the output);
        # per-block: the float32 product of weight and scale, rounded to bfloat16 once
        w = q.double() if mode == "int8" else dequantize(q, scale).to(torch.bfloat16).double()
    tiled = TiledInt8Linear()
    got = tiled(x, q, scale, b, compute=torch.bfloat16)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    exact = x.to(torch.bfloat16).double() @ w.t()  # the rounded operands' product, in float64
    if mode == "int8":
        exact = exact * scale.double()
    # the product's own rounding to bfloat16 (at most 2^-9 of it; float32 sums a little
    # more), then the bias in float32
    err = (got.double() - exact - b.double()).abs()
    assert bool((err <= 2 ** -8 * exact.abs() + 1e-5 * float(exact.abs().max())).all()), float(err.max())
    floats = tiled(x, q, scale, b)  # float32 operands: another function
    assert (got - floats).abs().max() > 1e-3 * floats.abs().max()


def test_prefill_compute_auto_is_bf16_where_the_cpu_has_bf16_units(monkeypatch):
    import polyengine.backends.cpu.plan as mod
    from polyengine import hostinfo

    model = load_model("random:tiny-gqa")
    bf16_rows, int8_rows = {"weight_dtype": "bfloat16", "bf16_compute": "bf16"}, {"quantize": "int8",
                                                                                   "int8_compute": "int8"}
    for units, options, want in (
            (True, bf16_rows, torch.bfloat16), (True, int8_rows, torch.bfloat16),
            (False, bf16_rows, torch.float32), (False, int8_rows, torch.float32), (True, {}, torch.float32),
            # float32 activations in decode (or int8x2's float-like two rows): float32 prefill
            (True, {"weight_dtype": "bfloat16"}, torch.float32), (True, {"quantize": "int8"}, torch.float32),
            (True, {**bf16_rows, "prefill_compute": "float"}, torch.float32),
            (False, {"quantize": "int8-block32", "prefill_compute": "bf16"}, torch.bfloat16)):
        monkeypatch.setattr(mod, "has_bf16_units", lambda: units)
        assert _engine(model, **options).plan.prefill_compute == want, (units, options)
    # a forced path below avx512 runs as its hosts would: no bfloat16 units for auto
    monkeypatch.setattr(mod, "has_bf16_units", lambda: True)
    runnable = hostinfo.runnable_isas()
    for isa, want in (("avx2", torch.float32), ("scalar", torch.float32), ("avx512", torch.bfloat16)):
        if isa not in runnable:
            continue
        eng = _engine(model, **int8_rows, isa=isa)
        assert eng.plan.prefill_compute == want, isa
        if want == torch.float32:
            unbuilt = mod.CpuPlan.resolve(eng.options, None, mod.CpuHost.detect(), dtype=torch.float32)
            assert f"as on the hosts isa '{isa}' stands for" in unbuilt.describe()["prefill"]
    forced = _engine(model, **int8_rows, isa="scalar", prefill_compute="bf16")
    assert forced.plan.prefill_compute == torch.bfloat16
    assert "the hosts isa 'scalar' stands for have no bfloat16 units" in forced.speed_paths()["prefill"]
    with pytest.raises(UnsupportedFeature, match="add weight_dtype='bfloat16' or quantize"):
        _engine(model, prefill_compute="bf16")


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "no-kernels"])
def test_bf16_prefill_moves_the_logits_a_little_and_decodes_on(kernels):
    """A prompt longer than the kernels' rows (16) is prefilled on bfloat16 operands when
    forced: logits near the float32 operands' (not equal), the prefix decodes on."""
    model = load_model("random:tiny-gqa")
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, model.config.vocab_size, 40)]
    sp = SamplingParams(temperature=0, max_tokens=8)
    runs = {}
    for compute in ("float", "bf16"):
        eng = _engine(model, weight_dtype="bfloat16", prefill_compute=compute, cpu_kernels=kernels)
        assert ("bfloat16 operands" in eng.speed_paths()["prefill"]) == (compute == "bf16")
        params, state = eng.load_params(), eng.init_decode_state()
        prefix, _ = eng.prefill(params=params, tokens=prompt, sampling=sp)
        logits = np.asarray(prefix.host_logits(), np.float64)
        state = eng.insert(prefix, state, 1)
        for _ in range(4):
            state, res = eng.generate(params, state)
            assert 0 <= int(res.tokens[1, 0]) < model.config.vocab_size
        runs[compute] = logits
    a, b = runs["float"], runs["bf16"]
    assert 0 < np.abs(a - b).max() < 0.05 * np.abs(a).max()


@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-qwen2"])  # tiny-qwen2: q/k/v biases
def test_fused_projections_are_slices_of_one_matrix_and_compute_the_same(preset):
    """Option fuse_projections: q/k/v and gate/up of each layer as row slices of one
    bfloat16 matrix (the torch forward multiplies them in one GEMM), no memory added, the
    same logits and tokens as separate matrices, in prefill (float32 or bfloat16 operands)
    and through the torch forward's decode."""
    model = load_model(f"random:{preset}")
    prompt = [int(t) for t in np.random.default_rng(1).integers(1, model.config.vocab_size, 40)]
    for compute in ("float", "bf16"):
        runs = {}
        for fuse in (True, False):
            eng = _engine(model, weight_dtype="bfloat16", prefill_compute=compute, fuse_projections=fuse,
                          fused_decode=False)
            t = eng.load_params().tensors
            pre = "model.layers.0."
            assert (pre + "self_attn.qkv_proj.qweight" in t) == fuse and (pre + "mlp.gate_up_proj.qweight" in t) == fuse
            if fuse:
                whole = t[pre + "mlp.gate_up_proj.qweight"]
                assert t[pre + "mlp.up_proj.qweight"].untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
                assert (pre + "self_attn.qkv_proj.bias" in t) == (pre + "self_attn.q_proj.bias" in t)
            runs[fuse] = _greedy(eng, steps=6), _prefill_logits(eng, prompt)
        (tokens, lps), logits = runs[True]
        (tokens2, lps2), logits2 = runs[False]
        assert tokens == tokens2, compute
        for slot in lps:
            np.testing.assert_allclose(lps[slot], lps2[slot], atol=1e-4)
        # bfloat16 operands: a GEMM of another shape may round a product the other way
        np.testing.assert_allclose(logits, logits2, atol=1e-4 if compute == "float" else 2e-2 * np.abs(logits2).max())


def _prefill_logits(eng: CpuEngine, prompt: list[int]) -> np.ndarray:
    prefix, _ = eng.prefill(params=eng.load_params(), tokens=prompt, sampling=SamplingParams(temperature=0))
    return np.asarray(prefix.host_logits(), np.float64)
