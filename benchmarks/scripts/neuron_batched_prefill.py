"""Batched prefill on the neuron engine's CPU compile path (option ``batched_prefill``):
what it costs at construction and what it saves per call.

1. Construction: the engine built in a fresh process with the option on and off (the
   exported graphs are memoized per process, so each build runs alone), seconds and
   graph counts. Skipped with ``--no-build``.
2. Calls: one engine with the option on; per prompt length, ``--rows`` fresh prompts of
   that length through ``prefill_batch`` (one context-encoding graph of that many rows)
   and through the kit's loop (``EngineBase.prefill_batch``: one ``prefill`` each) in
   alternating rounds, a warm-up of each first; medians of the rounds and the median of
   the rounds' ratios.

    python benchmarks/scripts/neuron_batched_prefill.py                     # the default model, default config
    python benchmarks/scripts/neuron_batched_prefill.py --model random:tiny-gqa --no-build --lengths 8,20
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

BUILD = """
import json, sys, time
import polyengine
from polyengine.models import load_model
model = load_model({model!r})
start = time.perf_counter()
eng = polyengine.create_engine("neuron", model=model, config={config})
print(json.dumps({{"seconds": time.perf_counter() - start, "graphs": len(eng.graphs)}}))
"""


def build_times(model: str | None, config: dict) -> dict[str, dict]:
    out = {}
    for setting in ("on", "off"):
        cfg = {**config, "options": {**config.get("options", {}), "batched_prefill": setting}}
        proc = subprocess.run([sys.executable, "-c", BUILD.format(model=model, config=cfg)], capture_output=True,
                              text=True, check=True)
        out[setting] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def call_times(model_name: str | None, config: dict, lengths: list[int], rows: int, rounds: int) -> list[dict]:
    import numpy as np

    import polyengine
    from polyengine.engine import EngineBase, PrefillRequest
    from polyengine.models import load_model
    from polyengine.sampling import SamplingParams

    model = load_model(model_name)
    eng = polyengine.create_engine("neuron", model=model,
                                   config={**config, "options": {**config.get("options", {}), "batched_prefill": "on"}})
    params = eng.load_params()
    rng = np.random.default_rng(0)
    table = []
    for n in lengths:
        reqs = [PrefillRequest(rng.integers(3, model.config.vocab_size, n).tolist(), SamplingParams(temperature=0.0))
                for _ in range(rows)]
        ways = {"batched": lambda: eng.prefill_batch(params=params, requests=reqs),
                "one by one": lambda: EngineBase.prefill_batch(eng, params=params, requests=reqs)}
        times: dict[str, list[float]] = {way: [] for way in ways}
        for way in ways.values():  # warm-up
            way()
        for r in range(rounds):
            for way in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                start = time.perf_counter()
                ways[way]()
                times[way].append(time.perf_counter() - start)
        ratios = [b / a for a, b in zip(times["batched"], times["one by one"])]
        table.append({"tokens": n, "batched_ms": statistics.median(times["batched"]) * 1e3,
                      "one_by_one_ms": statistics.median(times["one by one"]) * 1e3,
                      "speedup": statistics.median(ratios), "min": min(ratios), "max": max(ratios)})
    return table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model spec (default: the embedded default model)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4, help="prompts per call (2 or 4 run as one graph)")
    ap.add_argument("--lengths", default="40,100,200", help="prompt lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--no-build", action="store_true", help="skip the construction timings")
    args = ap.parse_args(argv)
    from polyengine.hostinfo import cpu_model

    config = {"max_slots": args.slots}
    print(f"{cpu_model()}; neuron (CPU compile path), model {args.model or 'default'}, max_slots {args.slots}")
    if not args.no_build:
        builds = build_times(args.model, config)
        print("| batched_prefill | construction s | graphs |\n| --- | ---: | ---: |")
        for setting, b in builds.items():
            print(f"| {setting} | {b['seconds']:.1f} | {b['graphs']} |")
    table = call_times(args.model, config, [int(x) for x in args.lengths.split(",")], args.rows, args.rounds)
    print(f"\n| {args.rows} prompts of | batched ms | one by one ms | speedup, median of {args.rounds} rounds (range) |")
    print("| ---: | ---: | ---: | --- |")
    for row in table:
        print(f"| {row['tokens']} tokens | {row['batched_ms']:.0f} | {row['one_by_one_ms']:.0f} | "
              f"{row['speedup']:.2f}x ({row['min']:.2f}-{row['max']:.2f}) |")


if __name__ == "__main__":
    main()
