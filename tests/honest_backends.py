"""Correct backends that differ from the reference the way real accelerator backends do.

Each must pass the whole conformance suite (tests/test_conformance_honest.py): a check
that rejects one of them is the suite's own bug. Together with the broken backends
(tests/broken_backends.py) they pin the suite from both sides. Each is the reference
engine with one legitimate difference:

- ``honest_float32``: computes in float32 only.
- ``honest_bfloat16`` / ``honest_float16``: weights and logits rounded to bf16 / fp16,
  as a backend computing in that precision sees them (the sampler then works on those
  logits, so filter boundaries move by rounding).
- ``honest_left_pad``: prefixes keep left padding inside (a static-shape layout).
- ``honest_permuted``: slots live in permuted internal rows.
- ``honest_async``: ``generate`` returns lazy packed results computed on a worker
  thread (``async_results``; the driver pipelines its steps).
- ``honest_no_logprobs``: declares no log-probs.
- ``honest_kv_pool``: the engine owns the KV pool; the decode state is a handle.
- ``honest_donated``: the first insert of a prefix donates its cache buffer to the slot
  (no copy); a prefix inserted again is copied (the protocol lets it be reused).
- ``honest_speculative``: up to three tokens per step, a varying number accepted (one
  for a slot given a token mask).

Every variant but ``honest_no_logprobs`` and ``honest_kv_pool`` also declares
allowed-token masks (``token_masks``): those whose ``generate`` differs from the
reference's map or check them their own way (slot rows, the worker thread, speculation);
the two that do not keep the undeclared path checked.

``restricted`` (tests/restricted_backend.py) is the variant that declares little.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.engine import ResultLayout, ResultTokens
from polyengine.errors import InvalidRequest, UnsupportedFeature
from polyengine.sampling.params import ENGINE_FIELDS


def round_bf16(a: np.ndarray) -> np.ndarray:
    """Round to the nearest bfloat16 (ties to even), kept in float32."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def round_fp16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


class _Variant(ReferenceEngine):
    """A reference engine that declares its own dtypes (computing in ``COMPUTE``) and
    capability changes."""

    DTYPES: tuple[str, ...] = ("float64", "float32")
    COMPUTE: str | None = None  # the reference dtype that does the work; None: as requested
    CAPS: dict = {}

    def __init__(self, model, config):
        dtype = config.dtype or self.DTYPES[0]
        if dtype not in self.DTYPES:
            raise UnsupportedFeature(f"dtype {dtype!r}", self.name, f"declared dtypes: {', '.join(self.DTYPES)}")
        super().__init__(model, config.model_copy(update={"dtype": self.COMPUTE or dtype}))
        self.capabilities = self.capabilities.model_copy(update={"dtypes": self.DTYPES, **self.CAPS})
        self.dtype = dtype


class Float32Engine(_Variant):
    DTYPES = ("float32",)


class _Rounded(_Variant):
    COMPUTE = "float32"
    ROUND = staticmethod(round_bf16)

    def load_params(self):
        fresh = self._params is None
        params = super().load_params()
        if fresh:
            params.w = {k: self.ROUND(v) for k, v in params.w.items()}
            head = "model.embed_tokens.weight" if self.model.config.tie_word_embeddings else "lm_head.weight"
            params.lm_head = params.w[head]
        return params

    def _forward(self, params, tokens, starts, k_caches, v_caches):
        return self.ROUND(super()._forward(params, tokens, starts, k_caches, v_caches))


class BFloat16Engine(_Rounded):
    DTYPES = ("bfloat16",)


class Float16Engine(_Rounded):
    DTYPES = ("float16",)
    ROUND = staticmethod(round_fp16)


@dataclass
class _LeftPadded:
    """K/V of a prompt padded on the left to its bucket; ``pad`` positions of junk first."""

    k: np.ndarray
    v: np.ndarray
    pad: int

    def __getitem__(self, i: int) -> np.ndarray:  # the true positions, as the reference reads them
        return (self.k, self.v)[i][:, :, self.pad:]


