"""Continuous batching over any Engine.

The scheduler owns requests and slots; the engine owns caches and sampling. Each
``step()`` admits queued requests into free slots (prefill, then insert or
bulk_insert), runs one ``generate`` for every occupied slot, and turns each slot's
token into text, tool actions and stop decisions. Requests join and leave between
steps, so a short request never waits for a long one.

Prefill goes through :class:`~polyengine.driver.prefill.Prefiller`: from the longest
cached prefix of the prompt (the prefix cache), and, while streams decode, in pieces of
at most ``prefill_chunk`` tokens, at most ``max_num_batched_tokens`` prompt tokens per
step before its ``generate``, so a long prompt arriving never stalls the running streams
for its whole prefill. Requests start their prefill in arrival order (first come, first
served) as slots free up; a step's pieces of every request being prefilled run as one
batched call (``prefill_batch``) where the engine declares ``batched_prefill``.

Per token, in order: the tool machine may replace the engine's token with a forced one
(fed back through ``overrides``); a constrained sample's grammar advances over it; then
the stop checks run: EOS / end-of-turn (unless ``ignore_eos``), ``stop_token_ids``, stop
strings (none of them before ``min_tokens``), the grammar's completion, then
``max_tokens`` and the cache limit (prompt + completion <= ``max_cache_length``).

Structured output (``SamplingParams.structured``, :mod:`.structured`): each step's
allowed-token masks are computed for every constrained slot (llguidance's threads, one
buffer) right before ``generate``, and passed as ``token_masks``; the first token's mask
goes to ``prefill``. A mask needs the token before it, so while a constrained slot runs
the loop is in lock step.

K/V pages (an engine declaring ``page_size`` whose pool is bounded, ``PagePool.capacity``):
a request is admitted when the pages it needs now (its prompt, less the full pages it
shares with a cached prefix, and its samples' next step: :meth:`Prefiller.pages_now`,
:meth:`Prefiller.make_room_for`) and the running slots' next step fit the free pages,
after the prefix cache gave back what it can (never the prefix the request shares). Before each ``generate`` the slots' next writes
must fit; if they do not, the most recently admitted request is preempted: its slots
(and pages) are freed and it goes back to the front of the queue. When it is admitted
again its prompt is prefilled again (from the prefix cache where it is held) and the
completion tokens it had are replayed as forced tokens (``Override``), one per step, and
not emitted again; the engine's sampler then holds exactly the state it had (the step
that addresses the random stream, the completion tokens the penalties count, the sample
index), so the continuation equals a run that was never preempted. A piece on the
engine's prefill lane holds back the pages it may take (:meth:`Prefiller.piece_pages`)
from its start until it is collected, counted with the slots' next step; a preempted
request whose piece runs there waits for it and drops what it made.

Thread safety: every public method takes one re-entrant lock, so several threads may
submit, step and cancel; whichever thread steps advances every request.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from concurrent.futures import Future, wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from polyengine.driver.embeddings import pool
from polyengine.driver.outputs import Completion, CompletionOutput, StreamDelta, Usage
from polyengine.driver.prefill import PrefillJob, Prefiller
from polyengine.driver.textstream import TextStream
from polyengine.engine import Engine, Override, Prefix, ResultTokens, check_prompt, check_request, is_int
from polyengine.errors import EngineDead, InvalidRequest, NumericalError, PluginError, QueueFull, UnsupportedFeature
from polyengine.memory import as_insufficient, translating_memory_errors
from polyengine.results import NONFINITE_TOKEN
from polyengine.sampling.masks import allows_any, step_masked_ids
from polyengine.sampling.params import SamplingParams

__all__ = ["Request", "Scheduler"]

_ids = itertools.count()
MAX_CACHE_SALT_CHARS = 1024


def token_ids(tokens: Iterable[Any], what: str) -> list[int]:
    """Token ids as Python ints; anything but integers (floats, bools) is refused."""
    out = []
    for t in tokens:
        if not is_int(t):
            raise InvalidRequest(f"{what} token ids must be integers, got {t!r} ({type(t).__name__})", field=what)
        out.append(int(t))
    return out


def check_cache_salt(salt: Any) -> None:
    """A ``cache_salt`` is None or a non-empty string of at most MAX_CACHE_SALT_CHARS."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        got = f"a string of {len(salt):,} characters" if isinstance(salt, str) else type(salt).__name__
        raise InvalidRequest(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters "
                             f"(or None), got {got}", field="cache_salt")


@dataclass
class _Sample:
    index: int
    text: TextStream
    tool: Any | None  # a ToolRow, or None when tools are off
    limit: int  # completion tokens at most
    slot: int | None = None
    out: CompletionOutput = field(default=None)  # type: ignore[assignment]
    grammar: Any | None = None  # a GrammarRow for a constrained request
    # After a preemption: the completion tokens the engine must be given again (forced,
    # one per step), and how many of them were forced so far.
    replay: list[int] | None = None
    replayed: int = 0

    @property
    def finished(self) -> bool:
        return self.out.finish_reason is not None


