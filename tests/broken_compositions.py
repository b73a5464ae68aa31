"""Broken backends whose fault shows only where two capabilities meet: each is right on
every single capability, wrong on one pair of them (docs/conformance.md, "Composed
capabilities"). The differential layer's chains catch them; registered with the others
by tests/broken_backends.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.engine import ResultTokens


class MaskBulkSamplesEngine(ReferenceEngine):
    """mask + bulk_insert: bulk_insert draws every sample's first token without the
    prefix's mask (prefill applies it to sample 0's, generate applies step masks)."""

    def _install(self, prefix, state, slots, *, draw):
        if draw:
            prefix = dataclasses.replace(prefix, token_mask=None)
        return super()._install(prefix, state, slots, draw=draw)


class OverrideBulkSampleEngine(ReferenceEngine):
    """bulk_insert + override: rolling a slot back for an override rebuilds its sampler
    row as sample 0's, so a bulk-inserted sample i > 0 continues on sample 0's stream."""

    @staticmethod
    def _force(state, slot, token, position):
        ReferenceEngine._force(state, slot, token, position)
        state.rows[slot].sample_index = 0


class BulkContinuationLogitsEngine(ReferenceEngine):
    """continuation + bulk_insert: a continuation's prefix keeps the logits handle of the
    prefix it continues for bulk_insert, whose samples draw from the base's last logits."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self._base_logits: dict[int, tuple] = {}

    def prefill(self, *, params, tokens, sampling, existing_prefix=None, token_mask=None):
        prefix, first = super().prefill(params=params, tokens=tokens, sampling=sampling,
                                        existing_prefix=existing_prefix, token_mask=token_mask)
        if existing_prefix is not None:
            self._base_logits[id(prefix)] = (prefix, existing_prefix.logits)
        return prefix, first

    def _install(self, prefix, state, slots, *, draw):
        kept = self._base_logits.get(id(prefix))
        if draw and kept is not None and kept[0] is prefix:
            prefix = dataclasses.replace(prefix, logits=kept[1])
        return super()._install(prefix, state, slots, draw=draw)


class OverrideWritesPrefixEngine(ReferenceEngine):
    """override + reinsert: an inserted slot's completion starts in the prefix's own
    first-token cell (no copy), so an override at completion position 0 rewrites the
    prefix's first token, and the prefix inserted again (or bulk-inserted: sample 0's
    first token was drawn at prefill, and bulk_insert reuses that cell) starts from the
    forced token."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self._holder: dict[int, object] = {}

    def _install(self, prefix, state, slots, *, draw):
        out = super()._install(prefix, state, slots, draw=draw)
        for slot in slots:
            if draw:
                self._holder.pop(slot, None)
            else:
                self._holder[slot] = prefix
        if draw:
            first, s0 = int(prefix.first_token), slots[0]
            state.rows[s0].completion_tokens = np.array([first], np.int32)
            state.next_token[s0] = first
            tokens = np.array(out.tokens, copy=True)
            tokens[0, 0] = first
            out = ResultTokens(tokens=tokens, valid=out.valid, lengths=out.lengths, logprobs=out.logprobs,
                               top_ids=out.top_ids, top_logprobs=out.top_logprobs)
        return out

    def _release(self, state, slot):
        super()._release(state, slot)
        self._holder.pop(slot, None)

    def _force(self, state, slot, token, position):
        ReferenceEngine._force(state, slot, token, position)
        if position == 0 and slot in self._holder:
            self._holder[slot].first_token = int(token)


_DIFF = ("test_differential and mha_tied and not bucket", "test_differential[mha_tied]")
COMPOSED_BROKEN = {
    "broken_mask_bulk_samples": MaskBulkSamplesEngine,
    "broken_override_bulk_sample": OverrideBulkSampleEngine,
    "broken_bulk_continuation_logits": BulkContinuationLogitsEngine,
    "broken_override_writes_prefix": OverrideWritesPrefixEngine,
}
COMPOSED_CAUGHT_BY = {
    "broken_mask_bulk_samples": (*_DIFF, "allowed-token mask leaves out"),
    "broken_override_bulk_sample": (*_DIFF, "forced at completion position"),
    "broken_bulk_continuation_logits": (*_DIFF, "bulk_insert sample"),
    "broken_override_writes_prefix": (*_DIFF, "had been inserted"),
}