class LeftPadEngine(ReferenceEngine):
    BUCKET = 8

    def prefill(self, **kw):
        prefix, first = super().prefill(**kw)
        k, v = prefix.kv
        pad = -k.shape[2] % self.BUCKET
        junk = np.full(k.shape[:2] + (pad,) + k.shape[3:], 7.0, k.dtype)
        prefix.kv = _LeftPadded(np.concatenate([junk, k], axis=2), np.concatenate([junk, v], axis=2), pad)
        return prefix, first


class PermutedEngine(ReferenceEngine):
    """Slot s lives in internal row ``rows[s]`` (reversed)."""

    def _row(self, slot):
        return self.max_concurrent_decodes - 1 - self.check_slot(slot)

    def insert(self, prefix, decode_state, slot):
        return super().insert(prefix, decode_state, self._row(slot))

    def bulk_insert(self, prefix, decode_state, slots):
        try:
            rows = [self._row(s) for s in slots]
        except TypeError:
            rows = slots
        return super().bulk_insert(prefix, decode_state, rows)

    def free_resource(self, decode_state, slot):
        return super().free_resource(decode_state, self._row(slot))

    def _rows(self, per_slot):
        mapped = {}
        for slot, value in (per_slot or {}).items():
            try:
                mapped[self._row(slot)] = value
            except InvalidRequest:
                mapped[slot] = value  # refused below with the caller's slot number
        return mapped

    def generate(self, params, decode_state, *, overrides=None, token_masks=None):
        state, r = super().generate(params, decode_state, overrides=self._rows(overrides),
                                    token_masks=self._rows(token_masks))
        order = [self._row(s) for s in range(self.max_concurrent_decodes)]
        return state, ResultTokens(tokens=r.tokens[order], valid=r.valid[order], lengths=r.lengths[order],
                                   logprobs=r.logprobs[order], top_ids=r.top_ids[order], top_logprobs=r.top_logprobs[order])


class AsyncEngine(ReferenceEngine):
    """Steps run on a worker thread; results come back as one packed buffer, read lazily."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self.capabilities = self.capabilities.model_copy(update={"async_results": True})
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="honest-async")
        self._pending = None

    def _wait(self):
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def generate(self, params, decode_state, *, overrides=None, token_masks=None):
        self._wait()
        state = decode_state
        # Refusals come before any work, on the caller's thread.
        forced = self.check_overrides(overrides, state.slots.last_result)
        self.check_token_masks(token_masks, state.slots.last_result, forced=forced, sampling_of=state.slots.sampling)
        live = state.slots.occupied()
        layout = ResultLayout(k=1, top_n=max((state.rows[i].params.top_logprobs for i in live), default=0), logprobs=True)

        def step():
            _, r = ReferenceEngine.generate(self, params, state, overrides=overrides, token_masks=token_masks)
            # the step sizes its top log-probs by the slots with room: a full slot may have asked more
            n, top = r.tokens.shape[0], r.top_ids.shape[2]
            ids = np.full((n, 1, layout.top_n), -1, np.int32)
            lps = np.full((n, 1, layout.top_n), -np.inf, np.float32)
            ids[:, :, :top], lps[:, :, :top] = r.top_ids, r.top_logprobs
            return layout.pack(r.tokens, r.valid, r.lengths, r.logprobs, ids, lps)

        self._pending = self._worker.submit(step)
        return state, ResultTokens.from_packed(self._pending, layout, to_host=lambda future: future.result())

    def insert(self, prefix, decode_state, slot):
        self._wait()
        return super().insert(prefix, decode_state, slot)

    def bulk_insert(self, prefix, decode_state, slots):
        self._wait()
        return super().bulk_insert(prefix, decode_state, slots)

    def free_resource(self, decode_state, slot):
        self._wait()
        return super().free_resource(decode_state, slot)


class NoLogprobsEngine(ReferenceEngine):
    def __init__(self, model, config):
        super().__init__(model, config)
        self.capabilities = self.capabilities.model_copy(
            update={"sampling_params": ENGINE_FIELDS - {"logprobs", "top_logprobs"}, "max_top_logprobs": 0})

    @staticmethod
    def _strip(r):
        return ResultTokens(tokens=r.tokens, valid=r.valid, lengths=r.lengths)

    def prefill(self, **kw):
        prefix, r = super().prefill(**kw)
        return prefix, self._strip(r)

    def bulk_insert(self, prefix, decode_state, slots):
        state, r = super().bulk_insert(prefix, decode_state, slots)
        return state, self._strip(r)

    def generate(self, params, decode_state, *, overrides=None):
        state, r = super().generate(params, decode_state, overrides=overrides)
        return state, self._strip(r)


@dataclass
class _PoolHandle:
    num_slots: int
    key: int


class KVPoolEngine(ReferenceEngine):
    """The engine owns every decode state's caches; callers hold a small handle."""

    _keys = itertools.count()

    def __init__(self, model, config):
        super().__init__(model, config)
        self._pool: dict[int, object] = {}

    def init_decode_state(self):
        key = next(self._keys)
        self._pool[key] = super().init_decode_state()
        return _PoolHandle(self.max_concurrent_decodes, key)

    def insert(self, prefix, decode_state, slot):
        super().insert(prefix, self._pool[decode_state.key], slot)
        return decode_state

    def bulk_insert(self, prefix, decode_state, slots):
        _, r = super().bulk_insert(prefix, self._pool[decode_state.key], slots)
        return decode_state, r

    def generate(self, params, decode_state, *, overrides=None):
        _, r = super().generate(params, self._pool[decode_state.key], overrides=overrides)
        return decode_state, r

    def free_resource(self, decode_state, slot):
        super().free_resource(self._pool[decode_state.key], slot)
        return decode_state


