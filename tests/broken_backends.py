"""Deliberately broken backends: the reference engine with one realistic fault each.

The conformance suite's own tests register these in-process (:data:`PLUGIN`) and check
that each is caught by the test named in :data:`CAUGHT_BY` (and those in
:data:`ALSO_CAUGHT_BY`), with a failure message that points at the fault.

The last four are sampler faults that only show away from temperature 1 (or with
``min_tokens=1``): the suite ran its log-prob, logit_bias and penalty checks only
greedy or at temperature 1 before, and all four passed it.
"""

from __future__ import annotations

import numpy as np

from polyengine import PROTOCOL_VERSION
from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.engine import Capabilities, ResultTokens
from polyengine.plugins import BackendSpec, Probe, hookimpl
from polyengine.sampling import raw_logprobs, sample
from polyengine.sampling.params import ENGINE_FIELDS

from restricted_backend import RestrictedEngine


class LeakyEngine(ReferenceEngine):
    """An off-by-one in the cache layout: insert also writes the prefix into the next slot."""

    name = "broken_leaky"

    def insert(self, prefix, decode_state, slot):
        state = super().insert(prefix, decode_state, slot)
        nxt = (slot + 1) % state.num_slots
        if state.slots[nxt] is not None:
            n = prefix.true_length
            state.k[nxt][:, :, :n] = prefix.kv[0]
            state.v[nxt][:, :, :n] = prefix.kv[1]
        return state


class IgnoresOverridesEngine(ReferenceEngine):
    """Drops generate's overrides: the slot feeds its own sampled token."""

    name = "broken_overrides"

    def generate(self, params, decode_state, *, overrides=None):
        return super().generate(params, decode_state, overrides=None)


class SharedFirstTokenEngine(ReferenceEngine):
    """bulk_insert hands sample 0's first token to every slot instead of drawing sample i."""

    name = "broken_bulk"

    def bulk_insert(self, prefix, decode_state, slots):
        slots = self.check_bulk_slots(slots, decode_state.is_occupied)
        for i, slot in enumerate(slots):
            self._install(prefix, decode_state, slot, i, prefix.first_token)
        n = len(slots)
        return decode_state, ResultTokens(
            tokens=np.full((n, 1), prefix.first_token, np.int32), valid=np.ones((n, 1), bool),
            lengths=np.ones(n, np.int32),
        )


class IgnoresTopPEngine(ReferenceEngine):
    """Declares top_p but samples from the whole distribution."""

    name = "broken_top_p"

    def prefill(self, *, params, tokens, sampling, existing_prefix=None):
        if sampling.top_p < 1.0:
            sampling = sampling.replace(top_p=1.0)
        return super().prefill(params=params, tokens=tokens, sampling=sampling, existing_prefix=existing_prefix)


_GLOBAL_STREAM = np.random.default_rng()


class GlobalStreamEngine(ReferenceEngine):
    """Seeds every request from one process-wide random stream, not from its own seed."""

    name = "broken_global_stream"

    def prefill(self, *, params, tokens, sampling, existing_prefix=None):
        sampling = sampling.model_copy(update={"seed": int(_GLOBAL_STREAM.integers(1 << 63))})
        return super().prefill(params=params, tokens=tokens, sampling=sampling, existing_prefix=existing_prefix)


class ForgetsFreeEngine(ReferenceEngine):
    """free_resource checks the slot and returns, leaving it occupied."""

    name = "broken_free"

    def free_resource(self, decode_state, slot):
        self.check_slot(slot)
        return decode_state


class SilentParamEngine(ReferenceEngine):
    """Does not declare repetition_penalty, yet accepts it and silently drops it."""

    name = "broken_silent_param"

    def __init__(self, model, config):
        super().__init__(model, config)
        self.capabilities = Capabilities(
            dtypes=self.capabilities.dtypes,
            sampling_params=ENGINE_FIELDS - {"repetition_penalty"},
            bulk_insert=True, portable_prefix=True, prefix_reuse=True,
        )

    def prefill(self, *, params, tokens, sampling, existing_prefix=None):
        if sampling.repetition_penalty != 1.0:
            sampling = sampling.replace(repetition_penalty=1.0)
        return super().prefill(params=params, tokens=tokens, sampling=sampling, existing_prefix=existing_prefix)


