"""The neuron backend's costs on this machine: compile time per graph and bucket (cold,
into a fresh artifact cache), the same engines built again from the warm cache (a new
process: it loads, compiles nothing), and decode tokens/s at batch 1 and a full batch
with and without speculation, beside the cpu backend on the same workload through
``polyengine.LLM``, with the speculation acceptance rate.

    python benchmarks/scripts/neuron_compile.py [--model M] [--slots 4] [--prompt-len 32]
                                   [--new-tokens 32] [--speculation 2] [--draft-layers 0]
                                   [--rounds 1] [--quick]

The engines use ``compiler="inductor"``, the CPU compiler that writes the artifacts a
cold and a warm cache compare (the default, ``export``, writes none).
``--quick`` is ``--model random:tiny-deep --slots 4 --prompt-len 16 --new-tokens 24``
(a 4-layer random model: minutes, not the default model's much longer compile).
Compile rows come from ``NeuronEngine.bench_report()``. Decode tokens/s: greedy
requests of ``--prompt-len`` tokens, ``--new-tokens`` each; the completion tokens after
the driver's first step over the time spent generating them (the best of ``--rounds``).
The CPU model and load average are printed: on a shared machine compare ratios
measured in the same run, never absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from polyengine import SamplingParams
from polyengine.benchmarks.host import cpu_info, load_average
from polyengine.driver import LLM
from polyengine.models import load_model

QUICK = {"model": "random:tiny-deep", "slots": 4, "prompt_len": 16, "new_tokens": 24}


def limits(args) -> dict:
    return dict(max_slots=args.slots, max_prefill_length=args.prompt_len,
                max_cache_length=args.prompt_len + args.new_tokens + 1)


def neuron_options(args, cache: str, speculation: int) -> dict:
    draft = {"draft_layers": args.draft_layers} if speculation > 1 else {}  # refused without speculation
    # Inductor: the compiler whose artifacts a cold and a warm cache are about (the default
    # off Neuron, export, keeps none; docs/neuron.md, "Choosing the CPU compiler").
    return {"compiler": "inductor", "cache_dir": cache, "speculation": speculation, **draft}


def build_engines(args, cache: str) -> dict:
    """The speculative and the plain engine, each timed; their compile rows, and how
    many programs each compiled and loaded from the cache (counted from those rows)."""
    from collections import Counter

    from polyengine import EngineConfig, create_engine

    model = load_model(args.model)
    out = {"rows": [], "build_s": {}, "counts": {}}
    for spec in (args.speculation, 1):
        t = time.perf_counter()
        engine = create_engine("neuron", model, EngineConfig(**limits(args), options=neuron_options(args, cache, spec)))
        out["build_s"][f"speculation={spec}"] = time.perf_counter() - t
        rows = engine.bench_report()["compile"]
        out["rows"] += [{**r, "engine": f"speculation={spec}"} for r in rows]
        out["counts"][f"speculation={spec}"] = dict(Counter(r.get("source", "compiled") for r in rows))
    return out


def measure(llm: LLM, prompt_len: int, new_tokens: int, batch: int) -> float:
    """Decode tokens/s of ``batch`` greedy requests (after the driver's first step)."""
    vocab = llm.engine.vocab_size
    prompts = [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(prompt_len)] for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    reqs = [llm.submit(p, sp) for p in prompts]
    llm.step()
    first = sum(len(r.completion.token_ids) for r in reqs)
    t = time.perf_counter()
    llm.scheduler.run_until(lambda: all(r.done for r in reqs))
    elapsed = time.perf_counter() - t
    return (sum(len(r.completion.token_ids) for r in reqs) - first) / elapsed


def throughput(args, cache: str) -> tuple[list[dict], dict]:
    model = load_model(args.model)
    setups = {
        f"neuron speculation={args.speculation}": dict(backend="neuron", options=neuron_options(args, cache, args.speculation)),
        "neuron speculation=1": dict(backend="neuron", options=neuron_options(args, cache, 1)),
        "cpu": dict(backend="cpu"),
    }
    rows, report = [], {}
    for name, kw in setups.items():
        llm = LLM(model, tools=False, **limits(args), **kw)
        llm.generate([[5] * 4], SamplingParams(temperature=0, max_tokens=2))  # warm-up request
        for batch in (1, args.slots):
            best = max(measure(llm, args.prompt_len, args.new_tokens, batch) for _ in range(args.rounds))
            rows.append({"engine": name, "batch": batch, "decode": best})
        if name.startswith("neuron") and hasattr(llm.engine, "bench_report"):
            report[name] = {k: v for k, v in llm.engine.bench_report().items() if k != "compile"}
    return rows, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--speculation", type=int, default=2, help="tokens per step of the speculative engine (>= 2)")
    ap.add_argument("--draft-layers", type=int, default=0, help="0: half the target's layers")
    ap.add_argument("--rounds", type=int, default=1, help="runs per throughput row; the best is kept")
    ap.add_argument("--quick", action="store_true", help="a 4-layer random model and small shapes (see above)")
    ap.add_argument("--cache", help=argparse.SUPPRESS)  # the warm child: an existing cache directory
    args = ap.parse_args()
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.speculation < 2:
        ap.error("--speculation must be at least 2 (the plain engine is measured too)")
    if args.cache:  # the warm-start child
        print("RESULT " + json.dumps(build_engines(args, args.cache)))
        return

    cache = tempfile.mkdtemp(prefix="neuron-bench-cache-")
    try:
        load = [load_average()]
        cold = build_engines(args, cache)
        cmd = [sys.executable, os.path.abspath(__file__), "--cache", cache, "--slots", str(args.slots),
               "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
               "--speculation", str(args.speculation), "--draft-layers", str(args.draft_layers)]
        proc = subprocess.run(cmd + (["--model", args.model] if args.model else []), capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            sys.exit(proc.stderr[-3000:])
        warm = json.loads(lines[-1][len("RESULT "):])
        load.append(load_average())
        rows, report = throughput(args, cache)
        load.append(load_average())
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    cpu = cpu_info()
    print(f"cpu: {cpu['model']} ({', '.join(cpu['isa'])}; {cpu['usable_cores']} usable cores); "
          f"load average (1/5/15 min) before, after compiling, at the end: {load}")
    print(f"model: {load_model(args.model)!r}; {args.slots} slots, prompts of {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, greedy; speculation {args.speculation} tokens per step\n")
    print("| engine | graph | bucket | cold: seconds (source) | warm: seconds (source) |")
    print("|---|---|---|---|---|")
    warm_rows = {(r["engine"], r["program"], r["bucket"]): r for r in warm["rows"]}
    for r in cold["rows"]:
        w = warm_rows[(r["engine"], r["program"], r["bucket"])]
        print(f"| {r['engine']} | {r['program']} | {r['bucket']} | {r['seconds']:.2f} ({r['source']}) "
              f"| {w['seconds']:.3f} ({w['source']}) |")
    for name in cold["build_s"]:
        print(f"\nengine construction, {name}: cold {cold['build_s'][name]:.1f} s (graphs compiled/loaded: "
              f"{cold['counts'][name]}), warm {warm['build_s'][name]:.2f} s in a new process ({warm['counts'][name]})", end="")
    print("\n\n| engine | batch | decode tok/s | vs cpu |")
    print("|---|---|---|---|")
    base = {r["batch"]: r["decode"] for r in rows if r["engine"] == "cpu"}
    for r in rows:
        print(f"| {r['engine']} | {r['batch']} | {r['decode']:.1f} | {r['decode'] / base[r['batch']]:.2f} |")
    for name, stats in report.items():
        print(f"\n{name}: " + ", ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in stats.items()))


if __name__ == "__main__":
    main()
