"""Deliberately broken backends: the reference engine with one realistic fault each.

One per row of the rule table in docs/conformance.md. The conformance suite's own tests
register them in-process (:data:`PLUGIN`) and check that each is caught by the test
named in :data:`CAUGHT_BY` (and those in :data:`ALSO_CAUGHT_BY`), with a failure
message that points at the fault. Sampler faults are built from the suite's own
:data:`polyengine.conformance.faults.FAULTS`, so the fault the suite proves its power
against is the very one caught here.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np

from polyengine import PROTOCOL_VERSION
from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.backends.reference.model import rope
from polyengine.conformance.faults import FAULTS
from polyengine.engine import ResultLayout, ResultTokens, Slot
from polyengine.errors import InsufficientMemory
from polyengine.models.blocks import dequantize_blocks
from polyengine.plugins import BackendSpec, Probe, hookimpl
from polyengine.sampling import RowState, raw_logprobs, sample
from polyengine.sampling.masks import SlotMasks, full_mask, mask_words
from polyengine.sampling.params import ENGINE_FIELDS

from broken_edges import EDGE_BROKEN, EDGE_CAUGHT_BY
from broken_compositions import COMPOSED_BROKEN, COMPOSED_CAUGHT_BY
from broken_lifetimes import LIFETIME_ALSO_CAUGHT_BY, LIFETIME_BROKEN, LIFETIME_CAUGHT_BY
from honest_backends import HONEST, AsyncEngine
from restricted_backend import RestrictedEngine

# -- surface ---------------------------------------------------------------------------------


class SignatureEngine(ReferenceEngine):
    """prefill without the existing_prefix parameter."""

    def prefill(self, *, params, tokens, sampling):  # type: ignore[override]
        return super().prefill(params=params, tokens=tokens, sampling=sampling)


class LimitsEngine(ReferenceEngine):
    """Reports the model's max positions as max_cache_length instead of the config's."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self.max_cache_length = model.config.max_position_embeddings


class EosAttributeEngine(ReferenceEngine):
    """eos_token_ids lists only the first of the model's EOS ids."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self.eos_token_ids = self.eos_token_ids[:1]


class CapabilitiesEngine(ReferenceEngine):
    """Declares max_top_logprobs=64, more than a request can ask."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self.capabilities = self.capabilities.model_copy(update={"max_top_logprobs": 64})


class EmptyRowsEngine(ReferenceEngine):
    """generate marks every row valid, empty slots included."""

    def generate(self, params, decode_state, *, overrides=None):
        state, r = super().generate(params, decode_state, overrides=overrides)
        return state, ResultTokens(tokens=r.tokens, valid=np.ones_like(r.valid), lengths=r.lengths,
                                   logprobs=r.logprobs, top_ids=r.top_ids, top_logprobs=r.top_logprobs)


# -- contract ----------------------------------------------------------------------------------


class LeakyEngine(ReferenceEngine):
    """An off-by-one in the cache layout: insert also writes the prefix into the next slot."""

    def insert(self, prefix, decode_state, slot):
        state = super().insert(prefix, decode_state, slot)
        nxt = (slot + 1) % state.num_slots
        if state.slots[nxt] is not None:
            n = prefix.true_length
            state.k[nxt][:, :, :n] = prefix.kv[0]
            state.v[nxt][:, :, :n] = prefix.kv[1]
        return state


class ForgetsFreeEngine(ReferenceEngine):
    """free_resource checks the slot and returns, leaving it occupied."""

    def free_resource(self, decode_state, slot):
        self.check_slot(slot)
        return decode_state


class OverwriteEngine(ReferenceEngine):
    """insert into an occupied slot silently replaces its request."""

    def insert(self, prefix, decode_state, slot):
        self.free_resource(decode_state, slot)
        return super().insert(prefix, decode_state, slot)


class NegativeSlotEngine(ReferenceEngine):
    """Accepts slot -1 (Python's negative indexing reaches the last slot)."""

    def check_slot(self, slot):
        return super().check_slot(slot % self.max_concurrent_decodes if slot < 0 else slot)


class PromptLimitEngine(ReferenceEngine):
    """Truncates a prompt over max_prefill_length instead of refusing it."""

    def check_prefill(self, tokens, sampling, existing_prefix=None):
        return super().check_prefill(list(tokens)[: self.max_prefill_length], sampling, existing_prefix)


class IgnoresOverridesEngine(ReferenceEngine):
    """Drops generate's overrides: the slot feeds its own sampled token."""

    def generate(self, params, decode_state, *, overrides=None):
        return super().generate(params, decode_state, overrides=None)


class OverridePenaltyEngine(ReferenceEngine):
    """Feeds an override but keeps the sampled token as the slot's completion token,
    so the penalties count the token that was replaced."""

    @staticmethod
    def _force(state, slot, token, position):
        sampled = int(state.rows[slot].completion_tokens[position])
        ReferenceEngine._force(state, slot, token, position)
        state.rows[slot].completion_tokens[-1] = sampled


class UncheckedOverridesEngine(ReferenceEngine):
    """Applies overrides without checking slot, token or position."""

    def check_overrides(self, overrides, last_result):
        return {int(s): (t.token if hasattr(t, "token") else t, last_result(int(s))[0] - 1) for s, t in (overrides or {}).items()}


class SharedFirstTokenEngine(ReferenceEngine):
    """bulk_insert hands sample 0's first token to every slot instead of drawing sample i."""

    def _install(self, prefix, state, slots, *, draw):
        super()._install(prefix, state, slots, draw=False)
        n = len(slots)
        return ResultTokens(tokens=np.full((n, 1), prefix.first_token, np.int32), valid=np.ones((n, 1), bool),
                            lengths=np.ones(n, np.int32)) if draw else None


class BulkOrderEngine(ReferenceEngine):
    """bulk_insert returns its rows in sorted slot order, not in the order given."""

    def bulk_insert(self, prefix, decode_state, slots):
        state, r = super().bulk_insert(prefix, decode_state, slots)
        order = np.argsort(list(slots))
        return state, ResultTokens(tokens=r.tokens[order], valid=r.valid[order], lengths=r.lengths[order],
                                   logprobs=r.logprobs[order], top_ids=r.top_ids[order], top_logprobs=r.top_logprobs[order])


class BulkPartialEngine(ReferenceEngine):
    """bulk_insert fills slots one by one, so a refusal midway leaves earlier slots filled."""

    def bulk_insert(self, prefix, decode_state, slots):
        firsts = []
        for i, slot in enumerate(slots):
            slot = self.check_empty_slot(slot, decode_state.is_occupied)  # checked only when its turn comes
            self._install(prefix, decode_state, [slot], draw=False)
            decode_state.slots.put(slot, Slot(prefix.true_length))
            firsts.append(prefix.first_token)
        n = len(firsts)
        return decode_state, ResultTokens(tokens=np.array(firsts, np.int32).reshape(n, 1), valid=np.ones((n, 1), bool),
                                          lengths=np.ones(n, np.int32))


