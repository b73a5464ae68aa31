"""Issue 38: finite by construction.

Config values that overflow float32 in what is computed from them (Gemma 2's
soft-caps, Phi-3's long-RoPE attention factor, RoPE factors and bases) are refused
when the config is read, naming the field; and a step whose logits hold NaN or +inf
fails its request with NumericalError instead of sampling from them: the torch, JAX
and NumPy (reference) samplers report ``NONFINITE_TOKEN`` for that row (on the device,
no host sync), and
the driver fails that request alone (any token outside the vocabulary, or a NaN
log-prob, is read the same way). Tiny models, milliseconds each.
"""

from __future__ import annotations

import numpy as np
import pytest

from polyengine import LLM, EngineConfig, SamplingParams
from polyengine.errors import ModelConfigError, NumericalError
from polyengine.models.config_files import config_from_hf
from polyengine.results import NONFINITE_TOKEN, ResultTokens

pytestmark = pytest.mark.filterwarnings("ignore::polyengine.models.RandomWeightsWarning")

BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 8192}
GEMMA2 = {**BASE, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}
PHI3 = {**BASE, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "original_max_position_embeddings": 4096}


def _longrope(**over):
    return {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4, **over}


@pytest.mark.parametrize("hf, field", [
    ({**GEMMA2, "attn_logit_softcapping": 1e300}, "attn_logit_softcapping"),
    ({**GEMMA2, "final_logit_softcapping": 1e300}, "final_logit_softcapping"),
    ({**GEMMA2, "query_pre_attn_scalar": 1e-300}, "query_pre_attn_scalar"),
    ({**PHI3, "rope_scaling": _longrope(attention_factor=1e300)}, "attention_factor"),
    ({**PHI3, "rope_scaling": _longrope(long_factor=[1e300] * 4)}, "long_factor"),
    ({**PHI3, "rope_scaling": _longrope(short_factor=[1e-300] * 4)}, "short_factor"),
    ({**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 1e-300}},
     "factor"),
    ({**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 1e-300}, "rope_theta"),
])
def test_config_values_that_overflow_float32_are_refused_by_name(hf, field):
    with pytest.raises(ModelConfigError, match=field):
        config_from_hf(hf)


def test_real_values_still_load():
    cfg = config_from_hf({**GEMMA2, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                               "query_pre_attn_scalar": 256})
    assert cfg.attn_logit_softcapping == 50.0
    cfg = config_from_hf({**PHI3, "rope_scaling": _longrope(attention_factor=1.19)})
    assert cfg.rope_scaling.attention_factor == 1.19


def test_the_torch_sampler_reports_rows_with_nonfinite_logits():
    torch = pytest.importorskip("torch")
    from polyengine.backends.torch_common.sampling import TorchSampler

    sampler = TorchSampler(16, 3, [0])
    for row, temperature in enumerate((0.0, 1.0, 0.7)):
        sampler.install(row, SamplingParams(temperature=temperature, seed=row), [1, 2])
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    clean = sampler.sample(logits.clone()).tokens.tolist()
    logits[1, 5] = float("nan")
    logits[2, 3] = float("inf")
    got = sampler.sample(logits).tokens.tolist()
    assert got == [clean[0], NONFINITE_TOKEN, NONFINITE_TOKEN]


def test_the_jax_sampler_reports_rows_with_nonfinite_logits():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from polyengine.backends.tpu_jax import sampling as smp

    import jax

    sample = jax.jit(smp.sample, static_argnames=("num_top", "candidates"))  # one compile, not one per op
    state = smp.neutral_state(3, jnp.asarray(smp.neutral_rows(1, 16, [0]).eos_mask))
    logits = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    clean = np.asarray(sample(state, jnp.asarray(logits), jnp.ones(3, bool), num_top=0, candidates=3).tokens)
    logits[1, 5], logits[2, 3] = np.nan, np.inf
    got = np.asarray(sample(state, jnp.asarray(logits), jnp.ones(3, bool), num_top=0, candidates=3).tokens)
    assert got.tolist() == [int(clean[0]), NONFINITE_TOKEN, NONFINITE_TOKEN]


class _Poisoned:
    """The reference engine, except that one slot's tokens come back as a broken
    sampler reports them (``bad``: the token, or a NaN log-prob)."""

    def __init__(self, engine, slot: int, bad: str):
        self._engine, self._slot, self._bad = engine, slot, bad

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, params, state, **kw):
        state, res = self._engine.generate(params, state, **kw)
        tokens, logprobs = res.tokens.copy(), None if res.logprobs is None else res.logprobs.copy()
        if self._bad == "token":
            tokens[self._slot] = NONFINITE_TOKEN
        else:
            logprobs[self._slot] = np.nan
        return state, ResultTokens(tokens=tokens, valid=res.valid, lengths=res.lengths, logprobs=logprobs,
                                   top_ids=res.top_ids, top_logprobs=res.top_logprobs)


@pytest.mark.parametrize("bad", ["token", "logprob"])
def test_the_driver_fails_only_the_request_whose_logits_were_not_finite(bad):
    good = LLM("random:tiny", "reference", max_slots=2, max_cache_length=32, max_prefill_length=16, tools=False)
    llm = LLM.from_engine(_Poisoned(good.engine, 0, bad), tools=False)
    sp = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0, logprobs=True)
    victim, bystander = llm.submit([1, 2, 3], sp), llm.submit([4, 5, 6], sp)
    llm.scheduler.run_until(lambda: victim.done and bystander.done)
    assert isinstance(victim.error, NumericalError) and "NaN or infinite" in str(victim.error)
    assert bystander.error is None and len(bystander.completion.outputs[0].token_ids) == 4


def test_on_the_reference_backend_nan_logits_fail_their_request_alone():
    """One request's own logits turn NaN at its second step (its slot's K/V poisoned):
    it fails with NumericalError, the request beside it in the batch finishes."""
    from polyengine.backends.reference.engine import ReferenceEngine
    from polyengine.models import load_model

    class Poisoning(ReferenceEngine):
        def generate(self, params, decode_state, **kw):
            for slot in self._live(decode_state):
                if decode_state.rows[slot].prompt_tokens[0] == 1:
                    decode_state.k[slot][:] = np.nan
            return super().generate(params, decode_state, **kw)

    model = load_model("random:tiny")
    llm = LLM.from_engine(Poisoning(model, EngineConfig(max_slots=2, max_cache_length=32)), tools=False)
    sp = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.7, seed=1)
    victim, bystander = llm.submit([1, 2, 3], sp), llm.submit([4, 5, 6], sp)
    llm.scheduler.run_until(lambda: victim.done and bystander.done)
    assert isinstance(victim.error, NumericalError) and "NaN or infinite" in str(victim.error)
    assert bystander.error is None and len(bystander.completion.outputs[0].token_ids) == 4
