"""The host-compiled causal attention of a prefill (cuda_torch option prefill_attention,
kernels/prefill_attn.cpp): its float32 path on every ISA path this CPU executes and its
bfloat16 path (vdpbf16ps) against float64 attention, causality, strided caches, and the
engine's choice, refusals and outputs against torch's SDPA."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.backends.cpu.engine import CpuEngine  # noqa: E402
from polyengine.driver import LLM  # noqa: E402
from polyengine.errors import UnsupportedFeature  # noqa: E402
from polyengine.models import load_model  # noqa: E402

from isa_paths import ISAS, kernels_for  # noqa: E402

# (heads, kv_heads, tokens, head_dim): GQA groups 1-3, tokens that are not a multiple of
# the key blocks (16 / 64) nor of the query blocks (16), head dims 16-128
SHAPES = [(4, 2, 37, 32), (6, 2, 129, 64), (8, 8, 70, 128), (3, 1, 5, 16), (9, 3, 300, 64)]


def _reference(q, k, v, scale):
    """float64 causal attention: q (T, H, D), k/v (Hk, T, D) -> (T, H * D)."""
    t, h, d = q.shape
    group = h // k.shape[0]
    kk = k.double().repeat_interleave(group, 0)  # (H, T, D)
    vv = v.double().repeat_interleave(group, 0)
    s = torch.einsum("thd,hsd->hts", q.double(), kk) * scale
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,hsd->thd", torch.softmax(s, -1), vv).reshape(t, h * d)


def _inputs(h, hk, t, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, d, generator=g), torch.randn(hk, t, d, generator=g),
            torch.randn(hk, t, d, generator=g))


def _bf16(x):
    return x.to(torch.bfloat16).float()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_float32_path_equals_float64_attention(isa, shape):
    kern = kernels_for(isa)
    h, hk, t, d = shape
    if kern.prefill_attention_fits(d, bf16=False):
        pytest.skip(kern.prefill_attention_fits(d, bf16=False))
    q, k, v = _inputs(*shape)
    out = kern.prefill_attention(q, k, v, d ** -0.5)
    ref = _reference(q, k, v, d ** -0.5)
    assert out.shape == (t, h * d) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bfloat16_path_is_attention_of_the_rounded_operands(shape):
    """q, k, v rounded to bfloat16, sums in float32: within the rounding of the softmax
    weights (8 significant bits) of float64 attention on the rounded operands, and not
    the float32 path's result (the bfloat16 products really ran)."""
    kern = kernels_for("auto")
    h, hk, t, d = shape
    if kern.prefill_attention_fits(d, bf16=True):
        pytest.skip(kern.prefill_attention_fits(d, bf16=True))
    q, k, v = _inputs(*shape, seed=1)
    out = kern.prefill_attention(q, k, v, d ** -0.5, bf16=True).double()
    ref = _reference(_bf16(q), _bf16(k), _bf16(v), d ** -0.5)
    err = (out - ref).abs().max().item()
    assert err < 2e-2, err
    assert err > 1e-6  # p was rounded: not float32 attention of the rounded operands
    exact = _reference(q, k, v, d ** -0.5)
    assert (out - exact).abs().max().item() < 4e-2


@pytest.mark.parametrize("bf16", [False, True])
def test_no_token_sees_a_later_one(bf16):
    """Causality: changing the last token's key and value changes only the last row."""
    kern = kernels_for("auto")
    if kern.prefill_attention_fits(64, bf16=bf16):
        pytest.skip(kern.prefill_attention_fits(64, bf16=bf16))
    q, k, v = _inputs(6, 2, 100, 64, seed=2)
    a = kern.prefill_attention(q, k, v, 0.125, bf16=bf16)
    k2, v2 = k.clone(), v.clone()
    k2[:, -1] += 3.0
    v2[:, -1] -= 5.0
    b = kern.prefill_attention(q, k2, v2, 0.125, bf16=bf16)
    assert torch.equal(a[:-1], b[:-1])
    assert not torch.equal(a[-1], b[-1])


def test_keys_read_in_place_from_a_longer_cache():
    """keys/values as views of a cache longer than the prompt (the engine's layout) give
    what contiguous copies give, bit for bit."""
    kern = kernels_for("auto")
    q, k, v = _inputs(4, 2, 50, 32, seed=3)
    cache_k, cache_v = torch.zeros(2, 80, 32), torch.zeros(2, 80, 32)
    cache_k[:, :50], cache_v[:, :50] = k, v
    assert torch.equal(kern.prefill_attention(q, cache_k[:, :50], cache_v[:, :50], 0.2),
                       kern.prefill_attention(q, k, v, 0.2))


def test_shapes_that_do_not_fit_are_refused():
    kern = kernels_for("auto")
    q, k, v = _inputs(4, 2, 10, 32)
    with pytest.raises(ValueError, match="does not fit"):
        kern.prefill_attention(q, k[:, :9], v[:, :9], 0.2)
    q, k, v = _inputs(4, 2, 10, 12)
    with pytest.raises(ValueError, match="head_dim 12 is not a multiple"):
        kern.prefill_attention(q, k, v, 0.2)