class PaddedLogitsEngine(ReferenceEngine):
    """Takes prefill's logits at the last padded position instead of the last true token."""

    def _forward(self, params, tokens, starts, k_caches, v_caches):
        out = super()._forward(params, tokens, starts, k_caches, v_caches)
        if out.shape[1] > 1:  # a prefill: every position gets the last (padded) one's logits
            out = np.repeat(out[:, -1:], out.shape[1], axis=1)
        return out


class PrefixPositionsEngine(ReferenceEngine):
    """Continues an existing prefix at position 0 instead of where the prefix ends."""

    def _forward(self, params, tokens, starts, k_caches, v_caches):
        if tokens.shape[1] > 1 and starts[0] > 0:
            scratch = [np.zeros_like(k) for k in k_caches], [np.zeros_like(v) for v in v_caches]
            logits = super()._forward(params, tokens, np.zeros_like(starts), *scratch)
            n = tokens.shape[1]
            k_caches[0][:, :, starts[0]: starts[0] + n] = scratch[0][0][:, :, :n]
            v_caches[0][:, :, starts[0]: starts[0] + n] = scratch[1][0][:, :, :n]
            return logits
        return super()._forward(params, tokens, starts, k_caches, v_caches)


class BatchPositionsEngine(ReferenceEngine):
    """A batched prefill runs every row at the first row's positions (a padded batch
    sharing one position vector): rows continuing prefixes of other lengths write and
    rotate their K/V at the wrong place."""

    def _forward(self, params, tokens, starts, k_caches, v_caches):
        if tokens.shape[0] > 1 and tokens.shape[1] > 1:  # a batched prefill (decode steps are one token wide)
            starts = np.minimum(starts, starts[0])
        return super()._forward(params, tokens, starts, k_caches, v_caches)


class PreRopeExportEngine(ReferenceEngine):
    """Exports K before RoPE (its cache layout) instead of after, as the format says."""

    def export_prefix(self, prefix):
        out = super().export_prefix(prefix)
        k = out.k  # (layers, kv_heads, length, head_dim), after RoPE
        pos = np.arange(k.shape[2])
        inv = self.load_params().inv_freq["global"]
        unrotated = np.stack([rope(layer.transpose(1, 0, 2), -pos, inv).transpose(1, 0, 2) for layer in k])
        out.k = unrotated.astype(np.float32)
        return out


class UncheckedImportEngine(ReferenceEngine):
    """import_prefix does not check the model fingerprint."""

    def import_prefix(self, portable):
        portable.check_compatible = lambda **kw: None
        return super().import_prefix(portable)


class TrustingImportEngine(ReferenceEngine):
    """import_prefix checks the model and the shapes but trusts the values: NaN K/V or
    logits and ids outside the vocabulary get in (as cuda_torch and tpu_jax once did)."""

    def check_portable(self, portable):
        import dataclasses

        clean = dataclasses.replace(
            portable, k=np.nan_to_num(portable.k), v=np.nan_to_num(portable.v),
            last_logits=np.nan_to_num(portable.last_logits), prompt_tokens=portable.prompt_tokens % self.vocab_size)
        super().check_portable(clean)
        return portable.prompt_tokens, portable.sampling.with_seed()


class TailHeadUncheckedEngine(ReferenceEngine):
    """import_prefix_tail takes any prefix of this engine long enough as the tail's head:
    the head's prompt ids are not compared with the tail's."""

    def check_portable_tail(self, portable, existing_prefix):
        import dataclasses

        head = dataclasses.replace(existing_prefix, prompt_tokens=np.concatenate(
            [portable.prompt_tokens[:portable.start], np.asarray(existing_prefix.prompt_tokens)[portable.start:]]))
        return super().check_portable_tail(portable, head)


class TailIgnoresHeadEngine(ReferenceEngine):
    """import_prefix_tail ignores the prefix it holds: the positions below the tail's
    start are zeros."""

    def _import_tail(self, portable, existing_prefix):
        if not portable.start:
            return self.import_prefix(portable)
        shape = (*portable.k.shape[:2], portable.start, portable.k.shape[3])
        return self.import_prefix(portable.joined(np.zeros(shape, np.float32), np.zeros(shape, np.float32)))


class ForeignPrefixEngine(ReferenceEngine):
    """Accepts prefixes made with other weights (no model_id check)."""

    def check_prefix(self, prefix):
        return prefix


class ContinuationEdgeEngine(ReferenceEngine):
    """Continuing a prefix that fills a bucket of 8 (its length a multiple of 8) copies one
    position too few of its K/V: an off-by-one where the prefix ends at a bucket edge."""

    def prefill(self, *, params, tokens, sampling, existing_prefix=None):
        if existing_prefix is not None and existing_prefix.true_length % 8 == 0:
            k, v = (a.copy() for a in existing_prefix.kv)
            k[:, :, -1], v[:, :, -1] = 0, 0
            existing_prefix = dataclasses.replace(existing_prefix, kv=(k, v))
        return super().prefill(params=params, tokens=tokens, sampling=sampling, existing_prefix=existing_prefix)


class ContinuationSamplingEngine(ReferenceEngine):
    """A continuation samples with the parameters of the prefix it continues (a cache that
    kept the first request's sampler row)."""

    def check_prefill(self, tokens, sampling, existing_prefix=None):
        toks, sampling, start = super().check_prefill(tokens, sampling, existing_prefix)
        return toks, (sampling if existing_prefix is None else existing_prefix.sampling), start


class ContinuationConsumesEngine(ReferenceEngine):
    """Continuing a prefix takes its K/V over (a buffer donated to the continuation): the
    prefix is left zeroed."""

    def prefill(self, *, params, tokens, sampling, existing_prefix=None):
        out = super().prefill(params=params, tokens=tokens, sampling=sampling, existing_prefix=existing_prefix)
        if existing_prefix is not None:
            for a in existing_prefix.kv:
                a[...] = 0
        return out


class PageRefusalAdvancesEngine(ReferenceEngine):
    """pages of 16 by default; a step its bounded pool refuses has already advanced its slots"""

    def _check_options(self, options):
        checked = super()._check_options(options)
        return {**checked, "page_size": checked["page_size"] or 16}

    def generate(self, params, decode_state, **kwargs):
        try:
            return super().generate(params, decode_state, **kwargs)
        except InsufficientMemory:
            decode_state.slots.advance(self._live(decode_state))  # the next step writes one position late
            raise


class CacheOverrunEngine(ReferenceEngine):
    """An off-by-one at the cache limit: one token more than max_cache_length allows
    (the last one is sampled but never fed, so the cache itself does not overflow)."""

    def _live(self, state):
        return [i for i in state.slots.occupied()
                if state.slots[i].total <= self.max_cache_length and state.slots[i].length < self.max_cache_length]


