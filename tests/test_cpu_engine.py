"""The cpu backend: discovery, refusals, the host-compiled kernels on every ISA path the
host runs, int8 weights, live rows. The whole conformance suite runs on it in
tests/test_conformance_cli.py, the driver smoke test in tests/test_backend_smoke.py;
cuda_torch's device path is tests/test_cuda_torch.py."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import polyengine  # noqa: E402
from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.backends.cpu.engine import CpuEngine  # noqa: E402
from polyengine.backends.cpu.kernels import SPLIT_PIECES  # noqa: E402
from polyengine.driver import LLM  # noqa: E402
from polyengine.errors import InvalidRequest, UnsupportedFeature  # noqa: E402
from polyengine.hostinfo import has_bf16_units  # noqa: E402
from polyengine.models import load_model  # noqa: E402

from isa_paths import ISAS, kernels_for  # noqa: E402

CFG = EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=64)


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny-gqa")


def test_auto_picks_cpu_on_a_host_without_an_accelerator():
    assert polyengine.select_backend("auto").name == "cpu"


@pytest.mark.parametrize(("options", "phrase"), [
    ({"attention": "flash"}, "attention='flash'"),
    ({"sampler_dtype": "float16"}, "sampler_dtype"),
    ({"device": "cpu"}, "'device' is an option of backend 'cuda_torch'"),
    ({"kv_block": 0}, "kv_block=0"),
    ({"isa": "neon"}, "isa='neon'"),
])
def test_bad_options_are_refused(model, options, phrase):
    with pytest.raises(InvalidRequest) as exc:
        CpuEngine(model, CFG.model_copy(update={"options": options}))
    assert phrase in str(exc.value)


def test_sync_and_async_steps_agree(model):
    prompts = [[1, 4, 4, 2], [3, 9]]
    sp = SamplingParams(seed=11, max_tokens=10)
    runs = []
    for async_steps in (False, True):
        eng = CpuEngine(model, CFG.model_copy(update={"options": {"async_steps": async_steps}}))
        runs.append([c.token_ids for c in LLM.from_engine(eng, tools=False).generate(prompts, sp)])
    assert runs[0] == runs[1]


def test_weights_share_the_models_memory_on_the_cpu(model):
    eng = CpuEngine(model, CFG)
    w = eng.load_params()
    src = model.weights["model.layers.0.mlp.up_proj.weight"]
    assert w.tensors["model.layers.0.mlp.up_proj.weight"].data_ptr() == src.ctypes.data


# -- the CPU kernels and int8 weights ----------------------------------------------------


def _quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The core's quantizer (the one every backend uses) on a torch matrix."""
    from polyengine.models.quantize import quantize_matrix

    return tuple(torch.from_numpy(a) for a in quantize_matrix(w.numpy(), group))


def dequantize(q, scale):
    from polyengine.backends.cpu.int8 import dequantize as widen

    return widen(q, scale)


@pytest.mark.parametrize("isa", ISAS)
def test_each_isa_path_is_what_it_says(isa):
    """A forced path's library is compiled for that instruction set (read from the
    library itself), "auto" for the best this CPU runs; each is its own cache entry."""
    from polyengine.backends.cpu.kernels import cache_entry
    from polyengine.hostinfo import runnable_isas

    kernels = kernels_for(isa)
    assert kernels.isa == (runnable_isas()[0] if isa == "auto" else isa)
    assert kernels.vector_width == (16 if kernels.isa == "avx512" else 8)
    assert kernels.path == cache_entry(isa)[0] and f"cpu-step-{isa}-" in kernels.path.name
    assert len({cache_entry(i)[0] for i in ISAS}) == len(ISAS)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize(("n", "k"), [(7, 13), (64, 576), (130, 48)])
def test_cpu_kernels_equal_torch_linear(m, n, k, isa):
    kernels = kernels_for(isa)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    torch.testing.assert_close(kernels.linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
    for group in (0, 16) if k % 16 == 0 else (0,):
        q, scale = _quantize(w, group)
        want = torch.nn.functional.linear(x, dequantize(q, scale), b)
        torch.testing.assert_close(kernels.linear(x, q, b, scale=scale), want, rtol=1e-5, atol=1e-4)
        assert (dequantize(q, scale) - w).abs().max() <= scale.max() / 2 + 1e-6  # rounding: half a step


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [0, 32])
def test_int8_activation_products(group, isa):
    """int8 weights against int8 activations (kernels/q8.cpp): one int8 row per row of
    x is within the activation rounding of the float product; two (the second carrying
    the first's rounding error) are closer by two orders of magnitude."""
    kernels = kernels_for(isa)
    g = torch.Generator().manual_seed(group + 3)
    x, w, b = torch.randn(5, 576, generator=g), torch.randn(70, 576, generator=g), torch.randn(70, generator=g)
    x[:, 7] *= 30  # an outlier channel, as LLM activations have
    q, scale = _quantize(w, group)
    want = torch.nn.functional.linear(x.double(), dequantize(q, scale).double(), b.double())
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
    eng = CpuEngine(model, CFG.model_copy(update={"options": {"quantize": "int8", "int8_compute": compute}}))
    fits = all(k % 32 == 0 for k in (model.config.hidden_size, model.config.intermediate_size, model.config.q_size))
    assert eng.plan.int8_activations == (expect if fits else 0)
    with pytest.raises(InvalidRequest, match="int8_compute"):
        CpuEngine(model, CFG.model_copy(update={"options": {"quantize": "int8", "int8_compute": "int4"}}))


