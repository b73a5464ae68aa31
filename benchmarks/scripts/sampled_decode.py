"""Decode throughput with sampling (temperature > 0), option sets side by side.

    python benchmarks/scripts/sampled_decode.py [--backend cpu] [--rows 1 8 32] [--tokens 64]
        [--rounds 3] [--model PATH] [--temperature T] [--top-p P] [--top-k K] [--options JSON ...]

The bench's decode and served parts are greedy; a request that leaves ``temperature`` at
its default (1.0) samples, and the sampler then draws a Threefry uniform per row and
token of the vocabulary every step. This measures that: per row count, ``rows`` prompts
of 128 random tokens, each ``--tokens`` new tokens at ``--temperature`` (1.0; seeded,
``ignore_eos``), decode tokens per second as (tokens - rows) / (time of the run less the
time of the same prompts with ``max_tokens`` 1), the median over ``--rounds``, the option
sets' runs interleaved round by round (one engine each, built first). Ratios mean
something only within one run on an idle host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--model", default=None, help="a model path (default: the embedded default model)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0, help="0 for greedy (the bench's own setting)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--options", action="append", default=None, help="engine options, JSON (repeatable)")
    args = ap.parse_args(argv)
    option_sets = [json.loads(o) for o in (args.options or ["{}"])]

    import polyengine
    from polyengine import SamplingParams

    from polyengine.models import load_model

    model = load_model(args.model)
    slots = max(args.rows)
    llms = [polyengine.LLM(model, backend=args.backend, options=o, max_slots=slots, max_cache_length=256,
                           prefix_cache_bytes=0) for o in option_sets]
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    print(f"{args.backend}, decode at temperature {args.temperature} top_p {args.top_p} top_k {args.top_k}, {args.tokens} new tokens a row, median of "
          f"{args.rounds} rounds; tok/s")
    print("| rows | " + " | ".join(json.dumps(o) for o in option_sets) + " |")
    print("| ---: |" + " ---: |" * len(option_sets))
    for rows in args.rows:
        rates: list[list[float]] = [[] for _ in option_sets]
        for r in range(args.rounds + 1):  # the first round warms up
            prompts = [[int(t) for t in rng.integers(10, vocab - 10, 128)] for _ in range(rows)]
            for i, llm in enumerate(llms):
                timed = []
                for new in (1, args.tokens):
                    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=r,
                                        max_tokens=new, ignore_eos=True)
                    t0 = time.perf_counter()
                    llm.generate(prompts, sp)
                    timed.append(time.perf_counter() - t0)
                if r:
                    rates[i].append(rows * (args.tokens - 1) / max(timed[1] - timed[0], 1e-9))
        print(f"| {rows} | " + " | ".join(f"{statistics.median(x):.1f}" for x in rates) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