class LengthsEngine(ReferenceEngine):
    """lengths counts decode steps only, not the first token."""

    def generate(self, params, decode_state, *, overrides=None):
        state, r = super().generate(params, decode_state, overrides=overrides)
        return state, ResultTokens(tokens=r.tokens, valid=r.valid, lengths=np.maximum(r.lengths - 1, 0),
                                   logprobs=r.logprobs, top_ids=r.top_ids, top_logprobs=r.top_logprobs)


class ValidGapsEngine(ReferenceEngine):
    """Returns two token columns with the token in the second (valid [0, 1])."""

    def generate(self, params, decode_state, *, overrides=None):
        state, r = super().generate(params, decode_state, overrides=overrides)
        pad = lambda a, fill: np.concatenate([np.full_like(a, fill), a], axis=1)  # noqa: E731
        return state, ResultTokens(tokens=pad(r.tokens, 0), valid=pad(r.valid, False), lengths=r.lengths,
                                   logprobs=pad(r.logprobs, 0.0), top_ids=pad(r.top_ids, -1),
                                   top_logprobs=pad(r.top_logprobs, -np.inf))


class OptionsEngine(ReferenceEngine):
    """Accepts options it does not know (and ignores them)."""

    def __init__(self, model, config):
        super().__init__(model, config.model_copy(update={"options": {}}))


class CacheBeyondModelEngine(ReferenceEngine):
    """Silently clamps a max_cache_length beyond the model's positions."""

    def __init__(self, model, config):
        clamp = min(config.max_cache_length, model.config.max_position_embeddings)
        super().__init__(model, config.model_copy(update={"max_cache_length": clamp}))


class NoMemoryCheckEngine(ReferenceEngine):
    """Allocates without checking that it fits."""

    def check_memory(self, needs, **kw):
        return 0


class DtypeEngine(ReferenceEngine):
    """Builds with an undeclared float16 by computing in float64 anyway."""

    def __init__(self, model, config):
        if config.dtype == "float16":
            config = config.model_copy(update={"dtype": None})
        super().__init__(model, config)


class DriftingEngine(ReferenceEngine):
    """An LM head off by ~1e-3 relative (a bad weight conversion): logits drift past tolerance."""

    def load_params(self):
        fresh = self._params is None
        params = super().load_params()
        if fresh:
            rng = np.random.default_rng(0)
            head = params.lm_head
            params.lm_head = head + 1e-3 * float(np.std(head)) * rng.standard_normal(head.shape).astype(head.dtype)
        return params


class FullAttentionEngine(ReferenceEngine):
    """Ignores sliding windows: every layer attends to the whole context (a cache that
    keeps everything but forgets to mask)."""

    def load_params(self):
        params = super().load_params()
        params.config = params.config.model_copy(update={"sliding_window": None, "layer_types": None})
        return params


class BlockBitsEngine(ReferenceEngine):
    """Computes on Q5_K blocks but reads each sub-block's fifth bits from the mirrored bit
    of ``qh`` (bit 7 - s for sub-block s, a layout slip): only a model with Q5_K weights
    shows it, and only where those bits differ."""

    def load_params(self):
        fresh = self._params is None
        params = super().load_params()
        if fresh:
            mirrored = np.array([int(f"{b:08b}"[::-1], 2) for b in range(256)], np.uint8)
            for name, record in self.model.records.items():
                if record.format == "Q5_K":
                    raw = record.rows().reshape(-1, 176).copy()
                    raw[:, 16:48] = mirrored[raw[:, 16:48]]
                    w = dequantize_blocks("Q5_K", raw, params.dtype).reshape(record.shape)
                    params.w[name] = w
                    if name == self.model.config.head_weight:
                        params.lm_head = w
        return params


class UndeclaredArchitectureEngine(ReferenceEngine):
    """Declares only the Llama family but builds an engine for any model."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self.capabilities = self.capabilities.model_copy(update={"architectures": ("llama", "qwen2")})


# -- sampling --------------------------------------------------------------------------------


class IgnoresTopPEngine(ReferenceEngine):
    """Declares top_p but samples from the whole distribution."""

    def check_prefill(self, tokens, sampling, existing_prefix=None):
        toks, sampling, start = super().check_prefill(tokens, sampling, existing_prefix)
        return toks, sampling.model_copy(update={"top_p": 1.0}), start


_GLOBAL_STREAM = np.random.default_rng()


class GlobalStreamEngine(ReferenceEngine):
    """Seeds every request from one process-wide random stream, not from its own seed."""

    def check_prefill(self, tokens, sampling, existing_prefix=None):
        toks, sampling, start = super().check_prefill(tokens, sampling, existing_prefix)
        return toks, sampling.model_copy(update={"seed": int(_GLOBAL_STREAM.integers(1 << 63))}), start


class SlotStreamEngine(ReferenceEngine):
    """Keys each slot's stream by seed + slot (a per-slot generator)."""

    def _install(self, prefix, state, slots, *, draw):
        out = super()._install(prefix, state, slots, draw=draw)
        for slot in slots:
            row = state.rows[slot]
            row.params = row.params.model_copy(update={"seed": (row.params.seed + slot) % (1 << 64)})
        return out


class SilentParamEngine(ReferenceEngine):
    """Does not declare repetition_penalty, yet accepts it and silently drops it."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self.capabilities = self.capabilities.model_copy(update={"sampling_params": ENGINE_FIELDS - {"repetition_penalty"}})

    def check_prefill(self, tokens, sampling, existing_prefix=None):
        return super().check_prefill(tokens, sampling.model_copy(update={"repetition_penalty": 1.0}), existing_prefix)


class ProcessedLogprobsEngine(ReferenceEngine):
    """Reports log-probs of the temperature-scaled distribution, log_softmax(logits / T), not the raw model's."""

    def _sample(self, logits, rows):  # every path: prefill, bulk_insert, generate, import_prefix
        out = sample(np.stack(logits), rows, self.eos_token_ids)
        for b, row in enumerate(rows):
            lp = raw_logprobs(np.asarray(logits[b], np.float64) / (row.params.temperature or 1.0))
            out.logprobs[b] = lp[out.tokens[b]]
            k = row.params.top_logprobs
            if k:
                ids = np.argsort(-lp, kind="stable")[:k]
                out.top_ids[b, :k], out.top_logprobs[b, :k] = ids, lp[ids]
        return out


class TopLogprobsOrderEngine(ReferenceEngine):
    """Reports the top log-probs in ascending order."""

    def _sample(self, logits, rows):
        out = super()._sample(logits, rows)
        for b, row in enumerate(rows):
            k = row.params.top_logprobs
            out.top_ids[b, :k] = out.top_ids[b, :k][::-1].copy()
            out.top_logprobs[b, :k] = out.top_logprobs[b, :k][::-1].copy()
        return out


