"""The subprocess that measures one system: ``python -m polyengine.benchmarks.worker FD``.

It reads one job (JSON) on stdin, builds the system, runs the job's part of the
workload, and writes events as JSON lines to the file descriptor ``FD`` (not stdout:
llama.cpp and transformers print there, and their chatter must not be parsed):

- ``{"event": "progress", "phase": ..., "detail": ...}`` as the runs go;
- ``{"event": "system", "details": ...}`` once the system is built (dtype, threads, ...);
- ``{"event": "partial", "metrics": ..., "details": ...}`` after each finished phase (what a worker
  stopped later still measured);
- then one ``{"event": "result", "metrics": ..., "system": ..., "peak_rss_bytes": ...}``
  or ``{"event": "error", "error": ..., "traceback": ...}``.

The peak RSS is this process's own high-water mark, read after the last run: the
interpreter, the libraries the system imported, its weights, caches and temporaries.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from polyengine.benchmarks.phases import PHASES, run_long, run_standard
from polyengine.benchmarks.stats import peak_rss_bytes
from polyengine.benchmarks.workload import Workload

__all__ = ["build_system", "main"]


def build_system(kind: str, params: dict[str, Any]) -> Any:
    """The system a job names; its heavy imports happen here, in the worker."""
    if kind == "polyengine":
        from polyengine.benchmarks.run_polyengine import PolyengineSystem

        return PolyengineSystem(**params)
    if kind == "transformers":
        from polyengine.benchmarks.run_transformers import TransformersSystem

        return TransformersSystem(**params)
    if kind == "llamacpp":
        from polyengine.benchmarks.run_llamacpp import LlamaCppSystem

        return LlamaCppSystem(**params)
    raise ValueError(f"unknown system kind {kind!r}")


def run_job(job: dict[str, Any], send: Any) -> dict[str, Any]:
    work = Workload.from_dict(job["workload"])

    def emit(phase: str, detail: str) -> None:
        send({"event": "progress", "phase": phase, "detail": detail})

    emit("load", "loading the model")
    start = time.perf_counter()
    system = build_system(job["kind"], job["params"])
    load_seconds = time.perf_counter() - start
    send({"event": "system", "details": getattr(system, "description", {})})
    notes: list[str] = []
    if job["part"] == "long":
        metrics = run_long(system, work, emit)
    elif job["part"] == "pages":
        from polyengine.benchmarks.pages_phases import run_pages

        metrics = run_pages(system, work, emit, notes,
                            done=lambda m: send({"event": "partial", "metrics": m,
                                                 "details": getattr(system, "description", {})}))
    elif job["part"] == "prefix":
        from polyengine.benchmarks.prefix_phases import run_prefix

        metrics = run_prefix(system, work, emit, notes,
                             done=lambda m: send({"event": "partial", "metrics": m,
                                                  "details": getattr(system, "description", {})}))
    else:
        metrics = run_standard(system, work, job["repeats"], emit, phases=job.get("phases") or PHASES,
                               done=lambda m: send({"event": "partial", "metrics": m,
                                                    "details": getattr(system, "description", {})}))
    if job["part"] == "standard":
        # what a user waits for before the first token can be computed: the model's load
        # and the first engine (polyengine: weights prepared for the backend) or context
        # (llama.cpp) built, which the first phase did
        metrics["load_s"] = load_seconds + (getattr(system, "first_build_seconds", None) or 0.0)
    return {
        "event": "result",
        "metrics": metrics,
        "system": getattr(system, "description", {}),
        "load_seconds": load_seconds,
        "peak_rss_bytes": peak_rss_bytes(),
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = os.fdopen(int(argv[0]), "w", buffering=1, encoding="utf-8")

    def send(event: dict[str, Any]) -> None:
        out.write(json.dumps(event, default=str) + "\n")
        out.flush()

    try:
        job = json.loads(sys.stdin.read())
        send(run_job(job, send))
        return 0
    except BaseException as exc:  # report everything, KeyboardInterrupt included, then fail
        send({"event": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return 1
    finally:
        out.close()


if __name__ == "__main__":
    sys.exit(main())
