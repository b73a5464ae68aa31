"""How the driver prefills a prompt: from the longest cached prefix, in pieces.

The scheduler hands each admitted request to a :class:`Prefiller`, which plans its
prefill as pieces, each one ``engine.prefill`` call that continues the previous piece's
prefix (``existing_prefix``, capability ``prefix_reuse``):

- **The prefix cache** (:mod:`.prefix_cache`) gives the longest cached prefix of the
  prompt; the first piece continues it. At least one prompt token is always prefilled
  again, so the request's first token is drawn with its own sampling parameters from
  its own prefix: a cached prefix (which may carry another request's parameters) is
  continued, never inserted. Only prefixes of the request's own partition (its tenant:
  ``cache_salt``) are looked up, and its prefixes are filed there. When the prompt shares more tokens with some cached
  prompt than the longest entry covers, the prompt is cut where that shared run ends
  (rounded down to :data:`CACHE_BLOCK` tokens) and the prefix there is cached too: the
  second of two prompts sharing a system prompt leaves an entry that the third one
  continues. On an engine with ``prefix_truncate`` the second one does not prefill the
  shared part either: it is cut from the cached entry that holds it, filed there, and
  continued: as a head (``engine.prefix_head``: the shared positions' K/V, no forward
  run, no logits of its own, which a cache entry never needs since entries are only
  continued) where the engine has it, else ``engine.truncate_prefix`` (which prefills
  the cut's last token again for its logits: one more forward). Every completed prompt's
  prefix is cached (a conversation's next turn starts with it).
- **Chunked prefill**: while other requests decode, pieces also end at every multiple
  of ``prefill_chunk`` tokens (absolute positions), so no piece is longer than the
  chunk, and the scheduler runs at most ``max_num_batched_tokens`` prompt tokens per
  step (a piece is cut where the step's budget ends), between decode steps: running
  streams keep their pace.
- **Batched prefill**: a step's pieces (one per request being prefilled, in arrival
  order, until the budget is spent) go to the engine as one ``prefill_batch`` call on an
  engine that declares ``batched_prefill`` (one forward), else one ``prefill`` each. With nothing decoding there is
  no pace to keep, and the rest of the prompt runs as one piece (small pieces cost more
  per token: on the CPU a 64-token piece costs about twice a long prefill's per-token
  time).

Pieces other than the last are prefilled with a neutral request (greedy would do as well:
nobody samples from them); the last one with the request's own parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polyengine.driver.prefix_cache import CacheEntry, PrefixCache
from polyengine.pages import pages_for
from polyengine.protocol import DEFAULT_STEP_TOKENS, EngineConfig, PrefillRequest, Prefix
from polyengine.results import ResultTokens
from polyengine.sampling.params import SamplingParams

__all__ = ["DEFAULT_PREFILL_CHUNK", "DEFAULT_STEP_TOKENS", "CACHE_BLOCK", "PrefillJob", "Prefiller"]

# Prompt tokens per prefill piece while other requests decode (EngineConfig.prefill_chunk
# unset). Measured in docs/prefix-caching.md ("Choosing the chunk size").
DEFAULT_PREFILL_CHUNK = 64
# Prompts shorter than this are not cached, and a cut where prompts part is rounded down
# to a multiple of it (so near-identical prompts share one entry, not one each).
CACHE_BLOCK = 16
# The request of a piece whose first token nobody reads.
_PIECE = SamplingParams(seed=0)


@dataclass
class PrefillJob:
    """One request's prefill in progress: ``cuts`` are the places a piece must end
    (ascending: where the cache wants an entry, and the prompt's length), ``prefix``
    covers ``done`` tokens (the cache entry's, then each piece's), ``cached`` tokens came
    from the cache (the held entry, referenced until the first piece has continued it)."""

    tokens: list[int]
    sampling: SamplingParams
    cuts: list[int]
    keep: frozenset[int]  # cuts whose prefix goes into the cache (where prompts part)
    prefix: Prefix | None
    done: int
    cached: int
    held: CacheEntry | None = None
    token_mask: Any = None  # the allowed-token mask of the request's first token (structured output), or None
    partition: Any = None  # the prefix cache's partition of the request's tenant (its cache_salt)

    def next_end(self, chunk: int) -> int:
        """Where the next piece ends: the next cut, or sooner at a multiple of ``chunk``
        (0: no chunking)."""
        end = self.cuts[0]
        return min(end, (self.done // chunk + 1) * chunk) if chunk else end


class Prefiller:
    """Prefills for one engine: its prefix cache (None: off) and chunk size (0: off)."""

    def __init__(self, engine: Any, params: Any, *, cache: PrefixCache | None = None, chunk: int = 0,
                 block: int = CACHE_BLOCK, step_tokens: int = DEFAULT_STEP_TOKENS):
        self.engine, self.params = engine, params
        self.cache, self.chunk, self.block = cache, int(chunk), int(block)
        self.step_tokens = int(step_tokens)  # prompt tokens per step while streams decode (chunking on)
        # A step's pieces share one forward (engine.prefill_batch) where the engine says it runs them so.
        self.batched = bool(getattr(engine.capabilities, "batched_prefill", False))
        # The engine's default budget on a cache that grows with use: what the slots leave
        # of it (EngineBase.prefix_cache_shares_kv), so the budget follows the slots' lengths.
        self.shares_kv = cache is not None and bool(getattr(engine, "prefix_cache_shares_kv", False))
        # Where a prompt parts from a cached one, the shared part is cut from that entry
        # rather than prefilled again: as a head (engine.prefix_head, no forward) where the
        # engine has one, else engine.truncate_prefix.
        self.truncates = cache is not None and bool(getattr(engine.capabilities, "prefix_truncate", False))
        self.heads = self.truncates and bool(getattr(engine, "shares_prefix_heads", False))
        # A paged engine with a bounded page pool (EngineBase.pages, a PagePool with a
        # capacity): the scheduler admits a request when the pages it needs now fit
        # (pages_now), preempts when a step would run out, and the cache gives back its
        # pages on demand (make_room); its budget never exceeds the pool.
        pool = getattr(engine, "pages", None)
        self.pool = pool if pool is not None and getattr(pool, "capacity", None) is not None else None
        if self.pool is not None and cache is not None:
            cache.resize(min(cache.budget, self.pool.capacity * engine.kv_bytes(self.pool.page_size)))

    @classmethod
    def for_engine(cls, engine: Any, params: Any) -> "Prefiller":
        """The cache and chunk size the engine was built for (``EngineConfig``'s
        ``prefix_cache_bytes`` and ``prefill_chunk``); both off without ``prefix_reuse``."""
        if not engine.capabilities.prefix_reuse:
            return cls(engine, params)
        config = getattr(engine, "config", None)
        chunk = config.prefill_chunk if isinstance(config, EngineConfig) else None
        chunk = DEFAULT_PREFILL_CHUNK if chunk is None else chunk
        step = config.max_num_batched_tokens if isinstance(config, EngineConfig) else None
        step = DEFAULT_STEP_TOKENS if step is None else step
        budget = int(getattr(engine, "prefix_cache_bytes", 0) or 0)
        model = getattr(engine, "model", None)
        per_token = model.config.kv_bytes_per_token(4) if model is not None else 1
        paged = {}
        if engine.capabilities.page_size and getattr(engine, "pages", None) is not None:
            # Entries extending one another share pages: count each page once.
            paged = dict(pages_of=lambda p: engine.prefix_pages(p).pages,
                         page_bytes=engine.kv_bytes(engine.capabilities.page_size))
        cache = PrefixCache(budget, estimate=lambda p: p.true_length * per_token, **paged) if budget else None
        # A paged engine's cuts fall on its page edges, so a cut entry shares whole pages.
        block = engine.capabilities.page_size or CACHE_BLOCK
        return cls(engine, params, cache=cache, chunk=chunk, block=block, step_tokens=step)

    def fit(self, positions: int) -> None:
        """The slots hold K/V for ``positions`` cache positions now: on an engine whose
        prefix cache shares their bytes, the cache shrinks (or may grow again) to the rest,
        and never past a bounded page pool."""
        if self.shares_kv:
            budget = self.engine.prefix_cache_bytes - self.engine.kv_bytes(positions)
            if self.pool is not None:
                budget = min(budget, self.pool.capacity * self.engine.kv_bytes(self.pool.page_size))
            self.cache.resize(budget)

    def pages_needed(self, prompt: int, completion: int, samples: int) -> int:
        """Pages a request may hold at worst on a bounded pool: each sample's prompt and
        completion in pages of its own, and one that a prefill piece's copy on write
        holds until the piece before it is dropped."""
        return samples * pages_for(prompt + completion, self.pool.page_size) + 1

    def pages_now(self, prompt: int, completions: list[int], step_tokens: int = 1) -> int:
        """Pages a request needs to start (or restart, after a preemption) on a bounded pool:
        its prompt's, one for a prefill piece's copy on write, and for each unfinished sample
        the pages its slot writes up to its next step (``completions``: the completion
        tokens each will hold before that step, 0 for a new request; the prompt's full
        pages are shared, its partly filled last one copied). The whole prompt is counted:
        :meth:`make_room_for` takes off what a cache hit shares."""
        ps = self.pool.page_size
        shared = prompt // ps
        return pages_for(prompt, ps) + 1 + sum(pages_for(prompt + c + step_tokens, ps) - shared for c in completions)

    def cache_hit(self, tokens: list[int], partition: Any = None) -> tuple[CacheEntry | None, int]:
        """The pages of a prompt's K/V that :meth:`start` would take from the cache now,
        counting no query: ``(entry, pages)``, the entry they come from (the one continued,
        or the one a truncation cuts them from), or ``(None, 0)``. A continued entry of L
        tokens gives its L // page_size full pages (its partly filled last page is copied
        by the first piece); a cut at ``split`` tokens gives split // page_size as a head
        and (split - 1) // page_size through truncate_prefix, which prefills the last token
        again and so copies the page it falls in."""
        if self.cache is None or self.pool is None:
            return None, 0
        entry, split, donor = self._plan(tokens, partition, count=False)
        ps = self.pool.page_size
        if donor is not None:
            return donor, (split if self.heads else split - 1) // ps
        if entry is not None:
            return entry, entry.length // ps
        return None, 0

    def make_room_for(self, tokens: list[int], partition: Any, pages: int) -> bool:
        """:meth:`make_room` for a request about to :meth:`start`, ``pages`` counting its
        whole prompt (:meth:`pages_now`): the pages its prompt shares from the cache
        (:meth:`cache_hit`) are not counted, and the entry holding them is held while the
        cache gives back others, so the room made is not that entry's. If even evicting
        every other idle entry leaves too few, the count is redone without the hit (the
        cache may then give back that entry as well: a request alone fits the pool, its
        worst case was checked at submit, with nothing to share).

        Why :meth:`start`, right after, finds the same hit: eviction only removes entries,
        and the held one stays. The longest cached proper prefix of the prompt is still
        that entry; how far the prompt agrees with cached prompts can only shrink, but not
        below a held donor's cut (the donor agrees that far), so the cut is the same."""
        entry, shared = self.cache_hit(tokens, partition)
        if shared > 0:
            entry.refs += 1
            try:
                if self.make_room(pages - shared):
                    return True
            finally:
                self.cache.release(entry)
        del entry  # a reference held here would keep the entry's pages when the cache gives it back
        return self.make_room(pages)

    def piece_pages(self, job: PrefillJob, budget: int | None) -> int:
        """Pages the job's next piece takes from the pool at most: its new positions' pages
        and a copy of the partly filled page it continues, and one more for a copy the
        engine may make on the way (a truncation's last token)."""
        ps, end = self.pool.page_size, job.done + self.next_piece(job, budget)
        return pages_for(end, ps) - pages_for(job.done, ps) + (1 if job.done % ps else 0) + 1

    def make_room(self, pages: int) -> bool:
        """Whether ``pages`` pages are free on the bounded pool, after the prefix cache gave
        back what it must (entries not in use, in eviction order; none when even evicting
        them all would not be enough)."""
        free = self.pool.free
        if free >= pages:
            return True
        if self.cache is None:
            return False
        idle = self.cache.idle_pages()  # a page comes back when only idle entries hold it
        if free + sum(1 for p, n in idle.items() if self.pool.refcount(p) == n) < pages:
            return False
        while self.pool.free < pages and self.cache.evict_next():
            pass
        return self.pool.free >= pages

    def step_budget(self, decoding: bool) -> int | None:
        """Prompt tokens one scheduler step may prefill: ``max_num_batched_tokens`` while
        streams decode and chunking is on, no bound otherwise (None: pieces are not
        chunked either)."""
        return self.step_tokens if self.chunk and decoding else None

    def next_piece(self, job: PrefillJob, budget: int | None) -> int:
        """Tokens of the job's next piece under what is left of a step's ``budget``
        (chunked, and cut where the budget ends, when bounded)."""
        n = job.next_end(self.chunk if budget is not None else 0) - job.done
        return n if budget is None else min(n, budget)

    def waits_for(self, tokens: list[int], partition: Any, jobs: list[PrefillJob]) -> bool:
        """Whether a prompt should wait for a prefill in progress rather than start beside
        it: it shares at least a cache block with that job's prompt beyond what the cache
        gave the job, so once the job's prefix is cached the prompt continues it instead
        of computing the shared part again (in the same batch it could not)."""
        if self.cache is None:
            return False
        for job in jobs:
            if job.partition != partition:
                continue
            shared = 0
            for a, b in zip(tokens, job.tokens):
                if a != b:
                    break
                shared += 1
            if shared // self.block * self.block > max(job.cached, self.block - 1):
                return True
        return False

    def start(self, tokens: list[int], sampling: SamplingParams, token_mask: Any = None,
              partition: Any = None) -> PrefillJob:
        """Plan a prompt's pieces (looking it up in the cache, holding the entry found);
        ``token_mask`` constrains the first token, drawn by the last piece; ``partition``
        is the tenant whose cached prompts it may continue and where its own are filed."""
        n, held, prefix, have, keep = len(tokens), None, None, 0, set()
        if self.cache is not None:
            entry, split, donor = self._plan(tokens, partition)
            if donor is not None:
                (held, prefix), have, entry = self._cut(tokens[:split], partition, donor), split, None
            if entry is not None:
                held, prefix, have = entry, self.cache.acquire(entry), entry.length
            if split > have:
                keep.add(split)
        return PrefillJob(list(tokens), sampling, sorted({n, *keep}), frozenset(keep), prefix, have, have, held,
                          token_mask, partition)

    def _plan(self, tokens: list[int], partition: Any, *,
              count: bool = True) -> tuple[CacheEntry | None, int, CacheEntry | None]:
        """What the cache offers a prompt: ``(entry, split, donor)``, the longest cached
        proper prefix (None: none), where the prompt parts from the cached prompts (rounded
        down to the block, never the whole prompt), and, where that is past the entry on an
        engine with ``prefix_truncate``, the entry that part is cut from (else None).
        ``count``: count the lookup as a query (:meth:`start` does, :meth:`cache_hit` not)."""
        entry, matched = self.cache.lookup(tokens, partition, count=count)
        split = min(matched, len(tokens) - 1) // self.block * self.block
        donor = None
        if split > (entry.length if entry is not None else 0) and self.truncates:
            donor = self.cache.covering(tokens[:split], partition)
        return entry, split, donor

    def _cut(self, tokens: list[int], partition: Any, donor: CacheEntry) -> tuple[CacheEntry | None, Prefix]:
        """The prefix of ``tokens`` (a multiple of the block long) cut from ``donor``, a
        cached entry that begins with them (``engine.prefix_head``, else
        ``engine.truncate_prefix``), filed where the prompts part and held. ``(entry,
        prefix)``; the entry is None when the budget has no room for it (the prefix is
        continued all the same)."""
        donor.refs += 1  # filing the cut may evict; the donor must outlive the cut
        try:
            cut = self.engine.prefix_head if self.heads else self.engine.truncate_prefix
            prefix = cut(params=self.params, prefix=donor.prefix, length=len(tokens))
        finally:
            self.cache.release(donor)
        entry = self.cache.insert(prefix, shared=True, partition=partition)
        if entry is None:
            self.cache.count_hit(len(tokens))
            return None, prefix
        return entry, self.cache.acquire(entry)

    def advance(self, job: PrefillJob, budget: int | None = None) -> tuple[Prefix, ResultTokens] | None:
        """Run the job's next piece (chunked under a step's ``budget``, see
        :meth:`step_budget`); after the last, its prefix and first token."""
        n = self.next_piece(job, budget)
        return self.advanced(job, job.done + n, self.engine.prefill(params=self.params, **self.piece(job, n)))

    def advance_pieces(self, pieces: list[tuple[PrefillJob, int]]) -> list[tuple[Prefix, ResultTokens] | None]:
        """Run one piece of ``n`` tokens of each job, together: one ``prefill_batch`` on an
        engine with ``batched_prefill``, else one ``prefill`` each. Per job, as
        :meth:`advance`. A batch that raises has changed no job (the engine checks every
        entry before any work), so the caller may run the pieces one by one to find whose
        it was."""
        if not self.batched or len(pieces) == 1:
            return [self.advanced(job, job.done + n, self.engine.prefill(params=self.params, **self.piece(job, n)))
                    for job, n in pieces]
        done = self.engine.prefill_batch(params=self.params, requests=self.requests(pieces))
        return [self.advanced(job, job.done + n, out) for (job, n), out in zip(pieces, done)]

    def requests(self, pieces: list[tuple[PrefillJob, int]]) -> list[PrefillRequest]:
        """The pieces as ``prefill_batch`` entries (or a mixed step's: ``generate_with_prefill``)."""
        return [PrefillRequest(**self.piece(job, n)) for job, n in pieces]

    def piece(self, job: PrefillJob, n: int) -> dict[str, Any]:
        """The prefill keywords of the job's next ``n`` tokens: the last piece with the
        request's own parameters (and its first token's mask), others neutral."""
        end = job.done + n
        final = end == len(job.tokens)
        extra = {"token_mask": job.token_mask} if final and job.token_mask is not None else {}
        return dict(tokens=job.tokens[job.done: end], sampling=job.sampling if final else _PIECE,
                    existing_prefix=job.prefix, **extra)

    def advanced(self, job: PrefillJob, end: int, out: tuple[Prefix, ResultTokens]) -> tuple[Prefix, ResultTokens] | None:
        """Record a piece that ran to ``end`` (here, or on the engine's prefill lane: the
        scheduler's ``_collect_lane``): the job's prefix, the held entry let go, the prefix
        cached where the cache wants it; after the last, ``out``."""
        prefix, first = out
        final = end == len(job.tokens)
        if end == job.cuts[0]:
            job.cuts.pop(0)
        job.prefix, job.done = prefix, end
        self._release(job)  # continued: the entry is not needed any more
        if self.cache is not None and end >= self.block and (final or end in job.keep):
            self.cache.insert(prefix, shared=end in job.keep, partition=job.partition)
        return (prefix, first) if final else None

    def abandon(self, job: PrefillJob) -> None:
        """A request that will not finish its prefill (cancelled, failed) lets go of its entry."""
        self._release(job)
        job.cuts.clear()

    def _release(self, job: PrefillJob) -> None:
        if job.held is not None:
            self.cache.release(job.held)
            job.held = None
