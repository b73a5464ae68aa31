"""The neuron CPU compile path's two compilers on one model: what building an engine's
graphs costs under ``export`` and ``inductor`` (its ``bench_report()`` rows), and its
decode steps, the two engines stepped alternately (interleaved A/B, medians), as
docs/neuron.md's "Choosing the CPU compiler" records.

    python benchmarks/scripts/neuron_compilers.py [--model M] [--positions 256] [--prompt-len 16]
                                      [--threads 1] [--steps 15] [--compilers export,inductor]

Each engine has one slot, one prefill bucket (``--prompt-len``) and one sequence bucket
(``--positions``): three graphs (context, continuation, token generation), built through
the plugin registry with fresh artifact caches (Inductor: vectorized C++ unless
``POLYENGINE_NEURON_FAST_COMPILE=1``). A step is one synchronous ``generate`` (the
token-generation graph and the engine's host bookkeeping) of a greedy request in slot 0.
Build CPU seconds are this process's (Inductor's C++ builds run in child processes: see
the total ``/usr/bin/time`` prints). One thread is the fair setting on a shared machine:
with two, OpenMP's spinning inflates CPU time under load. Prints the CPU model and the
load average.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from polyengine import EngineConfig, SamplingParams, create_engine
from polyengine.benchmarks.host import cpu_info, load_average
from polyengine.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--compilers", default="export,inductor")
    args = ap.parse_args()
    model = load_model(args.model)
    out: dict = {"cpu": cpu_info(), "load_before": load_average(), "threads": args.threads,
                 "positions": args.positions, "prompt_len": args.prompt_len}
    runs = {}
    for compiler in args.compilers.split(","):
        options = {"compiler": compiler, "threads": args.threads, "async_steps": False,
                   "seq_buckets": [args.positions]}
        if compiler == "inductor":
            options["cache_dir"] = tempfile.mkdtemp(prefix="neuron-compilers-")
        wall, cpu = time.perf_counter(), time.process_time()
        engine = create_engine("neuron", model, EngineConfig(
            max_slots=1, max_prefill_length=args.prompt_len, max_cache_length=args.positions, options=options))
        report = engine.bench_report()
        out[f"{compiler}_build"] = {"wall_s": round(time.perf_counter() - wall, 1),
                                    "cpu_s_this_process": round(time.process_time() - cpu, 1),
                                    "graphs": {r["program"]: round(r["seconds"], 1) for r in report["compile"]}}
        print(compiler, out[f"{compiler}_build"], flush=True)
        params, state = engine.load_params(), engine.init_decode_state()
        prefix, _ = engine.prefill(params=params, tokens=list(range(1, args.prompt_len + 1)),
                                   sampling=SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
        runs[compiler] = [engine, params, engine.insert(prefix, state, 0)]
    times: dict = {k: ([], []) for k in runs}
    for step in range(3 + args.steps):
        for name, run in runs.items():
            engine, params, state = run
            wall, cpu = time.perf_counter(), time.process_time()
            run[2], result = engine.generate(params, state)
            _ = result.tokens  # read back: the step is done
            if step >= 3:
                times[name][0].append(time.perf_counter() - wall)
                times[name][1].append(time.process_time() - cpu)
    for name, (wall, cpu) in times.items():
        out[f"{name}_step"] = {"median_wall_ms": round(1000 * statistics.median(wall), 1),
                               "median_cpu_ms": round(1000 * statistics.median(cpu), 1)}
    out["load_after"] = load_average()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
