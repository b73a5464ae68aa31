"""The host-compiled causal attention of a prefill (cpu option prefill_attention,
backends/cpu/csrc/prefill_attn.h): its float32 path on every ISA path this CPU executes
and its bfloat16 path (vdpbf16ps) against float64 attention, from position 0 and
continuing a prefix (queries at start..start+T-1), causality, strided caches, and the
engine's choice, refusals and outputs (whole prompts and prompts in pieces) against
torch's SDPA."""

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


def _reference(q, k, v, scale, start=0):
    """float64 causal attention of queries at positions start..start+T-1: q (T, H, D),
    k/v (Hk, start + T, D) -> (T, H * D); query t sees keys 0..start + t."""
    t, h, d = q.shape
    group = h // k.shape[0]
    kk = k.double().repeat_interleave(group, 0)  # (H, S, D)
    vv = v.double().repeat_interleave(group, 0)
    s = torch.einsum("thd,hsd->hts", q.double(), kk) * scale
    s = s.masked_fill(torch.ones(t, start + t, dtype=torch.bool).triu(start + 1), float("-inf"))
    return torch.einsum("hts,hsd->thd", torch.softmax(s, -1), vv).reshape(t, h * d)


def _inputs(h, hk, t, d, seed=0, start=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, d, generator=g), torch.randn(hk, start + t, d, generator=g),
            torch.randn(hk, start + t, d, generator=g))


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
    with pytest.raises(ValueError, match=r"keys hold 9 positions, but queries at positions 0..9 need start \+ T = 10"):
        kern.prefill_attention(q, k[:, :9], v[:, :9], 0.2)
    with pytest.raises(ValueError, match=r"keys hold 10 positions, but queries at positions 3..12 need start \+ T = 13"):
        kern.prefill_attention(q, k, v, 0.2, start=3)
    with pytest.raises(ValueError, match="does not fit"):
        kern.prefill_attention(q, k, v[:, :9], 0.2)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="start must be an int >= 0"):
            kern.prefill_attention(q, k, v, 0.2, start=bad)
    q, k, v = _inputs(4, 2, 10, 12)
    with pytest.raises(ValueError, match="head_dim 12 is not a multiple"):
        kern.prefill_attention(q, k, v, 0.2)


# -- continuing a prefix: queries at start..start+T-1, keys 0..start+T-1 -----------------

STARTS = (0, 1, 15, 16, 17, 100)  # around the key blocks of 16 (and of 64 on AVX-512's 4 x 16)
TOKENS = (1, 5, 16, 33)  # one query, part of a query block, one block, past two
GROUPS = {1: (3, 3), 3: (6, 2)}  # GQA group -> (heads, kv_heads)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_float32_path_continuing_a_prefix_equals_float64_attention(isa, group):
    kern = kernels_for(isa)
    h, hk = GROUPS[group]
    for start in STARTS:
        for t in TOKENS:
            q, k, v = _inputs(h, hk, t, 64, seed=start * 100 + t, start=start)
            out = kern.prefill_attention(q, k, v, 0.125, start=start)
            assert out.shape == (t, h * 64) and out.dtype == torch.float32
            torch.testing.assert_close(out.double(), _reference(q, k, v, 0.125, start), atol=2e-6, rtol=1e-5,
                                       msg=lambda m: f"start {start}, T {t}: {m}")


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_bfloat16_path_continuing_a_prefix_is_attention_of_the_rounded_operands(group):
    """The bfloat16 path's bounds (as from position 0) at every start and length."""
    kern = kernels_for("auto")
    if kern.prefill_attention_fits(64, bf16=True):
        pytest.skip(kern.prefill_attention_fits(64, bf16=True))
    h, hk = GROUPS[group]
    worst = 0.0
    for start in STARTS:
        for t in TOKENS:
            q, k, v = _inputs(h, hk, t, 64, seed=start * 100 + t + 1, start=start)
            out = kern.prefill_attention(q, k, v, 0.125, bf16=True, start=start).double()
            err = (out - _reference(_bf16(q), _bf16(k), _bf16(v), 0.125, start)).abs().max().item()
            assert err < 2e-2, (start, t, err)
            assert (out - _reference(q, k, v, 0.125, start)).abs().max().item() < 4e-2, (start, t)
            worst = max(worst, err)
    assert worst > 1e-6  # p was rounded: not float32 attention of the rounded operands


@pytest.mark.parametrize("bf16", [False, True])
def test_a_continued_prefill_sees_the_prefix_and_no_later_token(bf16):
    """A prefix key changes every row; the last new token's key only the last row; start
    0 over the same new tokens is another result (the prefix really is attended)."""
    kern = kernels_for("auto")
    if kern.prefill_attention_fits(64, bf16=bf16):
        pytest.skip(kern.prefill_attention_fits(64, bf16=bf16))
    start, t = 37, 20
    q, k, v = _inputs(6, 2, t, 64, seed=5, start=start)
    a = kern.prefill_attention(q, k, v, 0.125, bf16=bf16, start=start)
    k2, v2 = k.clone(), v.clone()
    k2[:, -1] += 3.0
    v2[:, -1] -= 5.0
    b = kern.prefill_attention(q, k2, v2, 0.125, bf16=bf16, start=start)
    assert torch.equal(a[:-1], b[:-1]) and not torch.equal(a[-1], b[-1])
    k3 = k.clone()
    k3[:, 0] += 3.0
    c = kern.prefill_attention(q, k3, v, 0.125, bf16=bf16, start=start)
    assert all(not torch.equal(a[i], c[i]) for i in range(t))
    fresh = kern.prefill_attention(q, k[:, start:], v[:, start:], 0.125, bf16=bf16)
    assert not torch.equal(a, fresh)