class TopLogprobsCapEngine(ReferenceEngine):
    """Declares max_top_logprobs=4 but serves more without refusing."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self.capabilities = self.capabilities.model_copy(update={"max_top_logprobs": 4})

    def check_prefill(self, tokens, sampling, existing_prefix=None):
        caps, self.capabilities = self.capabilities, self.capabilities.model_copy(update={"max_top_logprobs": 20})
        try:
            return super().check_prefill(tokens, sampling, existing_prefix)
        finally:
            self.capabilities = caps


# -- allowed-token masks ---------------------------------------------------------------------


class MaskOneStepLateEngine(ReferenceEngine):
    """Applies generate's token masks one step late (each call's masks reach the sampler
    with the next call, as a mask buffer copied after its step was queued would): a step
    samples under the masks of the call before it. Refusals and prefill's mask are on time."""

    _late = None

    def check_token_masks(self, token_masks, last_result, **kw):
        now = super().check_token_masks(token_masks, last_result, **kw)
        late, self._late = self._late, now
        return late


class MaskLenientLengthEngine(ReferenceEngine):
    """Fits a token mask of the wrong length to ceil(V / 32) words (truncated, or padded
    with zero words) instead of refusing it, as a converter into a fixed buffer would."""

    def check_token_mask(self, token_mask, sampling, **kw):
        a = None if token_mask is None else np.asarray(token_mask)
        w = mask_words(self.vocab_size)
        if a is not None and a.ndim == 1 and a.dtype in (np.int32, np.uint32) and a.shape[0] != w:
            fitted = np.zeros(w, a.dtype)
            fitted[: min(w, a.shape[0])] = a[:w]
            token_mask = fitted
        return super().check_token_mask(token_mask, sampling, **kw)


# -- found by the differential layer: each breaks a rule only where no example test looks ------


class LiveBatchLogprobsEngine(ReferenceEngine):
    """Gathers each slot's log-probs from the step's packed rows by its index among the live
    slots, off by one: a request alone reads its own row, in a live batch each slot reads
    its neighbour's log-probs and top log-probs."""

    def generate(self, params, decode_state, *, overrides=None):
        state, r = super().generate(params, decode_state, overrides=overrides)
        live = [i for i in range(r.tokens.shape[0]) if r.valid[i].any()]
        if len(live) < 2:
            return state, r
        src = live[1:] + live[:1]
        lp, ids, top = r.logprobs.copy(), r.top_ids.copy(), r.top_logprobs.copy()
        lp[live], ids[live], top[live] = r.logprobs[src], r.top_ids[src], r.top_logprobs[src]
        return state, ResultTokens(tokens=r.tokens, valid=r.valid, lengths=r.lengths, logprobs=lp, top_ids=ids,
                                   top_logprobs=top)


class GqaExportEngine(ReferenceEngine):
    """Exports K/V from its grouped-attention layout with the KV heads in reverse order (a
    transposed (groups, kv_heads) view): right for multi-head attention, where every KV
    head is its own group, wrong under grouped-query attention."""

    def export_prefix(self, prefix):
        out = super().export_prefix(prefix)
        c = self.model.config
        if c.num_key_value_heads < c.num_attention_heads:
            out.k, out.v = out.k[:, ::-1].copy(), out.v[:, ::-1].copy()
        return out


class BucketPadPrefixEngine(ReferenceEngine):
    """With prefill buckets, continues an existing prefix after its padded length: the new
    tokens take positions from the prefix's bucket on and attend its pad positions (zero
    K/V). Without buckets nothing is padded, and it is right."""

    _pad = 0

    def prefill(self, *, params, tokens, sampling, existing_prefix=None):
        if existing_prefix is not None and self.config.prefill_buckets is not None:
            self._pad = self.config.bucket_for(existing_prefix.true_length) - existing_prefix.true_length
        try:
            return super().prefill(params=params, tokens=tokens, sampling=sampling, existing_prefix=existing_prefix)
        finally:
            self._pad = 0

    def _forward(self, params, tokens, starts, k_caches, v_caches):
        if not self._pad:
            return super()._forward(params, tokens, starts, k_caches, v_caches)
        start, n, pad = int(starts[0]), tokens.shape[1], self._pad
        k, v = k_caches[0], v_caches[0]
        shape = k.shape[:2] + (start + pad + n,) + k.shape[3:]
        kk, vv = np.zeros(shape, k.dtype), np.zeros(shape, v.dtype)
        kk[:, :, :start], vv[:, :, :start] = k[:, :, :start], v[:, :, :start]
        logits = super()._forward(params, tokens, np.array([start + pad]), [kk], [vv])
        k[:, :, start:start + n], v[:, :, start:start + n] = kk[:, :, start + pad:], vv[:, :, start + pad:]
        return logits


class BatchFilterEngine(ReferenceEngine):
    """Filters a generate step's rows with one batch-wide top_k/top_p/min_p, the first live
    slot's: each slot's own parameters only when its neighbours' are the same."""

    def _sample(self, logits, rows):
        if len(rows) > 1:
            lead = rows[0].params
            same = {"top_k": lead.top_k, "top_p": lead.top_p, "min_p": lead.min_p}
            rows = [RowState(r.params.model_copy(update=same), r.sample_index, r.step, r.prompt_tokens,
                             r.completion_tokens, r.token_mask) for r in rows]
        return super()._sample(logits, rows)


class OverridesAppliedWhileCheckedEngine(ReferenceEngine):
    """Checks and applies generate's overrides one at a time: when a later entry is refused,
    the earlier ones are already applied (their slots rolled back and forced), though the
    call raised."""

    def generate(self, params, decode_state, *, overrides=None):
        state = decode_state
        for slot, value in dict(overrides or {}).items():
            for s, (token, position) in self.check_overrides({slot: value}, state.slots.last_result).items():
                self._force(state, s, token, position)
        return super().generate(params, state)


class SharedScratchPrefixEngine(ReferenceEngine):
    """Keeps a prefix's K/V in one engine-wide prefill scratch buffer instead of copying it
    out: the next prefill overwrites the K/V of a prefix that was not inserted yet."""

    _scratch = None

    def prefill(self, **kw):
        prefix, first = super().prefill(**kw)
        if self._scratch is None:
            shape = self._cache_shape(self.max_prefill_length)
            self._scratch = (np.zeros(shape, self.np_dtype), np.zeros(shape, self.np_dtype))
        n = prefix.true_length
        k, v = self._scratch
        k[:, :, :n], v[:, :, :n] = prefix.kv
        prefix.kv = (k[:, :, :n], v[:, :, :n])
        return prefix, first


