"""Running streams' pace while a long prompt prefills, by per-step token budget.

Four streams decode (greedy, 16-token prompts); a 2,000-token prompt arrives. For each
``max_num_batched_tokens`` (prompt tokens one scheduler step prefills while streams
decode) and for no chunking at all, the table gives the streams' time between tokens
before the prompt arrived (median, p99) and while it prefilled (median, p99), the
ratio of that p99 to the median before (target: at most 3), and the prompt's time to
first token against its time alone, nothing else running (target: at most 2). The
default model on the cpu backend, one engine for every row (the budget is the
driver's: set on its prefiller between rows), the prefix cache off so no row reuses
another's prompt. On an engine with a prefill lane (the cpu backend's default, option
``prefill_threads``) the prompt prefills there, beside the steps, at every budget;
``--option prefill_threads=0`` measures the steps' own pieces. One run: ratios within a
run compare; absolute times depend on the host and its load.

    python benchmarks/scripts/prefill_under_load.py [--budgets 16,32,64] [--prompt 2000] [--streams 4]
                                                    [--backend cpu] [--model PATH] [--option KEY=VALUE ...]
                                                    [--timeline]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def _p99(xs: list[float]) -> float:
    return float(np.percentile(np.asarray(xs), 99)) if xs else float("nan")


def ttft_alone(llm, prompt: list[int]) -> float:
    """Seconds from submit to the first token with nothing else running."""
    from polyengine import SamplingParams

    start = time.perf_counter()
    req = llm.submit(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while not req.samples[0].out.token_ids:
        llm.step()
    return time.perf_counter() - start


def under_load(llm, streams: list[list[int]], prompt: list[int], margin: int) -> dict[str, float]:
    """The streams' gaps before and while ``prompt`` prefills, and its time to first token."""
    from polyengine import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=llm.engine.max_cache_length - 20, ignore_eos=True)
    reqs = [llm.submit(s, sp) for s in streams]
    stamps: list[list[float]] = [[] for _ in reqs]
    steps: list[tuple[float, float]] = []  # each scheduler step's (start, end)

    def step() -> None:
        started = time.perf_counter()
        llm.step()
        now = time.perf_counter()
        steps.append((started, now))
        for i, r in enumerate(reqs):
            while len(stamps[i]) < len(r.samples[0].out.token_ids):
                stamps[i].append(now)

    while min(len(s) for s in stamps) < 2 * margin:  # the first steps warm the streams' caches
        step()
    arrived = time.perf_counter()
    long = llm.submit(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while not long.samples[0].out.token_ids:
        step()
    first_at = time.perf_counter()
    ttft = first_at - arrived
    for r in reqs:
        r.cancel()
    while llm.scheduler.busy:
        llm.step()
    gaps = [(b, b - a) for s in stamps for a, b in zip(s, s[1:]) if b <= first_at]
    before = [g for end, g in gaps if end <= arrived][-margin * len(streams):]
    during = [g for end, g in gaps if end > arrived]  # the gap the arrival falls in, and every one after
    return {"before_med": statistics.median(before), "before_p99": _p99(before),
            "during_med": statistics.median(during) if during else float("nan"), "during_p99": _p99(during),
            "ttft": ttft, "steps": len(during) / len(streams),
            "timeline": [(a - arrived, b - a) for a, b in steps if arrived < b <= first_at]}


def main() -> None:
    from polyengine.benchmarks.host import cpu_info
    from polyengine.driver import LLM
    from polyengine.models import default_model_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cpu")
    p.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the embedded default model)")
    p.add_argument("--budgets", default="16,32,64", help="max_num_batched_tokens values, comma-separated")
    p.add_argument("--prompt", type=int, default=2000, help="the arriving prompt's length")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--margin", type=int, default=16, help="steps of the streams' pace measured before the arrival")
    p.add_argument("--timeline", action="store_true",
                   help="also print each scheduler step while the prompt prefilled: seconds after its arrival, "
                        "milliseconds the step took")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an engine option (the value read as JSON, else a string), e.g. warmup=true on tpu_jax so "
                        "no row pays a compile")
    args = p.parse_args()
    options = {}
    for text in args.option:
        key, _, raw = text.partition("=")
        try:
            options[key] = json.loads(raw)
        except ValueError:
            options[key] = raw
    budgets = [int(b) for b in args.budgets.split(",")]
    cache = args.prompt + 64 + 40 * args.prompt // max(1, min(budgets))
    llm = LLM(args.model or str(default_model_path()), backend=args.backend, tools=False, max_slots=args.streams + 1,
              max_cache_length=cache, max_prefill_length=args.prompt, prefix_cache_bytes=0, options=options)
    rng = np.random.default_rng(0)
    vocab = llm.engine.vocab_size
    fresh = lambda n: rng.integers(100, vocab, n).tolist()  # noqa: E731
    info = cpu_info()
    print(f"host: {info['model']}, {info['usable_cores']} cores, ISA {' '.join(info['isa'])}; backend "
          f"{args.backend} on {llm.engine.device}; batched_prefill={llm.engine.capabilities.batched_prefill}, "
          f"prefill_lane={llm.engine.capabilities.prefill_lane}")
    ttft_alone(llm, fresh(args.prompt))  # warm-up: buffers and kernels of a long prefill
    alone = statistics.median(ttft_alone(llm, fresh(args.prompt)) for _ in range(2))
    prefiller = llm.scheduler.prefiller
    chunk = prefiller.chunk
    print(f"the {args.prompt}-token prompt alone: TTFT {alone * 1e3:.0f} ms (median of 2)")
    print(f"{'max_num_batched_tokens':>22} | before p50 | before p99 | during p50 | during p99 | "
          f"p99 / p50 before | TTFT | TTFT / alone | steps")
    for budget in [*budgets, 0]:
        prefiller.chunk, prefiller.step_tokens = (chunk, budget) if budget else (0, prefiller.step_tokens)
        r = under_load(llm, [fresh(16) for _ in range(args.streams)], fresh(args.prompt), args.margin)
        name = str(budget) if budget else "no chunking"
        print(f"{name:>22} | {r['before_med'] * 1e3:7.1f} ms | {r['before_p99'] * 1e3:7.1f} ms | "
              f"{r['during_med'] * 1e3:7.1f} ms | {r['during_p99'] * 1e3:7.1f} ms | "
              f"{r['during_p99'] / r['before_med']:16.1f} | {r['ttft'] * 1e3:5.0f} ms | {r['ttft'] / alone:12.2f} | "
              f"{r['steps']:.0f}", flush=True)
        if args.timeline:
            print(f"{'':>22}   steps while it prefilled (s after arrival: ms): "
                  + " ".join(f"{at:.1f}: {took * 1e3:.0f}" for at, took in r["timeline"]), flush=True)
    prefiller.chunk = chunk


if __name__ == "__main__":
    main()
