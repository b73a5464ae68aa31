"""The ``prefix`` part: prefix caching and chunked prefill, on and off, in one run.

Three workloads (sizes in :class:`~.workload.Workload`, prompts from its seeded
generator) and the standard serve phase again:

- **shared prefix**: one system prompt, then requests one at a time, each the system
  prompt plus a distinct user turn; time to first token (TTFT), median and p90 over the
  requests, with the prefix cache and without. The first requests fill the cache, so
  they are in the numbers too.
- **multi-turn**: conversations one request at a time; each turn's prompt is the last
  turn's prompt, its answer (greedy) and a new message; TTFT per turn (median over the
  conversations), with the cache and without.
- **long prompt under load**: streams decode; a long prompt arrives; the streams'
  inter-token latency (ITL: the gaps between a stream's successive tokens) from
  ``loaded_margin`` steps before the arrival to ``loaded_margin`` steps after the long
  prompt's first token, median, p99 and max, with chunked prefill and without; also the
  median of the gaps before the arrival (the streams' own pace) and that prompt's TTFT.
- **serve**: the standard serve phase with the cache on and off (end-to-end tok/s):
  what the cache costs a workload it cannot help.

TTFT here is from submitting a request to its first token on the host; a polyengine
request's admission ends there (its last prefill piece ran, it was inserted, its token
read). Each workload runs once per setting after a warm-up of the same shapes with
other prompts (each has many samples: requests, turns, steps). A system that cannot run
a workload (no scheduler to add a prompt to running streams, say) lacks the method, and
its row shows ``-`` there with a note.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Protocol

from polyengine.benchmarks.stats import median, percentile, rate
from polyengine.benchmarks.workload import Workload, prompts, serve_requests

__all__ = ["LoadedRun", "PrefixSystem", "run_prefix", "shared_prompts", "turn_prompts", "loaded_prompts"]

Emit = Callable[[str, str], None]


@dataclass
class LoadedRun:
    gaps: list[float]  # the running streams' inter-token gaps in the window
    before: list[float]  # those that ended before the prompt arrived: the streams' own pace
    prompt_ttft: float  # the arriving prompt's time to first token
    chunk: int = 0  # the chunk size it ran with (0: whole prompts)


class PrefixSystem(Protocol):
    """What a system implements of the part; each method is optional."""

    def shared(self, system: list[int], users: list[list[int]], new_tokens: int, cache: bool) -> list[float]:
        """TTFT of each request (system prompt + user turn), run one after another."""
        ...

    def turns(self, firsts: list[list[int]], users: list[list[list[int]]], answer: int, cache: bool) -> list[list[float]]:
        """TTFT ``[turn][conversation]``; ``users[t][c]`` is conversation c's message after turn t."""
        ...

    def loaded(self, streams: list[list[int]], prompt: list[int], margin: int, chunked: bool) -> LoadedRun:
        ...

    def serve_cache(self, requests: list, slots: int, sized_for: list | None, cache: bool):
        """The standard serve phase (a ``phases.ServeRun``) with the prefix cache on or off."""
        ...


def shared_prompts(work: Workload, vocab: int, phase: str = "shared") -> tuple[list[int], list[list[int]]]:
    system = prompts(vocab, 1, work.shared_system, phase=phase, seed=work.seed)[0]
    users = prompts(vocab, work.shared_requests, work.shared_user, phase=phase, seed=work.seed + 1)
    return system, users


def turn_prompts(work: Workload, vocab: int, phase: str = "turns") -> tuple[list[list[int]], list[list[list[int]]]]:
    firsts = prompts(vocab, work.turn_conversations, work.turn_first, phase=phase, seed=work.seed)
    users = [prompts(vocab, work.turn_conversations, work.turn_user, phase=phase, seed=work.seed + 1 + t)
             for t in range(work.turns - 1)]
    return firsts, users


