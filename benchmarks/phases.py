"""Warm-up, repeats and medians: the measuring loop every system goes through.

A *system* (polyengine on one backend and setting, transformers in one dtype,
llama.cpp with one file and thread count) implements three timed primitives, each one
run of one phase (:class:`System`); this module decides what runs, in which order, how
often, and turns the runs into the reported metrics. So the definitions below hold for
every row of the table alike:

- decode tok/s at batch B: completion tokens after each request's first, all requests
  together, over the time from the moment every request had its first token (all
  prefills done) to the last token: ``B * (new_tokens - 1) / decode_seconds``.
- prefill tok/s: prompt tokens over the time from the call to the first token on the
  host (prefill plus sampling the first token).
- serve: end-to-end tok/s is all completion tokens over the time from submitting every
  request to the last one finishing; TTFT p50 is the median, over requests, of the time
  from that submission to the request's first token; driver overhead per step is the
  scheduler's time outside engine calls divided by the number of steps.
- long: the decode rate at a full-context batch is the median over decode steps of
  (tokens the step delivered / its duration): one run, and a median over its steps keeps
  one-time costs of the first step (compilation at a new shape) out.

Every phase but ``long`` runs one shortened warm-up (other prompts, same shapes and an
engine sized like the measured run's, ``warmup_tokens`` new tokens) and then ``repeats`` measured runs; a metric is the median
of the per-run values (``stats.summary`` keeps the samples and their spread).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

from polyengine.benchmarks.stats import median, rate, summary
from polyengine.benchmarks.workload import Request, Workload, prompts, serve_requests

__all__ = ["DecodeRun", "ServeRun", "System", "Emit", "PHASES", "run_standard", "run_long"]

PHASES = ("decode", "prefill", "serve")  # the standard part's, in the order they run

Emit = Callable[[str, str], None]  # (phase, detail) for the progress display


@dataclass
class DecodeRun:
    decode_tokens: int  # completion tokens after each request's first
    decode_seconds: float  # from the last request's first token to the last token
    step_seconds: list[float] = field(default_factory=list)  # duration of each decode step
    step_tokens: list[int] = field(default_factory=list)  # tokens that step delivered, all requests
    overhead_seconds: float | None = None  # driver time outside engine calls (polyengine only)
    steps: int | None = None


@dataclass
class ServeRun:
    completion_tokens: int  # tokens the requests asked for (a static batch's extra tokens are not counted)
    seconds: float  # submission of all requests to the last token
    ttfts: list[float]  # per request, from submission to its first token
    overhead_seconds: float | None = None
    steps: int | None = None


class System(Protocol):
    """One row of the table. Each method is one run of a phase; all are greedy, EOS ignored."""

    vocab_size: int

    def decode(self, prompts: list[list[int]], new_tokens: int, room: int | None = None) -> DecodeRun:
        """Run the prompts as one batch, each to exactly ``new_tokens`` tokens. ``room``: size
        the cache for this many new tokens (a warm-up sized like the measured run, so a
        static-shape system compiles its measured shapes there); None: ``new_tokens``."""
        ...

    def prefill(self, prompt: list[int]) -> float:
        """Seconds from the call to the first token on the host."""
        ...

    def serve(self, requests: list[Request], slots: int, sized_for: list[Request] | None = None) -> ServeRun:
        """Run every request (all submitted at once) with at most ``slots`` at a time;
        ``sized_for``: size the engine for these requests instead (the warm-up's)."""
        ...


def _repeat(emit: Emit, phase: str, repeats: int, warmup: Callable[[], object], run: Callable[[], object]) -> list:
    emit(phase, "warm-up")
    warmup()
    out = []
    for i in range(repeats):
        emit(phase, f"run {i + 1}/{repeats}")
        out.append(run())
    return out


def _per_step(runs: list) -> dict | None:
    """Driver overhead per step, median over runs; None where the system has no driver."""
    vals = [r.overhead_seconds / r.steps for r in runs if r.overhead_seconds is not None and r.steps]
    return summary(vals) if len(vals) == len(runs) and vals else None


def run_standard(system: System, work: Workload, repeats: int, emit: Emit,
                 done: Callable[[dict], None] = lambda metrics: None, phases: tuple[str, ...] = PHASES) -> dict:
    """The standard part's ``phases`` (default all: decode, prefill, serve); returns the
    metrics (each a ``stats.summary``).

    ``done(metrics)`` is called after each phase with the metrics so far, so a run
    stopped half way (a time limit, a crash) still reports the phases it finished.
    """
    vocab = system.vocab_size
    warm = prompts(vocab, max(max(work.batches), 1), work.prompt_len, phase="warmup", seed=work.seed)
    metrics: dict = {"decode_tok_s": {}, "decode_overhead_s_per_step": {}} if "decode" in phases else {}
    for b in work.batches if "decode" in phases else ():
        ps = prompts(vocab, b, work.prompt_len, phase="decode", seed=work.seed)
        runs = _repeat(emit, f"decode b{b}", repeats,
                       lambda: system.decode(warm[:b], work.warmup_tokens, room=work.new_tokens),
                       lambda: system.decode(ps, work.new_tokens))
        metrics["decode_tok_s"][str(b)] = summary([rate(r.decode_tokens, r.decode_seconds) for r in runs])
        metrics["decode_overhead_s_per_step"][str(b)] = _per_step(runs)
        done(metrics)

    if "prefill" in phases:
        p = prompts(vocab, 1, work.prefill_len, phase="prefill", seed=work.seed)[0]
        pw = prompts(vocab, 1, work.prefill_len, phase="warmup", seed=work.seed)[0]
        secs = _repeat(emit, f"prefill {work.prefill_len}", repeats, lambda: system.prefill(pw), lambda: system.prefill(p))
        metrics["prefill_tok_s"] = summary([rate(work.prefill_len, s) for s in secs])
        done(metrics)
    if "serve" not in phases:
        return metrics

    reqs = serve_requests(work, vocab)
    wreqs = [replace(r, prompt=w[: len(r.prompt)], max_tokens=min(r.max_tokens, work.warmup_tokens))
             for r, w in zip(reqs, prompts(vocab, len(reqs), max(len(r.prompt) for r in reqs), phase="warmup", seed=work.seed))]
    runs = _repeat(emit, f"serve {len(reqs)} requests", repeats,
                   lambda: system.serve(wreqs, work.serve_slots, sized_for=reqs),
                   lambda: system.serve(reqs, work.serve_slots))
    metrics["serve_e2e_tok_s"] = summary([rate(r.completion_tokens, r.seconds) for r in runs])
    metrics["serve_ttft_p50_s"] = summary([median(r.ttfts) for r in runs])
    metrics["driver_overhead_s_per_step"] = _per_step(runs)
    metrics["serve_steps"] = runs[-1].steps
    return metrics


def run_long(system: System, work: Workload, emit: Emit) -> dict:
    """The full-context batch: one run; its decode rate from the median step time."""
    ps = prompts(system.vocab_size, work.long_batch, work.long_prompt_len, phase="long", seed=work.seed)
    emit(f"long b{work.long_batch}x{work.long_context}", "run 1/1")
    run = system.decode(ps, work.long_new_tokens)
    if run.step_seconds:
        per_step = median([rate(n, s) for n, s in zip(run.step_tokens, run.step_seconds)])
    else:
        per_step = rate(run.decode_tokens, run.decode_seconds)
    return {"long_decode_tok_s": summary([per_step])}
