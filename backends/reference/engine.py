"""The reference engine: the whole protocol over the NumPy forward and the core sampler.

Every other backend is compared with this one, so it takes the plainest route: the
KV cache is one host array per slot, the decode state is mutated in place (and
returned, as the protocol asks), and every check runs before any state changes, so a
refused call leaves nothing half done.

With the option ``page_size`` (> 0) it keeps K/V in pages instead (:mod:`polyengine.pages`,
the page rules of docs/design.md): a slot and a prefix are page lists, inserting or
continuing a prefix shares its pages, and the first write into a shared page copies it.
The forward still runs over contiguous arrays, gathered from the pages before and
scattered back after, so the paged engine's numbers are the contiguous engine's, bit
for bit. Contiguous stays the default while the broken-backend fixtures of the
conformance suite (subclasses of this engine) reach into its per-slot arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np

from polyengine.engine import Capabilities, EngineBase, EngineConfig, PrefillRequest, Prefix, ResultTokens, SlotTable
from polyengine.errors import InvalidRequest
from polyengine.options import Option
from polyengine.pages import PageList, PagePool, pages_for
from polyengine.models import Model
from polyengine.models.blocks import FORMATS
from polyengine.models.config import ARCHITECTURES
from polyengine.prefix import PortablePrefix
from polyengine.sampling import RowState, SamplingParams, sample
from polyengine.sampling.params import ENGINE_FIELDS

from polyengine.backends.reference.model import ReferenceParams, forward, hidden_states

__all__ = ["ReferenceEngine", "ReferenceDecodeState", "create_engine"]

_DTYPES = {"float64": np.float64, "float32": np.float32}


@dataclass
class ReferenceDecodeState:
    num_slots: int
    k: list[np.ndarray]  # per slot (layers, kv_heads, max_cache_length, head_dim); empty when paged
    v: list[np.ndarray]
    slots: SlotTable  # the kit's host record: prompt and completion counts, last result
    rows: list[RowState | None] = field(default_factory=list)  # sampler state: params, prompt, completion so far
    next_token: list[int] = field(default_factory=list)  # what each slot's next generate step feeds
    seqs: list[PageList | None] = field(default_factory=list)  # per slot, when paged: its pages

    def occupied(self) -> list[int]:
        return self.slots.occupied()

    def is_occupied(self, slot: int) -> bool:
        return self.slots.is_occupied(slot)


# The engine's options (also the plugin spec's table: `backends --verbose`, the CLI's
# checks before the weights load).
OPTIONS = {
    "page_size": Option(0, "K/V pages of this many positions (0: one contiguous cache per slot)",
                        minimum=0, maximum=4096),
    "kv_pages": Option(0, "with page_size: the pages the K/V of slots and prefixes share (0: as many as they "
                          "use); the driver admits requests by the pages they need and preempts when they "
                          "run out", minimum=0),
}


class ReferenceEngine(EngineBase):
    name = "reference"
    OPTIONS = OPTIONS

    def __init__(self, model: Model, config: EngineConfig):
        super().__init__(model, config, device="cpu (NumPy)")
        self.np_dtype = np.dtype(_DTYPES[self.dtype])
        mc = model.config
        # .get: a subclass that declares OPTIONS of its own (the suite's test backends) keeps
        # the contiguous cache
        ps, kv_pages = self.capabilities.page_size, self.options.get("kv_pages", 0)
        if kv_pages and (not ps or kv_pages < pages_for(config.max_cache_length, ps) + 1):
            raise InvalidRequest(
                f"kv_pages={kv_pages} needs page_size and at least one context's pages and one more "
                f"({pages_for(config.max_cache_length, ps or 1) + 1} with page_size={ps or 1}); raise it or leave it 0",
                field="options.kv_pages")
        # Refuse before allocating: the engine converts the weights into its dtype (the
        # Model's records stay as stored) and preallocates every slot's cache (or its pool's).
        kv = (f"the K/V pool of {kv_pages} pages x {ps} positions", kv_pages * ps) if kv_pages else (
            f"the KV caches of {config.max_slots} slots x {config.max_cache_length} positions",
            config.max_slots * config.max_cache_length)
        self.check_memory({
            f"a {self.dtype} copy of the weights": mc.num_parameters() * self.np_dtype.itemsize,
            kv[0]: kv[1] * mc.kv_bytes_per_token(self.np_dtype.itemsize),
        })
        self._params: ReferenceParams | None = None
        # Pages are host arrays indexed by page id. Unbounded (kv_pages 0), the slots never
        # hold more than the memory check counted and the driver's prefixes stay within its
        # budget (counted too); bounded, the driver admits requests by the pages they need
        # now and preempts (recompute) when a step would run out.
        self.pages = PagePool(ps, kv_pages or None) if ps else None
        self._k_pages: list[np.ndarray] = []
        self._v_pages: list[np.ndarray] = []

    def capabilities_for(self, model: Model, config: EngineConfig) -> Capabilities:
        return Capabilities(
            dtypes=tuple(_DTYPES),
            sampling_params=ENGINE_FIELDS,
            max_top_logprobs=20,
            bulk_insert=True,
            portable_prefix=True,
            prefix_reuse=True,
            prefix_truncate=True,
            portable_prefix_tail=True,  # paged: the head's pages shared; contiguous: the kit's copy
            architectures=ARCHITECTURES, token_masks=True,
            weight_formats=tuple(FORMATS),  # every block format, dequantized exactly (float64) at load
            embeddings=True,
            # one forward for a batch of prefills; a subclass with a prefill of its own gets the kit's loop over it
            batched_prefill=type(self).prefill is ReferenceEngine.prefill,
            page_size=self.options.get("page_size", 0),
        )

    # -- lifecycle -----------------------------------------------------------------------

    def load_params(self) -> ReferenceParams:
        if self._params is None:
            self._params = ReferenceParams.from_model(self.model, self.np_dtype, context=self.max_cache_length,
                                                      formats=self.capabilities.weight_formats)
        return self._params

    def init_decode_state(self) -> ReferenceDecodeState:
        shape = self._cache_shape(self.max_cache_length)
        n = self.max_concurrent_decodes
        contiguous = 0 if self.pages else n
        return ReferenceDecodeState(
            num_slots=n,
            k=[np.zeros(shape, self.np_dtype) for _ in range(contiguous)],
            v=[np.zeros(shape, self.np_dtype) for _ in range(contiguous)],
            slots=SlotTable(n), rows=[None] * n, next_token=[0] * n, seqs=[None] * n,
        )

    def _cache_shape(self, length: int) -> tuple[int, int, int, int]:
        c = self.model.config
        return (c.num_hidden_layers, c.num_key_value_heads, length, c.head_dim)

    # -- prefill -------------------------------------------------------------------------

    def prefill(
        self,
        *,
        params: ReferenceParams,
        tokens: Sequence[int] | np.ndarray,
        sampling: SamplingParams,
        existing_prefix: Prefix | None = None,
        token_mask: np.ndarray | None = None,
    ) -> tuple[Prefix, ResultTokens]:
        toks, sampling, start = self.check_prefill(tokens, sampling, existing_prefix)
        mask = self.check_token_mask(token_mask, sampling)
        return self._prefill_rows(params, [(toks, sampling, start, mask)], [existing_prefix])[0]

    def prefill_batch(self, *, params: ReferenceParams,
                      requests: Sequence[PrefillRequest]) -> list[tuple[Prefix, ResultTokens]]:
        if type(self).prefill is not ReferenceEngine.prefill:  # a subclass's own prefill is honoured, entry by entry
            return EngineBase.prefill_batch(self, params=params, requests=requests)
        checked = self.check_prefill_batch(requests)
        return self._prefill_rows(params, checked, [r.existing_prefix for r in requests])

    def _prefill_rows(self, params: ReferenceParams, checked: list, existing: list[Prefix | None]):
        """Checked prefills (``(tokens, sampling, start, mask)`` each) as one forward: row
        ``i`` holds entry ``i``'s tokens at positions ``start_i..``, padded at the end to the
        longest entry (to its bucket when configured, the way a static-shape backend
        would: pad tokens sit after the true ones, so causality keeps them out of every
        true position, and their cache entries are dropped below). Each row has its own
        cache, so rows never see each other's keys."""
        width = 0
        for toks, _, start, _ in checked:
            total = start + toks.size
            width = max(width, (total if self.config.prefill_buckets is None else self.config.bucket_for(total)) - start)
        batch = np.zeros((len(checked), width), np.int64)  # (B, T)
        ks, vs = [], []
        for i, ((toks, _, start, _), prior) in enumerate(zip(checked, existing)):
            shape = self._cache_shape(start + width)
            k, v = np.zeros(shape, self.np_dtype), np.zeros(shape, self.np_dtype)
            if prior is not None:
                k[:, :, :start], v[:, :, :start] = self._prefix_arrays(prior)
            batch[i, : toks.size] = toks
            ks.append(k)
            vs.append(v)
        starts = np.array([start for _, _, start, _ in checked])
        logits_all = self._forward(params, batch, starts, ks, vs)  # (B, T, vocab)
        prefixes, rows, last = [], [], []
        for i, ((toks, sampling, start, mask), prior) in enumerate(zip(checked, existing)):
            total = start + toks.size
            logits = logits_all[i, toks.size - 1]
            prompt = toks if prior is None else np.concatenate([prior.prompt_tokens, toks])
            kept = self._keep(ks[i], vs[i], start, total, prior)
            prefixes.append(Prefix(
                kv=kept, logits=logits, prompt_tokens=prompt.astype(np.int32), sampling=sampling, backend=self.name,
                first_token=-1, model_id=self.model_id, token_mask=mask, nbytes=self._held_bytes(kept, total),
            ))
            rows.append(RowState(sampling, 0, 0, prefixes[-1].prompt_tokens, np.zeros(0, np.int32), mask))
            last.append(logits)
        out = self._sample(last, rows)
        results = []
        for i, prefix in enumerate(prefixes):
            prefix.first_token = int(out.tokens[i])
            results.append((prefix, self._result(_row(out, i, prefix.sampling.top_logprobs))))
        return results

    # -- insert (the kit's flow: checks, then _install, then the slot table) ---------------

    def _install(self, prefix: Prefix, state: ReferenceDecodeState, slots: list[int], *, draw: bool):
        out = None
        if draw:
            empty = np.zeros(0, np.int32)
            rows = [RowState(prefix.sampling, i, 0, prefix.prompt_tokens, empty, prefix.token_mask)
                    for i in range(len(slots))]
            out = self._sample([prefix.logits] * len(slots), rows)
        n = prefix.true_length
        for i, slot in enumerate(slots):
            first = int(out.tokens[i]) if draw else prefix.first_token
            if self.pages:  # the slot shares the prefix's pages; its first write copies the last one
                state.seqs[slot] = prefix.kv.fork(finalize=True)
            else:
                state.k[slot][:, :, :n] = prefix.kv[0]
                state.v[slot][:, :, :n] = prefix.kv[1]
            state.rows[slot] = RowState(prefix.sampling, i, 1, prefix.prompt_tokens, np.array([first], np.int32))
            state.next_token[slot] = first
        return self._result(out) if draw else None

    def _release(self, state: ReferenceDecodeState, slot: int) -> None:
        state.rows[slot] = None
        if self.pages and state.seqs[slot] is not None:
            state.seqs[slot].release()
            state.seqs[slot] = None

    # -- generate --------------------------------------------------------------------------

    def generate(
        self, params: ReferenceParams, decode_state: ReferenceDecodeState, *, overrides: Mapping[int, int] | None = None,
        token_masks: Mapping[int, np.ndarray] | None = None,
    ) -> tuple[ReferenceDecodeState, ResultTokens]:
        state = decode_state
        forced = self.check_overrides(overrides, state.slots.last_result)
        masks = self.check_token_masks(token_masks, state.slots.last_result, forced=forced,
                                       sampling_of=state.slots.sampling)
        n = state.num_slots
        live = self._live(state)
        if self.pages:
            # Pages first: a pool that runs out refuses here, before anything observable
            # changed (a copy on write leaves the same K/V; an override, one token a step,
            # replaces the latest token, so the positions written are the same after it).
            for i in live:
                s = state.slots[i].length
                state.seqs[i].prepare_write(s, s + 1, self._copy_page)
        for slot, (tok, position) in forced.items():
            self._force(state, slot, tok, position)
        tokens = np.zeros((n, 1), np.int32)
        valid = np.zeros((n, 1), bool)
        top_n = max([state.rows[i].params.top_logprobs for i in live], default=0)
        logprobs = np.zeros((n, 1), np.float32)
        top_ids = np.full((n, 1, top_n), -1, np.int32)
        top_lp = np.full((n, 1, top_n), -np.inf, np.float32)
        if live:
            batch = np.array([[state.next_token[i]] for i in live], np.int64)
            starts = np.array([state.slots[i].length for i in live])
            if self.pages:
                ks, vs = zip(*(self._gather(state.seqs[i], int(s) + 1) for i, s in zip(live, starts)))
            else:
                ks, vs = [state.k[i] for i in live], [state.v[i] for i in live]
            logits = self._forward(params, batch, starts, list(ks), list(vs))[:, 0]
            if self.pages:
                for i, s, k, v in zip(live, starts, ks, vs):
                    self._scatter(state.seqs[i], k, v, int(s), int(s) + 1)
            rows = []
            for i in live:
                row = state.rows[i]
                row.step = len(row.completion_tokens)
                row.token_mask = masks.words[i] if masks is not None and masks.masked[i] else None
                rows.append(row)
            out = self._sample(list(logits), rows)
            for j, i in enumerate(live):
                row, tok = state.rows[i], int(out.tokens[j])
                state.next_token[i] = tok
                row.completion_tokens = np.append(row.completion_tokens, tok).astype(np.int32)
                tokens[i, 0], valid[i, 0] = tok, True
                logprobs[i, 0] = out.logprobs[j]
                k = out.top_ids.shape[1]
                top_ids[i, 0, :k] = out.top_ids[j]
                top_lp[i, 0, :k] = out.top_logprobs[j]
            state.slots.advance(live)
        lengths = np.array(state.slots.lengths(), np.int32)
        return state, ResultTokens(
            tokens=tokens, valid=valid, lengths=lengths, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_lp
        )

    def _live(self, state: ReferenceDecodeState) -> list[int]:
        """Occupied slots with room for another token (prompt plus completion below max_cache_length)."""
        return state.slots.live(self.max_cache_length)

    @staticmethod
    def _force(state: ReferenceDecodeState, slot: int, token: int, position: int) -> None:
        """Make ``token`` completion token ``position``, dropping what followed it: the
        cache then holds the prompt and the completion tokens fed before it."""
        row = state.rows[slot]
        row.completion_tokens = np.append(row.completion_tokens[:position], token).astype(np.int32)
        state.slots.force(slot, position)
        state.next_token[slot] = token

    # -- portable prefixes -----------------------------------------------------------------

    def export_prefix(self, prefix: Prefix) -> PortablePrefix:
        self.check_prefix(prefix).require_logits("export_prefix")
        k, v = self._prefix_arrays(prefix)
        return PortablePrefix(
            k=k, v=v, prompt_tokens=prefix.prompt_tokens,
            last_logits=prefix.logits, sampling=prefix.sampling,
            model_fingerprint=self.model.fingerprint,
        )

    def import_prefix(self, portable: PortablePrefix) -> Prefix:
        prompt, sampling = self.check_portable(portable)
        return self._imported(portable, prompt, sampling, None)

    def _import_tail(self, portable: PortablePrefix, existing_prefix: Prefix) -> Prefix:
        """Paged: the existing prefix's pages below the tail's start shared (a partly
        filled last one copied when the tail's first position is written), the tail's
        positions written into new pages. Contiguous: the existing prefix's first
        positions copied as they are (the kit's way would round them to float32)."""
        return self._imported(portable, portable.prompt_tokens, portable.sampling, existing_prefix)

    def _imported(self, portable: PortablePrefix, prompt: np.ndarray, sampling: SamplingParams,
                  existing: Prefix | None) -> Prefix:
        """A checked portable prefix as a Prefix; a tail onto ``existing``, whose first
        ``start`` positions it holds (shared pages, or a copy of its arrays)."""
        logits = portable.last_logits.astype(self.np_dtype)
        row = RowState(sampling, 0, 0, prompt, np.zeros(0, np.int32))
        first = int(self._sample([logits], [row]).tokens[0])
        k, v = portable.k.astype(self.np_dtype), portable.v.astype(self.np_dtype)
        if existing is None:
            kept = self._keep(k, v, 0, prompt.size, None)
        elif not self.pages:
            s = portable.start
            kept = (np.concatenate([existing.kv[0][:, :, :s], k], axis=2),
                    np.concatenate([existing.kv[1][:, :, :s], v], axis=2))
        else:
            kept = existing.kv.fork(portable.start, finalize=True)
            if portable.start < prompt.size:  # an empty tail writes nothing (and copies no shared page)
                self._scatter(kept, k, v, portable.start, prompt.size, offset=portable.start)
        return Prefix(
            kv=kept, logits=logits,
            prompt_tokens=prompt, sampling=sampling, backend=self.name, first_token=first,
            model_id=self.model_id, nbytes=self._held_bytes(kept, prompt.size),
        )

    shares_prefix_heads = True  # _prefix_head: views of the arrays or the pages shared

    def _prefix_head(self, prefix: Prefix, length: int) -> Prefix:
        """The first ``length`` positions, exact (the kit's way goes through float32): the
        prefix's full pages shared, or views of its arrays (the continuation that reads
        them copies them)."""
        kv = prefix.kv.fork(length, finalize=True) if self.pages else (prefix.kv[0][:, :, :length], prefix.kv[1][:, :, :length])
        return replace(prefix, kv=kv, prompt_tokens=prefix.prompt_tokens[:length])

    # -- K/V: contiguous arrays or pages ---------------------------------------------------

    def _prefix_arrays(self, prefix: Prefix) -> tuple[np.ndarray, np.ndarray]:
        """A prefix's K/V as ``(layers, kv_heads, true_length, head_dim)`` arrays."""
        if self.pages:
            return self._gather(prefix.kv, prefix.true_length)
        return prefix.kv[0], prefix.kv[1]

    def _keep(self, k: np.ndarray, v: np.ndarray, start: int, total: int, existing: Prefix | None):
        """A new prefix's K/V from the arrays a prefill wrote (positions ``start..total``
        new): its own copy, or, paged, the existing prefix's pages shared and new pages
        for the rest (a partly filled shared page copied first)."""
        if not self.pages:
            return k[:, :, :total].copy(), v[:, :, :total].copy()
        seq = PageList.continuing(self.pages, None if existing is None else existing.kv)
        self._scatter(seq, k, v, start, total)
        return seq

    def check_prefix(self, prefix: Prefix) -> Prefix:
        """The kit's checks, and K/V this engine holds: a paged prefix's pages belong to the
        pool of the engine that made it, which another engine of the same weights must not read."""
        prefix = super().check_prefix(prefix)
        paged = isinstance(prefix.kv, PageList)
        if paged != bool(self.pages) or (paged and prefix.kv.pool is not self.pages):
            raise InvalidRequest("prefix's K/V live in another reference engine's pages (or this engine's hold none); "
                                 "move it with export_prefix/import_prefix")
        return prefix

    def prefix_pages(self, prefix: Prefix) -> PageList:
        if not self.pages:
            return super().prefix_pages(prefix)
        return self.check_prefix(prefix).kv

    def slot_pages(self, decode_state: ReferenceDecodeState, slot: int) -> PageList | None:
        if not self.pages:
            return super().slot_pages(decode_state, slot)
        return decode_state.seqs[self.check_slot(slot)]

    def _held_bytes(self, kv, length: int) -> int:
        """What a prefix's K/V hold: its positions, or its whole pages (shared ones too)."""
        return self.kv_bytes(len(kv.pages) * self.pages.page_size if self.pages else length)

    def _page(self, page: int) -> tuple[np.ndarray, np.ndarray]:
        """Page ``page``'s K and V arrays ``(layers, kv_heads, page_size, head_dim)``,
        made when the pool first hands the id out (both lists at once: a prefill on
        another thread, a lane's, may ask beside a step)."""
        with self.pages.lock:
            while len(self._k_pages) <= page:
                shape = self._cache_shape(self.pages.page_size)
                self._k_pages.append(np.zeros(shape, self.np_dtype))
                self._v_pages.append(np.zeros(shape, self.np_dtype))
            return self._k_pages[page], self._v_pages[page]

    def _copy_page(self, src: int, dst: int) -> None:
        (ks, vs), (kd, vd) = self._page(src), self._page(dst)
        kd[...], vd[...] = ks, vs

    def _gather(self, seq: PageList, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Contiguous K/V of ``length`` positions: the sequence's first ones (at most its
        length), zeros after."""
        ps, have = self.pages.page_size, min(length, seq.length)
        k, v = np.zeros(self._cache_shape(length), self.np_dtype), np.zeros(self._cache_shape(length), self.np_dtype)
        for i in range(pages_for(have, ps)):
            lo, hi = i * ps, min(have, (i + 1) * ps)
            pk, pv = self._page(seq.pages[i])
            k[:, :, lo:hi], v[:, :, lo:hi] = pk[:, :, : hi - lo], pv[:, :, : hi - lo]
        return k, v

    def _scatter(self, seq: PageList, k: np.ndarray, v: np.ndarray, start: int, end: int, *, offset: int = 0) -> None:
        """Write positions ``start..end`` of ``k``/``v`` (which hold positions from
        ``offset``) into the sequence's pages (pages added as needed, shared ones copied
        before the write)."""
        ps = self.pages.page_size
        seq.prepare_write(start, end, self._copy_page)
        for i in range(start // ps, pages_for(end, ps)):
            lo, hi = max(start, i * ps), min(end, (i + 1) * ps)
            pk, pv = self._page(seq.pages[i])
            pk[:, :, lo - i * ps: hi - i * ps] = k[:, :, lo - offset: hi - offset]
            pv[:, :, lo - i * ps: hi - i * ps] = v[:, :, lo - offset: hi - offset]

    # -- embeddings ------------------------------------------------------------------------

    def embed(self, *, params: ReferenceParams, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        toks = self.check_embed(tokens)
        shape = self._cache_shape(toks.size)  # a scratch cache: no slot or prefix is touched
        k, v = np.zeros(shape, self.np_dtype), np.zeros(shape, self.np_dtype)
        return hidden_states(params, toks[None].astype(np.int64), np.array([0]), [k], [v])[0]

    # -- helpers ---------------------------------------------------------------------------

    def _forward(self, params: ReferenceParams, tokens, starts, k_caches, v_caches) -> np.ndarray:
        """The model's forward (one seam, so test variants can change its precision)."""
        return forward(params, tokens, starts, k_caches, v_caches)

    def _sample(self, logits: list[np.ndarray], rows: list[RowState]):
        return sample(np.stack(logits), rows, self.eos_token_ids)

    @staticmethod
    def _result(out) -> ResultTokens:
        return ResultTokens.first_tokens(out.tokens.astype(np.int32), out.logprobs.astype(np.float32),
                                         out.top_ids.astype(np.int32), out.top_logprobs.astype(np.float32))


def _row(out, i: int, top: int):
    """Row ``i`` of a batch's sampler output as the one-row output its own call gives
    (``top`` top log-probs, not the batch's widest)."""
    return replace(out, tokens=out.tokens[i: i + 1], logprobs=out.logprobs[i: i + 1], top_ids=out.top_ids[i: i + 1, :top],
                   top_logprobs=out.top_logprobs[i: i + 1, :top])


def create_engine(*, model: Model, config: EngineConfig) -> ReferenceEngine:
    return ReferenceEngine(model, config)


def diagnose() -> dict[str, str]:
    """What ``polyengine backends --verbose`` says of this backend: one path, no fallback."""
    return {"device": "cpu", "compute": f"NumPy {np.__version__}, float64 by default: the oracle (exact, slow)",
            "prefix tails": "import_prefix_tail (capability portable_prefix_tail): with page_size the held prefix's "
                            "pages below the tail's start are shared and only the tail is written; contiguous, a "
                            "copy through the host"}
