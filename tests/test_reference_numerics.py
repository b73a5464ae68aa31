"""The reference backend's numerics against transformers' LlamaForCausalLM / Qwen2.

Tolerance: relative L2 error per logits row <= 1e-4 against float32 torch. The
reference computes in float64, so the measured error is float32 noise (~1e-6).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from _oracle import SHAPES, hf_greedy, hf_logits, polyengine_twin, hf_model, rel_l2  # noqa: E402

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.backends.reference.engine import ReferenceEngine  # noqa: E402
from polyengine.backends.reference.model import forward  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(SHAPES))
def pair(request):
    hf = hf_model(request.param)
    return request.param, hf, polyengine_twin(hf)


def _engine(model, **cfg):
    base = dict(max_slots=3, max_prefill_length=48, max_cache_length=96)
    return ReferenceEngine(model, EngineConfig(**{**base, **cfg}))


def test_prefill_and_incremental_logits_match_transformers(pair):
    name, hf, model = pair
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, model.config.vocab_size, size=40)
    want = hf_logits(hf, tokens)
    eng = _engine(model)
    params = eng.load_params()
    # whole prompt at once
    k = np.zeros((model.config.num_hidden_layers, model.config.num_key_value_heads, 64, model.config.head_dim))
    v = np.zeros_like(k)
    got = forward(params, tokens[None, :30], np.array([0]), [k], [v])[0]
    assert rel_l2(got, want[:30]).max() <= TOL, name
    # then one token at a time on the same cache (the decode path)
    for pos in range(30, 40):
        step = forward(params, tokens[None, pos : pos + 1], np.array([pos]), [k], [v])[0, 0]
        assert rel_l2(step, want[pos]).max() <= TOL, (name, pos)


def test_engine_prefix_logits_and_greedy_tokens_match_transformers(pair):
    name, hf, model = pair
    prompt = [5, 17, 42, 9, 77, 3, 64]
    eng = _engine(model)
    params = eng.load_params()
    prefix, first = eng.prefill(params=params, tokens=prompt, sampling=SamplingParams(temperature=0))
    assert rel_l2(prefix.logits, hf_logits(hf, prompt)[-1]).max() <= TOL
    state = eng.insert(prefix, eng.init_decode_state(), 1)
    got = [int(first.tokens[0, 0])]
    for _ in range(11):
        state, res = eng.generate(params, state)
        assert res.valid[1, 0] and not res.valid[0, 0] and not res.valid[2, 0]
        got.append(int(res.tokens[1, 0]))
    assert got == hf_greedy(hf, prompt, 12), name


def test_float32_mode_is_close_to_float64(pair):
    _, _, model = pair
    prompt = [4, 8, 15, 16, 23, 42]
    e64, e32 = _engine(model), _engine(model, dtype="float32")
    p64, _ = e64.prefill(params=e64.load_params(), tokens=prompt, sampling=SamplingParams(temperature=0))
    p32, _ = e32.prefill(params=e32.load_params(), tokens=prompt, sampling=SamplingParams(temperature=0))
    assert p32.logits.dtype == np.float32
    assert rel_l2(p32.logits, p64.logits).max() <= TOL


def test_bucket_padding_does_not_change_results(pair):
    _, _, model = pair
    prompt = [7, 1, 99, 23, 5]
    plain = _engine(model)
    bucketed = _engine(model, prefill_buckets=(8, 16, 48))
    a, _ = plain.prefill(params=plain.load_params(), tokens=prompt, sampling=SamplingParams(temperature=0))
    b, _ = bucketed.prefill(params=bucketed.load_params(), tokens=prompt, sampling=SamplingParams(temperature=0))
    np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=1e-12)
    np.testing.assert_allclose(a.kv[0], b.kv[0], rtol=0, atol=1e-12)
    assert a.kv[0].shape[2] == b.kv[0].shape[2] == len(prompt)


def test_existing_prefix_continues_a_prompt(pair):
    _, _, model = pair
    eng = _engine(model)
    params = eng.load_params()
    whole, _ = eng.prefill(params=params, tokens=[3, 4, 5, 6, 7, 8], sampling=SamplingParams(temperature=0))
    head, _ = eng.prefill(params=params, tokens=[3, 4, 5], sampling=SamplingParams(temperature=0))
    tail, _ = eng.prefill(params=params, tokens=[6, 7, 8], sampling=SamplingParams(temperature=0), existing_prefix=head)
    np.testing.assert_allclose(tail.logits, whole.logits, rtol=0, atol=1e-10)
    np.testing.assert_allclose(tail.kv[1], whole.kv[1], rtol=0, atol=1e-10)
    assert tail.prompt_tokens.tolist() == [3, 4, 5, 6, 7, 8]