class DriftingEngine(ReferenceEngine):
    """An LM head off by ~1e-3 relative (a bad weight conversion): logits drift past tolerance."""

    name = "broken_drift"

    def load_params(self):
        fresh = self._params is None
        params = super().load_params()
        if fresh:
            rng = np.random.default_rng(0)
            head = params.lm_head
            params.lm_head = head + 1e-3 * float(np.std(head)) * rng.standard_normal(head.shape).astype(head.dtype)
        return params


class _RewritesSampling(ReferenceEngine):
    """Base: the request's sampling parameters are rewritten when it is admitted (prefill),
    so every draw of the request, prefill and decode, uses the rewritten ones; the
    rewrite is how a faulty sampler behaves, expressed in the reference's parameters."""

    def rewrite(self, sampling):
        raise NotImplementedError

    def prefill(self, *, params, tokens, sampling, existing_prefix=None):
        # model_copy, not replace: a rewritten value may leave the API's range
        return super().prefill(params=params, tokens=tokens, sampling=self.rewrite(sampling),
                               existing_prefix=existing_prefix)


class BiasAfterTemperatureEngine(_RewritesSampling):
    """Adds logit_bias after dividing by the temperature (the same draws as the bias times T, added first)."""

    name = "broken_bias_after_temperature"

    def rewrite(self, sampling):
        t = sampling.temperature or 1.0
        return sampling.model_copy(update={"logit_bias": {k: v * t for k, v in sampling.logit_bias.items()}})


class PenaltiesAfterTemperatureEngine(_RewritesSampling):
    """Subtracts presence/frequency penalties after dividing by the temperature."""

    name = "broken_penalties_after_temperature"

    def rewrite(self, sampling):
        t = sampling.temperature or 1.0
        return sampling.model_copy(update={"presence_penalty": sampling.presence_penalty * t,
                                           "frequency_penalty": sampling.frequency_penalty * t})


class MinTokensOffByOneEngine(_RewritesSampling):
    """Masks EOS only while step < min_tokens - 1: EOS gets through one token early."""

    name = "broken_min_tokens"

    def rewrite(self, sampling):
        return sampling.model_copy(update={"min_tokens": max(0, sampling.min_tokens - 1)})


class ProcessedLogprobsEngine(ReferenceEngine):
    """Reports log-probs of the temperature-scaled distribution, log_softmax(logits / T), not the raw model's."""

    name = "broken_processed_logprobs"

    def _faulty_sample(self, logits, rows, eos_token_ids):
        out = sample(logits, rows, eos_token_ids)
        for b, row in enumerate(rows):
            lp = raw_logprobs(np.asarray(logits[b], np.float64) / (row.params.temperature or 1.0))
            out.logprobs[b] = lp[out.tokens[b]]
            k = row.params.top_logprobs
            if k:
                ids = np.argsort(-lp, kind="stable")[:k]
                out.top_ids[b, :k], out.top_logprobs[b, :k] = ids, lp[ids]
        return out

    def _sample(self, logits, rows):  # every path: prefill, bulk_insert, generate, import_prefix
        return self._faulty_sample(np.stack(logits), rows, self.eos_token_ids)


BROKEN = {
    cls.name: cls
    for cls in (LeakyEngine, IgnoresOverridesEngine, SharedFirstTokenEngine, IgnoresTopPEngine,
                GlobalStreamEngine, ForgetsFreeEngine, SilentParamEngine, DriftingEngine,
                ProcessedLogprobsEngine, BiasAfterTemperatureEngine, PenaltiesAfterTemperatureEngine,
                MinTokensOffByOneEngine)
}