def _generate(model, options, prompts, sp):
    eng = CpuEngine(model, CFG.model_copy(update={"options": options}))
    return eng, [c.token_ids for c in LLM.from_engine(eng, tools=False).generate(prompts, sp)]


@pytest.mark.parametrize("isa", ISAS)
def test_kernels_off_is_the_same_engine(model, isa):
    """The fused step and products of each ISA path decode what the torch forward does."""
    kernels_for(isa)  # skips where this CPU cannot execute the path
    prompts, sp = [[1, 5, 9, 4, 2], [3, 3, 8]], SamplingParams(seed=5, max_tokens=8)
    eng, on = _generate(model, {"isa": isa}, prompts, sp)
    assert eng._fused is not None and eng._kernels.requested == isa
    assert eng.speed_paths()["isa"].startswith(eng._kernels.isa + " (")
    with pytest.warns(polyengine.errors.FallbackWarning, match="cpu_kernels=False"):
        assert on == _generate(model, {"cpu_kernels": False}, prompts, sp)[1]


@pytest.mark.parametrize("isa", ISAS)
def test_the_sampler_kernel_draws_the_torch_samplers_tokens(model, isa):
    """Option sampler_kernel (on by default): the stream's bits and plain temperature
    sampling's draw from csrc/threefry.h on each ISA path (float64, the core's formula);
    seeded sampled completions, n = 2 among them, equal the float32 torch ops' (they could
    part only at a float32 near tie, which these prompts do not reach)."""
    kernels_for(isa)
    prompts = [[1, 5, 9, 4, 2], [3, 3, 8]]
    sp = SamplingParams(seed=11, max_tokens=10, temperature=0.9, n=2, ignore_eos=True)
    eng, on = _generate(model, {"isa": isa}, prompts, sp)
    assert eng._prefill_sampler.kernels is not None
    off_eng, off = _generate(model, {"isa": isa, "sampler_kernel": False}, prompts, sp)
    assert off_eng._prefill_sampler.kernels is None
    assert on == off and len(set(map(tuple, on))) > 1


def test_a_forced_isa_the_cpu_lacks_is_refused(model, monkeypatch):
    """Forcing a path this CPU cannot execute names what it lacks and what it runs, before
    anything is compiled or loaded; a forced path where the kernels do not run is refused."""
    from polyengine.backends.cpu import kernels as cpu_kernels

    monkeypatch.setattr(cpu_kernels, "missing_for", lambda isa: ("avx512f", "avx512bw") if isa == "avx512" else ())
    monkeypatch.setattr(cpu_kernels, "runnable_isas", lambda: ("avx2", "scalar"))
    with pytest.raises(UnsupportedFeature, match=r"isa='avx512'.*lacks avx512f, avx512bw; it runs isa 'avx2', "
                                                 r"'scalar'") as exc:
        CpuEngine(model, CFG.model_copy(update={"options": {"isa": "avx512"}}))
    assert exc.value.feature == "isa='avx512'"
    with pytest.raises(UnsupportedFeature, match="cpu_kernels=True"):
        CpuEngine(model, CFG.model_copy(update={"options": {"isa": "scalar", "cpu_kernels": False}}))