class LaneBufferEngine(ReferenceEngine):
    """Declares prefill_lane, and its lane leaves a prefix's logits in an engine-wide buffer
    that every generate step then writes into (a scratch the lane shares with the steps):
    a prefix made on the lane reads what the steps left there by the time it is used."""

    _buffer = None

    def __init__(self, model, config):
        super().__init__(model, config)
        self.capabilities = self.capabilities.model_copy(update={"prefill_lane": True})

    def start_prefill(self, *, params, **kw):
        from concurrent.futures import Future

        prefix, first = self.prefill(params=params, **kw)
        self._buffer = np.array(prefix.logits)
        prefix.logits = self._buffer
        future = Future()
        future.set_result((prefix, first))
        return future

    def generate(self, params, decode_state, **kw):
        out = super().generate(params, decode_state, **kw)
        if self._buffer is not None:
            self._buffer[...] = np.roll(self._buffer, 1)
        return out


class _MixedEngine(ReferenceEngine):
    """The reference declaring mixed_step: generate_with_prefill is the entries'
    prefill_batch and then :meth:`_step` (each broken mixed path below changes that)."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self.capabilities = self.capabilities.model_copy(update={"mixed_step": 16})

    def generate_with_prefill(self, params, decode_state, *, requests, overrides=None, token_masks=None):
        from concurrent.futures import Future

        out = Future()
        out.set_result(self.prefill_batch(params=params, requests=requests))
        return (*self._step(params, decode_state, overrides, token_masks), out)


class MixedOverridesEngine(_MixedEngine):
    """Declares mixed_step, and its generate_with_prefill runs the entries and then the step
    but drops the step's overrides on the way (a mixed path that forgot them): the slot
    forced a token in that call continues from the token it had."""

    def _step(self, params, decode_state, overrides, token_masks):
        return self.generate(params, decode_state, token_masks=token_masks)


class MixedRowsOffEngine(_MixedEngine):
    """Declares mixed_step, and its generate_with_prefill reports each slot's token from
    the next row (a fused pass that put the entries' row first and read the slots' rows
    from row 1): the slots' own streams go on right, their reported tokens do not."""

    def _step(self, params, decode_state, overrides, token_masks):
        state, r = self.generate(params, decode_state, overrides=overrides, token_masks=token_masks)
        off = lambda a: None if a is None else np.roll(np.asarray(a), -1, axis=0)  # noqa: E731
        return state, ResultTokens(tokens=off(r.tokens), valid=r.valid, lengths=r.lengths, logprobs=off(r.logprobs),
                                   top_ids=off(r.top_ids), top_logprobs=off(r.top_logprobs))


class ZeroedPrefixEngine(ReferenceEngine):
    """Donates a prefix's K/V buffer at insert (as jax.jit(donate_argnames=...) would) and
    forgets that the caller still holds the prefix: after its first insert the prefix
    reads zeros, so inserting it again (or continuing or exporting it) goes wrong."""

    @staticmethod
    def _donate(prefix):
        for a in prefix.kv:
            a[...] = 0.0

    def insert(self, prefix, decode_state, slot):
        state = super().insert(prefix, decode_state, slot)
        self._donate(prefix)
        return state

    def bulk_insert(self, prefix, decode_state, slots):
        out = super().bulk_insert(prefix, decode_state, slots)
        self._donate(prefix)
        return out


class SharedResultBufferEngine(AsyncEngine):
    """Packs every step's results into one reused host buffer, which a result reads once the
    queued steps are done: a result read after the next step was dispatched (as the
    driver reads step n) shows step n+1's tokens."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self._layout = ResultLayout(k=1, top_n=self.capabilities.max_top_logprobs, logprobs=True)
        self._buffer = np.zeros((config.max_slots, self._layout.width), np.int32)

    def generate(self, params, decode_state, *, overrides=None):
        self._wait()
        state, layout = decode_state, self._layout
        self.check_overrides(overrides, state.slots.last_result)

        def step():
            _, r = ReferenceEngine.generate(self, params, state, overrides=overrides)
            n, top = r.tokens.shape[0], r.top_ids.shape[2]
            ids, lps = np.full((n, 1, layout.top_n), -1, np.int32), np.full((n, 1, layout.top_n), -np.inf, np.float32)
            ids[:, :, :top], lps[:, :, :top] = r.top_ids, r.top_logprobs
            self._buffer[...] = layout.pack(r.tokens, r.valid, r.lengths, r.logprobs, ids, lps)

        self._pending = self._worker.submit(step)

        def read(_):
            self._wait()
            return self._buffer.copy()

        return state, ResultTokens.from_packed(None, layout, to_host=read)


class SeedLowWordOnSecondPathEngine(ReferenceEngine):
    """bulk_insert and import_prefix put the request's seed through a 32-bit table and keep
    only its low word there (insert and prefill keep all 64 bits)."""

    @staticmethod
    def _low(sampling):
        return sampling.model_copy(update={"seed": sampling.seed & 0xFFFFFFFF})

    def bulk_insert(self, prefix, decode_state, slots):
        return super().bulk_insert(dataclasses.replace(prefix, sampling=self._low(prefix.sampling)), decode_state, slots)

    def import_prefix(self, portable):
        full = portable.sampling
        portable.sampling = self._low(full)
        prefix = super().import_prefix(portable)  # its first token drawn from the low word
        prefix.sampling = full
        return prefix


class MaskLiveRowsEngine(ReferenceEngine):
    """Gathers a step's token masks by each occupied slot's index among the occupied slots
    (a compact batch reading the dense per-slot mask rows as if they were compact): right
    while the occupied slots are 0..n-1, wrong once a slot below an occupied one is empty."""

    def check_token_masks(self, token_masks, last_result, **kw):
        masks = super().check_token_masks(token_masks, last_result, **kw)
        if masks is None:
            return None
        n = self.max_concurrent_decodes
        words, masked = full_mask(self.vocab_size, n), np.zeros(n, bool)
        for row, slot in enumerate(s for s in range(n) if last_result(s) is not None):
            words[slot], masked[slot] = masks.words[row], masks.masked[row]
        return SlotMasks(words, masked)


class MaskContinuationEngine(ReferenceEngine):
    """prefill continuing a prefix (existing_prefix) checks its token_mask but does not
    carry it to the continuation's last piece: that first token, and the bulk_insert
    samples of the new prefix, are drawn unmasked. A plain prefill applies its mask."""

    def prefill(self, *, params, tokens, sampling, existing_prefix=None, token_mask=None):
        if existing_prefix is not None and token_mask is not None:
            _, checked, _ = self.check_prefill(tokens, sampling, existing_prefix)
            self.check_token_mask(token_mask, checked)
            token_mask = None
        return super().prefill(params=params, tokens=tokens, sampling=sampling, existing_prefix=existing_prefix,
                               token_mask=token_mask)


def _faulty(fault_name: str) -> type:
    """The reference engine whose sampler has one of the suite's FAULTS."""
    fault = FAULTS[fault_name]

    class FaultyEngine(ReferenceEngine):
        def _sample(self, logits, rows):
            rows = [RowState(fault.request(r.params), r.sample_index, r.step, r.prompt_tokens, r.completion_tokens,
                             r.token_mask) for r in rows]
            return sample(np.stack(logits), rows, self.eos_token_ids, pipeline=fault.pipeline(), draw=fault.drawer())

    FaultyEngine.__doc__ = fault.message
    FaultyEngine.__name__ = FaultyEngine.__qualname__ = f"Faulty_{fault_name}"
    return FaultyEngine


