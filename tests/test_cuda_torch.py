"""The cuda_torch backend on this machine's device (the CPU here, CUDA where a GPU is
present): discovery, refusals, the CPU kernels, int8 and CUDA graphs. The whole
conformance suite runs on it in tests/test_conformance_cli.py, the driver smoke test in
tests/test_backend_smoke.py."""

from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch")

import polyengine  # noqa: E402
from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.backends.cuda_torch.engine import TorchEngine  # noqa: E402
from polyengine.driver import LLM  # noqa: E402
from polyengine.errors import InvalidRequest  # noqa: E402
from polyengine.models import load_model  # noqa: E402

CFG = EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=64)


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny-gqa")


def test_auto_picks_cuda_torch_over_the_reference():
    info = polyengine.select_backend("auto")
    assert info.name == "cuda_torch"


@pytest.mark.parametrize(("options", "phrase"), [
    ({"attention": "flash"}, "attention='flash'"),
    ({"sampler_dtype": "float16"}, "sampler_dtype"),
    ({"device": "tpu"}, "device='tpu'"),
    ({"kv_block": 0}, "kv_block=0"),
])
def test_bad_options_are_refused(model, options, phrase):
    with pytest.raises(InvalidRequest) as exc:
        TorchEngine(model, CFG.model_copy(update={"options": options}))
    assert phrase in str(exc.value)


def test_sync_and_async_steps_agree(model):
    prompts = [[1, 4, 4, 2], [3, 9]]
    sp = SamplingParams(seed=11, max_tokens=10)
    runs = []
    for async_steps in (False, True):
        eng = TorchEngine(model, CFG.model_copy(update={"options": {"async_steps": async_steps}}))
        runs.append([c.token_ids for c in LLM.from_engine(eng, tools=False).generate(prompts, sp)])
    assert runs[0] == runs[1]


def test_weights_share_the_models_memory_on_the_cpu(model):
    eng = TorchEngine(model, CFG)
    w = eng.load_params()
    src = model.weights["model.layers.0.mlp.up_proj.weight"]
    assert w.tensors["model.layers.0.mlp.up_proj.weight"].data_ptr() == src.ctypes.data


