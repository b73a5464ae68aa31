"""The ``pages`` part: the paged K/V memory target, paged K/V against full reservations.

The issue: "with a 4,096-token context, 64 concurrent requests of ~600 tokens each run
in the KV memory that 8 full reservations take today, none failed". One workload (sizes
in :class:`~.workload.Workload`'s ``pages_*`` fields), in two variants and two settings:

- **shared**: every prompt begins with the same ``pages_system``-token system prompt,
  then its own tokens up to ``pages_prompt``; **distinct**: every prompt its own.
- **paged**: the backend's option ``page_size`` = ``pages_page_size`` with a bounded pool
  ``kv_pages`` = ``pages_reserved_slots x pages_context / pages_page_size`` (the positions
  of the full reservations), ``max_slots`` = ``pages_requests``;
  **reserved**: the same engine without pages, ``max_slots`` = ``pages_reserved_slots``
  (a full ``pages_context`` of K/V per slot: what those reservations allow).

Each run submits all ``pages_requests`` requests at once (greedy, EOS ignored,
``pages_new_tokens`` each) and steps to the end: requests completed and failed, the most
running at once, preemptions, the most pages held at once (slots and cached prefixes
together), the K/V positions the engine holds (the pool, or slots x context), the
prompt tokens the prefix cache gave, the seconds from submission to the last token and
the worker process's CPU seconds over them (user + sys, every thread). Counts and memory
are exact; seconds are what the host gave (a loaded host stretches them), while the CPU
seconds barely move with the load, so the two engines' cost compares on a busy host
too (docs/prefix-caching.md, "The memory target"). A warm-up of two requests of other prompts runs first on each engine,
and its cached prefixes are dropped before the measured run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Protocol

from polyengine.benchmarks.workload import Request, Workload, prompts

__all__ = ["PagesRun", "PagesSystem", "VARIANTS", "SETTINGS", "pages_requests", "run_pages"]

VARIANTS = ("shared", "distinct")
SETTINGS = ("paged", "reserved")
Emit = Callable[[str, str], None]


@dataclass
class PagesRun:
    requests: int
    completed: int  # finished with every token asked for
    failed: int  # ended with an error
    peak_running: int  # the most requests holding slots at once
    preemptions: int
    peak_pages: int | None  # the most pages held at once (None: no pages)
    pool_pages: int | None  # the pool's capacity (None: no pages)
    kv_positions: int  # K/V positions the engine holds: pool pages x page size, or slots x context
    kv_mib: float | None  # those positions' bytes in the engine's K/V dtype
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache, all requests
    seconds: float  # submission of every request to the last token
    completion_tokens: int
    cpu_seconds: float | None = None  # the worker process's CPU time (user + sys, all threads) over ``seconds``


class PagesSystem(Protocol):
    vocab_size: int

    def pages_run(self, requests: list[Request], *, paged: bool, work: Workload, warmup: list[Request]) -> PagesRun:
        """Run every request (submitted at once) on the setting's engine (see the module
        docstring), after ``warmup`` on the same engine."""
        ...


def pages_requests(work: Workload, vocab: int, shared: bool, phase: str = "pages") -> list[Request]:
    """The variant's requests: ``pages_requests`` prompts of ``pages_prompt`` tokens, the
    first ``pages_system`` of them one system prompt when ``shared``."""
    bodies = prompts(vocab, work.pages_requests, work.pages_prompt, phase=phase, seed=work.seed)
    if shared:
        system = prompts(vocab, 1, work.pages_system, phase=phase, seed=work.seed + 1)[0]
        bodies = [system + b[work.pages_system:] for b in bodies]
    return [Request(b, work.pages_new_tokens) for b in bodies]


def run_pages(system: PagesSystem, work: Workload, emit: Emit, notes: list[str],
              done: Callable[[dict], None] = lambda metrics: None) -> dict:
    """Both settings, both variants; the metrics: ``pages_runs[variant][setting]`` (a
    :class:`PagesRun` as a dict) and the workload's sizes."""
    vocab = system.vocab_size
    runs: dict = {v: {} for v in VARIANTS}
    metrics: dict = {"pages_runs": runs, "pages_workload": {
        "requests": work.pages_requests, "prompt": work.pages_prompt, "system": work.pages_system,
        "new_tokens": work.pages_new_tokens, "context": work.pages_context, "page_size": work.pages_page_size,
        "reserved_slots": work.pages_reserved_slots, "kv_pages": work.pages_pool}}
    warm = [Request(r.prompt, 2) for r in pages_requests(work, vocab, True, "warmup")[:2]]
    for setting in SETTINGS:
        for variant in VARIANTS:
            emit(f"pages: {variant}", f"{setting} ({work.pages_requests} requests)")
            run = system.pages_run(pages_requests(work, vocab, variant == "shared"), paged=setting == "paged",
                                   work=work, warmup=warm)
            runs[variant][setting] = asdict(run)
            done(metrics)
    return metrics