BROKEN: dict[str, type] = {
    "broken_signature": SignatureEngine,
    "broken_limits": LimitsEngine,
    "broken_eos_attribute": EosAttributeEngine,
    "broken_caps": CapabilitiesEngine,
    "broken_empty_rows": EmptyRowsEngine,
    "broken_leaky": LeakyEngine,
    "broken_free": ForgetsFreeEngine,
    "broken_overwrite": OverwriteEngine,
    "broken_negative_slot": NegativeSlotEngine,
    "broken_prompt_limit": PromptLimitEngine,
    "broken_overrides": IgnoresOverridesEngine,
    "broken_override_penalty": OverridePenaltyEngine,
    "broken_override_unchecked": UncheckedOverridesEngine,
    "broken_bulk": SharedFirstTokenEngine,
    "broken_bulk_order": BulkOrderEngine,
    "broken_bulk_partial": BulkPartialEngine,
    "broken_padded_logits": PaddedLogitsEngine,
    "broken_prefix_positions": PrefixPositionsEngine,
    "broken_batch_positions": BatchPositionsEngine,
    "broken_lane_buffer": LaneBufferEngine,
    "broken_mixed_overrides": MixedOverridesEngine,
    "broken_mixed_rows_off": MixedRowsOffEngine,
    "broken_prerope_export": PreRopeExportEngine,
    "broken_unchecked_import": UncheckedImportEngine,
    "broken_trusting_import": TrustingImportEngine,
    "broken_foreign_prefix": ForeignPrefixEngine,
    "broken_tail_head_unchecked": TailHeadUncheckedEngine,
    "broken_tail_ignores_head": TailIgnoresHeadEngine,
    "broken_continuation_edge": ContinuationEdgeEngine,
    "broken_continuation_sampling": ContinuationSamplingEngine,
    "broken_continuation_consumes": ContinuationConsumesEngine,
    "broken_cache_overrun": CacheOverrunEngine,
    "broken_lengths": LengthsEngine,
    "broken_valid_gaps": ValidGapsEngine,
    "broken_options": OptionsEngine,
    "broken_cache_beyond_model": CacheBeyondModelEngine,
    "broken_no_memory_check": NoMemoryCheckEngine,
    "broken_dtype": DtypeEngine,
    "broken_drift": DriftingEngine,
    "broken_window": FullAttentionEngine,
    "broken_block_bits": BlockBitsEngine,
    "broken_architecture": UndeclaredArchitectureEngine,
    "broken_top_p": IgnoresTopPEngine,
    "broken_global_stream": GlobalStreamEngine,
    "broken_slot_stream": SlotStreamEngine,
    "broken_silent_param": SilentParamEngine,
    "broken_processed_logprobs": ProcessedLogprobsEngine,
    "broken_top_logprobs_order": TopLogprobsOrderEngine,
    "broken_top_logprobs_cap": TopLogprobsCapEngine,
    "broken_mask_one_step_late": MaskOneStepLateEngine,
    "broken_mask_lenient_length": MaskLenientLengthEngine,
    **{f"broken_{name}": _faulty(name) for name in FAULTS},
    # caught by the differential layer
    "broken_live_batch_logprobs": LiveBatchLogprobsEngine,
    "broken_gqa_export": GqaExportEngine,
    "broken_bucket_pad_prefix": BucketPadPrefixEngine,
    "broken_batch_filter": BatchFilterEngine,
    "broken_override_half_applied": OverridesAppliedWhileCheckedEngine,
    "broken_prefix_scratch": SharedScratchPrefixEngine,
    "broken_prefix_zeroed": ZeroedPrefixEngine,
    "broken_result_buffer": SharedResultBufferEngine,
    "broken_seed_second_path": SeedLowWordOnSecondPathEngine,
    "broken_mask_live_rows": MaskLiveRowsEngine,
    "broken_mask_continuation": MaskContinuationEngine,
    "broken_page_refusal_advances": PageRefusalAdvancesEngine,
    # caught by the lifetime layer (tests/broken_lifetimes.py)
    **LIFETIME_BROKEN,
    # caught by the differential layer's chains of composed capabilities (tests/broken_compositions.py)
    **COMPOSED_BROKEN,
    # caught at a model's configuration edges (tests/broken_edges.py)
    **EDGE_BROKEN,
}