# backend -> (-k selection that runs only the layer meant to catch it, the test that
# must fail, a phrase its message must hold)
CAUGHT_BY = {
    "broken_leaky": ("test_slot_isolation", "test_slot_isolation", "state leaks between slots"),
    "broken_overrides": ("test_overrides_force_next_input", "test_overrides_force_next_input", "overrides are ignored"),
    "broken_bulk": ("test_bulk_insert", "test_bulk_insert_independent_first_tokens", "each slot must draw its own first token"),
    "broken_top_p": ("test_sampling_support and top_p", "test_sampling_support[top_p]", "does not apply top_p"),
    "broken_global_stream": ("test_same_seed_same_tokens or test_seeded_stream", "test_same_seed_same_tokens",
                             "does not derive its random stream from the request's seed"),
    "broken_free": ("test_free_resource_then_reuse", "test_free_resource_then_reuse", "the slot was not emptied"),
    "broken_silent_param": ("test_sampling_parameter and repetition_penalty", "test_sampling_parameter[repetition_penalty]",
                            "never be silently ignored"),
    "broken_drift": ("test_prefill_logits_match_reference and mha_tied", "test_prefill_logits_match_reference[mha_tied-float64]",
                     "logits_rel_l2"),
    # faults visible only at a temperature other than 1 (or at min_tokens=1)
    "broken_processed_logprobs": ("test_sampling_parameter and logprobs", "test_sampling_parameter[logprobs]",
                                  "reported log-probs are not the raw model's"),
    "broken_bias_after_temperature": ("test_sampling_parameter and logit_bias", "test_sampling_parameter[logit_bias]",
                                      "logit_bias is applied after the temperature division"),
    "broken_penalties_after_temperature": ("test_sampling_parameter and presence_penalty",
                                           "test_sampling_parameter[presence_penalty]",
                                           "penalties are applied after the temperature division"),
    "broken_min_tokens": ("test_sampling_parameter and min_tokens", "test_sampling_parameter[min_tokens]",
                          "EOS was let through early"),
}

# Other layers that must catch the same faults (same shape as CAUGHT_BY, several per backend).
# The sampler layer's chi-square also fails broken_bias_after_temperature (setting
# "logit_bias": statistic ~230 on 52 df) and broken_penalties_after_temperature
# ("penalties": ~380 on 24 df); those runs cost ~1.5 s each, so they are left out here,
# and the suite itself asserts on every run that the two settings have the power
# (layer_sampler.SETTING_FAULTS).
ALSO_CAUGHT_BY = {
    "broken_processed_logprobs": [
        ("test_decode_logprobs_match_reference and mha_tied", "test_decode_logprobs_match_reference[mha_tied-float64]",
         "they equal log-softmax(logits / temperature)"),
    ],
    "broken_penalties_after_temperature": [
        ("test_sampling_parameter and frequency_penalty", "test_sampling_parameter[frequency_penalty]",
         "penalties are applied after the temperature division"),
    ],
    "broken_min_tokens": [
        ("test_driver_stop_conditions", "test_driver_stop_conditions", "min_tokens=1"),
    ],
}


def _factory(cls):
    def create_engine(*, model, config):
        return cls(model, config)

    return create_engine


class BrokenBackendsPlugin:
    """One in-process plugin registering every broken backend plus the restricted one."""

    @hookimpl
    def polyengine_backends(self):
        specs = [
            BackendSpec(
                name=name, description=f"deliberately broken: {cls.__doc__.splitlines()[0]}",
                protocol_version=PROTOCOL_VERSION, probe=lambda: Probe(True), factory=_factory(cls),
            )
            for name, cls in BROKEN.items()
        ]
        specs.append(BackendSpec(
            name="restricted", description="correct, declares little (tests/restricted_backend.py)",
            protocol_version=PROTOCOL_VERSION, probe=lambda: Probe(True), factory=_factory(RestrictedEngine),
        ))
        return specs


PLUGIN = BrokenBackendsPlugin()
