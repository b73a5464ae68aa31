"""Layer 1, surface: the engine has the protocol's names, signatures and attributes.

Nothing here runs a model beyond one prefill; a failure here means the backend does
not speak the protocol, and every later layer would fail for that reason.
"""

from __future__ import annotations

import numpy as np

from polyengine.engine import Capabilities, Prefix, ResultTokens, protocol_problems
from polyengine.sampling import SamplingParams
from polyengine.sampling.params import ENGINE_FIELDS, MAX_TOP_LOGPROBS

from polyengine.conformance import layer
from polyengine.conformance.harness import LIMITS
from polyengine.conformance.models import build_model
from polyengine.conformance.tolerances import QUANTITIES


@layer("surface")
class SurfaceLayer:
    def test_engine_attributes(self, conformance):
        """Required attributes exist, have the protocol's types and honour the config."""
        eng = conformance.harness.default_engine
        model = build_model(conformance.harness.default_model)
        missing = [p for p in protocol_problems(eng) if p.startswith("attribute")]
        assert not missing, f"{type(eng).__name__} does not implement polyengine.Engine: " + "; ".join(missing)
        assert isinstance(eng.name, str) and eng.name, f"engine.name must be a non-empty str, got {eng.name!r}"
        assert isinstance(eng.device, str) and eng.device, f"engine.device must say where it computes, got {eng.device!r}"
        want = {
            "max_concurrent_decodes": LIMITS["max_slots"],
            "max_prefill_length": LIMITS["max_prefill_length"],
            "max_cache_length": LIMITS["max_cache_length"],
            "vocab_size": model.config.vocab_size,
        }
        for attr, value in want.items():
            got = getattr(eng, attr)
            assert isinstance(got, (int, np.integer)) and got == value, (
                f"engine.{attr} is {got!r} but the EngineConfig/model asked for {value}"
            )
        eos = tuple(eng.eos_token_ids)
        assert all(isinstance(t, (int, np.integer)) for t in eos), f"eos_token_ids must be ints, got {eos!r}"
        assert set(eos) == set(model.eos_token_ids), (
            f"engine.eos_token_ids {eos} differ from the model's {model.eos_token_ids} (every EOS id of the model, "
            f"the tokenizer's end-of-turn included): min_tokens/ignore_eos would mask the wrong tokens and the driver "
            f"would not stop on them"
        )

    def test_method_signatures(self, conformance):
        """Every protocol method (optional ones included) exists with the protocol's
        parameter names (the Engine Protocol in polyengine.engine is the declaration)."""
        eng = conformance.harness.default_engine
        problems = [p for p in protocol_problems(eng) if not p.startswith("attribute")]
        assert not problems, "protocol signature mismatch: " + "; ".join(problems)

    def test_capabilities_well_formed(self, conformance):
        """Capabilities is the core's model with sane values."""
        caps = conformance.harness.default_engine.capabilities
        assert isinstance(caps, Capabilities), f"capabilities must be polyengine.Capabilities, got {type(caps).__name__}"
        assert caps.dtypes and all(isinstance(d, str) and d for d in caps.dtypes), f"dtypes must be non-empty names: {caps.dtypes}"
        assert len(set(caps.dtypes)) == len(caps.dtypes), f"dtypes lists a dtype twice: {caps.dtypes}"
        assert caps.sampling_params <= ENGINE_FIELDS, f"unknown sampling params {sorted(caps.sampling_params - ENGINE_FIELDS)}"
        assert caps.max_top_logprobs <= MAX_TOP_LOGPROBS, (
            f"max_top_logprobs={caps.max_top_logprobs} exceeds what a request can ask ({MAX_TOP_LOGPROBS})"
        )
        for dtype in caps.dtypes:  # every declared dtype needs tolerances to be tested at all
            for quantity in QUANTITIES:
                conformance.tolerance(quantity, dtype)

    def test_result_shapes(self, conformance):
        """prefill gives (Prefix, one-row ResultTokens); generate on an empty state gives
        one invalid row per slot; the prefix carries the prompt, a seed and the logits."""
        eng = conformance.harness.default_engine
        params = conformance.harness.params(eng)
        state = eng.init_decode_state()
        assert getattr(state, "num_slots", None) == eng.max_concurrent_decodes, (
            f"init_decode_state().num_slots is {getattr(state, 'num_slots', None)!r}, expected {eng.max_concurrent_decodes}"
        )
        prompt = [5, 17, 42]
        prefix, first = eng.prefill(params=params, tokens=prompt, sampling=SamplingParams(temperature=0.0))
        assert isinstance(prefix, Prefix), f"prefill must return a Prefix first, got {type(prefix).__name__}"
        assert isinstance(first, ResultTokens), f"prefill must return ResultTokens second, got {type(first).__name__}"
        assert first.num_rows == 1 and first.tokens.shape[1] >= 1, f"prefill's result must have one row, got {first!r}"
        assert bool(first.valid[0, 0]) and int(first.tokens[0, 0]) == prefix.first_token, (
            f"prefill's first token {int(first.tokens[0, 0])} (valid={bool(first.valid[0, 0])}) differs from prefix.first_token {prefix.first_token}"
        )
        assert int(first.lengths[0]) == 1 and int(np.asarray(first.valid[0]).sum()) == 1, (
            f"prefill's result must hold exactly one valid token with lengths == 1 (the completion so far), got "
            f"valid={first.valid[0].tolist()}, lengths={first.lengths.tolist()}"
        )
        assert list(np.asarray(prefix.prompt_tokens)) == prompt, f"prefix.prompt_tokens {prefix.prompt_tokens} != prompt {prompt}"
        assert prefix.sampling.seed is not None, "the prefix's sampling parameters must carry the resolved seed"
        logits = prefix.host_logits()
        assert logits.shape == (eng.vocab_size,) and np.all(np.isfinite(logits)), (
            f"prefix.host_logits() must be ({eng.vocab_size},) finite, got shape {logits.shape}"
        )
        state, result = eng.generate(params, state)
        assert isinstance(result, ResultTokens) and result.num_rows == eng.max_concurrent_decodes, (
            f"generate must return one row per slot ({eng.max_concurrent_decodes}), got {result!r}"
        )
        assert not np.asarray(result.valid).any(), "generate on an empty decode state reported valid tokens"
        assert not np.asarray(result.lengths).any(), (
            f"generate on an empty decode state reported completion lengths {result.lengths.tolist()} (empty slots have 0)"
        )
