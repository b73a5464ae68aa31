"""The driver's cost per step (core/driver) with many requests running: the bench's pages
workload (shared variant) on the cpu backend, every engine call on the calling thread
(``async_steps`` off), and the bench's own step timing (``PolyengineSystem._run``: time
outside the engine's calls) read on this thread's CPU clock instead of the wall clock,
so a loaded host does not add to it.

    python benchmarks/scripts/driver_overhead.py paged|reserved [REQUESTS] [RESERVED_SLOTS] [NEW_TOKENS]
    e.g. python benchmarks/scripts/driver_overhead.py paged 64 8 32    # 64 running at once
         python benchmarks/scripts/driver_overhead.py reserved 64 8 32 # 8 running at once
"""

from __future__ import annotations

import json
import sys
import time


def main(setting: str, requests: int, slots: int, new_tokens: int) -> None:
    import polyengine.benchmarks.run_polyengine as bench
    from polyengine.benchmarks.pages_phases import pages_requests
    from polyengine.benchmarks.workload import Request, Workload

    options = {"threads": 1, "async_steps": False}
    work = Workload(name="pages", pages_requests=requests, pages_reserved_slots=slots, pages_new_tokens=new_tokens)
    system = bench.PolyengineSystem(model=None, backend="cpu", dtype=None, options=options)
    paged = setting == "paged"
    if paged:
        options.update(page_size=work.pages_page_size, kv_pages=work.pages_pool)
    llm = system.llm(requests if paged else slots, work.pages_prompt, work.pages_context, options=options)
    reqs = pages_requests(work, system.vocab_size, True)
    system._run(llm, [Request(r.prompt, 2) for r in reqs[:2]])  # warm-up
    wall = bench.time.perf_counter
    bench.time.perf_counter = time.thread_time  # the bench's step clock becomes this thread's CPU clock
    try:
        _, _, t = system._run(llm, reqs)
    finally:
        bench.time.perf_counter = wall
    steps = len(t["ends"])
    print(json.dumps({"setting": setting, "requests": requests, "running_at_most": requests if paged else slots,
                      "steps": steps, "cpu_s": round(t["ends"][-1] - t["t0"], 2),
                      "driver_s": round(t["overhead"], 3), "driver_ms_per_step": round(t["overhead"] / steps * 1000, 2)}))


if __name__ == "__main__":
    if len(sys.argv) < 2 or any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    a = sys.argv[1:]
    main(a[0], *(int(x) for x in a[1:4]), *(64, 8, 32)[len(a[1:4]):])
