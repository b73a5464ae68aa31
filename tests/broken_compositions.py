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
from polyengine.sampling import RowState


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


class MaskDroppedOnForcedEngine(ReferenceEngine):
    """mask + override: a slot given an override in a step draws that step's token
    without the step's allowed-token mask (masked steps and forced steps are each right
    alone)."""

    def generate(self, params, decode_state, *, overrides=None, token_masks=None):
        if overrides and token_masks:
            token_masks = {slot: m for slot, m in token_masks.items() if slot not in overrides} or None
        return super().generate(params, decode_state, overrides=overrides, token_masks=token_masks)


class _Reinserts(ReferenceEngine):
    """Remembers the prefixes inserted before (held, so an id is never reused)."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self._inserted: dict[int, object] = {}

    def _seen(self, prefix) -> bool:
        seen = self._inserted.get(id(prefix)) is prefix
        self._inserted[id(prefix)] = prefix
        return seen


class MaskRedrawnOnReinsertEngine(_Reinserts):
    """mask + reinsert: a prefix inserted again draws its first token anew from the kept
    logits, without the prefill's allowed-token mask (the redraw equals the prefill's
    draw wherever there is no mask: same stream, sample 0, step 0)."""

    def _install(self, prefix, state, slots, *, draw):
        again = self._seen(prefix)
        if not draw and again and prefix.token_mask is not None:
            row = RowState(prefix.sampling, 0, 0, prefix.prompt_tokens, np.zeros(0, np.int32), None)
            first = int(self._sample([prefix.logits], [row]).tokens[0])
            prefix = dataclasses.replace(prefix, first_token=first)
        return super()._install(prefix, state, slots, draw=draw)


class _Continuations(ReferenceEngine):
    """Remembers each continuation's prefix and the length of the prefix it continued."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self._base_length: dict[int, tuple[object, int]] = {}
        self._slot_base: dict[int, int] = {}

    def prefill(self, *, params, tokens, sampling, existing_prefix=None, token_mask=None):
        prefix, first = super().prefill(params=params, tokens=tokens, sampling=sampling,
                                        existing_prefix=existing_prefix, token_mask=token_mask)
        if existing_prefix is not None:
            self._base_length[id(prefix)] = (prefix, existing_prefix.true_length)
        return prefix, first

    def _continued(self, prefix) -> int:
        kept = self._base_length.get(id(prefix))
        return kept[1] if kept is not None and kept[0] is prefix else 0

    def _install(self, prefix, state, slots, *, draw):
        out = super()._install(prefix, state, slots, draw=draw)
        for slot in slots:
            self._slot_base[slot] = self._continued(prefix)
        return out


class OverrideDropsBaseEngine(_Continuations):
    """continuation + override: rolling a slot back for an override rebuilds its cache
    from the continuation's own tokens, leaving the part it continued zeroed (a plain
    prefix's slot rolls back right; a continuation's slot is right without overrides)."""

    def _force(self, state, slot, token, position):
        ReferenceEngine._force(state, slot, token, position)
        base = self._slot_base.get(slot, 0)
        if base and not self.pages:
            state.k[slot][:, :, :base] = 0
            state.v[slot][:, :, :base] = 0


class ReinsertDropsBaseEngine(_Continuations, _Reinserts):
    """continuation + reinsert: a continuation's prefix inserted again copies only its own
    positions, as if the prefix it continued were still in the slot (the first insert
    copies everything; a plain prefix inserted again too)."""

    def _install(self, prefix, state, slots, *, draw):
        again = self._seen(prefix)
        out = super()._install(prefix, state, slots, draw=draw)
        base = self._continued(prefix)
        if again and base and not self.pages:
            for slot in slots:
                state.k[slot][:, :, :base] = 0
                state.v[slot][:, :, :base] = 0
        return out


class BulkNumbersOnEngine(ReferenceEngine):
    """bulk_insert + reinsert: bulk_insert numbers a prefix's samples on from the ones it
    inserted before (sample index i + earlier inserts), so a prefix inserted, freed and
    bulk-inserted again draws on another sample's stream (a fresh prefix's samples are
    numbered right; an insert again uses the prefix's first token, right)."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self._inserts: dict[int, tuple[object, int]] = {}
        self._offset = 0

    def _install(self, prefix, state, slots, *, draw):
        kept = self._inserts.get(id(prefix))
        before = kept[1] if kept is not None and kept[0] is prefix else 0
        self._inserts[id(prefix)] = (prefix, before + len(slots))
        self._offset = before if draw else 0
        try:
            out = super()._install(prefix, state, slots, draw=draw)
        finally:
            self._offset = 0
        if draw and before:
            for slot in slots:
                state.rows[slot].sample_index += before
        return out

    def _sample(self, logits, rows):
        if self._offset:
            rows = [dataclasses.replace(row, sample_index=row.sample_index + self._offset) for row in rows]
        return super()._sample(logits, rows)


_DIFF = ("test_differential and mha_tied and not bucket", "test_differential[mha_tied]")
COMPOSED_BROKEN = {
    "broken_mask_bulk_samples": MaskBulkSamplesEngine,
    "broken_override_bulk_sample": OverrideBulkSampleEngine,
    "broken_bulk_continuation_logits": BulkContinuationLogitsEngine,
    "broken_override_writes_prefix": OverrideWritesPrefixEngine,
    "broken_mask_dropped_on_override": MaskDroppedOnForcedEngine,
    "broken_mask_redrawn_on_reinsert": MaskRedrawnOnReinsertEngine,
    "broken_override_drops_base": OverrideDropsBaseEngine,
    "broken_reinsert_drops_base": ReinsertDropsBaseEngine,
    "broken_bulk_numbers_on": BulkNumbersOnEngine,
}
COMPOSED_CAUGHT_BY = {
    "broken_mask_bulk_samples": (*_DIFF, "allowed-token mask leaves out"),
    "broken_override_bulk_sample": (*_DIFF, "forced at completion position"),
    "broken_bulk_continuation_logits": (*_DIFF, "bulk_insert sample"),
    "broken_override_writes_prefix": (*_DIFF, "had been inserted"),
    "broken_mask_dropped_on_override": (*_DIFF, "allowed-token mask leaves out"),
    "broken_mask_redrawn_on_reinsert": (*_DIFF, "(insert) is"),
    "broken_override_drops_base": (*_DIFF, "forced at completion position"),
    "broken_reinsert_drops_base": (*_DIFF, "the reference draws"),
    "broken_bulk_numbers_on": (*_DIFF, "bulk_insert sample 0, row 0"),
}