class Request:
    """A submitted request. Read ``done``, ``completion`` and ``error``; ``cancel()`` it."""

    def __init__(self, scheduler: "Scheduler", prompt: str | None, tokens: list[int], sampling: SamplingParams,
                 cache_salt: str | None = None):
        self.id = f"req-{next(_ids)}"
        self.cache_salt = cache_salt  # the prefix cache partition it may continue and fills (None: the common one)
        self.prompt = prompt
        self.prompt_tokens = tokens
        self.sampling = sampling
        self.samples: list[_Sample] = []
        self.events: deque[StreamDelta] = deque()
        self.error: Exception | None = None  # why it failed (typed for anything a caller caused)
        self.status = "queued"  # queued -> running -> finished | cancelled | failed
        self.cached_tokens = 0  # prompt tokens whose K/V came from the prefix cache
        self.pages = 0  # the K/V pages it may need at worst on a bounded page pool (Prefiller.pages_needed)
        self.admitted = -1  # when it last started its prefill (the scheduler's admission order)
        self.preemptions = 0  # times it gave its slots and pages back to make room
        self._scheduler = scheduler

    @property
    def done(self) -> bool:
        return self.status in ("finished", "cancelled", "failed")

    def cancel(self) -> None:
        """Stop the request now: queued, it is dropped; running, its slots are freed."""
        self._scheduler.cancel(self)

    @property
    def completion(self) -> Completion:
        if self.error is not None:
            raise self.error
        outs = [s.out for s in self.samples]
        return Completion(
            request_id=self.id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_tokens),
            outputs=outs,
            seed=int(self.sampling.seed),
            usage=Usage(len(self.prompt_tokens), sum(len(o.token_ids) for o in outs), self.cached_tokens),
        )