def test_a_continued_prefill_reads_keys_in_place_from_a_longer_cache():
    """The engine's layout: keys/values as views of a longer cache row, bit for bit what
    contiguous copies give; and start 0 is the from-scratch call, bit for bit."""
    kern = kernels_for("auto")
    start, t = 45, 19
    q, k, v = _inputs(4, 2, t, 32, seed=6, start=start)
    cache_k, cache_v = torch.zeros(2, 120, 32), torch.zeros(2, 120, 32)
    cache_k[:, : start + t], cache_v[:, : start + t] = k, v
    assert torch.equal(kern.prefill_attention(q, cache_k[:, : start + t], cache_v[:, : start + t], 0.2, start=start),
                       kern.prefill_attention(q, k, v, 0.2, start=start))
    q0, k0, v0 = _inputs(4, 2, t, 32, seed=7)
    assert torch.equal(kern.prefill_attention(q0, k0, v0, 0.2, start=0), kern.prefill_attention(q0, k0, v0, 0.2))


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


PIECES = (0, 40, 57, 90)  # PROMPTS[0] in three pieces, starts off the key blocks


def _in_pieces(eng, params, tokens, cuts, sampling):
    prefix = None
    for a, b in zip(cuts, cuts[1:]):
        prefix, first = eng.prefill(params=params, tokens=tokens[a:b], sampling=sampling, existing_prefix=prefix)
    return prefix, first


@pytest.mark.parametrize("choice", ["kernel", "sdpa", "kernel-bf16"])
def test_a_prompt_in_pieces_continues_as_one_whole_prefill(model, monkeypatch, choice):
    """A prefill after a cached prefix (a chunked prefill's later pieces, a prefix-cache
    hit) gives one whole prefill's logits and first token: on the kernel (every piece,
    each from its own start) and on SDPA (the masked path) alike."""
    extra = {"weight_dtype": "bfloat16", "bf16_compute": "bf16"} if choice == "kernel-bf16" else {}
    if extra and not kernels_for("auto").attention_bf16:
        pytest.skip("no bfloat16 dot products (AVX512-BF16) on this CPU")
    eng = CpuEngine(model, CFG.model_copy(update={"options": {**extra, "prefill_attention": choice.split("-")[0]}}))
    starts = []
    if eng._causal_attention is not None:
        kernel = eng._causal_attention

        def spy(q, keys, vals, scale, start=0):
            starts.append(start)
            return kernel(q, keys, vals, scale, start)

        monkeypatch.setattr(eng, "_causal_attention", spy)
    params, greedy = eng.load_params(), SamplingParams(temperature=0)
    whole, whole_first = eng.prefill(params=params, tokens=PROMPTS[0], sampling=greedy)
    pieces, pieces_first = _in_pieces(eng, params, PROMPTS[0], PIECES, greedy)
    assert pieces.first_token == whole.first_token
    assert list(pieces.prompt_tokens) == list(whole.prompt_tokens)
    if extra:  # bfloat16 operands: the pieces' GEMMs and sums round in another order
        rel = ((pieces.logits.double() - whole.logits.double()).norm() / whole.logits.double().norm()).item()
        assert rel < 2e-2, rel
    else:
        torch.testing.assert_close(pieces.logits.double(), whole.logits.double(), atol=1e-4, rtol=1e-4)
    layers = model.config.num_hidden_layers
    if choice == "sdpa":
        assert eng._causal_attention is None
    else:  # every layer of every call on the kernel: the whole prompt and the first piece
        # from 0, the later pieces from their starts
        assert sorted(set(starts)) == [0, 40, 57] and starts.count(40) == starts.count(57) == layers


def test_prefill_batch_continues_prefixes_of_one_length_on_the_kernel(model, monkeypatch):
    """Entries that all continue prefixes of one length run the kernel from that start,
    and give what their prefills one by one give."""
    from polyengine.engine import PrefillRequest

    eng = CpuEngine(model, CFG.model_copy(update={"options": {"prefill_attention": "kernel"}}))
    kernel, starts = eng._causal_attention, []

    def spy(q, keys, vals, scale, start=0):
        starts.append((q.shape[0], start))
        return kernel(q, keys, vals, scale, start)

    monkeypatch.setattr(eng, "_causal_attention", spy)
    params, greedy = eng.load_params(), SamplingParams(temperature=0)
    a, b = PROMPTS[0][:60], list(np.random.default_rng(5).integers(0, 256, 50))
    heads = [eng.prefill(params=params, tokens=x[:21], sampling=greedy)[0] for x in (a, b)]
    requests = [PrefillRequest(a[21:], greedy, heads[0]), PrefillRequest(b[21:], greedy, heads[1])]
    starts.clear()
    batch = eng.prefill_batch(params=params, requests=requests)
    assert set(starts) == {(2, 21)}
    for req, (prefix, _) in zip(requests, batch):
        alone, _ = eng.prefill(params=params, tokens=req.tokens, sampling=greedy, existing_prefix=req.existing_prefix)
        assert prefix.first_token == alone.first_token
        torch.testing.assert_close(prefix.logits.double(), alone.logits.double(), atol=2e-5, rtol=0)
