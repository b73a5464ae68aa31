"""Broken backends of the lifetime layer: the reference engine, keeping a prefix right
when it is first used and breaking it at one later event each (docs/conformance.md,
"Lifetimes"). Registered with the others by tests/broken_backends.py.

Each is a realistic shortcut of a backend that owns its memory: pages shared between a
prefix and a slot, a sampler row installed without a copy, staging buffers reused.
"""

from __future__ import annotations

import numpy as np

from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.backends.reference.model import rope


class _Remembers(ReferenceEngine):
    """Keeps, per slot, the prefix whose K/V it holds (what a paged pool records)."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self._holder: dict[int, object] = {}

    def _install(self, prefix, state, slots, *, draw):
        out = super()._install(prefix, state, slots, draw=draw)
        for slot in slots:
            self._on_install(prefix, slot)
            self._holder[slot] = prefix
        return out

    def _on_install(self, prefix, slot) -> None:
        pass


class FreeReleasesPrefixEngine(_Remembers):
    """insert shares the prefix's K/V pages with the slot (no copy) and free_resource
    returns the slot's pages to the pool, zeroed: the prefix the driver's prefix cache
    holds reads zeros once its first request ends."""

    def _release(self, state, slot):
        super()._release(state, slot)
        prefix = self._holder.pop(slot, None)
        if prefix is not None:
            for a in prefix.kv:
                a[...] = 0.0


class SlotAliasesPrefixEngine(_Remembers):
    """insert adopts the prefix's K/V pages as the slot's first pages (no copy), and they
    stay the slot's after it is freed: the next request inserted into that slot writes its
    prompt over the earlier prefix."""

    def _on_install(self, prefix, slot):
        old = self._holder.get(slot)
        if old is not None and old is not prefix:
            n = min(old.true_length, prefix.true_length)
            old.kv[0][:, :, :n] = prefix.kv[0][:, :, :n]
            old.kv[1][:, :, :n] = prefix.kv[1][:, :, :n]


class EvictsIdlePrefixesEngine(ReferenceEngine):
    """A pool that counts the pages of a prefix no occupied slot holds as free: inserting
    a request takes them, so a prefix kept for later (prefill ahead, a cached prefix
    whose request ended) reads zeros after other slots' inserts."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self._made: list = []
        self._holder: dict[int, object] = {}

    def prefill(self, **kw):
        prefix, first = super().prefill(**kw)
        self._made.append(prefix)
        return prefix, first

    def import_prefix(self, portable):
        prefix = super().import_prefix(portable)
        self._made.append(prefix)
        return prefix

    def _install(self, prefix, state, slots, *, draw):
        out = super()._install(prefix, state, slots, draw=draw)
        for slot in slots:
            self._holder[slot] = prefix
        held = [self._holder[s] for s in state.occupied() if s in self._holder] + [prefix]
        for other in self._made:
            if not any(other is h for h in held):
                for a in other.kv:
                    a[...] = 0.0
        return out

    def _release(self, state, slot):
        super()._release(state, slot)
        self._holder.pop(slot, None)


class PrefixRowSharedEngine(ReferenceEngine):
    """insert installs the sampler row the prefix carries instead of a fresh one: the
    slot's steps advance the prefix's own row (step counter, completion for the
    penalties), so the prefix inserted again starts where that slot was."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self._rows: dict[int, tuple[object, object]] = {}

    def _install(self, prefix, state, slots, *, draw):
        out = super()._install(prefix, state, slots, draw=draw)
        if not draw:
            kept = self._rows.get(id(prefix))
            if kept is None or kept[0] is not prefix:
                kept = self._rows[id(prefix)] = (prefix, state.rows[slots[0]])
            state.rows[slots[0]] = kept[1]
        return out


class ContinuationInPlaceEngine(ReferenceEngine):
    """Every continuation of one prefix is written into one extension buffer of that
    prefix (its K/V are views of it): continuing the same prefix again overwrites the
    earlier continuation's tokens."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self._ext: dict[int, tuple] = {}

    def prefill(self, *, params, tokens, sampling, existing_prefix=None, token_mask=None):
        prefix, first = super().prefill(params=params, tokens=tokens, sampling=sampling,
                                        existing_prefix=existing_prefix, token_mask=token_mask)
        if existing_prefix is not None:
            buf = self._ext.get(id(existing_prefix))
            if buf is None or buf[0] is not existing_prefix:
                shape = self._cache_shape(self.max_cache_length)
                buf = self._ext[id(existing_prefix)] = (existing_prefix, np.zeros(shape, self.np_dtype),
                                                        np.zeros(shape, self.np_dtype))
            n = prefix.true_length
            buf[1][:, :, :n], buf[2][:, :, :n] = prefix.kv
            prefix.kv = (buf[1][:, :, :n], buf[2][:, :, :n])
        return prefix, first


