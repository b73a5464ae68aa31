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

    # -- engines -------------------------------------------------------------------------

    def llm(self, slots: int, prefill_len: int, cache_len: int) -> Any:
        """An LLM over a timed engine of this shape (the previous one is released first)."""
        import polyengine
        from polyengine.construction import speed_paths

        key = (slots, prefill_len, cache_len)
        if key != self._key:
            self._llm = self._key = self._engine = None
            gc.collect()  # drop the last engine's weights and caches before allocating new ones
            config = dict(max_slots=slots, max_prefill_length=prefill_len, max_cache_length=cache_len,
                          dtype=self.dtype, options=self.options)
            start = time.perf_counter()
            engine = polyengine.create_engine(self.backend, model=self.model, config=config)
            self._llm = polyengine.LLM.from_engine(TimedEngine(engine), self.model.tokenizer, tools=False)
            # construction, weights and decode state: a static-graph backend compiles here
            self.builds.append(engine_build(engine, key, time.perf_counter() - start))
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

    def serve(self, requests: list[Request], slots: int, sized_for: list[Request] | None = None) -> ServeRun:
        shape = sized_for or requests
        llm = self.llm(slots, max(len(r.prompt) for r in shape), max(len(r.prompt) + r.max_tokens for r in shape))
        reqs, first, t = self._run(llm, requests)
        return ServeRun(
            completion_tokens=sum(len(r.completion.outputs[0].token_ids) for r in reqs),
            seconds=t["ends"][-1] - t["t0"],
            ttfts=[f for f in first if f is not None],
            overhead_seconds=t["overhead"],
            steps=len(t["ends"]),
        )