# backend -> (-k selection that runs only the test meant to catch it, the test that must
# fail, a phrase its message must hold). One row per rule of docs/conformance.md.
_HONESTY = "test_sampling_parameter and "
CAUGHT_BY: dict[str, tuple[str, str, str]] = {
    "broken_signature": ("test_method_signatures", "test_method_signatures", "needs keyword parameter 'existing_prefix'"),
    "broken_limits": ("test_engine_attributes", "test_engine_attributes", "engine.max_cache_length is"),
    "broken_eos_attribute": ("test_engine_attributes", "test_engine_attributes", "differ from the model's"),
    "broken_caps": ("test_capabilities_well_formed", "test_capabilities_well_formed", "exceeds what a request can ask"),
    "broken_empty_rows": ("test_result_shapes", "test_result_shapes", "empty decode state reported valid tokens"),
    "broken_leaky": ("test_slot_isolation", "test_slot_isolation", "state leaks between slots"),
    "broken_free": ("test_free_resource_then_reuse", "test_free_resource_then_reuse", "the slot was not emptied"),
    "broken_overwrite": ("test_insert_into_occupied_slot", "test_insert_into_occupied_slot", "SlotError"),
    "broken_negative_slot": ("test_bad_slot_indices", "test_bad_slot_indices", "SlotError"),
    "broken_prompt_limit": ("test_prompt_length_limits", "test_prompt_length_limits", "prefill accepted 25 tokens"),
    "broken_overrides": ("test_overrides_force_next_input", "test_overrides_force_next_input", "overrides are ignored"),
    "broken_override_penalty": ("test_override_counts_for_penalties", "test_override_counts_for_penalties",
                                "must count the forced token"),
    "broken_override_unchecked": ("test_override_refusals", "test_override_refusals", "expected InvalidRequest"),
    "broken_bulk": ("test_bulk_insert_independent", "test_bulk_insert_independent_first_tokens",
                    "each slot must draw its own first token"),
    "broken_bulk_order": ("test_bulk_insert_independent", "test_bulk_insert_independent_first_tokens",
                          "in sorted slot order"),
    "broken_bulk_partial": ("test_bulk_insert_refusals", "test_bulk_insert_refusals", "must change nothing"),
    "broken_padded_logits": ("test_prefill_bucket_invariance", "test_prefill_bucket_invariance", "bucket_rel_l2"),
    "broken_prefix_positions": ("test_prefix_reuse", "test_prefix_reuse", "positions of the continuation"),
    "broken_batch_positions": ("test_prefill_batch", "test_prefill_batch", "each row at its own positions"),
    "broken_lane_buffer": ("test_prefill_lane", "test_prefill_lane", "logits vs the reference's prefill"),
    "broken_mixed_overrides": ("test_generate_with_prefill", "test_generate_with_prefill",
                               "decoding through a mixed step"),
    "broken_mixed_rows_off": ("test_generate_with_prefill", "test_generate_with_prefill",
                              "decoding through a mixed step"),
    "broken_continuation_edge": ("test_prefix_reuse_at_bucket_edges", "test_prefix_reuse_at_bucket_edges",
                                 "a prefix of 8 tokens continued"),
    "broken_continuation_sampling": ("test_prefix_reuse_leaves_the_prefix", "test_prefix_reuse_leaves_the_prefix",
                                     "sampling of the prefix it continues"),
    "broken_continuation_consumes": ("test_prefix_reuse_leaves_the_prefix", "test_prefix_reuse_leaves_the_prefix",
                                     "continuation of one prefix vs the reference"),
    "broken_prerope_export": ("test_portable_prefix_roundtrip", "test_portable_prefix_roundtrip", "kv_rel_l2"),
    "broken_unchecked_import": ("test_portable_prefix_roundtrip", "test_portable_prefix_roundtrip",
                                "model_fingerprint"),
    "broken_trusting_import": ("test_untrusted_portable_prefix_refused", "test_untrusted_portable_prefix_refused",
                               "accepted a portable prefix with NaN in K"),
    "broken_foreign_prefix": ("test_foreign_prefix_refused", "test_foreign_prefix_refused", "expected InvalidRequest"),
    "broken_tail_head_unchecked": ("test_portable_prefix_tail_refused", "test_portable_prefix_tail_refused",
                                   "accepted a head whose prompt id"),
    "broken_tail_ignores_head": ("test_portable_prefix_tail and not refused and not shares",
                                 "test_portable_prefix_tail", "K/V differ from the whole prefix imported"),
    "broken_cache_overrun": ("test_cache_limit", "test_cache_limit", "it must yield exactly"),
    "broken_lengths": ("test_result_lengths", "test_result_lengths", "lengths["),
    "broken_valid_gaps": ("test_result_lengths", "test_result_lengths", "valid tokens are not first"),
    "broken_options": ("test_config_refusals", "test_config_refusals", "an unknown option"),
    "broken_cache_beyond_model": ("test_config_refusals", "test_config_refusals", "max_cache_length 257"),
    "broken_no_memory_check": ("test_config_refusals", "test_config_refusals", "1 MiB of memory"),
    "broken_dtype": ("test_dtype and float16", "test_dtype[float16]", "does not declare"),
    "broken_drift": ("test_prefill_logits_match_reference and mha_tied", "test_prefill_logits_match_reference[mha_tied-float64]",
                     "logits_rel_l2"),
    "broken_window": ("test_prefill_logits_match_reference and mistral-float64",
                      "test_prefill_logits_match_reference[mistral-float64]", "logits_rel_l2"),
    "broken_block_bits": ("test_prefill_logits_match_reference and quant_mixed-float64",
                          "test_prefill_logits_match_reference[quant_mixed-float64]", "logits_rel_l2"),
    "broken_architecture": ("test_architecture and gemma2", "test_architecture[gemma2]", "does not declare"),
    "broken_top_p": ("test_sampling_support and top_p", "test_sampling_support[top_p]", "does not apply top_p"),
    "broken_global_stream": ("test_same_seed_same_tokens or test_seeded_stream", "test_same_seed_same_tokens",
                             "does not derive its random stream from the request's seed"),
    "broken_slot_stream": ("test_samples_independent", "test_samples_independent_of_slot_and_neighbours",
                           "depend on its slot or its neighbours"),
    "broken_silent_param": (_HONESTY + "repetition_penalty", "test_sampling_parameter[repetition_penalty]",
                            "never be silently ignored"),
    "broken_processed_logprobs": (_HONESTY + "logprobs", "test_sampling_parameter[logprobs]",
                                  "reported log-probs are not the raw model's"),
    "broken_top_logprobs_order": (_HONESTY + "top_logprobs", "test_sampling_parameter[top_logprobs]",
                                  "not in descending order"),
    "broken_top_logprobs_cap": ("test_top_logprobs_limit", "test_top_logprobs_limit", "UnsupportedFeature"),
    "broken_mask_one_step_late": ("test_token_masks and greedy", "test_token_masks[greedy]",
                                  "allowed-token mask leaves out"),
    "broken_mask_lenient_length": ("test_token_mask_refusals", "test_token_mask_refusals", "with wrong length was accepted"),
    # the sampler faults of polyengine.conformance.faults
    "broken_bias_after_temperature": (_HONESTY + "logit_bias", "test_sampling_parameter[logit_bias]",
                                      "logit_bias is applied after the temperature division"),
    "broken_penalties_after_temperature": (_HONESTY + "presence_penalty", "test_sampling_parameter[presence_penalty]",
                                           "penalties are applied after the temperature division"),
    "broken_min_tokens_off_by_one": (_HONESTY + "min_tokens", "test_sampling_parameter[min_tokens]",
                                     "EOS was let through early"),
    "broken_bias_skips_token_zero": (_HONESTY + "logit_bias", "test_sampling_parameter[logit_bias]",
                                     "the logit_bias of token id 0 is ignored"),
    "broken_eos_masks_first_eos_only": (_HONESTY + "min_tokens", "test_sampling_parameter[min_tokens]",
                                        "only the first of the model's EOS ids is masked"),
    "broken_min_tokens_ignores_stop_ids": (_HONESTY + "min_tokens", "test_sampling_parameter[min_tokens]",
                                           "but not the request's stop_token_ids"),
    "broken_ignore_eos_masks_stop_ids": (_HONESTY + "ignore_eos", "test_sampling_parameter[ignore_eos]",
                                         "ignore_eos also masks the request's stop_token_ids"),
    "broken_repetition_divides_negative": (_HONESTY + "repetition_penalty", "test_sampling_parameter[repetition_penalty]",
                                           "divides every seen token's logit"),
    "broken_repetition_completion_only": (_HONESTY + "repetition_penalty", "test_sampling_parameter[repetition_penalty]",
                                          "counts only the completion's tokens"),
    "broken_presence_counts_prompt": (_HONESTY + "presence_penalty", "test_sampling_parameter[presence_penalty]",
                                      "count the prompt's tokens too"),
    "broken_frequency_counts_once": (_HONESTY + "frequency_penalty", "test_sampling_parameter[frequency_penalty]",
                                     "applied once per token"),
    "broken_greedy_ignores_processing": (_HONESTY + "logit_bias", "test_sampling_parameter[logit_bias]",
                                         "argmax of the raw logits"),
    "broken_greedy_ties_to_highest_id": ("test_exact_ties", "test_exact_ties_go_to_lowest_id",
                                         "resolved to the highest token id"),
    "broken_filter_ties_to_highest_id": ("test_exact_ties", "test_exact_ties_go_to_lowest_id",
                                         "top_k/top_p resolve exact ties"),
    "broken_top_k_keeps_one_more": ("test_sampling_support and top_k", "test_sampling_support[top_k]",
                                    "lies outside the allowed set"),
    "broken_top_p_excludes_crossing_token": ("test_sampling_distribution and top_p", "test_sampling_distribution[top_p]",
                                             "do not follow the specified distribution"),
    "broken_top_p_before_top_k": ("test_sampling_distribution and combined", "test_sampling_distribution[combined]",
                                  "do not follow the specified distribution"),
    "broken_min_p_before_temperature": ("test_sampling_distribution and min_p", "test_sampling_distribution[min_p]",
                                        "do not follow the specified distribution"),
    "broken_temperature_ignored": (_HONESTY + "temperature", "test_sampling_parameter[temperature]",
                                   "the temperature is ignored"),
    "broken_seed_low_word_only": ("test_seeded_stream", "test_seeded_stream_matches_reference",
                                  "only the low 32 bits of the seed"),
    # the differential layer's (each found by random programs; the phrase is from its failure message)
    "broken_live_batch_logprobs": ("test_differential and mha_tied and not bucket", "test_differential[mha_tied]",
                                   "log-probs of completion token"),
    "broken_gqa_export": ("test_differential and gqa_llama3", "test_differential[gqa_llama3]", "exported K/V"),
    "broken_bucket_pad_prefix": ("test_differential and mha_tied-buckets", "test_differential[mha_tied-buckets]",
                                 "(continuing P"),
    "broken_batch_filter": ("test_differential and mha_tied and not bucket", "test_differential[mha_tied]",
                            "the reference draws"),
    "broken_override_half_applied": ("test_differential and mha_tied and not bucket", "test_differential[mha_tied]",
                                     "a refused call must change nothing"),
    "broken_prefix_scratch": ("test_differential and mha_tied and not bucket", "test_differential[mha_tied]",
                              "prefill call(s) ran after"),
    "broken_prefix_zeroed": ("test_differential and mha_tied and not bucket", "test_differential[mha_tied]",
                             "had been inserted"),
    "broken_result_buffer": ("test_differential and mha_tied and not bucket", "test_differential[mha_tied]",
                             "read after the next generate was dispatched"),
    "broken_seed_second_path": ("test_differential and mha_tied and not bucket", "test_differential[mha_tied]",
                                "the reference draws"),
    "broken_mask_live_rows": ("test_differential and mha_tied and not bucket", "test_differential[mha_tied]",
                              "allowed-token mask leaves out"),
    "broken_mask_continuation": ("test_differential and mha_tied and not bucket", "test_differential[mha_tied]",
                                 "allowed-token mask leaves out"),
    "broken_page_refusal_advances": ("test_programs_under_page_pressure", "test_programs_under_page_pressure",
                                     "a refused call must change nothing"),
    **LIFETIME_CAUGHT_BY,
    **COMPOSED_CAUGHT_BY,
    **EDGE_CAUGHT_BY,
}
assert set(CAUGHT_BY) == set(BROKEN), sorted(set(CAUGHT_BY) ^ set(BROKEN))