def loaded_prompts(work: Workload, vocab: int, phase: str = "loaded") -> tuple[list[list[int]], list[int]]:
    streams = prompts(vocab, work.loaded_streams, work.loaded_stream_prompt, phase=phase, seed=work.seed)
    return streams, prompts(vocab, 1, work.loaded_prompt, phase=phase, seed=work.seed + 1)[0]


def _itl(run: LoadedRun) -> dict[str, float]:
    gaps = run.gaps
    return {"median": median(gaps), "p99": percentile(gaps, 99), "max": max(gaps), "before": median(run.before)}


def _on_off(emit: Emit, title: str, labels: tuple[str, str], warm: Callable[[bool], object],
            run: Callable[[bool], object]) -> dict[str, object]:
    """Warm up, then run, with the feature on (``labels[0]``) and off (``labels[1]``)."""
    out = {}
    for on, label in zip((True, False), labels):
        emit(f"prefix: {title}", f"warm-up ({label})")
        warm(on)
        emit(f"prefix: {title}", label)
        out[label] = run(on)
    return out


def run_prefix(system: PrefixSystem, work: Workload, emit: Emit, notes: list[str],
               done: Callable[[dict], None] = lambda metrics: None) -> dict:
    """Every workload the system implements; returns the metrics (plain numbers)."""
    vocab = system.vocab_size
    small = replace(work, shared_requests=min(3, work.shared_requests), turn_conversations=1)
    metrics: dict = {}
    name = type(system).__name__
    cache = ("cache", "no_cache")
    if hasattr(system, "shared"):
        out = _on_off(emit, "shared prefix", cache,
                      lambda on: system.shared(*shared_prompts(small, vocab, "warmup"), small.shared_new_tokens, on),
                      lambda on: system.shared(*shared_prompts(work, vocab), work.shared_new_tokens, on))
        metrics["prefix_shared_ttft_p50_s"] = {k: median(v) for k, v in out.items()}
        metrics["prefix_shared_ttft_p90_s"] = {k: percentile(v, 90) for k, v in out.items()}
        metrics["prefix_shared_ttft_samples_s"] = out
        done(metrics)
    else:
        notes.append(f"{name}: no shared-prefix run (it has no way to reuse a prompt's K/V)")
    if hasattr(system, "turns"):
        out = _on_off(emit, "multi-turn", cache,
                      lambda on: system.turns(*turn_prompts(small, vocab, "warmup"), small.turn_answer, on),
                      lambda on: system.turns(*turn_prompts(work, vocab), work.turn_answer, on))
        metrics["prefix_turn_ttft_s"] = {k: [median(t) for t in v] for k, v in out.items()}
        done(metrics)
    if hasattr(system, "loaded"):
        out = _on_off(emit, "long prompt under load", ("chunked", "whole"),
                      lambda on: system.loaded(*loaded_prompts(work, vocab, "warmup"), work.loaded_margin, on),
                      lambda on: system.loaded(*loaded_prompts(work, vocab), work.loaded_margin, on))
        metrics["prefix_loaded_itl_s"] = {k: _itl(run) for k, run in out.items()}
        metrics["prefix_loaded_ttft_s"] = {k: run.prompt_ttft for k, run in out.items()}
        metrics["prefix_loaded_chunk"] = out["chunked"].chunk
        done(metrics)
    else:
        notes.append(f"{name}: no long-prompt-under-load run (no scheduler adds a prompt to running streams)")
    if hasattr(system, "serve_cache"):
        reqs = serve_requests(work, vocab)
        out = _on_off(emit, "serve", cache,
                      lambda on: system.serve_cache(reqs[: min(4, len(reqs))], work.serve_slots, reqs, on),
                      lambda on: system.serve_cache(reqs, work.serve_slots, None, on))
        metrics["prefix_serve_e2e_tok_s"] = {k: rate(run.completion_tokens, run.seconds) for k, run in out.items()}
        done(metrics)
    return metrics