@dataclass
class _Donatable:
    """A prefix's K/V in a whole cache buffer (as a static-shape backend prefills it), and
    whether a slot has taken the buffer over."""

    k: np.ndarray  # (layers, kv_heads, max_cache_length, head_dim)
    v: np.ndarray
    n: int  # prompt positions
    donated: bool = False

    def __getitem__(self, i: int) -> np.ndarray:  # the prompt positions, as the reference reads them
        return (self.k, self.v)[i][:, :, : self.n]


class DonatedEngine(ReferenceEngine):
    """The first insert of a prefix donates its cache buffer to the slot: no copy, the slot
    decodes in the prefix's buffer, past its prompt positions (which nothing writes again,
    so the prefix stays valid for export and existing_prefix). A prefix inserted again
    (or a slot that takes an imported prefix) gets a buffer of its own, copied: the
    protocol lets a prefix be inserted any number of times."""

    def prefill(self, **kw):
        prefix, first = super().prefill(**kw)
        shape = self._cache_shape(self.max_cache_length)
        k, v = np.zeros(shape, self.np_dtype), np.zeros(shape, self.np_dtype)
        n = prefix.true_length
        k[:, :, :n], v[:, :, :n] = prefix.kv
        prefix.kv = _Donatable(k, v, n)
        return prefix, first

    def _install(self, prefix, state, slots, *, draw):
        kv = prefix.kv
        for slot in slots:
            if isinstance(kv, _Donatable) and not kv.donated:
                state.k[slot], state.v[slot] = kv.k, kv.v
                kv.donated = True
            else:  # copy on reuse, into a fresh buffer: the slot's may be another prefix's donated one
                state.k[slot], state.v[slot] = np.zeros_like(state.k[slot]), np.zeros_like(state.v[slot])
        return super()._install(prefix, state, slots, draw=draw)


