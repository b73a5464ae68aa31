"""Broken backends whose fault shows only under an engine option: right in the run
without options, wrong in the run of one option set (docs/conformance.md, "Option
sets"). tests/test_conformance_options.py runs each in subclass mode with
:data:`TOLERANCES` (its ``[[conformance_options]]``) and the option set's
``--polyengine-option``.
"""

from __future__ import annotations

import numpy as np

from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.engine import Option
from polyengine.sampling.masks import unpack_mask

from broken_backends import SharedResultBufferEngine, _factory


class _Optioned(ReferenceEngine):
    """The reference with the options its faults hang on (all off by default)."""

    OPTIONS = {
        "kv_dtype": Option("auto", "K/V stored as 'auto' (the compute dtype) or 'float16'", choices=("auto", "float16")),
        "fast_logits": Option(False, "final norm and LM head in float32 (declared lossy, within 1e-5)"),
        "async_steps": Option(False, "steps on a worker thread, results read later"),
    }

    def _forward(self, params, tokens, starts, k_caches, v_caches):
        out = super()._forward(params, tokens, starts, k_caches, v_caches)
        if self.options["kv_dtype"] == "float16":
            for cache in (*k_caches, *v_caches):
                cache[...] = cache.astype(np.float16)
        if self.options["fast_logits"]:
            # the fault: a bf16-like rounding of the logits, far more than the 1e-5 declared
            out = (out.astype(np.float32).view(np.int32) & np.int32(-65536)).view(np.float32).astype(out.dtype)
        return out


class LossyClaimedLosslessEngine(_Optioned):
    """kv_dtype = "float16" stores K/V in float16 and is declared lossless: the run of
    that option set is judged at the float64 tolerances, where it fails."""


class BeyondDeclaredToleranceEngine(_Optioned):
    """fast_logits = true declares logits within 1e-5 of the reference; it rounds them
    to 8 mantissa bits."""


class AsyncOptionBufferEngine(SharedResultBufferEngine):
    """async_steps = true packs every step's results into one reused host buffer
    (broken_result_buffer's fault, only under the option); without it the steps run
    synchronously, as the reference."""

    OPTIONS = _Optioned.OPTIONS

    def generate(self, params, decode_state, *, overrides=None):
        if not self.options["async_steps"]:
            return ReferenceEngine.generate(self, params, decode_state, overrides=overrides)
        return super().generate(params, decode_state, overrides=overrides)


class MaskedRunnerUpEngine(_Optioned):
    """Not broken: under option ``masked_runner_up`` a greedy prefill under a token mask
    draws the runner-up of the allowed ids (a lossy option's rounding at a near tie of
    the reference), declared with a tie_gap that covers it: a run of the suite passes."""

    OPTIONS = {**_Optioned.OPTIONS, "masked_runner_up": Option(False, "masked greedy draws take the runner-up")}

    def _sample(self, logits, rows):
        if self.options["masked_runner_up"]:
            logits = [np.array(row_logits, copy=True) for row_logits in logits]
            for row_logits, row in zip(logits, rows):
                if row.token_mask is None or row.params.temperature != 0.0:
                    continue
                allowed = np.flatnonzero(unpack_mask(row.token_mask, row_logits.shape[-1]))
                if allowed.size > 1:
                    best, second = allowed[np.argsort(row_logits[allowed])[::-1][:2]]
                    row_logits[best] = row_logits[second] - 1e-6
        return super()._sample(logits, rows)


TOLERANCES = {"conformance_options": [
    {"options": {"kv_dtype": "float16"}, "lossless": True, "reason": "claimed lossless (the fault)"},
    {"options": {"fast_logits": True}, "reason": "float32 final norm and LM head",
     "tolerances": {"logits_rel_l2": 1e-5, "logprob_abs": 1e-5, "tie_gap": 1e-5}},
    {"options": {"async_steps": True}, "lossless": True, "reason": "the same computation on a worker thread"},
    {"options": {"masked_runner_up": True}, "reason": "masked greedy draws at a near tie",
     "tolerances": {"tie_gap": 5.0}},
]}


def create_engine_for(name: str):
    """The factory of the broken (or honest) backend ``name`` (as the registry would give it)."""
    return _factory(name, {**OPTION_BROKEN, **OPTION_HONEST}[name][0])


# backend -> (its engine class, the option it runs with, -k selection, the failing test, a phrase of its message)
OPTION_BROKEN = {
    "broken_option_claimed_lossless": (LossyClaimedLosslessEngine, "kv_dtype=float16",
                                       "test_decode_logprobs_match_reference and mha_tied-float64",
                                       "test_decode_logprobs_match_reference[mha_tied-float64]", "logprob"),
    "broken_option_beyond_tolerance": (BeyondDeclaredToleranceEngine, "fast_logits=true",
                                       "test_prefill_logits_match_reference and mha_tied-float64",
                                       "test_prefill_logits_match_reference[mha_tied-float64]", "option set [fast_logits"),
    "broken_option_async_buffer": (AsyncOptionBufferEngine, "async_steps=true",
                                   "test_differential and mha_tied and not bucket", "test_differential[mha_tied]",
                                   "read after the next generate was dispatched"),
}

# honest backends: (engine class, the option, -k selection) whose run passes
OPTION_HONEST = {
    "honest_option_masked_runner_up": (MaskedRunnerUpEngine, "masked_runner_up=true", "test_edges and gqa_llama3"),
}
