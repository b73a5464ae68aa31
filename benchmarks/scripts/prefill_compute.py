"""Prefill speed of the cpu backend by weight storage and GEMM operands: float32
weights; bfloat16 weights on float32 operands, on bfloat16 operands with separate and
with fused q/k/v and gate/up matrices (options ``prefill_compute``,
``fuse_projections``); int8-block32 weights on bfloat16 operands; each causal attention
on torch's SDPA or the host kernel (option ``prefill_attention``). One process, every
engine built first, then a 1024-token prompt (``--tokens``) prefilled by each engine in
turns; the table shows each row's median and the median of its per-turn ratio to
float32 (docs/benchmarks/2026-11-cpu-paths.md, "Prefill on bfloat16 operands").

    python benchmarks/scripts/prefill_compute.py [--repeats 5] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

BACKEND = "cpu"

ROWS = {
    "float32 weights, SDPA": {"prefill_attention": "sdpa"},
    "float32 weights, attention kernel (float32)": {"prefill_attention": "kernel"},
    "bfloat16 weights, prefill_compute float": {"weight_dtype": "bfloat16", "bf16_compute": "bf16",
                                                "prefill_compute": "float", "prefill_attention": "sdpa"},
    "bfloat16 weights, bf16 operands, fuse_projections off, SDPA": {
        "weight_dtype": "bfloat16", "bf16_compute": "bf16", "prefill_compute": "bf16", "fuse_projections": False,
        "prefill_attention": "sdpa"},
    "bfloat16 weights, bf16 operands (fuse_projections on), SDPA": {
        "weight_dtype": "bfloat16", "bf16_compute": "bf16", "prefill_compute": "bf16", "prefill_attention": "sdpa"},
    "bfloat16 weights, bf16 operands, attention kernel (bfloat16)": {
        "weight_dtype": "bfloat16", "bf16_compute": "bf16", "prefill_compute": "bf16", "prefill_attention": "kernel"},
    "int8-block32 weights, bf16 operands, SDPA": {"quantize": "int8-block32", "int8_compute": "int8",
                                                  "prefill_compute": "bf16", "prefill_attention": "sdpa"},
    "int8-block32 weights, bf16 operands, attention kernel (bfloat16)": {
        "quantize": "int8-block32", "int8_compute": "int8", "prefill_compute": "bf16", "prefill_attention": "kernel"},
}


def main() -> None:
    from polyengine import EngineConfig, SamplingParams, create_engine
    from polyengine.models import default_model_path, load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=1024, help="prompt length")
    args = p.parse_args()
    model = load_model(default_model_path())
    cfg = EngineConfig(max_slots=2, max_prefill_length=args.tokens, max_cache_length=args.tokens + 64)
    prompt = np.random.default_rng(0).integers(100, model.config.vocab_size, args.tokens).tolist()
    greedy = SamplingParams(temperature=0)
    engines = {}
    for name, options in ROWS.items():
        eng = create_engine(BACKEND, model, cfg.model_copy(update={"options": options}))
        params = eng.load_params()
        eng.prefill(params=params, tokens=prompt, sampling=greedy)  # warm-up: buffers, oneDNN's kernels
        engines[name] = eng, params
    seconds: dict[str, list[float]] = {name: [] for name in ROWS}
    for _ in range(args.repeats):
        for name, (eng, params) in engines.items():
            start = time.perf_counter()
            eng.prefill(params=params, tokens=prompt, sampling=greedy)
            seconds[name].append(time.perf_counter() - start)
    base = seconds[next(iter(ROWS))]
    print(f"default model, float32 compute, a {args.tokens}-token prefill; medians of {args.repeats} in turns")
    print("| weights, operands | prefill tok/s | vs float32 weights | speed_paths() prefill |")
    print("| --- | ---: | ---: | --- |")
    for name, ts in seconds.items():
        ratio = statistics.median(b / t for b, t in zip(base, ts))
        print(f"| {name} | {args.tokens / statistics.median(ts):.0f} | {ratio:.2f}x | "
              f"{engines[name][0].speed_paths()['prefill']} |")


if __name__ == "__main__":
    main()