class ExportInPlaceEngine(ReferenceEngine):
    """export_prefix stages the portable format's K in the prefix's own buffer (RoPE
    applied in place, as from a cache that holds K before RoPE) and hands out a copy:
    the export is right, the prefix is rotated twice afterwards."""

    def export_prefix(self, prefix):
        out = super().export_prefix(prefix)
        out.k, out.v = np.array(out.k, copy=True), np.array(out.v, copy=True)
        k = prefix.kv[0]
        pos = np.arange(k.shape[2])
        inv = self.load_params().inv_freq["global"]
        for layer in range(k.shape[0]):
            k[layer] = rope(k[layer].transpose(1, 0, 2), pos, inv).transpose(1, 0, 2)
        return out


class ImportStagingEngine(ReferenceEngine):
    """import_prefix keeps the imported K/V in one engine-wide staging buffer (the
    prefix's K/V are views of it): the next import overwrites an earlier imported prefix."""

    _staging = None

    def import_prefix(self, portable):
        prefix = super().import_prefix(portable)
        if self._staging is None:
            shape = self._cache_shape(self.max_cache_length)
            self._staging = (np.zeros(shape, self.np_dtype), np.zeros(shape, self.np_dtype))
        n = prefix.true_length
        k, v = self._staging
        k[:, :, :n], v[:, :, :n] = prefix.kv
        prefix.kv = (k[:, :, :n], v[:, :, :n])
        return prefix


_LIFETIME = "test_prefix_lifetime and "
LIFETIME_BROKEN = {
    "broken_free_releases_prefix": FreeReleasesPrefixEngine,
    "broken_slot_aliases_prefix": SlotAliasesPrefixEngine,
    "broken_evicts_idle_prefixes": EvictsIdlePrefixesEngine,
    "broken_prefix_row_shared": PrefixRowSharedEngine,
    "broken_continuation_in_place": ContinuationInPlaceEngine,
    "broken_export_in_place": ExportInPlaceEngine,
    "broken_import_staging": ImportStagingEngine,
}
_PHRASE = "a Prefix stays valid and unchanged"
LIFETIME_CAUGHT_BY = {
    "broken_free_releases_prefix": (_LIFETIME + "prefill-slot_freed", "test_prefix_lifetime[prefill-slot_freed]",
                                    "after it was inserted into slot 0, which ran 2 steps and was freed"),
    "broken_slot_aliases_prefix": (_LIFETIME + "prefill-slot_reused", "test_prefix_lifetime[prefill-slot_reused]",
                                   "was freed and took another request"),
    "broken_evicts_idle_prefixes": (_LIFETIME + "prefill-other_slots", "test_prefix_lifetime[prefill-other_slots]",
                                    "after other requests were inserted into slots 1 and 2"),
    "broken_prefix_row_shared": (_LIFETIME + "prefill-slot_generated", "test_prefix_lifetime[prefill-slot_generated]",
                                 _PHRASE),
    "broken_continuation_in_place": (_LIFETIME + "continuation-continued",
                                     "test_prefix_lifetime[continuation-continued]", "a continuation's Prefix"),
    "broken_export_in_place": (_LIFETIME + "prefill-exported", "test_prefix_lifetime[prefill-exported]",
                               "after it was exported"),
    "broken_import_staging": (_LIFETIME + "import-imported_again", "test_prefix_lifetime[import-imported_again]",
                              "an imported Prefix"),
}
# the older faults of the same class, caught again at their event
LIFETIME_ALSO_CAUGHT_BY = {
    "broken_prefix_scratch": [(_LIFETIME + "prefill-later_prefills", "test_prefix_lifetime[prefill-later_prefills]",
                               "after two more prefills ran")],
    "broken_prefix_zeroed": [(_LIFETIME + "prefill-inserted", "test_prefix_lifetime[prefill-inserted]",
                              "after it was inserted into slot 0")],
    "broken_continuation_consumes": [(_LIFETIME + "prefill-continued", "test_prefix_lifetime[prefill-continued]",
                                      "after it was continued twice")],
}
