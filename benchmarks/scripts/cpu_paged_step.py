"""Decode steps of the cpu engine on paged K/V (option ``page_size`` 16, a bounded pool)
against the contiguous cache, at several row counts: interleaved A/B in one process,
process CPU seconds (user + sys, every thread) per step, so a loaded host stretches
both alike.

For each row count R both engines get R slots and a 4,096-position context (the pages
part's shape, docs/prefix-caching.md "The memory target"); one ``PROMPT``-token prompt is
prefilled on each and inserted into all R slots (paged: the slots share its pages, the
partly filled last one copied on the first write), one step runs as a warm-up, then
``ROUNDS`` rounds alternate the engines, ``STEPS`` greedy steps each. Medians per step
and per row.

    python benchmarks/scripts/cpu_paged_step.py [MODEL] [ROWS,...] [ROUNDS] [STEPS] [PROMPT] [THREADS]
    e.g. python benchmarks/scripts/cpu_paged_step.py default 8,32,64 3 4 590 1
"""

from __future__ import annotations

import statistics
import sys
import time


def main(name: str, rows: list[int], rounds: int, steps: int, prompt: int, threads: int) -> None:
    import numpy as np

    from polyengine import SamplingParams, create_engine
    from polyengine.hostinfo import cpu_model
    from polyengine.models import load_model

    model = load_model(None if name == "default" else name)
    sampling = SamplingParams(temperature=0, max_tokens=4096 - prompt, ignore_eos=True)
    tokens = np.random.default_rng(0).integers(3, model.config.vocab_size, prompt)
    print(f"cpu: {cpu_model()}; model {name}; threads {threads}; prompt {prompt} tokens; "
          f"{rounds} rounds x {steps} steps per engine")
    print("| rows | contiguous ms/step | paged ms/step | paged / contiguous | contiguous ms/row | paged ms/row |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        engines = {}
        for kind, extra in (("contiguous", {}), ("paged", {"page_size": 16, "kv_pages": 2048})):
            engine = create_engine("cpu", model=model, config=dict(
                max_slots=r, max_prefill_length=max(prompt, 16), max_cache_length=4096,
                options={"threads": threads, **extra}))
            params, state = engine.load_params(), engine.init_decode_state()
            prefix, _ = engine.prefill(params=params, tokens=tokens, sampling=sampling)
            for slot in range(r):
                state = engine.insert(prefix, state, slot)
            state, res = engine.generate(params, state)
            res.row_tokens(0)  # the warm-up step done
            engines[kind] = [engine, params, state]
        per_step: dict[str, list[float]] = {k: [] for k in engines}
        for _ in range(rounds):
            for kind, held in engines.items():
                engine, params, state = held
                start = time.process_time()
                for _ in range(steps):
                    state, res = engine.generate(params, state)
                    res.row_tokens(0)  # the step done before the next is timed
                per_step[kind].append((time.process_time() - start) / steps)
                held[2] = state
        c, p = (statistics.median(per_step[k]) * 1000 for k in ("contiguous", "paged"))
        print(f"| {r} | {c:.0f} | {p:.0f} | {p / c:.2f} | {c / r:.1f} | {p / r:.1f} |", flush=True)
        del engines


if __name__ == "__main__":
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    a = sys.argv[1:]
    main(a[0] if a else "default", [int(x) for x in (a[1] if len(a) > 1 else "8,32,64").split(",")],
         int(a[2]) if len(a) > 2 else 3, int(a[3]) if len(a) > 3 else 4, int(a[4]) if len(a) > 4 else 590,
         int(a[5]) if len(a) > 5 else 1)