@pytest.mark.slow
def test_int8_weights_on_the_default_model(default_gguf):
    """int8 weight-only (per-channel) against float32 on the default model: the logits'
    relative error and greedy agreement, with the bounds docs/cuda_torch.md states."""
    real = load_model(default_gguf)
    cfg = EngineConfig(max_slots=2, max_prefill_length=64, max_cache_length=128)
    prompts = [real.tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):", "Once upon a time", (
        "The river rose through the night, and by morning the old stone bridge at the edge of the village was "
        "under water. The baker, who had crossed it every day for forty years, stood at the bank and"))]
    # the last prompt (over 16 tokens) is prefilled on torch's GEMM, not the kernels: with
    # bf16_compute=bf16 or int8_compute=int8, on bfloat16 operands where this CPU has
    # bfloat16 units (option prefill_compute auto)
    assert len(prompts[-1]) > 16
    f32 = CpuEngine(real, cfg)
    report = {}
    # default int8_compute ("auto": two int8 rows per activation row on this model)
    for mode, bound in (("int8", 0.25), ("int8-block32", 0.05)):
        report[mode] = _int8_agreement(real, cfg, f32, prompts, {"quantize": mode})
        assert report[mode]["rel_l2"] < bound, report
    # one int8 row per activation row: faster, about three times the logits error
    report["int8-block32/int8"] = _int8_agreement(real, cfg, f32, prompts, {"quantize": "int8-block32",
                                                                              "int8_compute": "int8"})
    assert report["int8-block32/int8"]["rel_l2"] < 0.25, report
    # bfloat16 weights (option weight_dtype), float32 or bfloat16 activations
    for name, options, bound in (("bfloat16", {"weight_dtype": "bfloat16"}, 0.02),
                                 # bfloat16 activations, in prefill too where it runs on bfloat16
                                 # operands: on long prompts 0.005-0.04 (moved that much by a
                                 # 1e-6 relative change of one product: measured, docs/cuda_torch.md)
                                 ("bfloat16/bf16", {"weight_dtype": "bfloat16", "bf16_compute": "bf16"},
                                  0.06 if has_bf16_units() else 0.02)):
        report[name] = _int8_agreement(real, cfg, f32, prompts, options)
        assert 0 < report[name]["rel_l2"] < bound, report
    print("int8 and bfloat16 weights vs float32 on the default model:", report)
    assert sum(report["int8-block32"]["agree"]) >= 48
    assert sum(report["bfloat16"]["agree"]) >= 48


def _int8_agreement(real, cfg, f32, prompts, options):
    from polyengine.sampling import raw_logprobs

    i8 = CpuEngine(real, cfg.model_copy(update={"options": options}))
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


