"""The running streams' time between tokens as the driver makes them, without HTTP: closed-loop
clients (each sends its next request when its last one ends, as the served part's clients
do), prompts that share a cached 32-token head and add 8 tokens of their own, greedy,
ignore_eos, 64-103 new tokens (so that requests end, and the next ones arrive, at different
steps). Each token's time is stamped when the scheduler takes it (``Scheduler._on_token``);
the gaps are those between a request's consecutive tokens. Two settings of the cpu backend
(default: option ``mixed_step`` on and off), each in a fresh process, in alternation, round
after round; the median and p99 gap and their ratio (the serving target: p99 within 2x the
median) per run.

    python benchmarks/scripts/step_gaps.py [--clients 8,32] [--rounds 3] [--options JSON ...]

e.g. ``--options '{"mixed_step": false}' --options '{"mixed_step": false, "driver": {"defer_frees": false}}'``
(``Scheduler.defer_frees``: a finished request's slot freed at the next step's start, or at once).

What docs/serving.md's "The mixed step" cites. ``polyengine bench --parts served`` measures
the same through the HTTP server and a client, where the server's event loop shares the
two cores and adds its own noise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def one_run(clients: int, options: dict) -> dict:
    """In this process: the closed loop of ``clients`` clients, 3 requests each."""
    import warnings

    import numpy as np

    from polyengine import SamplingParams
    from polyengine.driver import LLM

    warnings.simplefilter("ignore")
    options = dict(options)
    driver = options.pop("driver", {})  # the scheduler's own switches, e.g. {"defer_frees": false}
    llm = LLM(backend="cpu", max_slots=32, max_cache_length=512, options=options)
    sched = llm.scheduler
    for name, value in driver.items():
        if not hasattr(type(sched), name):
            raise SystemExit(f"the scheduler has no switch {name!r}")
        setattr(sched, name, value)
    stamps: dict[str, list[float]] = {}
    take = sched._on_token

    def on_token(req, sample, result, row):
        stamps.setdefault(req.id, []).append(time.perf_counter())
        return take(req, sample, result, row)

    sched._on_token = on_token
    rng = np.random.default_rng(0)
    head = rng.integers(100, 40000, 32).tolist()

    def submit(i: int):
        return sched.submit(head + rng.integers(100, 40000, 8).tolist(),
                            SamplingParams(temperature=0, max_tokens=64 + (i * 7) % 40, ignore_eos=True))

    live, made = [submit(i) for i in range(clients)], clients
    while live:
        sched.step()
        for req in [r for r in live if r.done]:
            live.remove(req)
            if made < 3 * clients:
                live.append(submit(made))
                made += 1
    gaps = np.concatenate([np.diff(v) for v in stamps.values()]) * 1000
    p50, p99 = float(np.median(gaps)), float(np.percentile(gaps, 99))
    return {"p50_ms": p50, "p99_ms": p99, "ratio": p99 / p50, "mixed": sched.mixed_prefills}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="8,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--options", action="append", default=None,
                   help="a setting's engine options as JSON, with the scheduler's switches under \"driver\" "
                        "(repeatable; default: mixed_step on, then off)")
    p.add_argument("--one", nargs=2, metavar=("CLIENTS", "OPTIONS"), help=argparse.SUPPRESS)  # a worker run
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(one_run(int(a.one[0]), json.loads(a.one[1]))))
        return 0
    settings = a.options or ['{"mixed_step": true}', '{"mixed_step": false}']
    print("| clients | options | round | ITL p50 ms | ITL p99 ms | p99 / p50 | pieces in steps |\n|---|---|---|---|---|---|---|")
    for clients in (int(c) for c in a.clients.split(",")):
        for r in range(a.rounds):
            for options in (settings if r % 2 == 0 else settings[::-1]):
                out = subprocess.run([sys.executable, __file__, "--one", str(clients), options],
                                     capture_output=True, text=True, check=True)
                m = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"| {clients} | `{options}` | {r + 1} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | {m['ratio']:.2f} | "
                      f"{m['mixed']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