class SpeculativeEngine(ReferenceEngine):
    """Up to K tokens per step; how many a slot accepts varies from step to step (as a
    draft model's acceptance does), and overrides may replace any token of the last result."""

    K = 3

    def __init__(self, model, config):
        super().__init__(model, config)
        self.capabilities = self.capabilities.model_copy(update={"tokens_per_step": self.K})

    def _accepted(self, row) -> int:
        return 1 + (row.params.seed + 7 * row.completion_tokens.size) % self.K

    def generate(self, params, decode_state, *, overrides=None, token_masks=None):
        state = decode_state
        forced = self.check_overrides(overrides, state.slots.last_result)
        masks = self.check_token_masks(token_masks, state.slots.last_result, forced=forced,
                                       sampling_of=state.slots.sampling)
        for slot, (token, position) in forced.items():
            self._force(state, slot, token, position)
        n = state.num_slots
        masked = [] if masks is None else masks.slots
        # a masked slot accepts one token: the mask is for its next token only
        want = {i: 1 if i in masked else self._accepted(state.rows[i]) for i in state.slots.occupied()}
        cols: dict[int, list[tuple]] = {i: [] for i in want}
        top_n = max((state.rows[i].params.top_logprobs for i in want), default=0)
        for r in range(self.K):
            active = [i for i, m in want.items() if m > r]
            hidden = {i: state.slots[i] for i in range(n) if i not in active}
            for i in hidden:
                state.slots.free(i)
            try:
                first = {i: masks.words[i] for i in masked} if r == 0 else None
                _, res = ReferenceEngine.generate(self, params, state, token_masks=first)
            finally:
                for i, s in hidden.items():
                    if s is not None:
                        state.slots.put(i, s)
            for i in active:
                if res.valid[i, 0]:
                    k = res.top_ids.shape[2]
                    cols[i].append((res.tokens[i, 0], res.logprobs[i, 0], res.top_ids[i, 0, :k], res.top_logprobs[i, 0, :k]))
        tokens, valid = np.zeros((n, self.K), np.int32), np.zeros((n, self.K), bool)
        logprobs = np.zeros((n, self.K), np.float32)
        top_ids, top_lp = np.full((n, self.K, top_n), -1, np.int32), np.full((n, self.K, top_n), -np.inf, np.float32)
        lengths = np.zeros(n, np.int32)
        for i, got in cols.items():
            lengths[i] = state.rows[i].completion_tokens.size
            if got:
                state.slots[i].last = len(got)
            for j, (t, lp, ids, vals) in enumerate(got):
                tokens[i, j], valid[i, j], logprobs[i, j] = t, True, lp
                top_ids[i, j, : ids.size], top_lp[i, j, : vals.size] = ids, vals
        return state, ResultTokens(tokens=tokens, valid=valid, lengths=lengths, logprobs=logprobs,
                                   top_ids=top_ids, top_logprobs=top_lp)


# The variants that compute the reference's float64 logits and sample them with its
# sampler, differing only in layout, ownership or when results are read: every token they
# draw is the reference's own (their differential layer compares each sampled token with the
# oracle's stream, and fails on any other), so the sampler layer's 1000-draw statistics on
# them are the reference's, which its whole-suite run checks (tests/test_conformance_cli.py).
# Their runs leave those two tests out; the rounded variants and the restricted one run them.
# The speculative one is among them: its first token of every step is the reference's own
# draw (ReferenceEngine.generate on the same rows), and the sampler layer reads that one.
SAME_DRAWS = frozenset({"honest_left_pad", "honest_permuted", "honest_async", "honest_no_logprobs", "honest_kv_pool",
                        "honest_donated", "honest_speculative"})

# The variants whose outputs may depend on the prefill buckets (EngineConfig.prefill_buckets):
# the padding one. The others leave the default model's bucket configurations of the
# differential layer to the reference's and the built-in backends' runs
# (tests/test_conformance_honest.py).
BUCKET_AWARE = frozenset({"honest_left_pad"})

HONEST: dict[str, type] = {
    "honest_float32": Float32Engine,
    "honest_bfloat16": BFloat16Engine,
    "honest_float16": Float16Engine,
    "honest_left_pad": LeftPadEngine,
    "honest_permuted": PermutedEngine,
    "honest_async": AsyncEngine,
    "honest_no_logprobs": NoLogprobsEngine,
    "honest_kv_pool": KVPoolEngine,
    "honest_donated": DonatedEngine,
    "honest_speculative": SpeculativeEngine,
}
