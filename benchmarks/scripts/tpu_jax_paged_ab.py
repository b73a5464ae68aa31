"""Decode steps of the tpu_jax engine with the contiguous cache against paged K/V
(option ``page_size`` 16): interleaved A/B in one process, CPU seconds per step.

Both engines hold the same model (random weights of a preset shape), 4 slots and a
context of ``CACHE`` positions. Each round re-inserts one 20-token prefix into the 4
slots and times 8 greedy steps (positions 20..27): the paged step attends over its
table-width bucket (2 pages, 32 positions), the contiguous one over the whole context.
Rounds alternate the engines; the first (compiling) is dropped; medians of the rest.
``CACHE`` 32 makes both attend to the same 32 positions (the gather's own cost).

    python benchmarks/scripts/tpu_jax_paged_ab.py MODEL CACHE ROUNDS
    e.g. python benchmarks/scripts/tpu_jax_paged_ab.py random:smollm2-135m 512 9
"""

from __future__ import annotations

import statistics
import sys
import time


def main(name: str, cache: int, rounds: int) -> None:
    import jax

    from polyengine import EngineConfig, SamplingParams, create_engine
    from polyengine.hostinfo import cpu_model
    from polyengine.models import load_model

    model = load_model(name)
    cfg = EngineConfig(max_slots=4, max_prefill_length=min(32, cache - 8), max_cache_length=cache, dtype="float32")
    engines = {}
    for label, options in (("contiguous", {}), ("paged, page_size 16", {"page_size": 16})):
        eng = create_engine("tpu_jax", model, cfg.model_copy(update={"options": options}))
        params = eng.load_params()
        prefix, _ = eng.prefill(params=params, tokens=list(range(3, 23)),
                                sampling=SamplingParams(temperature=0, ignore_eos=True))
        engines[label] = [eng, params, eng.init_decode_state(), prefix]
    seconds = {label: [] for label in engines}
    for _ in range(rounds):
        for label, held in engines.items():
            eng, params, state, prefix = held
            for slot in range(4):
                state = eng.free_resource(state, slot)
            state, _ = eng.bulk_insert(prefix, state, [0, 1, 2, 3])
            jax.block_until_ready(state.arrays)
            start = time.process_time()
            for _ in range(8):
                state, result = eng.generate(params, state)
            result.tokens  # reading them waits for the last step
            seconds[label].append((time.process_time() - start) / 8)
            held[2] = state
    print(f"{cpu_model()}; {name}, 4 slots, context {cache}, positions 20..27, CPU ms per step "
          f"(median of {rounds - 1} rounds, min-max)")
    for label, values in seconds.items():
        values = values[1:]
        print(f"  {label}: {statistics.median(values) * 1e3:.1f} ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
