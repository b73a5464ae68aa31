"""int8 weights (and tpu_jax's int8 KV cache) as a contract over the backends that store
them: what each engine keeps has the int8 dtype and exactly the bytes the mode implies,
the float matrices it replaces are gone, and the result differs from float32 by more than
nothing and less than a stated bound. A quantizer that did nothing fails every test here.

One adapter per engine (``cuda_torch`` with its compiled CPU kernels and without them,
``tpu_jax``); one quantizer behind all (:mod:`polyengine.models.quantize`), whose own
checks come first. Random tiny model (hidden 64, intermediate 160: every row divides
into blocks of 32), eight prompt tokens. Bounds, about 4x what was measured here:
prefill logits rel. L2 int8 0.03 (measured 0.0079), int8-block32 0.025 (0.0067); KV
int8 greedy log-prob error 0.001 (0.00014). A rounding error is at most half a step.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.errors import WeightsError  # noqa: E402
from polyengine.models import Model, load_model  # noqa: E402
from polyengine.models.quantize import (  # noqa: E402
    WEIGHT_MODES, dequantize_matrix, int8_bytes, quantize_matrix, quantize_model, quantized_names, replaced_weights,
)

CFG = EngineConfig(max_slots=2, max_prefill_length=16, max_cache_length=48)
PROMPT = [1, 7, 42, 9, 100, 3, 250, 17]
LOGITS_BOUND = {"int8": 0.03, "int8-block32": 0.025}


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny-gqa")


# -- the quantizer -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(WEIGHT_MODES))
def test_the_quantizer_rounds_to_int8_within_half_a_step(mode):
    w = np.random.default_rng(3).normal(size=(70, 96)).astype(np.float32)
    w[5] = 0.0  # a row of zeros: scale 1, weights 0
    q, scale = quantize_matrix(w, WEIGHT_MODES[mode])
    assert q.dtype == np.int8 and q.shape == w.shape and q.nbytes == 70 * 96
    assert scale.dtype == np.float32 and scale.shape == ((70, 3) if mode == "int8-block32" else (70,))
    assert np.abs(q).max() == 127 and q.min() >= -127
    err = np.abs(dequantize_matrix(q, scale) - w)
    step = scale if scale.ndim == 1 else np.repeat(scale, 32, axis=1)
    assert err.max() > 0 and (err <= (step if step.ndim == 2 else step[:, None]) / 2 + 1e-7).all()
    assert (q[5] == 0).all() and (scale[5] == 1).all()


def test_the_quantizer_is_the_one_cuda_torch_had_bit_for_bit():
    """The torch formula cuda_torch used before the core's quantizer replaced it (absmax
    per block / 127, round half to even, clip): the same int8 values and scales."""
    w = torch.randn(130, 64, generator=torch.Generator().manual_seed(1))
    for group in (0, 32):
        blocks = w.reshape(130, 64 // group, group) if group else w.reshape(130, 1, 64)
        scale = blocks.abs().amax(dim=2).clamp(min=1e-12) / 127.0
        q = torch.round(blocks / scale[:, :, None]).clamp(-127, 127).to(torch.int8).reshape(130, 64)
        got_q, got_scale = quantize_matrix(w.numpy(), group)
        assert np.array_equal(got_q, q.numpy())
        assert np.array_equal(got_scale, (scale if group else scale[:, 0]).numpy())


def test_an_exclusive_model_releases_what_its_int8_copies_replace():
    m = load_model("random:tiny-llama3", exclusive=True)
    fingerprint_before = Model(m.config, dict(m.weights)).fingerprint
    copies = quantize_model(m, "int8-block32")
    assert quantize_model(m, "int8-block32") is copies  # once per Model and mode
    assert set(m.released) == replaced_weights(m.config) and "model.embed_tokens.weight" in m.weights
    assert m.fingerprint == fingerprint_before  # of the float weights, computed before they went
    with pytest.raises(WeightsError, match="released from this Model by an engine.*Load the model again"):
        m.weights["model.layers.0.mlp.up_proj.weight"]
    kept = load_model("random:tiny-llama3")
    quantize_model(kept, "int8")
    assert not kept.released  # a Model the caller loaded is never touched


# -- the engines ---------------------------------------------------------------------------


class _Torch:
    def __init__(self, kernels: bool):
        self.kernels = kernels
        self.name = "cuda_torch" if kernels else "cuda_torch-no-kernels"

    def engine(self, model, options):
        from polyengine.backends.cpu.engine import CpuEngine
        from polyengine.errors import FallbackWarning

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)  # no kernels: on purpose here
            return CpuEngine(model, CFG.model_copy(update={"options": {**options, "cpu_kernels": self.kernels}}))

    def stored(self, engine) -> dict[str, tuple[np.dtype, tuple, int]]:
        return {k: (np.dtype(str(t.dtype).replace("torch.", "")), tuple(t.shape), t.numel() * t.element_size())
                for k, t in engine.load_params().tensors.items()}


class _Jax:
    name = "tpu_jax"

    def engine(self, model, options):
        pytest.importorskip("jax")
        from polyengine.backends.tpu_jax.engine import TpuJaxEngine

        return TpuJaxEngine(model, CFG.model_copy(update={"options": options}))

    def stored(self, engine) -> dict[str, tuple[np.dtype, tuple, int]]:
        return {k: (np.dtype(a.dtype), tuple(a.shape), int(a.nbytes)) for k, a in engine.load_params().items()}


@pytest.fixture(params=[_Torch(True), _Torch(False), _Jax()], ids=lambda a: a.name, scope="module")
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def float_logits(backend, model):
    return _prefill_logits(backend.engine(model, {}))


def _prefill_logits(engine) -> np.ndarray:
    prefix, _ = engine.prefill(params=engine.load_params(), tokens=PROMPT, sampling=SamplingParams(temperature=0))
    return prefix.host_logits()


@pytest.mark.parametrize("mode", list(WEIGHT_MODES))
def test_the_engine_keeps_int8_weights_of_the_modes_size_and_no_float_copies(backend, model, mode):
    eng = backend.engine(model, {"quantize": mode})
    stored = backend.stored(eng)
    shapes = model.config.weight_shapes()
    total = 0
    for name, source in quantized_names(model.config):
        n, k = shapes[source]
        q_dtype, q_shape, q_bytes = stored[name + ".qweight"]
        s_dtype, s_shape, s_bytes = stored[name + ".scale"]
        assert (q_dtype, q_shape, q_bytes) == (np.int8, (n, k), n * k), name
        assert s_dtype == np.float32 and s_shape == ((n, k // 32) if mode == "int8-block32" else (n,)), name
        total += q_bytes + s_bytes
    assert total == int8_bytes(model.config, mode)
    assert not replaced_weights(model.config) & set(stored)  # the float matrices are gone


@pytest.mark.parametrize("mode", list(WEIGHT_MODES))
def test_int8_logits_differ_from_float32_within_the_bound(backend, model, float_logits, mode):
    got = _prefill_logits(backend.engine(model, {"quantize": mode}))
    rel = float(np.linalg.norm(got - float_logits) / np.linalg.norm(float_logits))
    print(f"{backend.name} {mode}: prefill logits rel. L2 {rel:.5f}")
    assert 0 < rel < LOGITS_BOUND[mode], rel


def test_tpu_jax_int8_kv_cache_is_int8_of_its_size_and_close(model):
    pytest.importorskip("jax")
    from polyengine.driver import LLM

    adapter = _Jax()
    c = model.config
    outs = {}
    for kv in ("", "int8"):
        eng = adapter.engine(model, {"kv_quantize": kv})
        state = eng.init_decode_state()
        k = state.arrays.k
        width = c.head_dim + 4 if kv else c.head_dim
        assert k.shape == (c.num_hidden_layers, CFG.max_slots, c.num_key_value_heads, CFG.max_cache_length, width)
        assert np.dtype(k.dtype) == (np.int8 if kv else np.float32)
        assert k.nbytes == int(np.prod(k.shape)) * (1 if kv else 4)
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True)
        outs[kv] = LLM.from_engine(eng, tools=False).generate([PROMPT], sp)[0].outputs[0]
    n = next((i for i, (a, b) in enumerate(zip(outs[""].token_ids, outs["int8"].token_ids)) if a != b), 12)
    err = max(abs(a - b) for a, b in zip(outs[""].logprobs[1:n], outs["int8"].logprobs[1:n]))
    print(f"tpu_jax kv int8: {n} of 12 greedy tokens agree, log-prob error {err:.5f}")
    assert n >= 6 and 0 < err < 0.001, (n, err)


# -- memory: what cuda_torch holds, and what it checks before allocating --------------------


def _held_bytes(options) -> int:
    """Bytes of every distinct array the engine and its (exclusive) Model still hold."""
    m = load_model("random:tiny-llama3", exclusive=True)
    tensors = _Torch(True).engine(m, options).load_params().tensors
    held = {a.ctypes.data: a.nbytes for a in m.weights.values()}
    held.update({t.data_ptr(): t.numel() * t.element_size() for t in tensors.values()})
    return sum(held.values())


def test_cuda_torch_int8_holds_the_int8_copies_instead_of_the_float_matrices():
    c = load_model("random:tiny-llama3").config
    shapes = c.weight_shapes()
    replaced = sum(4 * int(np.prod(shapes[n])) for n in replaced_weights(c))
    f32 = _held_bytes({})
    for mode in WEIGHT_MODES:
        assert _held_bytes({"quantize": mode}) == f32 - replaced + int8_bytes(c, mode) < f32


def test_cuda_torch_checks_the_memory_it_really_allocates(model, monkeypatch):
    from polyengine.backends.cpu.engine import CpuEngine

    needs = {}
    monkeypatch.setattr(CpuEngine, "check_memory", lambda self, n, **kw: needs.update(n))
    fresh = load_model("random:tiny-gqa")
    _Torch(True).engine(fresh, {"quantize": "int8"}).load_params()
    int8 = {k: v for k, v in needs.items() if k.startswith("int8 copies")}
    assert list(int8.values()) == [int8_bytes(fresh.config, "int8")]
    assert not any("weights on cpu" in k for k in needs)  # float32 on the CPU: the Model's own arrays
    needs.clear()
    _Torch(True).engine(fresh, {"quantize": "int8"})  # the copies exist: nothing new to allocate
    assert not any(k.startswith("int8 copies") for k in needs)
