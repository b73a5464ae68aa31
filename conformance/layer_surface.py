"""Layer 1, surface: the engine has the protocol's names, signatures and attributes.

Nothing here runs a model beyond one prefill; a failure here means the backend does
not speak the protocol, and every later layer would fail for that reason.
"""

from __future__ import annotations

import inspect

import numpy as np

from polyengine.engine import Capabilities, Engine, Prefix, ResultTokens
from polyengine.sampling import SamplingParams
from polyengine.sampling.params import ENGINE_FIELDS, MAX_TOP_LOGPROBS

from polyengine.conformance import layer
from polyengine.conformance.harness import LIMITS
from polyengine.conformance.models import DEFAULT_MODEL, build_model
from polyengine.conformance.tolerances import QUANTITIES

# name -> (positional-or-keyword parameters after self, keyword-only parameters)
_SIGNATURES = {
    "load_params": ((), ()),
    "init_decode_state": ((), ()),
    "prefill": ((), ("params", "tokens", "sampling", "existing_prefix")),
    "insert": (("prefix", "decode_state", "slot"), ()),
    "generate": (("params", "decode_state"), ("overrides",)),
    "free_resource": (("decode_state", "slot"), ()),
    # optional methods exist on every engine; undeclared ones raise UnsupportedFeature
    "bulk_insert": (("prefix", "decode_state", "slots"), ()),
    "export_prefix": (("prefix",), ()),
    "import_prefix": (("portable",), ()),
}


@layer("surface")
class SurfaceLayer:
    def test_engine_attributes(self, conformance):
        """Required attributes exist, have the protocol's types and honour the config."""
        eng = conformance.harness.probe
        model = build_model(DEFAULT_MODEL)
        assert isinstance(eng, Engine), (
            f"{type(eng).__name__} does not implement polyengine.Engine; missing: "
            f"{[n for n in ('name', 'capabilities', 'max_concurrent_decodes', 'max_prefill_length', 'max_cache_length', 'vocab_size', 'eos_token_ids', *_SIGNATURES) if not hasattr(eng, n)]}"
        )
        assert isinstance(eng.name, str) and eng.name, f"engine.name must be a non-empty str, got {eng.name!r}"
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
            f"engine.eos_token_ids {eos} differ from the model's {model.eos_token_ids}: "
            f"min_tokens/ignore_eos would mask the wrong tokens"
        )

    def test_method_signatures(self, conformance):
        """Every protocol method exists with the protocol's parameter names."""
        eng = conformance.harness.probe
        problems = []
        for name, (positional, keyword_only) in _SIGNATURES.items():
            fn = getattr(eng, name, None)
            if not callable(fn):
                problems.append(f"{name}: missing")
                continue
            params = inspect.signature(fn).parameters
            for p in positional:
                if p not in params or params[p].kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY):
                    problems.append(f"{name}: needs positional parameter {p!r}")
            for p in keyword_only:
                if p not in params or params[p].kind not in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
                    problems.append(f"{name}: needs keyword parameter {p!r}")
        for name, default_param in (("prefill", "existing_prefix"), ("generate", "overrides")):
            p = inspect.signature(getattr(eng, name)).parameters.get(default_param) if callable(getattr(eng, name, None)) else None
            if p is not None and p.default is not None:
                problems.append(f"{name}: {default_param} must default to None")
        assert not problems, "protocol signature mismatch: " + "; ".join(problems)

    def test_capabilities_well_formed(self, conformance):
        """Capabilities is the core's model with sane values."""
        caps = conformance.harness.probe.capabilities
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
        eng = conformance.harness.probe
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
