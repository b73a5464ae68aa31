"""polyengine as a benchmarked system: any registered backend, through the public API.

Decode and serve runs go through ``polyengine.LLM`` (the continuous-batching driver),
so they include what a user pays: admission, detokenization, stop checks. Prefill
calls the engine protocol directly (``prefill`` and reading its first token), so the
number compares the backend's prompt processing with a peer's forward pass.

Each phase builds an engine sized for it (``max_slots`` = the batch, cache = prompt +
completion): a static-shape backend then computes the rows the phase has, not 32 slots
for a batch of one, just as a peer runs exactly the batch it is given.

Driver overhead is measured without touching the core: :class:`TimedEngine` forwards
every attribute to the engine and adds up the seconds spent inside its calls, and the
first read of each ``ResultTokens`` (which waits for an asynchronous backend and copies
to the host) counts as engine time too. What a ``step()`` takes beyond that is the
scheduler's own work.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from polyengine.benchmarks.phases import DecodeRun, ServeRun
from polyengine.benchmarks.workload import Request

__all__ = ["TimedEngine", "PolyengineSystem", "engine_build"]

_RESULT_FIELDS = ("tokens", "valid", "lengths", "logprobs", "top_ids", "top_logprobs")


class _TimedResult:
    """A ResultTokens whose first field read is timed as engine work."""

    def __init__(self, result: Any, clock: "TimedEngine", admission: bool):
        self._result, self._clock, self._admission = result, clock, admission

    def __getattr__(self, name: str) -> Any:  # only reached for attributes not yet set
        if name.startswith("_") or name not in _RESULT_FIELDS:
            return getattr(self._result, name)
        start = time.perf_counter()
        for f in _RESULT_FIELDS:
            setattr(self, f, getattr(self._result, f))
        end = time.perf_counter()
        self._clock.seconds += end - start
        if self._admission:
            self._clock.admitted_at = end
        return getattr(self, name)


class TimedEngine:
    """Forwards everything to ``engine``; ``seconds`` adds up the time spent in its calls.

    ``admitted_at`` is when the last admission finished (an ``insert`` returned or a
    prefill's first token was read): with every request admitted, decoding starts there.
    """

    def __init__(self, engine: Any):
        self.engine = engine
        self.seconds = 0.0
        self.admitted_at = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def load_params(self) -> Any:
        return self._call(self.engine.load_params)

    def init_decode_state(self) -> Any:
        return self._call(self.engine.init_decode_state)

    def prefill(self, **kwargs: Any) -> Any:
        prefix, first = self._call(self.engine.prefill, **kwargs)
        return prefix, _TimedResult(first, self, admission=True)

    def prefill_batch(self, **kwargs: Any) -> Any:
        # the driver's path on an engine declaring batched_prefill: timed like prefill, or
        # its forward counts as driver overhead
        done = self._call(self.engine.prefill_batch, **kwargs)
        return [(prefix, _TimedResult(first, self, admission=True)) for prefix, first in done]

    def insert(self, prefix: Any, state: Any, slot: int) -> Any:
        out = self._call(self.engine.insert, prefix, state, slot)
        self.admitted_at = time.perf_counter()
        return out

    def bulk_insert(self, prefix: Any, state: Any, slots: Any) -> Any:
        state, first = self._call(self.engine.bulk_insert, prefix, state, slots)
        self.admitted_at = time.perf_counter()
        return state, _TimedResult(first, self, admission=True)

    def generate(self, params: Any, state: Any, **kwargs: Any) -> Any:
        state, result = self._call(self.engine.generate, params, state, **kwargs)
        return state, _TimedResult(result, self, admission=False)

    def free_resource(self, state: Any, slot: int) -> Any:
        return self._call(self.engine.free_resource, state, slot)


def engine_build(engine: Any, shape: tuple[int, int, int], seconds: float) -> dict[str, Any]:
    """What building one engine cost: its construction time and, when the engine has the
    optional ``bench_report()``, what that says (``"compile"``: one row per program compiled
    or loaded from a cache, ``{"program", "bucket", "seconds", "source"}``; other keys are
    scalar stats). Static-graph backends compile there, so this is their cold/warm start."""
    return refresh_build({"shape": list(shape), "seconds": seconds}, engine)


def refresh_build(build: dict[str, Any], engine: Any) -> dict[str, Any]:
    """Update ``build`` with the engine's ``bench_report()`` now (its stats grow as it runs)."""
    report = getattr(engine, "bench_report", None)
    if callable(report):
        try:
            build.update(report())
        except Exception as exc:  # a broken report must not lose the measurements
            build["report_error"] = f"{type(exc).__name__}: {exc}"
    return build


class PolyengineSystem:
    """One backend with one dtype and one set of engine options."""

    def __init__(self, *, model: Any, backend: str, dtype: str | None, options: dict[str, Any]):
        from polyengine.models import load_model

        self.backend, self.dtype, self.options = backend, dtype, dict(options)
        self.model = load_model(model, exclusive=True)  # one option set: int8 copies are shared, floats released
        self.vocab_size = self.model.config.vocab_size
        self._key: tuple[int, int, int] | None = None
        self._llm: Any = None
        self.description: dict[str, Any] = {}
        self.builds: list[dict[str, Any]] = []
        self._engine: Any = None

    @property
    def first_build_seconds(self) -> float | None:
        """The first engine's construction (its weights prepared for the backend): part of
        what loading costs a user (the ``load_s`` metric)."""
        return self.builds[0]["seconds"] if self.builds else None

    # -- engines -------------------------------------------------------------------------

    def llm(self, slots: int, prefill_len: int, cache_len: int, *, prefix_cache: bool = True,
            prefill_chunk: int | None = None, options: dict[str, Any] | None = None) -> Any:
        """An LLM over a timed engine of this shape (the previous one is released first).
        ``prefix_cache`` False builds it with ``prefix_cache_bytes=0``; ``prefill_chunk``
        as ``EngineConfig.prefill_chunk`` (None: the default); ``options`` in place of
        the row's engine options (the pages part's page settings)."""
        import polyengine
        from polyengine.construction import speed_paths

        options = self.options if options is None else options
        key = (slots, prefill_len, cache_len, prefix_cache, prefill_chunk, tuple(sorted(options.items())))
        if key != self._key:
            self._llm = self._key = self._engine = None
            gc.collect()  # drop the last engine's weights and caches before allocating new ones
            config = dict(max_slots=slots, max_prefill_length=prefill_len, max_cache_length=cache_len,
                          dtype=self.dtype, options=options, prefill_chunk=prefill_chunk)
            if not prefix_cache:
                config["prefix_cache_bytes"] = 0
            start = time.perf_counter()
            engine = polyengine.create_engine(self.backend, model=self.model, config=config)
            self._llm = polyengine.LLM.from_engine(TimedEngine(engine), self.model.tokenizer, tools=False)
            # construction, weights and decode state: a static-graph backend compiles here
            self.builds.append(engine_build(engine, key[:3], time.perf_counter() - start))
            self._engine = engine
            self._key = key
            if not self.description:
                self.description = {
                    "backend": engine.name,
                    "dtype": getattr(engine, "dtype", None) or engine.capabilities.dtypes[0],
                    "options": self.options,
                    "device": getattr(engine, "device", ""),
                    "paths": speed_paths(engine),  # kernels or fallback, int8 path: what this row measured
                    "async_results": engine.capabilities.async_results,
                }
            self.description["engine_builds"] = self.builds
        return self._llm

    # -- the phases ----------------------------------------------------------------------

    def _run(self, llm: Any, requests: list[Request]) -> tuple[Any, list, dict[str, Any]]:
        """Submit every request at once, step until all are done; time every step."""
        from polyengine import SamplingParams

        timed: TimedEngine = llm.engine
        t0 = time.perf_counter()
        reqs = [llm.submit(r.prompt, SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
                for r in requests]
        first: list[float | None] = [None] * len(reqs)
        ends, counts, overhead = [], [], 0.0
        while not all(r.done for r in reqs):
            engine_before, start = timed.seconds, time.perf_counter()
            more = llm.step()
            end = time.perf_counter()
            overhead += (end - start) - (timed.seconds - engine_before)
            tokens = 0
            for i, r in enumerate(reqs):
                while r.events:
                    n = len(r.events.popleft().token_ids)
                    tokens += n
                    if n and first[i] is None:
                        first[i] = end - t0
            ends.append(end)
            counts.append(tokens)
            if not more and not all(r.done for r in reqs):
                raise RuntimeError("the driver went idle before every request finished")
        for r in reqs:
            if r.error is not None:
                raise r.error
        refresh_build(self.builds[-1], self._engine)
        return reqs, first, {"t0": t0, "ends": ends, "counts": counts, "overhead": overhead}

    def decode(self, prompts: list[list[int]], new_tokens: int, room: int | None = None) -> DecodeRun:
        plen = len(prompts[0])
        llm = self.llm(len(prompts), plen, plen + (new_tokens if room is None else room))
        reqs, _, t = self._run(llm, [Request(p, new_tokens) for p in prompts])
        produced = sum(len(r.completion.outputs[0].token_ids) for r in reqs)
        # Every request is admitted in the first step (there is a slot for each), so the
        # decode phase starts when the last admission ended.
        start = llm.engine.admitted_at
        ends = t["ends"]
        return DecodeRun(
            decode_tokens=produced - len(reqs),
            decode_seconds=ends[-1] - start,
            step_seconds=[b - a for a, b in zip(ends, ends[1:])],
            step_tokens=t["counts"][1:],
            overhead_seconds=t["overhead"],
            steps=len(ends),
        )

    def prefill(self, prompt: list[int]) -> float:
        from polyengine import SamplingParams

        llm = self.llm(1, len(prompt), len(prompt) + 2)
        engine, params = llm.engine.engine, llm.scheduler.params
        start = time.perf_counter()
        prefix, first = engine.prefill(params=params, tokens=prompt, sampling=SamplingParams(temperature=0))
        first.tokens  # noqa: B018 - reading the token waits for the device and copies it to the host
        seconds = time.perf_counter() - start
        del prefix
        refresh_build(self.builds[-1], self._engine)
        return seconds

    def serve_cache(self, requests: list[Request], slots: int, sized_for: list[Request] | None, cache: bool) -> ServeRun:
        return self.serve(requests, slots, sized_for, prefix_cache=cache)

    def serve(self, requests: list[Request], slots: int, sized_for: list[Request] | None = None,
              prefix_cache: bool = True) -> ServeRun:
        shape = sized_for or requests
        llm = self.llm(slots, max(len(r.prompt) for r in shape), max(len(r.prompt) + r.max_tokens for r in shape),
                       prefix_cache=prefix_cache)
        reqs, first, t = self._run(llm, requests)
        return ServeRun(
            completion_tokens=sum(len(r.completion.outputs[0].token_ids) for r in reqs),
            seconds=t["ends"][-1] - t["t0"],
            ttfts=[f for f in first if f is not None],
            overhead_seconds=t["overhead"],
            steps=len(t["ends"]),
        )

    # -- the prefix part (benchmarks/prefix_phases.py) ----------------------------------------

    def _first_token(self, llm: Any, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
        """One request alone: seconds from submitting it to its first token on the host
        (the end of its admission: the last piece prefilled, inserted, its token read),
        and its completion (greedy, EOS ignored)."""
        from polyengine import SamplingParams

        timed: TimedEngine = llm.engine
        start = time.perf_counter()
        req = llm.submit(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
        while not req.samples[0].out.token_ids:
            llm.step()
        ttft = timed.admitted_at - start
        while not req.done:
            llm.step()
        if req.error is not None:
            raise req.error
        return ttft, req.completion.token_ids

    def shared(self, system: list[int], users: list[list[int]], new_tokens: int, cache: bool) -> list[float]:
        longest = len(system) + max(len(u) for u in users)
        llm = self.llm(8, longest, longest + new_tokens, prefix_cache=cache)
        out = [self._first_token(llm, system + u, new_tokens)[0] for u in users]
        refresh_build(self.builds[-1], self._engine)
        return out

    def turns(self, firsts: list[list[int]], users: list[list[list[int]]], answer: int, cache: bool) -> list[list[float]]:
        longest = max(len(f) for f in firsts) + len(users) * (answer + max(len(u) for t in users for u in t))
        llm = self.llm(8, longest, longest + answer, prefix_cache=cache)
        convs, out = [list(f) for f in firsts], []
        for turn in range(len(users) + 1):
            times = []
            for c, prompt in enumerate(convs):
                ttft, completion = self._first_token(llm, prompt, answer)
                times.append(ttft)
                if turn < len(users):
                    convs[c] = prompt + completion + users[turn][c]
            out.append(times)
        refresh_build(self.builds[-1], self._engine)
        return out

    def loaded(self, streams: list[list[int]], prompt: list[int], margin: int, chunked: bool) -> "LoadedRun":
        from polyengine import SamplingParams
        from polyengine.benchmarks.prefix_phases import LoadedRun
        from polyengine.driver.prefill import DEFAULT_PREFILL_CHUNK, DEFAULT_STEP_TOKENS

        chunk = None if chunked else 0
        per_step = min(DEFAULT_PREFILL_CHUNK, DEFAULT_STEP_TOKENS)
        steps = 2 * margin + 8 + (-(-len(prompt) // per_step) if chunked else 1)
        cache_len = max(len(prompt) + 2, max(len(s) for s in streams) + steps + 2)
        llm = self.llm(len(streams) + 1, len(prompt), cache_len, prefill_chunk=chunk)
        sp = SamplingParams(temperature=0, max_tokens=cache_len - max(len(s) for s in streams), ignore_eos=True)
        reqs = [llm.submit(s, sp) for s in streams]
        got = [0] * len(reqs)
        stamps: list[list[float]] = [[] for _ in reqs]

        def step() -> None:
            llm.step()
            now = time.perf_counter()
            for i, r in enumerate(reqs):
                n = len(r.samples[0].out.token_ids)
                if n > got[i]:
                    got[i] = n
                    stamps[i].append(now)

        while min(len(s) for s in stamps) < margin + 1:
            step()
        window = [s[-margin - 1] for s in stamps]  # margin gaps before the arrival
        arrived = time.perf_counter()
        timed: TimedEngine = llm.engine
        before = timed.admitted_at
        long = llm.submit(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        while not long.samples[0].out.token_ids:
            step()
        ttft = timed.admitted_at - arrived if timed.admitted_at != before else time.perf_counter() - arrived
        after = [len(s) for s in stamps]
        while min(len(s) - a for s, a in zip(stamps, after)) < margin:
            step()
        for r in reqs:
            r.cancel()
        gaps = [b - a for s, w in zip(stamps, window) for a, b in zip(s, s[1:]) if a >= w]
        pace = [b - a for s, w in zip(stamps, window) for a, b in zip(s, s[1:]) if a >= w and b <= arrived]
        refresh_build(self.builds[-1], self._engine)
        return LoadedRun(gaps=gaps, before=pace, prompt_ttft=ttft, chunk=llm.scheduler.prefiller.chunk)

    # -- the pages part (benchmarks/pages_phases.py) -------------------------------------------

    def pages_run(self, requests: list[Request], *, paged: bool, work: Any, warmup: list[Request]) -> "PagesRun":
        """The setting's engine (paged: the row's options with ``page_size`` and a bounded
        ``kv_pages``, a slot per request; reserved: without pages, ``pages_reserved_slots``
        slots), ``warmup`` on it, its cached prefixes dropped, then every request at once."""
        from polyengine import SamplingParams
        from polyengine.benchmarks.pages_phases import PagesRun
        from polyengine.benchmarks.stats import MIB

        options = {k: v for k, v in self.options.items() if k not in ("page_size", "kv_pages")}
        if paged:
            options.update(page_size=work.pages_page_size, kv_pages=work.pages_pool)
        slots = work.pages_requests if paged else work.pages_reserved_slots
        llm = self.llm(slots, work.pages_prompt, work.pages_context, options=options)
        engine = self._engine
        pool = engine.pages if paged else None
        self._run(llm, warmup)
        if llm.scheduler.prefix_cache is not None:
            llm.scheduler.prefix_cache.clear()
        gc.collect()
        preempted = llm.page_stats["preemptions"]
        start, cpu_start = time.perf_counter(), time.process_time()
        reqs = [llm.submit(r.prompt, SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True))
                for r in requests]
        running = held = 0
        while not all(r.done for r in reqs):
            more = llm.step()
            running = max(running, sum(r.status == "running" for r in reqs))
            held = max(held, pool.held) if pool is not None else 0
            if not more and not all(r.done for r in reqs):
                raise RuntimeError("the driver went idle before every request finished")
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        positions = pool.capacity * pool.page_size if pool is not None else slots * work.pages_context
        kv_bytes = getattr(engine, "kv_bytes", None)
        tokens = [len(r.completion.outputs[0].token_ids) if r.error is None else 0 for r in reqs]
        refresh_build(self.builds[-1], engine)
        return PagesRun(
            requests=len(reqs),
            completed=sum(r.error is None and n == q.max_tokens for r, n, q in zip(reqs, tokens, requests)),
            failed=sum(r.error is not None for r in reqs),
            peak_running=running,
            preemptions=llm.page_stats["preemptions"] - preempted,
            peak_pages=held if pool is not None else None,
            pool_pages=pool.capacity if pool is not None else None,
            kv_positions=positions,
            kv_mib=kv_bytes(positions) / MIB if callable(kv_bytes) else None,
            cached_tokens=sum(r.cached_tokens for r in reqs),
            seconds=seconds,
            completion_tokens=sum(tokens),
            cpu_seconds=cpu_seconds,
        )
