"""Prometheus metrics of one server (one registry per app, so several apps in one
process, as in tests, do not share counters).

Exposed at ``GET /metrics``:
- ``polyengine_requests_total{endpoint, status}``: API requests by HTTP status,
  counted when the response starts (a stream cut short still counts as its 200).
- ``polyengine_prompt_tokens_total``, ``polyengine_generation_tokens_total``: tokens
  of every engine request that ended, cancelled ones included.
- ``polyengine_requests_cancelled_total``: engine requests cancelled before they ended
  (client disconnected, or shutdown).
- ``polyengine_queue_depth``, ``polyengine_running_requests``: requests waiting for a
  slot and holding one, as of the last engine step.
- ``polyengine_time_to_first_token_seconds``: from the request's arrival at the server
  to its first token; ``polyengine_inter_token_latency_seconds``: between a request's
  successive steps that gave it tokens; ``polyengine_request_duration_seconds``.
- The driver's prefix cache (docs/prefix-caching.md), read at each scrape:
  ``polyengine_prefix_cache_queries_total`` (prompts looked up) and
  ``polyengine_prefix_cache_query_tokens_total`` (their tokens),
  ``polyengine_prefix_cache_hits_total`` (prompts that continued a cached prefix) and
  ``polyengine_prefix_cache_hit_tokens_total`` (prompt tokens it supplied),
  ``polyengine_prefix_cache_evictions_total``; gauges ``polyengine_prefix_cache_bytes``,
  ``polyengine_prefix_cache_entries`` and ``polyengine_prefix_cache_budget_bytes``
  (0 when the cache is off).
- K/V pages of a paged engine (docs/prefix-caching.md, "Pages"), read at each scrape:
  gauges ``polyengine_kv_pages_total`` and ``polyengine_kv_pages_free`` (the bounded
  pool's size and its free pages; 0 for an unbounded pool or an engine without pages),
  ``polyengine_kv_pages_in_use`` (pages held by slots and prefixes) and
  ``polyengine_kv_pages_shared`` (held more than once); the counter
  ``polyengine_preemptions_total`` (requests that gave their pages back and were
  recomputed later).
- The prefill lane (docs/serving.md, "The prefill lane"): the counter
  ``polyengine_prefill_lane_pieces_total`` (prompt pieces prefilled there, beside the
  steps; 0 on an engine without ``prefill_lane``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from polyengine.driver.async_llm import AsyncLLM, AsyncRequest

__all__ = ["Metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("polyengine_requests", "API requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("polyengine_prompt_tokens", "prompt tokens of ended requests", registry=r)
        self.generation_tokens = Counter("polyengine_generation_tokens", "completion tokens generated", registry=r)
        self.cancelled = Counter("polyengine_requests_cancelled", "engine requests cancelled before they ended",
                                 registry=r)
        self.queue_depth = Gauge("polyengine_queue_depth", "requests waiting for a slot", registry=r)
        self.running = Gauge("polyengine_running_requests", "requests holding slots", registry=r)
        self.ttft = Histogram("polyengine_time_to_first_token_seconds", "arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("polyengine_inter_token_latency_seconds", "time between a request's token steps",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("polyengine_request_duration_seconds", "arrival to the last token",
                                  buckets=_LATENCY_BUCKETS, registry=r)

    def watch(self, engine: "AsyncLLM") -> None:
        """Read the engine's queue and slot counts, and its prefix cache, at every scrape."""
        self.queue_depth.set_function(lambda: engine.num_waiting)
        self.running.set_function(lambda: engine.num_running)
        self.registry.register(_PrefixCacheCollector(engine))
        self.registry.register(_PageCollector(engine))

    def track(self, handle: "AsyncRequest", arrived: float) -> None:
        """Record an engine request's tokens and timing when it ends (also after a disconnect)."""

        def ended(h: "AsyncRequest") -> None:
            self.prompt_tokens.inc(len(h.prompt_token_ids))
            c = h.completion
            if c is not None:
                self.generation_tokens.inc(c.usage.completion_tokens)
                if any(o.finish_reason == "cancelled" for o in c.outputs):
                    self.cancelled.inc()
            if h.first_token_at is not None:
                self.ttft.observe(max(0.0, h.first_token_at - arrived))
                self.duration.observe(max(0.0, (h.last_token_at or h.first_token_at) - arrived))
            for gap in h.token_gaps:
                self.itl.observe(gap)

        handle.add_done_callback(ended)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _PrefixCacheCollector:
    """The prefix cache's counters as Prometheus metrics, read from the cache's own
    cumulative counts at each scrape (the engine thread updates them)."""

    _COUNTERS = (
        ("queries", "prompts looked up in the prefix cache"),
        ("query_tokens", "prompt tokens looked up in the prefix cache"),
        ("hits", "prompts that continued a cached prefix"),
        ("hit_tokens", "prompt tokens whose K/V came from the prefix cache"),
        ("evictions", "prefixes evicted from the prefix cache"),
    )

    def __init__(self, engine: "AsyncLLM"):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        cache = self.engine.prefix_cache
        stats = None if cache is None else cache.stats
        for name, doc in self._COUNTERS:
            yield CounterMetricFamily(f"polyengine_prefix_cache_{name}", doc, value=getattr(stats, name, 0))
        yield GaugeMetricFamily("polyengine_prefix_cache_bytes", "bytes of K/V the prefix cache holds",
                                value=getattr(stats, "bytes", 0))
        yield GaugeMetricFamily("polyengine_prefix_cache_entries", "prefixes the prefix cache holds",
                                value=getattr(stats, "entries", 0))
        yield GaugeMetricFamily("polyengine_prefix_cache_budget_bytes", "the prefix cache's budget (0: off)",
                                value=0 if cache is None else cache.budget)


class _PageCollector:
    """The K/V page pool's counts, the preemptions and the prefill lane's pieces, read at
    each scrape."""

    _GAUGES = (
        ("total", "K/V pages of the bounded pool (0: unbounded or not paged)"),
        ("free", "free K/V pages of the bounded pool"),
        ("in_use", "K/V pages held by slots and prefixes"),
        ("shared", "K/V pages held more than once (shared prefixes)"),
    )

    def __init__(self, engine: "AsyncLLM"):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.engine.page_stats
        for name, doc in self._GAUGES:
            yield GaugeMetricFamily(f"polyengine_kv_pages_{name}", doc, value=stats[name])
        yield CounterMetricFamily("polyengine_preemptions", "requests preempted to free K/V pages",
                                  value=stats["preemptions"])
        yield CounterMetricFamily("polyengine_prefill_lane_pieces", "prompt pieces prefilled on the engine's "
                                  "prefill lane, beside the decode steps", value=self.engine.lane_prefills)
