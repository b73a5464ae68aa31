"""Decode and prefill speed and peak memory of the cpu backend's weight storage, in
one table: float32 weights, bfloat16 weights under float32 compute (option
``weight_dtype``; with float32 or bfloat16 activations, option ``bf16_compute``) and
int8-block32 (option ``quantize``), and prefill on bfloat16 GEMM operands (option
``prefill_compute``, auto where decode's activations are bfloat16 or int8 and the CPU
has bfloat16 units), each in a fresh process so
that its peak resident memory (``VmHWM``) is its own.

Each row: the default model, float32 compute, an engine of 32 slots; decode of one
request (b1) and of 32 together (b32, ``ignore_eos``), and a prefill of a 1024-token
prompt (the second of two). The configurations run in turns, ``--repeats`` times; the table shows medians
and each row's b1 and b32 time against float32 weights measured in the same turns.

    python benchmarks/scripts/weight_dtype.py [--repeats 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics

from fresh_process import run_fresh

ROWS = {
    "float32 weights": {},
    "bfloat16 weights (weight_dtype)": {"weight_dtype": "bfloat16"},
    "bfloat16 weights, bf16_compute bf16, prefill_compute float": {
        "weight_dtype": "bfloat16", "bf16_compute": "bf16", "prefill_compute": "float"},
    "bfloat16 weights, bf16_compute bf16 (prefill_compute auto)": {"weight_dtype": "bfloat16", "bf16_compute": "bf16"},
    "int8-block32 weights (quantize)": {"quantize": "int8-block32"},
    "int8-block32 weights, int8_compute int8 (prefill_compute auto)": {"quantize": "int8-block32",
                                                                       "int8_compute": "int8"},
}

_CHILD = r"""
import json, sys, time
import polyengine
from polyengine import SamplingParams
from polyengine.driver import LLM
from polyengine.memory import resident_bytes
opts, tokens = json.loads(sys.argv[1]), int(sys.argv[2])
llm = LLM(None, "cpu", max_slots=32, max_cache_length=2048, options=opts)
prompts = [f"Write a short story about a robot number {i} who learns to paint." for i in range(32)]
llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
out = {"module": polyengine.__file__, "kernels": llm.engine.speed_paths().get("kernels", "")}
for name, batch in (("b1", prompts[:1]), ("b32", prompts)):
    t = time.perf_counter()
    res = llm.generate(batch, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    out[name] = sum(len(c.token_ids) for c in res) / (time.perf_counter() - t)
long = list(range(1000, 2024))  # 1024 token ids
for _ in range(2):  # the second: the first at this length also makes its buffers
    t = time.perf_counter()
    llm.generate([long], SamplingParams(max_tokens=1, temperature=0))
    out["prefill"] = 1024 / (time.perf_counter() - t)
out["peak_mib"] = resident_bytes("VmHWM") / 2**20
print(json.dumps(out))
"""




def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in ROWS}
    for _ in range(args.repeats):
        for name, options in ROWS.items():
            runs[name].append(run_fresh(_CHILD, options, str(args.tokens)))
    base = runs[next(iter(ROWS))]
    print(f"default model, float32 compute, 32 slots; {args.tokens} new tokens a request; medians of {args.repeats}")
    print("| weights | decode b1 tok/s | b1 vs float32 | b32 tok/s | b32 vs float32 | prefill 1024 tok/s | "
          "prefill vs float32 | peak RSS MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("b1", "b32", "prefill", "peak_mib")}
        ratio = {k: statistics.median(r[k] / b[k] for r, b in zip(rs, base)) for k in ("b1", "b32", "prefill")}
        print(f"| {name} | {med['b1']:.1f} | {ratio['b1']:.2f}x | {med['b32']:.0f} | {ratio['b32']:.2f}x | "
              f"{med['prefill']:.0f} | {ratio['prefill']:.2f}x | {med['peak_mib']:.0f} |")


if __name__ == "__main__":
    main()