# -- the engine ------------------------------------------------------------------------

CFG = EngineConfig(max_slots=2, max_prefill_length=96, max_cache_length=160)
PROMPTS = [list(np.random.default_rng(4).integers(0, 256, 90)), [5, 9, 2, 7, 1, 1, 3]]


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny-gqa")


def _prefill_logits(model, options, tokens):
    eng = CpuEngine(model, CFG.model_copy(update={"options": options}))
    prefix, _ = eng.prefill(params=eng.load_params(), tokens=tokens, sampling=SamplingParams(temperature=0))
    return eng, prefix.logits.double()


@pytest.mark.parametrize("extra", [{}, {"weight_dtype": "bfloat16", "bf16_compute": "bf16"}],
                         ids=["float32", "bf16-operands"])
def test_the_engine_prefills_on_the_kernel_as_on_sdpa(model, extra):
    """Option prefill_attention 'kernel' runs the kernel (with bfloat16 operands where
    prefill's GEMMs take them) and gives SDPA's logits up to its rounding; decoding on
    from either gives the same greedy tokens."""
    kern = kernels_for("auto")
    if extra and not kern.attention_bf16:
        pytest.skip("no bfloat16 dot products (AVX512-BF16) on this CPU")
    eng, on = _prefill_logits(model, {**extra, "prefill_attention": "kernel"}, PROMPTS[0])
    _, off = _prefill_logits(model, {**extra, "prefill_attention": "sdpa"}, PROMPTS[0])
    want = "bfloat16" if extra else "float32"
    assert eng.plan.prefill_attention == want
    assert "causal attention on the host kernel" in eng.speed_paths()["prefill"]
    rel = ((on - off).norm() / off.norm()).item()
    assert rel < (2e-2 if extra else 1e-5), rel
    assert rel > 0  # the kernel ran: its sums differ from SDPA's in order
    sp = SamplingParams(temperature=0, max_tokens=8)
    runs = []
    for choice in ("kernel", "sdpa"):
        e = CpuEngine(model, CFG.model_copy(update={"options": {**extra, "prefill_attention": choice}}))
        runs.append([c.token_ids for c in LLM.from_engine(e, tools=False).generate(PROMPTS, sp)])
    if not extra:
        assert runs[0] == runs[1]
    else:  # bfloat16 rounding may flip a near tie of random weights; most tokens agree
        same = sum(a == b for x, y in zip(*runs) for a, b in zip(x, y))
        assert same >= 12, runs


def test_auto_picks_the_kernel_on_avx512_kernels_only(model):
    auto = CpuEngine(model, CFG)
    kern = kernels_for("auto")
    assert auto.plan.prefill_attention == ("float32" if kern.vector_width == 16 else None)
    kernels_for("avx2")  # skips where this CPU cannot execute the path
    eng = CpuEngine(model, CFG.model_copy(update={"options": {"isa": "avx2"}}))
    assert eng._kernels.isa == "avx2" and eng.plan.prefill_attention is None
    assert "causal attention on torch's SDPA" in eng.speed_paths()["prefill"]
    forced = CpuEngine(model, CFG.model_copy(update={"options": {"isa": "avx2", "prefill_attention": "kernel"}}))
    assert forced.plan.prefill_attention == "float32"
    eager = CpuEngine(model, CFG.model_copy(update={"options": {"attention": "eager"}}))
    assert eager.plan.prefill_attention is None


def test_a_forced_kernel_where_it_cannot_run_is_refused(model):
    with pytest.raises(UnsupportedFeature, match="cpu_kernels=False"):  # refused before any fallback warning
        CpuEngine(model, CFG.model_copy(update={"options": {"cpu_kernels": False, "prefill_attention": "kernel"}}))
    deep = load_model("random:tiny-deep")  # head_dim 8
    kern = kernels_for("auto")
    if kern.vector_width == 16:
        with pytest.raises(UnsupportedFeature, match="head_dim 8 is not a multiple of 16"):
            CpuEngine(deep, CFG.model_copy(update={"options": {"prefill_attention": "kernel"}}))
        assert CpuEngine(deep, CFG).plan.prefill_attention is None  # auto: SDPA, silently right


def test_a_continued_prefill_uses_sdpa_and_agrees(model):
    """A prefill after a cached prefix (queries not from position 0) is not causal from
    scratch: it runs the masked attention, and continues what one whole prefill gives."""
    eng = CpuEngine(model, CFG.model_copy(update={"options": {"prefill_attention": "kernel"}}))
    params, greedy = eng.load_params(), SamplingParams(temperature=0)
    whole, _ = eng.prefill(params=params, tokens=PROMPTS[0], sampling=greedy)
    first, _ = eng.prefill(params=params, tokens=PROMPTS[0][:40], sampling=greedy)
    rest, _ = eng.prefill(params=params, tokens=PROMPTS[0][40:], sampling=greedy, existing_prefix=first)
    torch.testing.assert_close(rest.logits.double(), whole.logits.double(), atol=1e-4, rtol=1e-4)
