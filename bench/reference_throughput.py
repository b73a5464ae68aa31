"""Throughput of a backend through the driver: prefill and decode tokens per second.

    python bench/reference_throughput.py [--backend reference] [--model M] [--dtype float64 float32]
                                         [--batch 1 4] [--prompt-len 64] [--new-tokens 32]

Prints one table row per (dtype, batch): prefill tokens/s (all prompt tokens over the
driver's first step, which prefills and inserts every request and runs one decode
step) and decode tokens/s (the remaining completion tokens over the time spent
generating them, all requests together). Run it on an idle
machine: with two shared cores, anything else running skews the numbers.
"""

from __future__ import annotations

import argparse
import time

import polyengine
from polyengine import SamplingParams
from polyengine.models import load_model


def run(model, backend: str, dtype: str, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    llm = polyengine.LLM(model, backend, max_slots=batch, max_prefill_length=prompt_len,
                         max_cache_length=prompt_len + new_tokens + 1, dtype=dtype)
    vocab = model.config.vocab_size
    prompts = [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(prompt_len)] for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    reqs = [llm.submit(p, sp) for p in prompts]
    t0 = time.perf_counter()
    llm.step()  # admits every request (prefill + insert) and runs one decode step
    t_first = time.perf_counter()
    llm.scheduler.run_until(lambda: all(r.done for r in reqs))
    t_end = time.perf_counter()
    produced = sum(len(r.completion.token_ids) for r in reqs)
    decode_tokens = produced - 2 * batch  # the first two tokens of each request came before t_first
    return batch * prompt_len / (t_first - t0), decode_tokens / (t_end - t_first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", nargs="+", default=["float64", "float32"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    model = load_model(args.model)
    print(f"model: {model!r}")
    print(f"backend: {args.backend}, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens per request\n")
    print(f"| {'dtype':8} | {'batch':>5} | {'prefill tok/s':>13} | {'decode tok/s':>12} |")
    print(f"|{'-' * 10}|{'-' * 7}|{'-' * 15}|{'-' * 14}|")
    for dtype in args.dtype:
        for batch in args.batch:
            pre, dec = run(model, args.backend, dtype, batch, args.prompt_len, args.new_tokens)
            print(f"| {dtype:8} | {batch:>5} | {pre:>13.1f} | {dec:>12.1f} |", flush=True)


if __name__ == "__main__":
    main()
