"""int8 weights and the int8 KV cache of tpu_jax against float32, with stated bounds.

The model is the default model's first four layers (its real weights, outliers
included; all 30 layers would cost minutes of compilation per mode on two cores; the
full model's numbers are in docs/tpu_jax.md). Each mode runs the same three prompts:
prefill logits, then 24 greedy tokens through the driver with log-probs. Bounds
(measured values on this machine in parentheses):

| mode | logits rel. L2 | log-prob error before divergence |
| --- | --- | --- |
| int8 (per channel) | 0.03 (0.009) | 0.3 (0.11) |
| int8-block32 | 0.015 (0.003) | 0.15 (0.039) |
| kv int8 | exactly 0 (prefill is not quantized) | 0.15 (0.090) |

Greedy agreement: the tokens equal float32's until the first step where float32's own
top-2 log-prob margin is below twice the mode's log-prob bound (quantization may
legitimately decide such a step), and at least half of all tokens agree (measured:
66 of 72 for each mode, all three parting from float32 at the same near tie).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.driver import LLM  # noqa: E402
from polyengine.models import Model, load_model  # noqa: E402

from polyengine.backends.tpu_jax.engine import TpuJaxEngine  # noqa: E402

CFG = EngineConfig(max_slots=4, max_prefill_length=16, max_cache_length=48)
TEXTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time")
STEPS = 24
BOUNDS = {  # mode -> (logits rel. L2, log-prob error)
    "int8": (0.03, 0.3),
    "int8-block32": (0.015, 0.15),
    "kv-int8": (0.0, 0.15),
}
OPTIONS = {"int8": {"quantize": "int8"}, "int8-block32": {"quantize": "int8-block32"}, "kv-int8": {"kv_quantize": "int8"}}


pytestmark = pytest.mark.usefixtures("jax_compile_less")  # tiny models: compile time over run time


@pytest.fixture(scope="module")
def smollm2_4(default_gguf):
    full = load_model(default_gguf)
    keep = {k: v for k, v in full.weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 4}
    return Model(full.config.model_copy(update={"num_hidden_layers": 4}), keep, full.tokenizer, source="SmolLM2 layers 0-3")


def _run(model, options):
    eng = TpuJaxEngine(model, CFG.model_copy(update={"options": options}))
    params = eng.load_params()
    prompts = [model.tokenizer.encode(t) for t in TEXTS]
    logits = [eng.prefill(params=params, tokens=p, sampling=SamplingParams(temperature=0, seed=0))[0].host_logits() for p in prompts]
    sp = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=True, top_logprobs=2)
    outs = [c.outputs[0] for c in LLM.from_engine(eng, tools=False).generate(prompts, sp)]
    return logits, outs


@pytest.fixture(scope="module")
def float32(smollm2_4):
    return _run(smollm2_4, {})


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(BOUNDS))
def test_quantized_against_float32(smollm2_4, float32, mode):
    rel_bound, lp_bound = BOUNDS[mode]
    logits, outs = _run(smollm2_4, OPTIONS[mode])
    want_logits, want = float32
    rel = max(float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(logits, want_logits))
    assert rel <= rel_bound, (mode, rel)
    agreed, errs = 0, []
    for got, ref in zip(outs, want):
        n = next((i for i, (a, b) in enumerate(zip(got.token_ids, ref.token_ids)) if a != b), STEPS)
        agreed += n
        err = max((abs(a - b) for a, b in zip(got.logprobs[:n], ref.logprobs[:n])), default=0.0)
        errs.append(round(err, 4))
        assert err <= lp_bound, (mode, err)
        if n < STEPS:  # a divergence must sit where float32 itself nearly tied
            top = sorted(ref.top_logprobs[n].values(), reverse=True)
            assert top[0] - top[1] < 2 * lp_bound, (mode, n, top)
    assert agreed >= STEPS * len(TEXTS) // 2, (mode, agreed)
    print(f"{mode}: logits rel. L2 {rel:.4f}, log-prob errors {errs}, {agreed} of {STEPS * len(TEXTS)} tokens agree")