# Other tests that must catch the same faults (same shape as CAUGHT_BY, several per backend).
ALSO_CAUGHT_BY = {
    "broken_mixed_rows_off": [  # the differential programs' mixed steps (generate_with_prefill)
        ("test_differential and mha_tied and not bucket", "test_differential[mha_tied]", "generate_with_prefill"),
    ],
    "broken_processed_logprobs": [
        ("test_decode_logprobs_match_reference and mha_tied", "test_decode_logprobs_match_reference[mha_tied-float64]",
         "they equal log-softmax(logits / temperature)"),
    ],
    "broken_penalties_after_temperature": [
        (_HONESTY + "frequency_penalty", "test_sampling_parameter[frequency_penalty]",
         "penalties are applied after the temperature division"),
    ],
    "broken_min_tokens_off_by_one": [
        ("test_driver_stop_conditions", "test_driver_stop_conditions", "min_tokens=1"),
    ],
    "broken_eos_masks_first_eos_only": [
        (_HONESTY + "ignore_eos", "test_sampling_parameter[ignore_eos]", "only the first of the model's EOS ids"),
    ],
    "broken_eos_attribute": [
        ("test_driver_stop_conditions", "test_driver_stop_conditions", "the driver stops on every id"),
    ],
    "broken_bias_after_temperature": [
        ("test_sampling_distribution and logit_bias", "test_sampling_distribution[logit_bias]",
         "do not follow the specified distribution"),
    ],
    **LIFETIME_ALSO_CAUGHT_BY,
}

# Every test that catches a broken backend. Each passes on the reference, so its failure on
# a broken backend is the fault's: checked on the reference's whole-suite run
# (tests/test_conformance_cli.py), not by a second run of the same selections.
CATCHING_TESTS = frozenset({test for _, test, _ in CAUGHT_BY.values()}
                           | {test for entries in ALSO_CAUGHT_BY.values() for _, test, _ in entries})


def _takes(method, keyword: str) -> bool:
    params = inspect.signature(method).parameters.values()
    return any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in params)


def _factory(name: str, cls: type):
    named = type(cls.__name__, (cls,), {"name": name, "__doc__": cls.__doc__})

    def create_engine(*, model, config):
        engine = named(model, config)
        if not (_takes(engine.generate, "token_masks") and _takes(engine.prefill, "token_mask")):
            # a variant written before masks (either keyword missing): it does not declare
            # them (the suite then checks that path), as a third-party engine of that time would not
            engine.capabilities = engine.capabilities.model_copy(update={"token_masks": False})
        return engine

    return create_engine


class BrokenBackendsPlugin:
    """One in-process plugin registering every broken backend, the restricted one and the
    honest variants (tests/honest_backends.py)."""

    @hookimpl
    def polyengine_backends(self):
        specs = [
            BackendSpec(
                name=name, description=f"deliberately broken: {(cls.__doc__ or name).splitlines()[0]}",
                protocol_version=PROTOCOL_VERSION, probe=lambda: Probe(True), factory=_factory(name, cls),
            )
            for name, cls in {**BROKEN, **HONEST, "restricted": RestrictedEngine}.items()
        ]
        return specs


PLUGIN = BrokenBackendsPlugin()

__all__ = ["BROKEN", "CAUGHT_BY", "ALSO_CAUGHT_BY", "PLUGIN"]
