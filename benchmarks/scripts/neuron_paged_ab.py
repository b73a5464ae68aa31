"""Decode steps and inserts of the neuron engine (CPU compile path, compiler ``export``)
with the contiguous cache against the block layout (option ``page_size`` 16):
interleaved A/B in one process, CPU seconds.

Both engines hold the same model (random weights of a preset shape), 4 slots and a
context of ``CACHE`` positions (one sequence bucket: every step attends to the whole
context, as the default buckets do up to 512 positions). Each round frees the 4 slots,
bulk-inserts one 20-token prefix into them (timed: the contiguous engine copies the
prefix's K/V into each slot's row, the block layout shares its blocks) and times 8
greedy steps (positions 20..27; the first copies the shared, partly filled block of
each slot). Rounds alternate the engines; the first is dropped; medians of the rest.

    python benchmarks/scripts/neuron_paged_ab.py MODEL CACHE ROUNDS
    e.g. python benchmarks/scripts/neuron_paged_ab.py random:smollm2-135m 512 9
"""

from __future__ import annotations

import statistics
import sys
import time


def main(name: str, cache: int, rounds: int) -> None:
    from polyengine import EngineConfig, SamplingParams, create_engine
    from polyengine.hostinfo import cpu_model
    from polyengine.models import load_model

    model = load_model(name)
    cfg = EngineConfig(max_slots=4, max_prefill_length=min(32, cache - 8), max_cache_length=cache, dtype="float32")
    engines = {}
    for label, options in (("contiguous", {}), ("blocks, page_size 16", {"page_size": 16})):
        eng = create_engine("neuron", model, cfg.model_copy(update={"options": {**options, "async_steps": False}}))
        params = eng.load_params()
        prefix, _ = eng.prefill(params=params, tokens=list(range(3, 23)),
                                sampling=SamplingParams(temperature=0, ignore_eos=True))
        engines[label] = [eng, params, eng.init_decode_state(), prefix]
    steps = {label: [] for label in engines}
    inserts = {label: [] for label in engines}
    for _ in range(rounds):
        for label, held in engines.items():
            eng, params, state, prefix = held
            for slot in range(4):
                state = eng.free_resource(state, slot)
            start = time.process_time()
            state, _ = eng.bulk_insert(prefix, state, [0, 1, 2, 3])
            inserts[label].append(time.process_time() - start)
            start = time.process_time()
            for _ in range(8):
                state, result = eng.generate(params, state)
            result.tokens
            steps[label].append((time.process_time() - start) / 8)
            held[2] = state
    print(f"{cpu_model()}; {name}, 4 slots, context {cache}, CPU ms (median of {rounds - 1} rounds, min-max)")
    for label in engines:
        for what, values in (("bulk_insert into 4 slots", inserts[label]), ("decode step", steps[label])):
            values = values[1:]
            print(f"  {label}, {what}: {statistics.median(values) * 1e3:.2f} "
                  f"({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f})")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
