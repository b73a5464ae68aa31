"""Time to first token through the driver (no server) of a cold request and of the warm
requests that share its 560-token system prompt with 20-token turns of their own, on one
backend, with the cut where prompts part made as a head (``engine.prefix_head``, the
driver's default where the engine offers it) and with ``truncate_prefix``, alternately in
one process (an A/B; two warm-up passes compile every program both ways use first).

    python benchmarks/scripts/first_warm_request.py [BACKEND]   (default tpu_jax)

What docs/prefix-caching.md's first-warm-request numbers cite."""
import statistics
import sys
import time

import numpy as np

import polyengine
from polyengine import SamplingParams

backend = sys.argv[1] if len(sys.argv) > 1 else "tpu_jax"
llm = polyengine.LLM(backend=backend, max_slots=2, max_cache_length=1024, max_prefill_length=1000, tools=False)
pre = llm.scheduler.prefiller
rng = np.random.default_rng(0)
sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def ttft(prompt):
    t = time.perf_counter()
    h = llm.submit(prompt, sp)
    while not h.done:
        llm.step()
    return time.perf_counter() - t, h


def one_pass(heads, label):
    pre.heads = heads
    rows = []
    for _ in range(3):
        system = rng.integers(100, 40000, 560).tolist()
        turns = [rng.integers(100, 40000, 20).tolist() for _ in range(4)]
        cold, _ = ttft(system + turns[0])
        warm = [ttft(system + t)[0] for t in turns[1:]]
        rows.append((cold, warm))
    if label:
        cold = statistics.median(r[0] for r in rows)
        first = [r[1][0] for r in rows]
        later = [w for r in rows for w in r[1][1:]]
        print(f"{label}: cold median {cold*1000:.0f} ms; first warm {[round(x*1000) for x in first]} ms "
              f"({min(first)/cold:.2f}-{max(first)/cold:.2f}x); later warm {min(later)*1000:.0f}-{max(later)*1000:.0f} ms "
              f"({min(later)/cold:.2f}-{max(later)/cold:.2f}x)", flush=True)


if not pre.heads:
    sys.exit(f"{backend}: the driver cuts with truncate_prefix here (no prefix_head): nothing to compare")
t0 = time.perf_counter()
one_pass(False, None); one_pass(True, None)  # compiles every program both ways use
print(f"warm-up passes: {time.perf_counter() - t0:.0f} s", flush=True)
for _ in range(2):
    one_pass(False, "truncate_prefix (before)")
    one_pass(True, "prefix_head (now)")