class Scheduler:
    # Free a slot whose request finished while a step's results were read at the next step's
    # start (_flush_frees), not at once: a free waits for the step in flight, so the rest of
    # the results read would reach their clients a step late. False: at once, as before
    # 2026-12-06 (benchmarks/scripts/step_gaps.py compares the two; docs/serving.md).
    defer_frees = True

    def __init__(
        self,
        engine: Engine,
        *,
        detokenizer_factory: Callable[[list[int]], Any] | None = None,
        tool_factory: Callable[[], Any] | None = None,
        skip_token_ids: frozenset[int] = frozenset(),
        max_queue: int = 1024,
        grammars: Any | None = None,
    ):
        if not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 1:
            # 0 would make every submit fail and generate() wait forever for room.
            raise InvalidRequest(f"max_queue must be an integer of at least 1, got {max_queue!r}", field="max_queue")
        self.engine = engine
        self._what = f"the {getattr(engine, 'name', type(engine).__name__)} backend"
        with translating_memory_errors(self._what), self._backend("load_params"):  # typed failures
            self.params = engine.load_params()
            self.state = engine.init_decode_state()
        self._detok = detokenizer_factory
        self._tool = tool_factory
        self._skip = skip_token_ids
        self._grammars = grammars  # a structured.Grammars (the model's tokenizer), or None
        self._masks: np.ndarray | None = None  # (slots, W) mask buffer, made on first use
        self.max_queue = max_queue
        self._queue: deque[Request] = deque()
        self._slots: dict[int, tuple[Request, _Sample]] = {}
        self._overrides: dict[int, Override] = {}
        self._pending: tuple[ResultTokens, dict[int, tuple[Request, _Sample]]] | None = None
        self._eos = frozenset(engine.eos_token_ids)
        self.prefiller = Prefiller.for_engine(engine, self.params)
        self._filling: list[tuple[Request, PrefillJob]] = []  # requests whose prefill runs in pieces, in order
        # The engine's prefill lane (Capabilities.prefill_lane): a long prompt's piece running
        # beside the steps, (request, job, tokens, future), or None; on a bounded page pool
        # the pages it may take, held back from the steps and the other pieces until then.
        self._lane_ok = bool(getattr(engine.capabilities, "prefill_lane", False))
        self._lane: tuple[Request, PrefillJob, int, Future] | None = None
        self._lane_pages = 0
        self.lane_prefills = 0  # pieces run on the prefill lane (cumulative)
        # The mixed step (Capabilities.mixed_step): a step's pieces of up to that many tokens
        # in all, held back from _admit and run inside the next generate call
        # (generate_with_prefill), their requests inserted after it.
        self._mix_tokens = int(getattr(engine.capabilities, "mixed_step", 0) or 0)
        self._deferred: list[tuple[Request, PrefillJob, int]] = []
        self._mixed: tuple[list[tuple[Request, PrefillJob, int]], Future] | None = None  # a mixed step's, uncollected
        self.mixed_prefills = 0  # pieces run inside a decode step (cumulative)
        # Slots whose requests finished while a step's results were read: freed at the next
        # step's start, not there (a free waits for the step in flight, and the tokens read
        # would then reach their clients a whole step late).
        self._later_frees: list[int] = []
        self._reading = False
        self._admissions = itertools.count()
        self.preemptions = 0  # requests preempted to make room for K/V pages (cumulative)
        self._lock = threading.RLock()
        # Requests whose stream was dropped unread: cancelled when the lock is next taken.
        self._abandoned: deque[Request] = deque()

    # -- admission -----------------------------------------------------------------------

    def submit(self, tokens: Iterable[int], sampling: SamplingParams, prompt: str | None = None, *,
               cache_salt: str | None = None) -> Request:
        """Validate and queue a request. Raises InvalidRequest, UnsupportedFeature or
        QueueFull at once; nothing is queued then and running requests are untouched."""
        req = self.prepare(tokens, sampling, prompt, cache_salt=cache_salt)
        self.enqueue(req)
        return req

    def prepare(self, tokens: Iterable[int], sampling: SamplingParams, prompt: str | None = None, *,
                cache_salt: str | None = None) -> Request:
        """Validate a request and build it, without queueing it (see :meth:`enqueue`).
        ``cache_salt``: requests share cached prefixes only with requests of the same
        salt (docs/security.md, "Prefix cache and tenants")."""
        check_cache_salt(cache_salt)
        eng = self.engine
        arr, sampling = check_request(eng, token_ids(tokens, "prompt"), sampling)
        tokens = arr.tolist()
        if sampling.stop and self._detok is None:
            raise InvalidRequest("stop strings need a tokenizer to match text; this model has none (use stop_token_ids)",
                                 field="stop")
        grammar = self._grammar_for(sampling)
        req = Request(self, prompt, tokens, sampling, cache_salt)
        room = eng.max_cache_length - len(tokens)
        limit = room if sampling.max_tokens is None else min(sampling.max_tokens, room)
        pool = self.prefiller.pool
        if pool is not None:
            req.pages = self.prefiller.pages_needed(len(tokens), limit, sampling.n)
            if req.pages > pool.capacity:
                raise InvalidRequest(
                    f"this request may need {req.pages} K/V pages ({sampling.n} sample(s) of {len(tokens)} prompt and "
                    f"{limit} completion tokens, in pages of {pool.page_size}) but the engine's pool holds "
                    f"{pool.capacity}; lower n or max_tokens", field="max_tokens")
        for i in range(sampling.n):
            detok = self._detok(tokens) if self._detok else None
            s = _Sample(i, TextStream(detok, sampling.stop, self._skip), self._tool() if self._tool else None, limit,
                        grammar=grammar() if grammar else None)
            s.out = CompletionOutput(
                index=i,
                logprobs=[] if sampling.logprobs else None,
                top_logprobs=[] if sampling.top_logprobs else None,
            )
            req.samples.append(s)
        return req

    def _grammar_for(self, sampling: SamplingParams) -> Callable[[], Any] | None:
        """A factory of grammar rows for a constrained request (compiled now, so a bad
        constraint is refused at submit), or None."""
        spec = sampling.structured
        if spec is None:
            return None
        if not getattr(self.engine.capabilities, "token_masks", False):
            raise UnsupportedFeature("structured output (allowed-token masks)", self.engine.name,
                                     "pick a backend that declares Capabilities.token_masks")
        if self._grammars is None:
            raise InvalidRequest("structured output needs the model's tokenizer; this model has none", field="structured")
        self._grammars.compile(spec)
        return lambda: self._grammars.row(spec)

    def _mask_rows(self, samples: list[_Sample]) -> np.ndarray:
        if self._masks is None:
            self._masks = self._grammars.buffer(self.engine.max_concurrent_decodes)
        rows = {s.slot if s.slot is not None else i: s.grammar for i, s in enumerate(samples)}
        self._grammars.fill(rows, self._masks)
        return self._masks

    def _step_masks(self) -> dict[int, np.ndarray] | None:
        """This step's masks for every running constrained sample; a sample whose grammar
        leaves only tokens min_tokens/ignore_eos mask finishes here ("stop")."""
        # A replaying sample needs its mask only at the step that draws its first new token.
        live = [(req, s) for req, s in self._slots.values() if s.grammar is not None and not s.finished
                and (s.replay is None or s.replayed == len(s.replay))]
        if not live:
            return None
        buf = self._mask_rows([s for _, s in live])
        out = {}
        for req, s in live:
            sp, step = req.sampling, len(s.out.token_ids)
            if (step < sp.min_tokens or sp.ignore_eos) and not allows_any(
                    buf[s.slot], self._grammars.vocab_size, step_masked_ids(sp, step, self.engine.eos_token_ids)):
                self._finish(req, s, "stop")
                continue
            out[s.slot] = buf[s.slot]
        return out or None

    def enqueue(self, req: Request) -> None:
        """Queue a prepared request; QueueFull when ``max_queue`` requests are waiting."""
        with self._lock:
            self._reap()
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"request queue is full ({self.max_queue} waiting); retry later or raise max_queue")
            self._queue.append(req)

    @property
    def queue_full(self) -> bool:
        return len(self._queue) >= self.max_queue

    def cancel(self, req: Request) -> None:
        with self._lock:
            if req.done:
                return
            if req in self._queue:
                self._queue.remove(req)
            for r, job in self._filling:
                if r is req:
                    self.prefiller.abandon(job)
            self._filling = [f for f in self._filling if f[0] is not req]
            for s in req.samples:
                if not s.finished:
                    s.out.finish_reason = "cancelled"
                    req.events.append(StreamDelta(s.index, "", [], "cancelled"))
                self._release(s)
            req.status = "cancelled"

    def abandon(self, req: Request) -> None:
        """Cancel ``req`` at the next step: safe from a finalizer, which may run while this
        thread is inside the scheduler (a deque append takes no lock)."""
        self._abandoned.append(req)

    def _reap(self) -> None:
        while self._abandoned:
            self.cancel(self._abandoned.popleft())

    @property
    def busy(self) -> bool:
        with self._lock:
            self._reap()
            # a lane's piece still running counts, its request cancelled or not (it is collected)
            return bool(self._queue or self._slots or self._pending or self._filling or self._lane or self._mixed
                        or self._later_frees)

    @property
    def free_slots(self) -> list[int]:
        return [i for i in range(self.engine.max_concurrent_decodes) if i not in self._slots]

    @property
    def prefix_cache(self) -> Any:
        """The prefix cache (:class:`~polyengine.driver.prefix_cache.PrefixCache`), or None when off."""
        return self.prefiller.cache

    def check_embed(self, tokens: Iterable[int]) -> np.ndarray:
        """Refuse an embedding request before any work: UnsupportedFeature when the
        engine lacks capability ``embeddings``, InvalidRequest for a bad prompt."""
        if not getattr(self.engine.capabilities, "embeddings", False):
            raise UnsupportedFeature("embeddings", getattr(self.engine, "name", None),
                                     "its engine returns no hidden states; serve the model on a backend that declares "
                                     "capability 'embeddings' (reference, cpu, cuda_torch)", field="input")
        return check_prompt(token_ids(tokens, "prompt"), max_prefill_length=self.engine.max_prefill_length,
                            vocab_size=self.engine.vocab_size)

    def embed(self, tokens: Iterable[int], *, normalize: bool = True) -> np.ndarray:
        """One prompt's embedding (:mod:`polyengine.driver.embeddings`): the engine's
        final hidden states, checked and pooled. It holds no slot; running requests wait
        for it as for a prefill."""
        ids = self.check_embed(tokens)
        name = getattr(self.engine, "name", type(self.engine).__name__)
        with self._lock, translating_memory_errors(self._what), self._backend("embed"):
            hidden = np.asarray(self.engine.embed(params=self.params, tokens=ids))
        width = getattr(getattr(getattr(self.engine, "model", None), "config", None), "hidden_size", None)
        if hidden.ndim != 2 or hidden.shape[0] != ids.size or (width is not None and hidden.shape[1] != width):
            raise PluginError(name, None, f"embed returned hidden states of shape {hidden.shape} for {ids.size} "
                                          f"tokens; expected ({ids.size}, {width or 'hidden_size'})")
        return pool(hidden, normalize=normalize, backend=name)

    def _admit(self) -> None:
        """Prefill and insert queued requests, in order: while streams decode, at most
        ``max_num_batched_tokens`` prompt tokens this step (the rest next step), each round
        one piece of every request being prefilled, run together; on an engine with a
        prefill lane, a prompt longer than that budget runs there instead, beside the steps."""
        self._collect_lane(wait=not self._slots)  # with nothing decoding there is no step to run beside it
        budget = self.prefiller.step_budget(decoding=bool(self._slots))
        while budget is None or budget > 0:
            pieces = self._plan_pieces(budget)
            if not pieces:
                return
            if self._mixes(pieces):
                self._deferred = pieces  # into the step about to run (step: _generate)
                return
            if budget is not None:
                budget -= sum(n for _, _, n in pieces)
            self._run_pieces(pieces)

    def _mixes(self, pieces: list[tuple[Request, PrefillJob, int]]) -> bool:
        """Whether a round's pieces go into the step (capability mixed_step): streams decode,
        the round fits the engine's count, and the page pool is unbounded (on a bounded one
        the pieces take their pages before _make_step_room counts the step's, as planned)."""
        return (bool(self._mix_tokens and self._slots) and self.prefiller.pool is None
                and sum(n for _, _, n in pieces) <= self._mix_tokens)

    def _plan_pieces(self, budget: int | None) -> list[tuple[Request, PrefillJob, int]]:
        """One piece of each request being prefilled, in order, then of queued ones that
        can start, until ``budget`` prompt tokens (None: no bound)."""
        pieces, i, need = [], 0, 0
        while budget is None or budget > 0:
            if i == len(self._filling) and (self._waits_for_prefill() or not self._start_next(need)):
                break
            req, job = self._filling[i]
            if self._lane is not None and self._lane[1] is job:
                i += 1  # its piece runs on the prefill lane
                continue
            if self._lane_takes(job, budget) and self._lane_room(job, need):
                i += self._start_lane(req, job)
                continue
            if self.prefiller.pool is not None and not self.prefiller.make_room(
                    need + self.prefiller.piece_pages(job, budget) + self._step_pages()) and (self._slots or pieces):
                break  # no pages for the piece now: running requests finish, or it is preempted
            i += 1
            if self.prefiller.pool is not None:
                need += self.prefiller.piece_pages(job, budget)
            n = self.prefiller.next_piece(job, budget)
            pieces.append((req, job, n))
            if budget is not None:
                budget -= n
        return pieces

    def _lane_takes(self, job: PrefillJob, budget: int | None) -> bool:
        """Whether the job's next piece goes to the prefill lane: the engine has one and it
        is free, streams decode under a step budget, and the prompt's rest is longer than a
        whole step's budget (shorter ones run within the steps, as they would there)."""
        return (self._lane_ok and self._lane is None and budget is not None and bool(self._slots)
                and len(job.tokens) - job.done > self.prefiller.step_tokens)

    def _lane_room(self, job: PrefillJob, planned: int) -> bool:
        """Whether the job's whole piece fits the free pages beside the slots' next step and
        the ``planned`` pages of this round's pieces (always, without a bounded pool); if
        it does not, a piece within the step's budget may (the usual path)."""
        if self.prefiller.pool is None:
            return True
        return self.prefiller.make_room(planned + self.prefiller.piece_pages(job, None) + self._step_pages())

    def _start_lane(self, req: Request, job: PrefillJob) -> int:
        """Start the job's next piece (up to its next cut, unchunked) on the prefill lane;
        1, or 0 where the engine refused it (the request failed and left ``_filling``)."""
        n = self.prefiller.next_piece(job, None)
        try:
            with self._backend("prefill"):
                future = self.engine.start_prefill(params=self.params, **self.prefiller.piece(job, n))
        except Exception as exc:
            self._abandon_prefill(req, job, exc)
            if isinstance(exc, EngineDead):
                raise
            return 0
        self._lane = (req, job, n, future)
        self._lane_pages = self.prefiller.piece_pages(job, None) if self.prefiller.pool is not None else 0
        self.lane_prefills += 1
        return 1

    def _collect_lane(self, *, wait: bool) -> None:
        """Take the prefill lane's piece once it is done (``wait``: block until then): recorded
        as a piece run here, the request inserted after its last; dropped if the request was
        cancelled meanwhile; its failure fails that request only."""
        if self._lane is None or not (wait or self._lane[3].done()):
            return
        (req, job, n, future), self._lane, self._lane_pages = self._lane, None, 0
        mine = any(r is req for r, _ in self._filling)
        try:
            with self._backend("prefill"):
                out = future.result()
        except Exception as exc:
            if mine:
                self._abandon_prefill(req, job, exc)
            if isinstance(exc, EngineDead):
                raise
            return
        if mine:
            self._finish_piece(req, job, self.prefiller.advanced(job, job.done + n, out))

    def _run_pieces(self, pieces: list[tuple[Request, PrefillJob, int]]) -> None:
        """Run the pieces (one batched call where the engine has one); insert the requests
        whose prefill they finish. A batch that fails is run again piece by piece, so a
        failure fails only the request it belongs to."""
        done: list[Any] = [None] * len(pieces)
        alone = len(pieces) == 1 or not self.prefiller.batched
        if not alone:
            try:
                with self._backend("prefill"):
                    done = self.prefiller.advance_pieces([(job, n) for _, job, n in pieces])
            except EngineDead as exc:
                for req, job, _ in pieces:
                    self._abandon_prefill(req, job, exc)
                raise
            except Exception:
                alone = True
        for (req, job, n), out in zip(pieces, done):
            if alone:
                try:
                    with self._backend("prefill"):
                        out = self.prefiller.advance_pieces([(job, n)])[0]
                except Exception as exc:  # any failure fails this request only...
                    self._abandon_prefill(req, job, exc)
                    if isinstance(exc, EngineDead):  # ...unless the engine itself is gone: then the caller must know
                        raise
                    continue
            self._finish_piece(req, job, out)

    def _finish_piece(self, req: Request, job: PrefillJob, out: tuple[Prefix, ResultTokens] | None) -> None:
        """After a piece: nothing more before the last; after it, the request's prefix
        inserted into its slots and its first token taken (a failure fails it alone)."""
        if out is None:
            return
        try:
            with self._backend("prefill"):
                prefix, first = out
                slots = self.free_slots[: req.sampling.n]
                if req.sampling.n == 1:
                    self.state = self.engine.insert(prefix, self.state, slots[0])
                else:
                    self.state, first = self.engine.bulk_insert(prefix, self.state, slots)
        except Exception as exc:  # any failure fails this request only...
            self._abandon_prefill(req, job, exc)
            if isinstance(exc, EngineDead):  # ...unless the engine itself is gone: then the caller must know
                raise
            return
        self._filling = [f for f in self._filling if f[0] is not req]
        req.status = "running"
        for slot, s in zip(slots, req.samples):
            s.slot = slot
            self._slots[slot] = (req, s)
        for row, s in enumerate(req.samples):
            if not self._resume(s):
                self._on_token(req, s, first, row)

    def _abandon_prefill(self, req: Request, job: PrefillJob, exc: Exception) -> None:
        """A request whose prefill failed: it lets go of its cache entry and fails."""
        self._filling = [f for f in self._filling if f[0] is not req]
        self.prefiller.abandon(job)
        self._fail(req, exc)

    def _waits_for_prefill(self) -> bool:
        """Whether the head request waits for a prefill in progress whose prompt it shares
        (then it continues that prompt's cached prefix, next round or step)."""
        if not self._queue or not self._filling:
            return False
        head = self._queue[0]
        return self.prefiller.waits_for(head.prompt_tokens, head.cache_salt, [job for _, job in self._filling])

    def _claimed_slots(self) -> int:
        """Slots the requests being prefilled will take at insert."""
        return sum(req.sampling.n for req, _ in self._filling)

    def _pages_free(self, req: Request, planned: int = 0) -> bool:
        """Whether the pages ``req`` needs now (its prompt and each unfinished sample's next
        step, or the completion it had before a preemption) fit beside the running slots'
        next step and the ``planned`` pages of the pieces this round runs before its own
        (always, without a bounded page pool); the pages its prompt shares with
        a cached prefix are not counted, and the prefix cache gives back pages (not that
        prefix's) to make them fit (:meth:`Prefiller.make_room_for`)."""
        if self.prefiller.pool is None:
            return True
        done = [max(len(s.out.token_ids) - 1, 0) for s in req.samples if not s.finished]
        need = self.prefiller.pages_now(len(req.prompt_tokens), done, self.engine.capabilities.tokens_per_step)
        need += planned + self._step_pages()
        if self.prefiller.cache is None:
            return self.prefiller.make_room(need)
        return self.prefiller.make_room_for(req.prompt_tokens, req.cache_salt, need)

    def _step_pages(self) -> int:
        """Pages the next ``generate`` takes from the pool: each running slot's new page or
        copy of a shared page where its next tokens go; and those a piece on the prefill
        lane may take meanwhile (held back from its start until it is collected)."""
        if self.prefiller.pool is None:
            return 0
        tps = self.engine.capabilities.tokens_per_step
        ahead = tps if self._pending is not None else 0  # a dispatched step not read yet
        total = self._lane_pages  # the lane's piece may take these while the step runs
        for slot, (req, s) in self._slots.items():
            held = s.replayed if s.replay is not None else len(s.out.token_ids)
            pos = min(len(req.prompt_tokens) + held - 1 + ahead, self.engine.max_cache_length)
            seq = self.engine.slot_pages(self.state, slot)
            if seq is not None:
                total += seq.pages_to_write(pos, min(pos + tps, self.engine.max_cache_length))
        return total

    def _make_step_room(self) -> None:
        """Before a ``generate`` on a bounded page pool: while the slots' next writes do not
        fit the free pages (after the prefix cache gave back what it can), preempt the most
        recently admitted request. With one request left nothing is preempted: its worst
        case fits the pool (checked at submit), so its step fits once the cache gave
        back what it holds."""
        while not self.prefiller.make_room(self._step_pages()):
            admitted = {id(r): r for r, _ in self._slots.values()}
            for r, _ in self._filling:
                admitted[id(r)] = r
            if len(admitted) < 2:
                return
            self._preempt(max(admitted.values(), key=lambda r: r.admitted))

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s slots and pages (or drop its prefill in progress: a piece on the
        prefill lane is waited for and what it made dropped) and put it back at the front
        of the queue; its completion so far is kept and replayed when it runs again (see
        the module docstring)."""
        self._flush_frees()  # the pages of requests that finished go back first
        if self._lane is not None and self._lane[0] is req:
            wait_futures([self._lane[3]])
            self._lane, self._lane_pages = None, 0  # what it made (and its pages) go with the future
        for r, job in self._filling:
            if r is req:
                self.prefiller.abandon(job)
                job.prefix = None  # its pages go back now
        self._filling = [f for f in self._filling if f[0] is not req]
        for s in req.samples:
            s.replay, s.replayed = None, 0
            self._release(s)
        req.status = "queued"
        req.preemptions += 1
        self.preemptions += 1
        self._queue.appendleft(req)

    def _resume(self, s: _Sample) -> bool:
        """After a preempted request's prefill and insert: a finished sample's slot is freed
        at once, and a sample that had tokens starts replaying them (the engine's first
        token is replaced by the first of them). Whether the sample was resumed (False: a
        new sample, whose first token is taken as usual)."""
        if s.finished:
            self._release(s)
            return True
        if not s.out.token_ids:
            return False
        s.replay, s.replayed = list(s.out.token_ids), 1
        self._overrides[s.slot] = Override(s.replay[0], 0)
        return True

    def _replay_step(self, req: Request, s: _Sample, result: ResultTokens, slot: int) -> None:
        """One step of a replay: force the next replayed token in place of the engine's;
        after the last, the step's tokens are the completion's new ones."""
        if s.replayed < len(s.replay):
            self._overrides[slot] = Override(s.replay[s.replayed], s.replayed)
            s.replayed += 1
            return
        s.replay, s.replayed = None, 0
        self._on_token(req, s, result, slot)

    def page_stats(self) -> dict[str, int]:
        """The K/V page pool's counts now (a paged engine's; all 0 otherwise): ``total``
        and ``free`` pages (0 for an unbounded pool), ``in_use`` (held), ``shared`` (held
        more than once), and ``preemptions`` so far. Plain reads: any thread may call it."""
        pool = getattr(self.engine, "pages", None) if getattr(self.engine.capabilities, "page_size", 0) else None
        if pool is None:
            return {"total": 0, "free": 0, "in_use": 0, "shared": 0, "preemptions": self.preemptions}
        return {"total": pool.capacity or 0, "free": pool.free or 0, "in_use": pool.held, "shared": pool.shared,
                "preemptions": self.preemptions}

    def _start_next(self, planned: int = 0) -> bool:
        """Start the head request's prefill once its slots are free and its pages fit beside
        the ``planned`` pages of this round's pieces so far (first come, first served: no
        overtaking); whether one started."""
        while (self._queue and len(self.free_slots) - self._claimed_slots() >= self._queue[0].sampling.n
               and self._pages_free(self._queue[0], planned)):
            req = self._queue.popleft()
            resumed = any(s.out.token_ids for s in req.samples)  # its first tokens are replayed: no mask
            try:
                mask = None
                if req.samples[0].grammar is not None and not resumed:  # every sample's grammar starts the same
                    mask = self._mask_rows(req.samples[:1])[0].copy()
                job = self.prefiller.start(req.prompt_tokens, req.sampling, token_mask=mask, partition=req.cache_salt)
            except Exception as exc:  # fails this request only
                self._fail(req, exc)
                continue
            req.admitted = next(self._admissions)
            if not resumed:
                req.cached_tokens = job.cached
            self._filling.append((req, job))
            return True
        return False

    # -- the loop ------------------------------------------------------------------------

    def step(self) -> bool:
        """Admit what fits, run one generate step; return whether work remains.

        With ``Capabilities.async_results`` the steps are pipelined: step ``n+1`` is
        dispatched before step ``n``'s results are read, so reading, detokenizing and
        stop checks overlap the engine's work. A slot that finished at step ``n`` then
        has a token of step ``n+1`` too, which is discarded (its row is matched to the
        request that held the slot at dispatch). While a forced tool token is due the
        loop runs in lock step, so every override replaces a token of the engine's last
        result, as :class:`~polyengine.engine.Override` requires.
        """
        with self._lock:
            self._reap()
            if self._pending is not None and not self._may_pipeline():
                self._process(*self._pending)
                self._pending = None
            self._flush_frees()
            if self._mixed is not None:  # the last step's pieces: their requests join before this step
                self._finish_mixed(*self._mixed)
            if self.prefiller.shares_kv:  # the slots' K/V as of now: a prefix cache sharing their bytes gets the rest
                self.prefiller.fit(sum(len(r.prompt_tokens) + len(s.out.token_ids) for r, s in self._slots.values()))
            self._admit()
            if self.prefiller.pool is not None:
                self._make_step_room()
            if self._deferred and not self._slots:  # preempted to the last: no step to run them in
                pieces, self._deferred = self._deferred, []
                self._run_pieces(pieces)
            if not self._slots:
                self._pending = None  # its rows belong to requests that are gone
                return bool(self._queue or self._filling or self._lane or self._idle())
            overrides, self._overrides = self._overrides, {}
            extra = {}
            masks = self._step_masks() if self._grammars is not None else None
            if masks:
                extra["token_masks"] = masks
            if not self._slots:
                return bool(self._queue)
            with translating_memory_errors(self._what), self._backend("generate"):
                self.state, result, mixed = self._generate(overrides, extra)
            previous, self._pending = self._pending, (result, dict(self._slots))
            self._mixed = mixed  # collected at the next step's start: the last step's tokens go out first
            if previous is not None:
                self._process(*previous)
            if not self._may_pipeline():
                self._process(*self._pending)
                self._pending = None
            return bool(self._queue or self._slots or self._pending or self._filling or self._lane or self._mixed
                        or self._idle())

    def _idle(self) -> bool:
        """Before the scheduler reports no work left: the frees held back, made (always False)."""
        self._flush_frees()
        return False

    def _flush_frees(self) -> None:
        """Free the slots whose requests finished while results were read (:meth:`_release`)."""
        while self._later_frees:
            slot = self._later_frees.pop(0)
            with self._backend("free_resource"):
                self.state = self.engine.free_resource(self.state, slot)

    def _generate(self, overrides: dict[int, Override], extra: dict[str, Any]) -> tuple[Any, ResultTokens, Any]:
        """The step; with pieces held back by _admit, the mixed call (``generate_with_prefill``)
        and ``(pieces, the future of their results)``, else None. A mixed call that raises
        changed nothing: the pieces then run on their own (a failure fails its request only)
        and the step after them."""
        pieces, self._deferred = self._deferred, []
        if pieces:
            try:
                state, result, outs = self.engine.generate_with_prefill(
                    self.params, self.state, requests=self.prefiller.requests([(job, n) for _, job, n in pieces]),
                    overrides=overrides, **extra)
            except EngineDead as exc:
                for req, job, _ in pieces:
                    self._abandon_prefill(req, job, exc)
                raise
            except Exception:
                self._run_pieces(pieces)
            else:
                self.mixed_prefills += len(pieces)
                return state, result, (pieces, outs)
        state, result = self.engine.generate(self.params, self.state, overrides=overrides, **extra)
        return state, result, None

    def _finish_mixed(self, pieces: list[tuple[Request, PrefillJob, int]], outs: Future) -> None:
        """A mixed step's pieces recorded once the step is done, as :meth:`_run_pieces`
        records its own (its failure fails the pieces' requests); a request cancelled
        meanwhile is skipped (its prefix dropped)."""
        self._mixed = None
        filling = {id(r) for r, _ in self._filling}
        pieces_done = [(p, i) for i, p in enumerate(pieces) if id(p[0]) in filling]
        try:
            with translating_memory_errors(self._what), self._backend("generate"):
                done = outs.result()
        except Exception as exc:
            for (req, job, _), _ in pieces_done:
                self._abandon_prefill(req, job, exc)
            if isinstance(exc, EngineDead):
                raise
            return
        for (req, job, n), i in pieces_done:
            out = done[i]
            try:
                with self._backend("prefill"):
                    out = self.prefiller.advanced(job, job.done + n, out)
            except Exception as exc:
                self._abandon_prefill(req, job, exc)
                continue
            self._finish_piece(req, job, out)

    def _may_pipeline(self) -> bool:
        """Whether the next step may be dispatched before the last one is read."""
        caps = self.engine.capabilities
        if not caps.async_results or self._overrides:
            return False
        if any(s.grammar is not None for _, s in self._slots.values()):
            return False  # the next mask needs this step's token
        if any(s.replay is not None for _, s in self._slots.values()):
            return False  # a replay forces a token each step, in place of the engine's last one
        tools = [s.tool for _, s in self._slots.values() if s.tool is not None]
        # A forced token is due: the pending result's token must be replaced first. With
        # several tokens per step a forced token may fall inside a stale result, so
        # tool rows keep such an engine in lock step.
        return not tools or (caps.tokens_per_step == 1 and not any(t.pending for t in tools))

    def _process(self, result: ResultTokens, holders: dict[int, tuple[Request, _Sample]]) -> None:
        """Take one step's results for the samples that held each slot at dispatch (the slots
        of those that finish are freed at the next step's start: _flush_frees)."""
        self._reading = True
        try:
            self._process_rows(result, holders)
        finally:
            self._reading = False

    def _process_rows(self, result: ResultTokens, holders: dict[int, tuple[Request, _Sample]]) -> None:
        for slot, (req, s) in holders.items():
            if self._slots.get(slot, (None, None))[1] is not s or s.finished:
                continue  # freed, cancelled or failed since: the row is not theirs any more
            if s.replay is not None and result.valid[slot].any():
                self._replay_step(req, s, result, slot)
            elif result.valid[slot].any():
                self._on_token(req, s, result, slot)
            else:  # the engine could not extend this slot: its cache is full
                self._finish(req, s, "length")

    def run_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            if not self.step() and not predicate():
                raise RuntimeError("scheduler went idle before the awaited requests finished")
        with self._lock:
            self._flush_frees()

    # -- per token -----------------------------------------------------------------------

    def _on_token(self, req: Request, s: _Sample, result: ResultTokens, row: int) -> None:
        """Take one row's tokens; an error here (a tool's bug, say) fails this request only."""
        try:
            with self._backend("reading a result"):
                tokens = result.tokens[row]
            for j, token in enumerate(tokens):
                if not result.valid[row, j] or s.finished:
                    continue
                self._check_finite(int(token), result, row, j)
                if self._accept(req, s, int(token), result, row, j):
                    break  # a forced token replaces the rest of this step's (speculative) tokens
        except Exception as exc:
            self._fail(req, exc)
            if isinstance(exc, EngineDead):  # reading the results found the engine gone: not this request's fault
                raise

    @contextlib.contextmanager
    def _backend(self, call: str) -> Iterator[None]:
        """A backend call: what it raises that is not an Exception (``SystemExit``, any
        other ``BaseException``; ``KeyboardInterrupt`` off the main thread, where no Ctrl-C
        can arrive) becomes a PluginError naming the backend, failing the requests the call
        concerns like any other error of it, instead of ending the thread that serves every
        request. A real Ctrl-C and a generator's close pass through."""
        try:
            yield
        except (Exception, GeneratorExit):
            raise
        except KeyboardInterrupt:
            if threading.current_thread() is threading.main_thread():
                raise
            raise self._foreign(call, "KeyboardInterrupt()") from None
        except BaseException as exc:
            raise self._foreign(call, f"{type(exc).__name__}({exc})") from None

    def _foreign(self, call: str, what: str) -> PluginError:
        return PluginError(getattr(self.engine, "name", type(self.engine).__name__), None,
                           f"the backend raised {what} in {call}, which would have ended the engine thread; the "
                           f"requests of that call fail with this error and the engine goes on")

    def _check_finite(self, token: int, result: ResultTokens, row: int, j: int) -> None:
        """NumericalError (this request's) for a token outside the vocabulary (a sampler's
        NONFINITE_TOKEN: the logits held NaN or +inf) or a NaN log-prob: never a token
        drawn from numbers that mean nothing."""
        lp = result.logprobs
        if 0 <= token < self.engine.vocab_size and (lp is None or not np.isnan(lp[row, j])):
            return
        raise NumericalError(
            f"{self._what} produced {'no token' if token == NONFINITE_TOKEN else f'token {token}'} at this step: the "
            f"model's logits are NaN or infinite (an overflow in its arithmetic or non-finite weights, not the "
            f"sampling parameters); try a wider dtype or check the model's config and weights")

    def _accept(self, req: Request, s: _Sample, token: int, result: ResultTokens, row: int, j: int) -> bool:
        """Record one token; return whether it was forced in place of the engine's."""
        forced = False
        if s.tool is not None:
            chosen, forced = s.tool.step(token)
            if chosen != token:
                # The forced token takes the place of the engine's token at this index of
                # the completion; the engine drops what it produced after it.
                self._overrides[s.slot] = Override(chosen, len(s.out.token_ids))
                token = chosen
        out, sp = s.out, req.sampling
        if s.grammar is not None:
            s.grammar.consume(token)  # forced tokens too: the grammar sees the whole completion
        out.token_ids.append(token)
        out.forced.append(1 if forced else 0)
        lp = None
        if out.logprobs is not None:
            lp = None if forced else float(result.logprobs[row, j])
            out.logprobs.append(lp)
        if out.top_logprobs is not None:
            ids, vals = result.top_ids[row, j, : sp.top_logprobs], result.top_logprobs[row, j, : sp.top_logprobs]
            out.top_logprobs.append({} if forced else {int(i): float(v) for i, v in zip(ids, vals) if i >= 0})
        n = len(out.token_ids)
        may_stop = n >= sp.min_tokens
        reason, stop_reason = None, None
        if not forced and may_stop and token in self._eos and not sp.ignore_eos:
            reason, stop_reason = "stop", token
        elif not forced and may_stop and token in sp.stop_token_ids:
            reason, stop_reason = "stop", token
        # Stop strings match the model's text, not a tool's forced output.
        text = "" if reason else s.text.push(token, check_stop=may_stop and not forced)
        if reason is None and s.text.stopped_by is not None:
            reason, stop_reason = "stop", s.text.stopped_by
        if reason is None and s.grammar is not None and s.grammar.done:
            reason = "stop"  # the grammar is complete: nothing but EOS could follow
        if reason is None and n >= s.limit:
            reason = "length"
        lps = None if out.logprobs is None else [lp]
        tops = None if out.top_logprobs is None else [out.top_logprobs[-1]]
        if reason is None:
            req.events.append(StreamDelta(s.index, text, [token], None, lps, tops))
            return forced
        out.stop_reason = stop_reason
        tail = text + ("" if s.text.stopped_by else s.text.finish())
        req.events.append(StreamDelta(s.index, tail, [token], reason, lps, tops))
        self._finish(req, s, reason, event=False)
        return True

    def _finish(self, req: Request, s: _Sample, reason: str, *, event: bool = True) -> None:
        if s.out.finish_reason is None:
            s.out.finish_reason = reason
            if event:
                req.events.append(StreamDelta(s.index, s.text.finish(), [], reason))
        self._release(s)
        if all(x.finished for x in req.samples):
            req.status = "finished"

    def _fail(self, req: Request, exc: Exception) -> None:
        if isinstance(exc, MemoryError):
            exc = as_insufficient(exc, f"{self._what} (request {req.id})")
        req.error, req.status = exc, "failed"
        for s in req.samples:
            self._release(s)

    def _release(self, s: _Sample) -> None:
        s.out.text = s.text.text
        if s.slot is not None and s.slot in self._slots:
            del self._slots[s.slot]
            self._overrides.pop(s.slot, None)
            if self._reading and self.defer_frees:
                self._later_frees.append(s.slot)
            else:
                with self._backend("free_resource"):
                    self.state = self.engine.free_resource(self.state, s.slot)
            s.slot = None
