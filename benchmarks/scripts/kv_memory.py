"""Peak memory and decode time of the cpu backend's KV cache options, in one table.

Each row is one engine (32 slots x 2048 positions, the default model, float32) decoding
32 requests of 256 tokens together (``ignore_eos``), in a fresh process each, so that
the peak resident memory (``VmHWM``) is that row's alone. The configurations run in
turns, ``--repeats`` times, and the table shows the medians and each one's time against
the reserved cache measured in the same turns.

    python benchmarks/scripts/kv_memory.py [--repeats 3] [--tokens 256]
"""

from __future__ import annotations

import argparse
import statistics

from fresh_process import run_fresh

ROWS = {
    "reserve (all slots' full context from the start)": {"kv_memory": "reserve"},
    "grow (the default)": {},
    "grow, kv_dtype bfloat16": {"kv_dtype": "bfloat16"},
}

_CHILD = r"""
import json, sys, time
from polyengine import SamplingParams
from polyengine.driver import LLM
from polyengine.memory import resident_bytes
opts, tokens = json.loads(sys.argv[1]), int(sys.argv[2])
llm = LLM(None, "cpu", max_slots=32, max_cache_length=2048, options=opts)
prompts = [f"Write a short story about a robot number {i} who learns to paint." for i in range(32)]
llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
t = time.perf_counter()
out = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "tokens": sum(len(c.token_ids) for c in out),
                  "peak_mib": resident_bytes("VmHWM") / 2**20}))
"""




def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=256, help="new tokens per request")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in ROWS}
    for _ in range(args.repeats):
        for name, options in ROWS.items():
            runs[name].append(run_fresh(_CHILD, options, str(args.tokens)))
    base = [r["seconds"] for r in runs[next(iter(ROWS))]]
    print(f"32 requests x {args.tokens} new tokens at batch 32, default model, float32; medians of {args.repeats}")
    print("| KV cache | decode tok/s | time vs reserve (same turn) | peak RSS MiB |")
    print("| --- | ---: | ---: | ---: |")
    for name, rs in runs.items():
        tps = statistics.median(r["tokens"] / r["seconds"] for r in rs)
        ratio = statistics.median(r["seconds"] / b for r, b in zip(rs, base))
        peak = statistics.median(r["peak_mib"] for r in rs)
        print(f"| {name} | {tps:.0f} | {ratio:.3f}x | {peak:.0f} |")


if __name__ == "__main__":
    main()
