"""The functional torch model against the reference forward (backends/reference/model.py).

Tiny random models cover every architecture the loader accepts: MHA with tied
embeddings, GQA with Llama-3 RoPE scaling, Qwen2's q/k/v biases with odd sizes
(the conformance models), and Llama with attention and MLP biases and linear RoPE
scaling (made here). Tolerances are relative to the largest reference logit:
float64 1e-10 (measured ~1e-15: only summation order differs), float32 1e-5
(measured ~1e-6). Everything is deterministic.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from polyengine.backends.reference.model import ReferenceParams
from polyengine.backends.reference.model import forward as reference_forward
from polyengine.conformance.models import build_model
from polyengine.models import Model, ModelConfig, RopeScaling

from polyengine.backends.torch_common.model import StepModule, StepSpec, TorchWeights, forward

from _legacy_forward import forward as legacy_forward


def run(w, tokens, positions, k_cache, v_cache, *, rows=None, write_mask=None, logits_at=None, **spec):
    """:func:`forward` with the spec's choices as keywords (kv_len, attention, causal, ...)."""
    return forward(w, StepSpec(**spec), tokens, positions, k_cache, v_cache, rows=rows, write_mask=write_mask,
                   logits_at=logits_at)

@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """These tensors are tiny: a second thread gains nothing, and on a shared two-core
    machine every parallel op can wait ~20 ms at a barrier for a descheduled thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
NP_DTYPE = {torch.float64: np.float64, torch.float32: np.float32}


def _biased_llama() -> Model:
    """Llama with o_proj and MLP biases, GQA 4/2, untied, linear RoPE scaling."""
    config = ModelConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, attention_bias=True, mlp_bias=True,
        rope_scaling=RopeScaling(rope_type="linear", factor=2.0), rope_theta=1000.0,
    )
    rng = np.random.default_rng(7)
    weights = {}
    for name, shape in config.weight_shapes().items():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        scale = 0.2 if name in ("model.embed_tokens.weight", "lm_head.weight") else 0.1
        weights[name] = (base + scale * rng.standard_normal(shape)).astype(np.float32)
    return Model(config, weights, source="test:biased_llama", is_random=True)


MODELS = {
    "mha_tied": lambda: build_model("mha_tied"),
    "gqa_llama3": lambda: build_model("gqa_llama3"),
    "odd_qwen2": lambda: build_model("odd_qwen2"),
    "biased_llama_linear": _biased_llama,
}
_cache: dict[str, Model] = {}


def _model(name: str) -> Model:
    if name not in _cache:
        _cache[name] = MODELS[name]()
    return _cache[name]


def _close(got: torch.Tensor, want: np.ndarray, dtype: torch.dtype) -> None:
    err = np.abs(got.double().numpy() - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= TOL[dtype], f"relative error {err:.2e} > {TOL[dtype]:.0e}"


class _Reference:
    """One reference cache per request (what the reference engine keeps per slot)."""

    def __init__(self, model: Model, dtype: torch.dtype, length: int):
        c = model.config
        self.params = ReferenceParams.from_model(model, np.dtype(NP_DTYPE[dtype]))
        self.shape = (c.num_hidden_layers, c.num_key_value_heads, length, c.head_dim)
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []

    def add(self) -> int:
        self.k.append(np.zeros(self.shape, self.params.dtype))
        self.v.append(np.zeros(self.shape, self.params.dtype))
        return len(self.k) - 1

    def run(self, req: int, tokens, start: int) -> np.ndarray:
        return reference_forward(self.params, np.array([tokens]), np.array([start]), [self.k[req]], [self.v[req]])[0]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(MODELS))
def test_batched_prefill_and_decode_equal_reference(name, dtype, attention):
    """Three requests of different lengths prefilled in one padded batch, then decoded
    together token by token; a fourth batch row is padding, once aimed at an empty
    row holding garbage and once at the very cell a live row writes."""
    model = _model(name)
    vocab = model.config.vocab_size
    w = TorchWeights.from_model(model, dtype=dtype)
    rng = np.random.default_rng(0)
    cache_len, bucket = 24, 9
    k_cache, v_cache = w.new_cache(4, cache_len)
    garbage = torch.randn(k_cache[:, 1].shape, dtype=dtype)
    k_cache[:, 1] = garbage  # row 1 is never live: it must keep these values
    ref = _Reference(model, dtype, cache_len)

    prompts = [rng.integers(0, vocab, n).tolist() for n in (5, 9, 2)]
    rows = torch.tensor([2, 0, 3])
    tokens = torch.zeros((3, bucket), dtype=torch.int64)
    mask = torch.zeros((3, bucket), dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = True
    positions = torch.arange(bucket)[None, :].expand(3, bucket)
    lengths = [len(p) for p in prompts]
    all_logits, _, _ = run(w, tokens, positions, k_cache, v_cache, rows=rows, write_mask=mask, attention=attention)
    logits, k_cache, v_cache = run(
        w, tokens, positions, k_cache, v_cache, rows=rows, write_mask=mask,
        logits_at=torch.tensor(lengths) - 1, attention=attention,
    )
    for i, p in enumerate(prompts):
        want = ref.run(ref.add(), p, 0)  # (T, vocab)
        _close(all_logits[i, : len(p)], want, dtype)
        _close(logits[i], want[-1], dtype)

    for step in range(4):
        batch_rows = torch.tensor([2, 0, 3, 1 if step % 2 == 0 else 2])
        pad_position = 3 if step % 2 == 0 else lengths[0]  # odd steps: row 2's own next cell
        toks = rng.integers(0, vocab, 4)
        positions = torch.tensor([[lengths[0]], [lengths[1]], [lengths[2]], [pad_position]])
        logits, k_cache, v_cache = run(
            w, torch.from_numpy(toks)[:, None], positions, k_cache, v_cache, rows=batch_rows,
            write_mask=torch.tensor([[True], [True], [True], [False]]), kv_len=16, attention=attention,
        )
        for i in range(3):
            _close(logits[i, 0], ref.run(i, [int(toks[i])], lengths[i])[0], dtype)
            lengths[i] += 1

    assert torch.equal(k_cache[:, 1], garbage) and not v_cache[:, 1].any()
    for i, row in enumerate(rows.tolist()):
        n = lengths[i]
        _close(k_cache[:, row, :, :n], ref.k[i][:, :, :n], dtype)
        _close(v_cache[:, row, :, :n], ref.v[i][:, :, :n], dtype)


@pytest.mark.parametrize("name", list(MODELS))
def test_tokens_far_into_the_context_equal_reference(name):
    """A chunk at positions 200..205 (RoPE tables and scaling far from 0), over a
    cache that is zero before it on both sides."""
    model = _model(name)
    w = TorchWeights.from_model(model, dtype=torch.float64)
    k_cache, v_cache = w.new_cache(1, 208)
    toks = np.random.default_rng(1).integers(0, model.config.vocab_size, 6)
    logits, _, _ = run(w, torch.from_numpy(toks)[None], torch.arange(200, 206)[None], k_cache, v_cache)
    ref = _Reference(model, torch.float64, 208)
    _close(logits[0], ref.run(ref.add(), toks.tolist(), 200), torch.float64)


def test_in_place_and_functional_updates_agree():
    model = _model("gqa_llama3")
    w = TorchWeights.from_model(model)
    k0, v0 = w.new_cache(3, 16)
    k0.normal_()
    v0.normal_()
    args = (torch.tensor([[5, 6, 7]]), torch.tensor([[4, 5, 6]]))
    kw = dict(rows=torch.tensor([1]), write_mask=torch.tensor([[True, True, False]]))
    k_in, v_in = k0.clone(), v0.clone()
    out_f = run(w, *args, k0, v0, **kw)
    out_i = run(w, *args, k_in, v_in, inplace=True, **kw)
    assert out_i[1] is k_in and out_i[2] is v_in  # mutated and returned
    assert not torch.equal(k_in, k0)  # ... and the functional call left its inputs alone
    for a, b in zip(out_f, out_i):
        assert torch.equal(a, b)


def test_fused_projections_equal_separate_ones():
    model = _model("biased_llama_linear")
    plain = TorchWeights.from_model(model, dtype=torch.float64)
    fused = TorchWeights.from_model(model, dtype=torch.float64, fuse_qkv=True, fuse_gate_up=True)
    assert "model.layers.1.self_attn.qkv_proj.bias" in fused.tensors
    assert "model.layers.1.mlp.gate_up_proj.bias" in fused.tensors
    assert "model.layers.0.self_attn.q_proj.weight" not in fused.tensors
    toks, pos = torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None]
    a = run(plain, toks, pos, *plain.new_cache(1, 8))[0]
    b = run(fused, toks, pos, *fused.new_cache(1, 8))[0]
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(MODELS))
def test_causal_prefill_equals_the_masked_one(name):
    """causal=True (SDPA's causal mode, GQA without repeats) computes what the explicit
    mask does for a prefill from position 0, pad tokens at the end included."""
    w = TorchWeights.from_model(_model(name), dtype=torch.float64)
    toks = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [7, 3, 5, 1, 0, 0, 0]])
    pos = torch.arange(7)[None].repeat(2, 1)
    kw = dict(write_mask=torch.tensor([[True] * 7, [True] * 4 + [False] * 3]))
    masked = run(w, toks, pos, *w.new_cache(2, 7), **kw)
    causal = run(w, toks, pos, *w.new_cache(2, 7), causal=True, **kw)
    torch.testing.assert_close(masked[0][:, :4], causal[0][:, :4], rtol=1e-12, atol=1e-12)  # live tokens' logits
    for a, b in zip(masked[1:], causal[1:]):  # the caches (pad writes are no-ops either way)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="causal"):
        run(w, toks, pos, *w.new_cache(2, 9), causal=True, **kw)


def test_float32_cpu_weights_share_the_models_memory():
    model = _model("mha_tied")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning, even for read-only arrays
        readonly = {k: v.view() for k, v in model.weights.items()}
        for arr in readonly.values():
            arr.flags.writeable = False
        w = TorchWeights.from_model(Model(model.config, readonly, source="readonly"))
    for name, arr in model.weights.items():
        assert np.shares_memory(w.tensors[name].numpy(), arr), name
    assert "lm_head.weight" not in w.tensors  # tied: one tensor, not two leaves
    w64 = TorchWeights.from_model(model, dtype=torch.float64)
    assert w64.dtype == torch.float64 and w64.tensors["model.norm.weight"].dtype == torch.float64


def test_bfloat16_runs_close_to_float32():
    """RMSNorm in float32 inside, logits returned as float32; bf16 keeps ~3 digits."""
    model = _model("odd_qwen2")
    toks, pos = torch.tensor([[3, 1, 4, 1, 5]]), torch.arange(5)[None]
    w32 = TorchWeights.from_model(model)
    w16 = TorchWeights.from_model(model, dtype=torch.bfloat16)
    a = run(w32, toks, pos, *w32.new_cache(1, 8))[0]
    b, k16, _ = run(w16, toks, pos, *w16.new_cache(1, 8))
    assert b.dtype == torch.float32 and k16.dtype == torch.bfloat16
    assert (b - a).abs().max() <= 0.05 * a.abs().max()


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # raised inside torch.export
def test_export_prefill_and_decode_steps():
    """torch.export traces both step shapes (no data-dependent control flow), and the
    exported programs compute what eager does."""
    model = _model("gqa_llama3")
    w = TorchWeights.from_model(model)
    k, v = w.new_cache(3, 16)
    prefill = (
        torch.tensor([[9, 8, 7, 6, 0, 0, 0, 0]]), torch.arange(8)[None], k, v, torch.tensor([2]),
        torch.tensor([[True] * 4 + [False] * 4]), torch.tensor([3]),
    )
    decode = (
        torch.tensor([[1], [2], [3]]), torch.tensor([[4], [0], [7]]), k, v, None,
        torch.tensor([[True], [False], [True]]), torch.zeros(3, dtype=torch.int64),
    )
    for args in (prefill, decode):
        module = StepModule(w, StepSpec(kv_len=16))
        program = torch.export.export(module, args)
        want = module(*args)
        for a, b in zip(program.module()(*args), want):
            assert torch.equal(a, b)  # the same aten ops
        # The core-aten form (SDPA decomposed to matmuls and softmax) rounds differently.
        for a, b in zip(program.run_decompositions().module()(*args), want):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_bad_static_arguments_are_refused():
    w = TorchWeights.from_model(_model("mha_tied"))
    k, v = w.new_cache(2, 8)
    toks, pos = torch.tensor([[1]]), torch.tensor([[0]])
    with pytest.raises(ValueError, match="attention"):
        run(w, toks, pos, k, v, rows=torch.tensor([0]), attention="flash")
    with pytest.raises(ValueError, match="kv_len"):
        run(w, toks, pos, k, v, rows=torch.tensor([0]), kv_len=9)
    with pytest.raises(ValueError, match="rows=None"):
        run(w, toks, pos, k, v)


class _DoublingCodec:
    """Stores K/V doubled (exact in binary floating point) and halves what it reads,
    and records which rows each call named."""

    def __init__(self):
        self.rows: list[tuple[str, str, list[int]]] = []

    def encode(self, which, layer, new, rows):
        self.rows.append(("encode", which, rows.tolist()))
        return new * 2

    def decode(self, which, layer, stored, rows):
        self.rows.append(("decode", which, rows.tolist()))
        return stored / 2


@pytest.mark.parametrize("rows", [None, [2, 0]], ids=["rows-none", "rows-given"])
def test_kv_codec_encodes_writes_and_decodes_reads(rows):
    """``kv_codec``: the cache holds the encoded values, attention sees the decoded ones,
    so a lossless codec changes no logit; it is told the cache row of every token."""
    model = _model("gqa_llama3")
    w = TorchWeights.from_model(model, dtype=torch.float64)
    toks = torch.tensor([[3, 7, 9], [4, 4, 1]])
    pos = torch.arange(3)[None].expand(2, 3)
    cache_rows = None if rows is None else torch.tensor(rows)
    plain_k, plain_v = w.new_cache(2 if rows is None else 3, 8)
    want, plain_k, plain_v = run(w, toks, pos, plain_k, plain_v, rows=cache_rows)
    codec = _DoublingCodec()
    k, v = w.new_cache(2 if rows is None else 3, 8)
    got, k, v = run(w, toks, pos, k, v, rows=cache_rows, kv_codec=codec)
    assert torch.equal(got, want)
    assert torch.equal(k, plain_k * 2) and torch.equal(v, plain_v * 2)
    expect = [0, 0, 0, 1, 1, 1] if rows is None else [2, 2, 2, 0, 0, 0]
    assert ("encode", "k", expect) in codec.rows and ("decode", "v", [0, 1] if rows is None else rows) in codec.rows


def _plain_linear(t, x, name):
    """A linear hook doing what F.linear on the HF weights does (the head tied or not)."""
    w = t.get("lm_head.weight", t["model.embed_tokens.weight"]) if name == "lm_head" else t[name + ".weight"]
    return torch.nn.functional.linear(x, w, t.get(name + ".bias"))


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("path", ["prefill", "prefill_causal", "decode_rows", "decode_all_rows", "int8_codec_fused"])
def test_blocks_are_bit_exact_against_the_forward_they_replaced(name, path):
    """The forward as small blocks over a StepSpec computes exactly (bit for bit) what the
    single function it replaced did (tests/_legacy_forward.py), on every path an engine
    uses: bucketed prefill with pad tokens, causal prefill, decode over chosen cache rows
    with a kv_len bound, decode over every row with a write mask, fused projections with
    a codec and a linear hook."""
    model = MODELS[name]()
    fused = path == "int8_codec_fused"
    w = TorchWeights.from_model(model, fuse_qkv=fused, fuse_gate_up=fused)
    torch.manual_seed(3)
    k0, v0 = w.new_cache(3, 16)
    k0.normal_(), v0.normal_()
    linear = _plain_linear if fused else None
    codec = _DoublingCodec() if fused else None
    if path in ("prefill", "prefill_causal"):
        causal = path == "prefill_causal"
        n = 8
        toks = torch.tensor([[5, 9, 2, 7, 1, 0, 0, 0]])
        args = (toks, torch.arange(n)[None])
        kw = dict(rows=None if causal else torch.tensor([1]), write_mask=None if causal else torch.arange(n)[None] < 5,
                  logits_at=torch.tensor([4]))
        k, v = (w.new_cache(1, n) if causal else (k0.clone(), v0.clone()))
        spec = dict(causal=causal, kv_len=n if causal else None)
    else:
        rows = torch.tensor([2, 0]) if path == "decode_rows" else None
        b = 2 if rows is not None else 3
        args = (torch.tensor([[4], [6], [3]])[:b], torch.tensor([[9], [4], [12]])[:b])
        kw = dict(rows=rows, write_mask=torch.tensor([[True], [False], [True]])[:b])
        k, v = k0.clone(), v0.clone()
        spec = dict(kv_len=13)
    want = legacy_forward(w, *args, k.clone(), v.clone(), **kw, **spec, linear=linear, kv_codec=codec)
    got = forward(w, StepSpec(**spec, linear=linear, kv_codec=codec), *args, k.clone(), v.clone(), **kw)
    for a, b_ in zip(got, want):
        assert a.dtype == b_.dtype and torch.equal(a, b_)
