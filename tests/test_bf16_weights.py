"""cuda_torch's bfloat16 weights under float32 compute (option ``weight_dtype``): the
projections and the LM head stored as bfloat16, widened exactly in the products, on
every ISA path the host runs; the fused step, the torch forward on the kernels and the
torch forward without them compute the same function; the float32 matrices are not kept."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.backends.cuda_torch.engine import TorchEngine  # noqa: E402
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


def _engine(model, **options) -> TorchEngine:
    return TorchEngine(model, EngineConfig(max_slots=3, max_cache_length=128, options=options))


def _greedy(eng: TorchEngine, steps: int = 12):
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
    fused = _greedy(_engine(model, weight_dtype="bfloat16", bf16_compute="bf16", isa=isa))
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


def test_bf16_weights_are_refused_where_they_do_not_apply():
    model = load_model("random:tiny")
    for options, dtype, phrase in (({"quantize": "int8"}, "float32", "choose one of quantize and weight_dtype"),
                                   ({}, "bfloat16", "computes in bfloat16; use dtype float32"),
                                   ({"cpu_kernels": False, "bf16_compute": "bf16"}, "float32", "not used here")):
        with pytest.raises(UnsupportedFeature, match=phrase):
            TorchEngine(model, EngineConfig(max_slots=2, max_cache_length=64, dtype=dtype,
                                            options={"weight_dtype": "bfloat16", **options}))
    with pytest.raises(UnsupportedFeature, match="add weight_dtype='bfloat16'"):
        TorchEngine(model, EngineConfig(max_slots=2, max_cache_length=64, options={"bf16_compute": "bf16"}))
    # likewise the activations of int8 products without int8 weights (it was ignored)
    with pytest.raises(UnsupportedFeature, match="add quantize='int8'"):
        TorchEngine(model, EngineConfig(max_slots=2, max_cache_length=64, options={"int8_compute": "int8"}))
