"""One run of the bench's pages part (one setting, one variant) in this process, its
sizes scaled from the command line: the bench's own ``PolyengineSystem.pages_run`` on the
cpu backend, printed as JSON with the process CPU seconds over it (engine build, the
warm-up and the measured run; ``cpu_seconds`` is the measured run alone).

Each setting in a fresh process, so neither inherits the other's heap; a loaded host
stretches ``seconds`` but hardly the CPU seconds (docs/prefix-caching.md, "The memory
target").

    python benchmarks/scripts/pages_one_run.py paged|reserved shared|distinct [REQUESTS] [RESERVED_SLOTS] [NEW_TOKENS] [THREADS] [profile]
    e.g. python benchmarks/scripts/pages_one_run.py paged distinct 64 8 128 1   # the standard sizes

``profile`` (after all four numbers): steps on the calling thread (``async_steps`` off)
under cProfile, and its 30 most costly functions (own time) printed after the JSON.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time


def main(setting: str, variant: str, requests: int, slots: int, new_tokens: int, threads: int,
         profile: bool = False) -> None:
    import cProfile
    import pstats

    from polyengine.benchmarks.pages_phases import pages_requests
    from polyengine.benchmarks.run_polyengine import PolyengineSystem
    from polyengine.benchmarks.workload import Request, Workload

    if setting not in ("paged", "reserved") or variant not in ("shared", "distinct"):
        raise SystemExit("usage: pages_one_run.py paged|reserved shared|distinct [REQUESTS] [SLOTS] [NEW] [THREADS]")
    work = Workload(name="pages", pages_requests=requests, pages_reserved_slots=slots, pages_new_tokens=new_tokens)
    options = {"threads": threads, **({"async_steps": False} if profile else {})}
    system = PolyengineSystem(model=None, backend="cpu", dtype=None, options=options)
    warm = [Request(r.prompt, 2) for r in pages_requests(work, system.vocab_size, True, "warmup")[:2]]
    profiler = cProfile.Profile() if profile else None
    start = time.process_time()
    if profiler:
        profiler.enable()
    run = system.pages_run(pages_requests(work, system.vocab_size, variant == "shared"), paged=setting == "paged",
                           work=work, warmup=warm)
    if profiler:
        profiler.disable()
    print(json.dumps({"setting": setting, "variant": variant, "process_cpu_s": round(time.process_time() - start, 1),
                      **dataclasses.asdict(run)}))
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    if len(sys.argv) < 3 or any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    a = sys.argv[1:]
    profile = a[-1] == "profile"
    numbers = [int(x) for x in a[2:6] if x != "profile"]
    main(a[0], a[1], *numbers, *(64, 8, 128, 1)[len(numbers):], profile=profile)