# -- the CPU kernels and int8 weights ----------------------------------------------------


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize(("n", "k"), [(7, 13), (64, 576), (130, 48)])
def test_cpu_kernels_equal_torch_linear(m, n, k):
    from polyengine.backends.cuda_torch.cpu_kernels import dequantize_int8, load, quantize_int8

    kernels = load(2)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    torch.testing.assert_close(kernels.linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
    for group in (0, 16) if k % 16 == 0 else (0,):
        q, scale = quantize_int8(w, group)
        want = torch.nn.functional.linear(x, dequantize_int8(q, scale), b)
        torch.testing.assert_close(kernels.linear(x, q, b, scale=scale), want, rtol=1e-5, atol=1e-4)
        assert (dequantize_int8(q, scale) - w).abs().max() <= scale.max() / 2 + 1e-6  # rounding: half a step


@pytest.mark.parametrize("group", [0, 32])
def test_int8_activation_products(group):
    """int8 weights against int8 activations (kernels/q8.cpp): one int8 row per row of
    x is within the activation rounding of the float product; two (the second carrying
    the first's rounding error) are closer by two orders of magnitude."""
    from polyengine.backends.cuda_torch.cpu_kernels import dequantize_int8, load, quantize_int8

    kernels = load(2)
    g = torch.Generator().manual_seed(group + 3)
    x, w, b = torch.randn(5, 576, generator=g), torch.randn(70, 576, generator=g), torch.randn(70, generator=g)
    x[:, 7] *= 30  # an outlier channel, as LLM activations have
    q, scale = quantize_int8(w, group)
    want = torch.nn.functional.linear(x.double(), dequantize_int8(q, scale).double(), b.double())
    err = {}
    for pairs in (1, 2):
        got = kernels.linear(x, q, b, scale=scale, int8_activations=pairs).double()
        err[pairs] = float((got - want).norm() / want.norm())
    assert err[1] < 0.02 and err[2] < err[1] / 50, err
    with pytest.raises(ValueError, match="multiples of 32"):
        kernels.linear(x[:, :40], q[:, :40].contiguous(), scale=scale[:, :1].contiguous() if group else scale,
                       int8_activations=1)


@pytest.mark.parametrize(("compute", "expect"), [("auto", 2), ("int8x2", 2), ("int8", 1), ("float", 0)])
def test_int8_compute_option(model, compute, expect):
    eng = TorchEngine(model, CFG.model_copy(update={"options": {"quantize": "int8", "int8_compute": compute}}))
    fits = all(k % 32 == 0 for k in (model.config.hidden_size, model.config.intermediate_size, model.config.q_size))
    assert eng.int8_activations == (expect if fits else 0)
    with pytest.raises(InvalidRequest, match="int8_compute"):
        TorchEngine(model, CFG.model_copy(update={"options": {"quantize": "int8", "int8_compute": "int4"}}))


def test_kernels_off_is_the_same_engine(model):
    prompts, sp = [[1, 5, 9, 4, 2], [3, 3, 8]], SamplingParams(seed=5, max_tokens=8)
    runs = []
    for on in (True, False):
        eng = TorchEngine(model, CFG.model_copy(update={"options": {"cpu_kernels": on}}))
        runs.append([c.token_ids for c in LLM.from_engine(eng, tools=False).generate(prompts, sp)])
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_int8_weights_on_the_default_model(default_gguf):
    """int8 weight-only (per-channel) against float32 on the default model: the logits'
    relative error and greedy agreement, with the bounds docs/cuda_torch.md states."""
    real = load_model(default_gguf)
    cfg = EngineConfig(max_slots=2, max_prefill_length=64, max_cache_length=128)
    prompts = [real.tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "Once upon a time")]
    f32 = TorchEngine(real, cfg)
    report = {}
    # default int8_compute ("auto": two int8 rows per activation row on this model)
    for mode, bound in (("int8", 0.25), ("int8-block32", 0.05)):
        report[mode] = _int8_agreement(real, cfg, f32, prompts, {"quantize": mode})
        assert report[mode]["rel_l2"] < bound, report
    # one int8 row per activation row: faster, about three times the logits error
    report["int8-block32/int8"] = _int8_agreement(real, cfg, f32, prompts, {"quantize": "int8-block32",
                                                                              "int8_compute": "int8"})
    assert report["int8-block32/int8"]["rel_l2"] < 0.25, report
    print("int8 weights vs float32 on the default model:", report)
    assert sum(report["int8-block32"]["agree"]) >= 48


def _int8_agreement(real, cfg, f32, prompts, options):
    from polyengine.sampling import raw_logprobs

    i8 = TorchEngine(real, cfg.model_copy(update={"options": options}))
    errs = []
    for p in prompts:
        a = f32.prefill(params=f32.load_params(), tokens=p, sampling=SamplingParams(temperature=0, seed=0))[0].host_logits()
        b = i8.prefill(params=i8.load_params(), tokens=p, sampling=SamplingParams(temperature=0, seed=0))[0].host_logits()
        errs.append(float(np.linalg.norm(b - a) / np.linalg.norm(a)))
        assert abs(raw_logprobs(a).max() - raw_logprobs(b).max()) < 0.5
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = [c.token_ids for c in LLM.from_engine(f32, tools=False).generate(prompts, sp)]
    got = [c.token_ids for c in LLM.from_engine(i8, tools=False).generate(prompts, sp)]
    agree = [next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), len(w)) for g, w in zip(got, want)]
    return {"rel_l2": round(max(errs), 4), "agree": agree}


@pytest.mark.gpu
def test_cuda_graphs_equal_eager_on_a_gpu(model):
    prompts, sp = [[1, 5, 9, 4, 2], [3, 3, 8]], SamplingParams(seed=5, max_tokens=70)
    cfg = EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=128)
    runs = []
    for graphs in (False, True):
        eng = TorchEngine(model, cfg.model_copy(update={"dtype": "float32", "options": {"cuda_graphs": graphs}}))
        runs.append([c.token_ids for c in LLM.from_engine(eng, tools=False).generate(prompts, sp)])
    assert runs[0] == runs[1]


def test_cuda_graphs_are_refused_on_the_cpu(model):
    from polyengine.errors import UnsupportedFeature

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(UnsupportedFeature, match="CUDA graphs need a CUDA device"):
        TorchEngine(model, CFG.model_copy(update={"options": {"cuda_graphs": True}}))