@pytest.mark.parametrize("kernels", [True, False], ids=["fused-kernels", "torch-fallback"])
def test_a_decode_step_computes_only_the_live_rows(model, monkeypatch, kernels):
    """One request in a four-slot engine: every forward (or fused step) runs one row, so a
    step's cost follows the live requests, not the engine's slot count."""
    import polyengine.backends.cpu.engine as mod
    from polyengine.backends.cpu.kernels import FusedDecoder

    rows: list[int] = []
    forward, fused = mod.forward, FusedDecoder.step

    def spy_forward(weights, spec, tokens, *args, **kwargs):
        rows.append(tokens.shape[0])
        return forward(weights, spec, tokens, *args, **kwargs)

    def spy_fused(self, x, *args, **kwargs):
        rows.append(x.shape[0])
        return fused(self, x, *args, **kwargs)

    monkeypatch.setattr(mod, "forward", spy_forward)
    monkeypatch.setattr(FusedDecoder, "step", spy_fused)
    with pytest.warns(polyengine.errors.FallbackWarning, match="cpu_kernels=True") if not kernels else _no_warning():
        # contiguous: a paged engine's short prefill is a call of the fused step too (3 rows)
        eng = CpuEngine(model, CFG.model_copy(update={"options": {"cpu_kernels": kernels, "page_size": 0}}))
    assert eng.max_concurrent_decodes == 4
    LLM.from_engine(eng, tools=False).generate([[1, 5, 9]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(rows) >= 6 and set(rows) == {1}, rows


def _no_warning():
    import contextlib
    import warnings

    @contextlib.contextmanager
    def fail_on_fallback():
        with warnings.catch_warnings():
            warnings.simplefilter("error", polyengine.errors.FallbackWarning)
            yield

    return fail_on_fallback()


@pytest.mark.parametrize("name", ["mha_tied", "odd_qwen2", "gemma3", "mixtral", "nanochat"])
def test_fused_cpu_step_only_for_the_llama_family(name):
    """The fused CPU decode kernel is written for Llama; other architectures decode
    through the shared forward (never a wrong model), and MoE refuses int8 weights."""
    from polyengine.conformance.models import build_model
    from polyengine.errors import UnsupportedFeature

    model = build_model(name)
    eng = CpuEngine(model, EngineConfig(max_slots=2, max_prefill_length=16, max_cache_length=32,
                                          ))
    eng.load_params()
    if eng._kernels is not None:
        assert (eng._fused is not None) == model.config.is_llama_family
    if model.config.num_experts:
        with pytest.raises(UnsupportedFeature, match="mixture-of-experts"):
            CpuEngine(model, EngineConfig(max_slots=2, max_prefill_length=16, max_cache_length=32,
                                            options={"quantize": "int8"}))


def test_int8_groupings_that_differ_decode_unfused_instead_of_failing():
    """int8-block32 on a model whose intermediate size is not a multiple of 32: its
    projections quantize in two groupings, which the fused step cannot take; the plan
    says so and decodes through the torch forward (found by the conformance suite's
    option sets)."""
    from polyengine.conformance.models import build_model

    model = build_model("gqa_llama3")
    assert model.config.intermediate_size % 32
    eng = CpuEngine(model, CFG.model_copy(update={"options": {"quantize": "int8-block32"}}))
    assert not eng.plan.fused_decode and "groups" in eng.speed_paths()["decode"]
    out = LLM.from_engine(eng, tools=False).generate([[1, 5, 9]], SamplingParams(temperature=0, max_tokens=6,
                                                                                 ignore_eos=True))
    assert len(out[0].token_ids) == 6


def test_the_memory_check_counts_only_what_is_converted(tmp_path, monkeypatch):
    """A Q8_0 file's blocks are read as mapped: nothing to count. An F16 file's matrices
    (a format the engine does not compute on) are widened to float32 tensor by tensor:
    the engine's memory check counts those copies."""
    from polyengine.models.quant_presets import quantized_model_file

    needs = {}
    monkeypatch.setattr(CpuEngine, "check_memory", lambda self, n, **kw: needs.update(n))
    CpuEngine(load_model(str(quantized_model_file("Q8_0", tmp_path))), CFG)
    assert "float32 copies of the weights stored in other formats" not in needs
    model = load_model(str(quantized_model_file("F16", tmp_path)))
    CpuEngine(model, CFG)
    assert needs["float32 copies of the weights stored in other formats"] == model.conversion_bytes() > 0


@pytest.mark.parametrize("n", [5, 20])
def test_prefill_runs_its_own_rows_unless_buckets_are_asked_for(model, monkeypatch, n):
    """The host pads nothing (no shapes are compiled here, and a pad row is a real row in
    every product); with ``prefill_buckets`` set it pads to them, as asked. Either way the
    prefix is the same: first token equal, logits and K/V within float32 rounding. (The
    torch forward's rows: fused_prefill off, or 5 tokens would be one fused call.)"""
    import polyengine.backends.torch_common.engine as torch_engine

    seen = []
    real = torch_engine.forward

    def spy(params, spec, tokens, *args, **kwargs):
        seen.append(tuple(tokens.shape))
        return real(params, spec, tokens, *args, **kwargs)

    monkeypatch.setattr(torch_engine, "forward", spy)
    cfg = EngineConfig(max_slots=2, max_prefill_length=40, max_cache_length=64, dtype="float32",
                       options={"fused_prefill": False})
    prompt = np.random.default_rng(n).integers(3, 250, n).tolist()
    out = {}
    for buckets in (None, (16, 32, 40)):
        eng = CpuEngine(model, cfg.model_copy(update={"prefill_buckets": buckets}))
        seen.clear()
        prefix, first = eng.prefill(params=eng.load_params(), tokens=prompt, sampling=SamplingParams(temperature=0))
        assert seen == [(1, n if buckets is None else eng.config.bucket_for(n))], buckets
        out[buckets] = (eng.export_prefix(prefix), int(first.tokens[0, 0]))
    (a, ta), (b, tb) = out.values()
    assert ta == tb and a.k.shape == b.k.shape
    np.testing.assert_allclose(a.last_logits, b.last_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.k, b.k, rtol=1e-5, atol=1e-5)


def _fused_and_torch(model, **options):
    """Two engines on ``model``: short prefills in the fused step, and through the torch
    forward; calls of the fused step's prefill counted on the first. Contiguous K/V (a
    paged engine's short prefill writes its pages through the fused step's ``step``)."""
    cfg = EngineConfig(max_slots=2, max_prefill_length=40, max_cache_length=64, dtype="float32")
    options = {"page_size": 0, **options}
    fused = CpuEngine(model, cfg.model_copy(update={"options": {**options, "fused_prefill": True}}))
    torch_path = CpuEngine(model, cfg.model_copy(update={"options": {**options, "fused_prefill": False}}))
    from polyengine.backends.cpu.kernels import MAX_ROWS, TILED_FUSED_PREFILL_ROWS

    limit = TILED_FUSED_PREFILL_ROWS if fused.plan.block_tiles else MAX_ROWS  # 64 on int16 tiles (while attention is short), else 16
    assert fused.plan.fused_prefill and fused.fused_prefill_rows == limit and torch_path.fused_prefill_rows == 0
    calls = []
    fused.load_params()  # builds the fused step
    real = fused._fused.prefill
    fused._fused.prefill = lambda x, *a: calls.append(x.shape[0]) or real(x, *a)
    return fused, torch_path, calls


def _decoded(eng, params, prefix, slot, steps=3):
    """The tokens ``prefix`` decodes greedily in ``slot`` of a fresh decode state."""
    state = eng.insert(prefix, eng.init_decode_state(), slot)
    tokens = []
    for _ in range(steps):
        state, res = eng.generate(params, state)
        tokens.append(int(res.tokens[slot, 0]))
    return tokens


def _same_prefix(a, b, atol):
    """Two engines' prefixes of one prompt: first token equal, last logits and K/V close."""
    (pa, fa), (pb, fb) = a, b
    assert int(fa.tokens[0, 0]) == int(fb.tokens[0, 0])
    ea, eb = pa.engine.export_prefix(pa.prefix), pb.engine.export_prefix(pb.prefix)
    assert ea.k.shape == eb.k.shape
    np.testing.assert_allclose(ea.last_logits, eb.last_logits, atol=atol)
    np.testing.assert_allclose(ea.k, eb.k, atol=atol)
    np.testing.assert_allclose(ea.v, eb.v, atol=atol)


@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16"])
def test_short_prefills_run_as_one_fused_call_like_the_torch_forward(model, kv_dtype):
    """A prefill of up to 16 tokens (fresh, continuing a prefix, or a batch of entries
    whose tokens add up to 16) is one call of the fused step, and makes the prefix the
    torch forward makes (first token equal, logits and K/V within float32 rounding; a
    narrow cache's elements within one rounding); 17 tokens run the torch forward."""
    from types import SimpleNamespace

    from polyengine.engine import PrefillRequest

    fused, torch_path, calls = _fused_and_torch(model, kv_dtype=kv_dtype)
    atol = 1e-4 if kv_dtype == "auto" else 2e-2
    params = {e: e.load_params() for e in (fused, torch_path)}
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    rng = np.random.default_rng(5)

    def both(tokens, existing=None):
        out = []
        for eng in (fused, torch_path):
            prefix, first = eng.prefill(params=params[eng], tokens=tokens, sampling=sp,
                                        existing_prefix=None if existing is None else existing[eng])
            out.append((SimpleNamespace(engine=eng, prefix=prefix), first))
        return out

    fresh = both(rng.integers(3, 250, 10).tolist())
    assert calls == [10]
    _same_prefix(*fresh, atol)
    long = both(rng.integers(3, 250, 20).tolist())  # 20 tokens: the torch forward
    assert calls == [10]
    heads = {eng: got[0].prefix for eng, got in zip((fused, torch_path), long)}
    piece = both(rng.integers(3, 250, 12).tolist(), heads)  # continues 20 positions
    assert calls == [10, 12]
    _same_prefix(*piece, atol)
    # a batch: a fresh entry of 5 and a continuation of 7, one fused call of 12 rows
    entries = [rng.integers(3, 250, 5).tolist(), rng.integers(3, 250, 7).tolist()]
    batches = [eng.prefill_batch(params=params[eng], requests=[
        PrefillRequest(tokens=entries[0], sampling=sp),
        PrefillRequest(tokens=entries[1], sampling=sp, existing_prefix=heads[eng])]) for eng in (fused, torch_path)]
    assert calls == [10, 12, 12]
    for (pa, fa), (pb, fb) in zip(*batches):
        _same_prefix((SimpleNamespace(engine=fused, prefix=pa), fa),
                     (SimpleNamespace(engine=torch_path, prefix=pb), fb), atol)
    # and the prefixes decode alike
    assert _decoded(fused, params[fused], piece[0][0].prefix, 0) == _decoded(
        torch_path, params[torch_path], piece[1][0].prefix, 0)


@pytest.mark.parametrize("prefill_compute", ["auto", "float"])
def test_short_prefills_on_block_weights_in_the_fused_step_decode_as_the_oracle(tmp_path, prefill_compute):
    """A GGUF file's blocks: a prompt prefilled in pieces of 8 tokens, each one call of
    the fused step continuing the last, decodes greedily as the reference does: on int16
    tiles (auto, where the kernels have them: TILE_ROWS rows) and on the int8x2 kernels."""
    from polyengine.models.quant_presets import quantized_model_file

    model = load_model(str(quantized_model_file("Q4_K", tmp_path)))
    fused, _, calls = _fused_and_torch(model, prefill_compute=prefill_compute)
    assert fused._fused.dims.tile_rows == (8 if fused.plan.block_tiles else 0)
    assert fused.plan.block_tiles == (prefill_compute == "auto" and fused._kernels.gguf_tiles)
    params = fused.load_params()
    sp = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    prompt = [3 + (5 * i) % 200 for i in range(30)]
    prefix = None
    for at in (0, 8, 16, 24):
        prefix, first = fused.prefill(params=params, tokens=prompt[at: at + 8], sampling=sp, existing_prefix=prefix)
    assert calls == [8, 8, 8, 6]
    state = fused.insert(prefix, fused.init_decode_state(), 0)
    tokens = [int(first.tokens[0, 0])]
    for _ in range(6):
        state, res = fused.generate(params, state)
        tokens.append(int(res.tokens[0, 0]))
    ref = LLM(model=model, backend="reference", max_slots=2, max_cache_length=64, max_prefill_length=40)
    assert tokens == ref.generate([prompt], sp)[0].token_ids


def test_fused_prefills_past_16_tokens_on_tiles_while_their_attention_is_short(tmp_path):
    """On int16 tiles a prefill of up to TILED_FUSED_PREFILL_ROWS tokens is one fused call:
    at any length of prefix where its rows attend as runs (attention_runs, the default:
    60 after 400 positions too); attending row by row, only when its queries attend at
    most FUSED_PREFILL_SCORES keys in all (a fresh prompt of 60: 3,600), the torch
    forward's when they would attend more (60 after 400 positions: 27,600); up to 16
    tokens it always is; every way decodes as the oracle."""
    from polyengine.backends.cpu.kernels import FUSED_PREFILL_SCORES, TILED_FUSED_PREFILL_ROWS
    from polyengine.models.quant_presets import quantized_model_file

    model = load_model(str(quantized_model_file("Q4_0", tmp_path)))
    eng = CpuEngine(model, EngineConfig(max_slots=1, max_prefill_length=480, max_cache_length=512,
                                        options={"page_size": 0}))  # the contiguous prefill's calls
    if not eng.plan.block_tiles:
        pytest.skip("int16 tiles need AVX-512 VNNI (csrc/tile.h)")
    assert eng.fused_prefill_rows == TILED_FUSED_PREFILL_ROWS and 60 * 460 > FUSED_PREFILL_SCORES >= 60 * 60
    assert model.config.head_dim % eng._kernels.vector_width == 0  # runs apply
    params = eng.load_params()
    rows = CpuEngine(model, eng.config)
    rows.attention_runs = False
    calls = []
    real = eng._fused.prefill
    eng._fused.prefill = lambda x, *a: calls.append(x.shape[0]) or real(x, *a)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = LLM(model=model, backend="reference", max_slots=1, max_cache_length=512, max_prefill_length=480)
    head = [3 + (11 * i) % 250 for i in range(400)]
    tail = [5 + (7 * i) % 250 for i in range(60)]
    rows_params = rows.load_params()
    rows_calls = []
    real_rows = rows._fused.prefill
    rows._fused.prefill = lambda x, *a: rows_calls.append(x.shape[0]) or real_rows(x, *a)
    cases = [(eng, params, calls, ([*tail], [60], [60]), ([*head, *tail], [400, 60], [60]),
              ([*head, *tail[:16]], [400, 16], [16])),
             (rows, rows_params, rows_calls, ([*tail], [60], [60]), ([*head, *tail], [400, 60], []),
              ([*head, *tail[:16]], [400, 16], [16]))]
    for eng, params, calls, *runs in cases:
        for prompt, pieces, fused_calls in runs:
            calls.clear()
            prefix, start = None, 0
            for n in pieces:
                prefix, first = eng.prefill(params=params, tokens=prompt[start: start + n], sampling=sp,
                                            existing_prefix=prefix)
                start += n
            assert calls == fused_calls, (pieces, calls)
            state = eng.insert(prefix, eng.init_decode_state(), 0)
            tokens = [int(first.tokens[0, 0])]
            for _ in range(3):
                state, res = eng.generate(params, state)
                tokens.append(int(res.tokens[0, 0]))
            assert tokens == ref.generate([prompt], sp)[0].token_ids, pieces


@pytest.mark.parametrize("page_size", [4, 16])
def test_short_paged_prefills_write_their_own_pages_in_the_fused_step(model, page_size):
    """Paged K/V: a prefill of up to 16 tokens is one call of the fused step writing
    straight into the new prefix's pages; continuing a prefix whose last page is partly
    filled copies that page first, so the continued prefix reads as it did; the prefixes
    equal the torch forward's and decode alike."""
    fused, torch_path, _ = _fused_and_torch(model, page_size=page_size)
    steps = []
    real = fused._fused.step
    fused._fused.step = lambda x, *a, **k: steps.append(x.shape[0]) or real(x, *a, **k)
    params = {e: e.load_params() for e in (fused, torch_path)}
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    rng = np.random.default_rng(7)
    head_tokens, piece_tokens = rng.integers(3, 250, 10).tolist(), rng.integers(3, 250, 13).tolist()
    heads, pieces = {}, {}
    for eng in (fused, torch_path):
        heads[eng] = eng.prefill(params=params[eng], tokens=head_tokens, sampling=sp)
    assert steps == [10]
    before = fused.export_prefix(heads[fused][0])
    for eng in (fused, torch_path):
        pieces[eng] = eng.prefill(params=params[eng], tokens=piece_tokens, sampling=sp, existing_prefix=heads[eng][0])
    assert steps == [10, 13]
    after = fused.export_prefix(heads[fused][0])
    np.testing.assert_array_equal(before.k, after.k)  # the shared partly filled page was copied, not written
    np.testing.assert_array_equal(before.v, after.v)
    from types import SimpleNamespace

    for got in (heads, pieces):
        _same_prefix(*[(SimpleNamespace(engine=e, prefix=got[e][0]), got[e][1]) for e in (fused, torch_path)], 1e-4)
    assert _decoded(fused, params[fused], pieces[fused][0], 1) == _decoded(
        torch_path, params[torch_path], pieces[torch_path][0], 1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("options", [{}, {"kv_dtype": "bfloat16"}, {"page_size": 4}])
def test_a_prefills_rows_attend_as_one_run_as_they_do_row_by_row(model, isa, options):
    """csrc/decode.h attn_tile: the fused step takes a prefill's consecutive rows of one
    sequence (at least ATT_RUN_MIN = 4) as one run, their query heads side by side in
    vector lanes; its prefixes equal those of the same engine attending row by row
    (``attention_runs`` off) within float32 rounding: a fresh prompt, a piece continuing
    it, a batch mixing a 3-token entry (row by row) with a run, on every ISA path, on
    float32 and bfloat16 K/V and on pages; and the step took runs where it should."""
    from types import SimpleNamespace

    from polyengine.engine import PrefillRequest

    cfg = EngineConfig(max_slots=2, max_prefill_length=40, max_cache_length=64, dtype="float32",
                       options={**options, "isa": isa})
    runs, rows = CpuEngine(model, cfg), CpuEngine(model, cfg)
    rows.attention_runs = False
    params = {e: e.load_params() for e in (runs, rows)}
    fused = runs._fused
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    width = runs._kernels.vector_width
    kv = model.config.num_key_value_heads
    # what the step takes as runs: 13 consecutive rows of one sequence, a 3-row one alone
    assert fused.attention_runs([0] * 13, list(range(7, 20))) == [13] * (kv * -(-13 * group // width))
    assert fused.attention_runs([0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 2, 5, 6, 7, 8, 9]) == [5] * (kv * -(-5 * group // width))
    assert fused.attention_runs([0, 1, 2, 3], [9, 9, 9, 9]) == []  # a decode step's rows
    assert rows._fused.attention_runs([0] * 13, list(range(13))) == []
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    rng = np.random.default_rng(11)
    got = {}
    for eng in (runs, rows):
        head = eng.prefill(params=params[eng], tokens=rng.integers(3, 250, 13).tolist(), sampling=sp)
        piece = eng.prefill(params=params[eng], tokens=rng.integers(3, 250, 16).tolist(), sampling=sp,
                            existing_prefix=head[0])
        batch = eng.prefill_batch(params=params[eng], requests=[
            PrefillRequest(tokens=rng.integers(3, 250, 3).tolist(), sampling=sp),
            PrefillRequest(tokens=rng.integers(3, 250, 9).tolist(), sampling=sp, existing_prefix=piece[0])])
        got[eng] = [head, piece, *batch]
        rng = np.random.default_rng(11)  # the same tokens for the second engine
    atol = 1e-5 if not options.get("kv_dtype") else 2e-2
    for a, b in zip(got[runs], got[rows]):
        _same_prefix((SimpleNamespace(engine=runs, prefix=a[0]), a[1]), (SimpleNamespace(engine=rows, prefix=b[0]), b[1]),
                     atol)
    assert _decoded(runs, params[runs], got[runs][-1][0], 0) == _decoded(rows, params[rows], got[rows][-1][0], 0)


@pytest.mark.parametrize(("nth", "pieces"), [(2, 8), (3, 8), (2, 1), (4, 16)])
def test_dynamic_shares_run_every_item_once_and_pass_a_late_threads_share_on(nth, pieces):
    """csrc/parallel.h's pe_for_share: with chunks, a thread that starts late runs less than
    its fixed share (the others took chunks from the back of it) and no item runs twice or
    never; with whole shares (pieces 0) it runs its share exactly."""
    lib = kernels_for("auto").lib
    total = 240
    ran = (ctypes.c_int * total)()
    late = lib.pe_split_check(total, nth, pieces, nth - 1, 30_000, 50_000, ran)
    assert all(r >= 0 for r in ran), f"items run twice (-2) or never (-1): {list(ran)}"
    share = total - total * (nth - 1) // nth
    assert late < share and set(ran) <= set(range(nth))
    fixed = lib.pe_split_check(total, nth, 0, nth - 1, 30_000, 1_000, ran)
    assert fixed == share and [r for r in ran] == [t for t in range(nth) for _ in range(
        total * (t + 1) // nth - total * t // nth)]


@pytest.mark.parametrize("source", ["tiny-gqa", "Q4_K", "Q8_0"])
def test_dynamic_split_decodes_the_fixed_shares_tokens_and_log_probs(model, tmp_path, source):
    """Which thread multiplies a row does not change its product: the fused step with
    dynamic shares (the default) gives the same tokens and log-probs, bit for bit, as fixed
    shares, on float and on block weights (repacked and as mapped)."""
    from polyengine.models.quant_presets import quantized_model_file

    m = model if source == "tiny-gqa" else load_model(str(quantized_model_file(source, tmp_path)))
    prompts = [[1, 5, 9, 4, 2, 7, 7], [3, 3, 8], [6, 1]]
    sp = SamplingParams(seed=3, max_tokens=12, temperature=0.8, logprobs=True, ignore_eos=True)
    runs = []
    for dynamic in (True, False):
        eng = CpuEngine(m, CFG.model_copy(update={"options": {"threads": 2, "dynamic_split": dynamic}}))
        out = LLM.from_engine(eng, tools=False).generate(prompts, sp)
        assert eng._fused is not None and eng._fused.dims.split_pieces == (SPLIT_PIECES if dynamic else 0)
        assert ("dynamic_split=False" in eng.speed_paths()["decode"]) == (not dynamic)
        runs.append([(c.token_ids, c.outputs[0].logprobs) for c in out])
    assert runs[0] == runs[1]


def test_barrier_yield_yields_at_short_steps_waits_and_changes_no_bit(model):
    """Option barrier_yield: in fused steps of up to that many rows (4 by default) the
    threads yield their core at the phase barriers they wait at (the library's count of
    such waits grows over a request on two threads), with 0 none does; the tokens and
    log-probs are the same bit for bit (the yield moves no work between threads)."""
    prompts = [[1, 5, 9, 4, 2, 7, 7], [3, 3, 8]]
    sp = SamplingParams(seed=5, max_tokens=10, temperature=0.7, logprobs=True, ignore_eos=True)
    runs, counts = [], []
    for rows in (4, 0):
        eng = CpuEngine(model, CFG.model_copy(update={"options": {"threads": 2, "barrier_yield": rows}}))
        llm = LLM.from_engine(eng, tools=False)
        lib = eng._fused.kernels.lib
        before = lib.pe_yield_count()
        out = llm.generate(prompts, sp)
        counts.append(lib.pe_yield_count() - before)
        assert eng._fused is not None and eng._fused.dims.barrier_yield == rows
        assert ("barrier_yield=0" in eng.speed_paths()["decode"]) == (not rows)
        runs.append([(c.token_ids, c.outputs[0].logprobs) for c in out])
    assert counts[0] > 0 and counts[1] == 0, counts
    assert runs[0] == runs[1]


def test_the_greedy_kernel_is_argmax_lowest_and_the_finiteness_check():
    """CpuKernels.greedy (option sampler_kernel): each row's token is argmax_lowest's, ties
    to the lowest id, a NaN row's the last id, an all -inf row's the first; the rows
    holding NaN or +inf are the ones the torch check finds."""
    from polyengine.backends.torch_common.sampling import argmax_lowest

    kernels = kernels_for("auto")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 1000, generator=g)
    x[1, [7, 300, 999]] = 50.0  # a tie: the lowest id wins
    x[2, 5] = float("nan")
    x[3] = float("-inf")
    x[4, [3, 600]] = float("inf")
    x[5, 10] = float("-inf")
    x[6] = 2.0  # every id tied
    x[7, 999] = 9.0  # the last id
    x[8, 0] = 9.0  # the first id
    tokens, broken = kernels.greedy(x)
    assert tokens.tolist() == argmax_lowest(x).tolist()
    assert tokens[[1, 2, 3, 6, 7, 8]].tolist() == [7, 999, 0, 0, 999, 0]
    assert broken.tolist() == (torch.isnan(x).any(-1) | torch.isposinf(x).any(-1)).tolist()
    assert broken.tolist() == [False, False, True, False, True, False, False, False, False]
    strided = torch.randn(4, 2000, generator=g)[:, ::2]
    assert kernels.greedy(strided)[0].tolist() == argmax_lowest(strided).tolist()


def test_the_sampler_on_the_kernels_checks_the_eos_columns_it_masked():
    """With the sparse EOS masking (ignore_eos rows, no min_tokens) the greedy kernel's one
    pass runs on the masked rows, and the raw logits' EOS columns are checked apart: a NaN
    or +inf there still marks its row, though the masked row holds -inf in that column."""
    from polyengine.backends.torch_common.sampling import TorchSampler
    from polyengine.results import NONFINITE_TOKEN

    sampler = TorchSampler(500, 3, (4, 400), kernels=kernels_for("auto"))
    for row in range(3):
        sampler.install(row, SamplingParams(temperature=0, ignore_eos=True, seed=row), [1])
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(3))
    logits[0, 400], logits[1, 4], logits[2, 9] = float("nan"), float("inf"), 50.0
    assert sampler.sample(logits).tokens.tolist() == [NONFINITE_TOKEN, NONFINITE_TOKEN, 9]


def test_the_kernels_rms_norm_is_torchs_within_float32_rounding():
    """CpuKernels.rms_norm (the final norm after a fused step) against the torch forward's."""
    from polyengine.backends.torch_common.model import rms_norm

    kernels = kernels_for("auto")
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 576, generator=g) * 3, torch.randn(576, generator=g)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="float32 rows"):
        kernels.rms_norm(x.double(), w, 1e-5)
