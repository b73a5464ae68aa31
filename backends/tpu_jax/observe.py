"""What the engine tells an operator: memory reports and JAX profiler traces.

- :func:`memory_report`: device bytes in use and the limit (from the devices' own
  ``memory_stats()`` where the platform has them: TPU, GPU; on the CPU, the bytes of
  the live JAX arrays on those devices, with no separate limit) and the host's resident
  bytes and limit. The engine records one after its weights load and one after warm-up
  (``engine.memory_reports``) and logs them on the ``polyengine.tpu_jax`` logger.
- :class:`Profiler`: the engine options ``profiler_port`` (start JAX's profiler server,
  for TensorBoard or ``jax.profiler`` clients to capture from) and ``trace_dir``
  (write a trace of ``trace_steps`` generate steps, starting with the first).
- :class:`CompileLog`: the programs an engine compiled, each with its bucket, the
  seconds it took and whether XLA compiled it or JAX's persistent compilation cache
  supplied it (``engine.bench_report()["compile"]``).
- :func:`diagnose`: what ``polyengine backends --verbose`` says of the JAX backends
  (the devices JAX sees here, and what the int8 options run).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Sequence

import jax

from polyengine.logs import PROGRESS_LOGGER
from polyengine.memory import available_host_memory, gib

__all__ = ["memory_report", "format_report", "Profiler", "CompileLog", "logger"]

logger = logging.getLogger("polyengine.tpu_jax")
_progress = logging.getLogger(PROGRESS_LOGGER)


def _host_resident() -> int | None:
    try:
        with open(f"/proc/{os.getpid()}/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_report(devices: Sequence[Any]) -> dict[str, Any]:
    """Bytes in use and limits on ``devices`` (this process's) and on the host."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    stats = [d.memory_stats() for d in local]
    if local and all(stats):
        in_use = sum(int(s.get("bytes_in_use", 0)) for s in stats)
        limit = sum(int(s.get("bytes_limit", 0)) for s in stats) or None
        source = "memory_stats"
    else:  # CPU: no allocator statistics; count the live arrays placed on these devices
        ids = {d.id for d in local}
        in_use = sum(s.data.nbytes for a in jax.live_arrays() for s in a.addressable_shards if s.device.id in ids)
        limit, source = None, "live arrays (the CPU platform keeps no allocator statistics)"
    rss = _host_resident()
    room = available_host_memory()
    return {
        "platform": local[0].platform if local else None,
        "devices": len(local),
        "device_bytes_in_use": in_use,
        "device_bytes_limit": limit,
        "device_source": source,
        "host_bytes_resident": rss,
        "host_bytes_limit": None if room is None or rss is None else rss + room,
    }


def format_report(report: dict[str, Any]) -> str:
    def g(x):
        return "unknown" if x is None else gib(x)

    return (f"{report['platform']} x{report['devices']}: {g(report['device_bytes_in_use'])} in use of "
            f"{g(report['device_bytes_limit'])} ({report['device_source']}); host {g(report['host_bytes_resident'])} "
            f"resident of {g(report['host_bytes_limit'])}")


# JAX times a program's compilation in three events, in this order: tracing to a
# jaxpr, lowering to an MLIR module, and the backend compile (XLA, or a read from the
# persistent compilation cache, which it reports as a separate event just before).
_TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_current = threading.local()  # .call: the _Tracked engine call running in this thread
_listen_lock = threading.Lock()
_listening = False


def _on_event(event: str, **_: Any) -> None:
    if event == _CACHE_HIT_EVENT:
        _current.hit = True


def _on_duration(event: str, secs: float, **kw: Any) -> None:
    if event in _TRACE_EVENTS:  # part of the program whose backend compile comes next
        _current.pending = getattr(_current, "pending", 0.0) + secs
    if event != _COMPILE_EVENT:
        return
    call, hit, pending = getattr(_current, "call", None), getattr(_current, "hit", False), getattr(_current, "pending", 0.0)
    _current.hit, _current.pending = False, 0.0
    if call is not None:
        call.log.record(kw.get("fun_name", "?"), call.bucket, pending + secs, "cache" if hit else "compiled")


class _Tracked:
    __slots__ = ("log", "bucket", "outer")

    def __init__(self, log: "CompileLog", bucket: str):
        self.log, self.bucket = log, bucket

    def __enter__(self) -> None:
        self.outer = getattr(_current, "call", None)
        _current.call, _current.pending = self, 0.0

    def __exit__(self, *exc: Any) -> None:
        _current.call = self.outer


class CompileLog:
    """The programs compiled while one engine's calls run (``with log.track(bucket):``).

    One process-wide pair of ``jax.monitoring`` listeners (JAX has no per-program
    hook) hands each compilation to the innermost tracked call running in that thread;
    a program compiles synchronously inside the call that first needs it, so the
    attribution is exact. A row's seconds are the program's tracing, lowering and
    backend compile (or persistent-cache read) together. Programs that exist once per prefill bucket (``per_bucket``)
    are recorded with the bucket of the call, the others with ``"-"``.
    """

    def __init__(self, per_bucket: Sequence[str] = ()):
        global _listening
        self.per_bucket = frozenset(per_bucket)
        self.rows: list[dict[str, Any]] = []
        with _listen_lock:
            if not _listening:
                jax.monitoring.register_event_listener(_on_event)
                jax.monitoring.register_event_duration_secs_listener(_on_duration)
                _listening = True

    def track(self, bucket: int | str = "-") -> _Tracked:
        return _Tracked(self, str(bucket))

    def record(self, fun_name: str, bucket: str, seconds: float, source: str) -> None:
        program = fun_name.removeprefix("jit(").removesuffix(")")
        bucket = bucket if program in self.per_bucket else "-"
        self.rows.append({"program": program, "bucket": bucket, "seconds": seconds, "source": source})
        if source == "compiled":  # JAX reports a compile once it is done: the line comes after it
            _progress.info("compiled the %s program%s in %.1f s (first use in this process)", program,
                           "" if bucket == "-" else f" for bucket {bucket}", seconds)


_servers: dict[int, Any] = {}
_server_lock = threading.Lock()


class Profiler:
    """The profiler switches of one engine. A server is started once per process and
    port (JAX allows one); a trace covers the engine's first ``trace_steps`` generate
    steps, and :meth:`stop` ends it early (the engine calls it when it is closed)."""

    def __init__(self, *, port: int = 0, trace_dir: str = "", trace_steps: int = 16):
        self.trace_dir, self.trace_steps = trace_dir, trace_steps
        self.steps = 0
        self.tracing = False
        if port:
            with _server_lock:
                if port not in _servers:
                    _servers[port] = jax.profiler.start_server(port)
                    logger.info("JAX profiler server listening on port %d", port)

    def before_step(self) -> None:
        if self.trace_dir and self.steps == 0 and not self.tracing:
            jax.profiler.start_trace(self.trace_dir)
            self.tracing = True

    def after_step(self, outputs: Any) -> None:
        if not self.tracing:
            return
        self.steps += 1
        if self.steps >= self.trace_steps:
            jax.block_until_ready(outputs)  # the trace should hold the steps' device work
            self.stop()

    def stop(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False
            logger.info("wrote a JAX trace of %d generate steps to %s", self.steps, self.trace_dir)


def diagnose() -> dict[str, str]:
    """The devices an engine with the default options would use here, and its int8 paths."""
    devices = jax.devices()
    kind = devices[0].device_kind if devices else "none"
    out = {"device": f"{devices[0].platform if devices else 'none'}: {len(devices)} device(s) ({kind}); "
                     f"JAX {jax.__version__}, {jax.process_count()} process(es)"}
    if devices and devices[0].platform == "cpu":
        out["note"] = ("no TPU or GPU visible to JAX: XLA's CPU backend (install jax[tpu] on a TPU host; "
                       "XLA_FLAGS=--xla_force_host_platform_device_count=N for N CPU devices)")
    out["prefix tails"] = ("import_prefix_tail (capability portable_prefix_tail): tpu_jax with page_size shares the "
                           "held prefix's pages below the tail's start and writes only the tail into pages; without "
                           "pages, the kit's copy through the host; tpu_jax_ray: not declared")
    out["int8"] = ("off by default; option quantize: int8 weights (XLA dot on the int8 matrix, scaled per channel, "
                   "or dequantized per block); kv_quantize=int8: an int8 KV cache")
    return out
