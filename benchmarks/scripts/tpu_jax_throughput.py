"""tpu_jax beside the cpu backend on one workload: decode tokens/s at batch 1 and a full
batch, prefill tokens/s, and tpu_jax's compile time per program, on this machine's
JAX devices and again on N CPU host devices (a subprocess started with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``).

    python benchmarks/scripts/tpu_jax_throughput.py [--model M] [--slots 8] [--prompt-len 64]
                                       [--new-tokens 48] [--host-devices 4] [--rounds 2]

Every engine runs through the driver with greedy requests of ``--prompt-len`` tokens:
prefill tokens/s is the prompt tokens of a full batch over the driver's first step
(prefill and insert of every request, one decode step); decode tokens/s the remaining
completion tokens over the time spent generating them. tpu_jax compiles every
program first (warm-up; per program and bucket from ``engine.bench_report()``);
cpu gets a warm-up request. The table prints the CPU model and ISA flags and
the load average: with two shared cores, compare ratios measured in the same run,
never absolute numbers across runs. ``polyengine bench`` is the standard workload
(its phases, peers and JSON report); this script puts tpu_jax on 1 and N host
devices beside the cpu backend in one table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from polyengine import EngineConfig, SamplingParams
from polyengine.driver import LLM
from polyengine.hostinfo import cpu_flags, cpu_model
from polyengine.models import load_model


def _cpu() -> str:
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if f in cpu_flags()]
    return f"{cpu_model()} ({', '.join(isa)}; {os.cpu_count()} cores)"


def measure(engine, slots: int, prompt_len: int, new_tokens: int, batch: int) -> tuple[float, float]:
    llm = LLM.from_engine(engine, tools=False)
    vocab = engine.vocab_size
    prompts = [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(prompt_len)] for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    reqs = [llm.submit(p, sp) for p in prompts]
    t0 = time.perf_counter()
    llm.step()
    t1 = time.perf_counter()
    llm.scheduler.run_until(lambda: all(r.done for r in reqs))
    t2 = time.perf_counter()
    produced = sum(len(r.completion.token_ids) for r in reqs)
    return batch * prompt_len / (t1 - t0), (produced - 2 * batch) / (t2 - t1)


def run_here(args) -> dict:
    """Every engine of the table on this process's devices; returns the rows."""
    import jax

    from polyengine import create_engine

    model = load_model(args.model)
    cfg = EngineConfig(max_slots=args.slots, max_prefill_length=args.prompt_len,
                       max_cache_length=args.prompt_len + args.new_tokens + 1)
    out = {"devices": len(jax.devices()), "platform": jax.devices()[0].platform, "rows": []}
    engines = {"tpu_jax": lambda: create_engine("tpu_jax", model, cfg.model_copy(update={"options": args.options}))}
    if not args.jax_only:
        engines["cpu"] = lambda: create_engine("cpu", model, cfg)
    for name, make in engines.items():
        engine = make()
        engine.load_params()
        if name == "tpu_jax":
            engine.warmup()
            report = engine.bench_report()
            out["warmup_s"] = report["warm-up seconds"]
            out["compile_s"] = [(r["program"] + ("" if r["bucket"] == "-" else f" {r['bucket']}"), r["seconds"])
                                for r in report["compile"]]
            out["mesh"] = report["mesh"]
        else:
            LLM.from_engine(engine, tools=False).generate([[5] * 8], SamplingParams(temperature=0, max_tokens=2))
        for batch in (1, args.slots):
            best = (0.0, 0.0)
            for _ in range(args.rounds):
                pre, dec = measure(engine, args.slots, args.prompt_len, args.new_tokens, batch)
                best = (max(best[0], pre), max(best[1], dec))
            out["rows"].append({"backend": name, "batch": batch, "prefill": best[0], "decode": best[1]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--host-devices", type=int, default=4, help="also run tpu_jax on this many CPU host devices (0: skip)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per row; the best is kept")
    ap.add_argument("--options", type=json.loads, default={}, help='tpu_jax engine options as JSON, e.g. \'{"data_parallel": 4}\'')
    ap.add_argument("--jax-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json:  # the subprocess of the host-device run
        print("RESULT " + json.dumps(run_here(args)))
        return
    runs = [run_here(args)]
    if args.host_devices:
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.host_devices}", "JAX_PLATFORMS": "cpu"}
        cmd = [sys.executable, __file__, "--json", "--jax-only", "--slots", str(args.slots), "--prompt-len", str(args.prompt_len),
               "--new-tokens", str(args.new_tokens), "--rounds", str(args.rounds), "--host-devices", "0",
               "--options", json.dumps(args.options)] + (["--model", args.model] if args.model else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            sys.exit(proc.stderr[-3000:])
        runs.append(json.loads(lines[-1][len("RESULT "):]))
    print(f"cpu: {_cpu()}; load average {os.getloadavg()[0]:.1f} (shared machine: compare ratios, not runs)")
    print(f"model: {load_model(args.model)!r}; {args.slots} slots, prompts of {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, greedy\n")
    print("| backend | devices | batch | prefill tok/s | decode tok/s | decode vs cpu |")
    print("|---|---|---|---|---|---|")
    base = {r["batch"]: r["decode"] for r in runs[0]["rows"] if r["backend"] == "cpu"}
    for run in runs:
        for r in run["rows"]:
            dev = f"{run['devices']} {run['platform']}" + (f" ({run['mesh']})" if r["backend"] == "tpu_jax" else "")
            ratio = f"{r['decode'] / base[r['batch']]:.2f}" if r["batch"] in base else "-"
            print(f"| {r['backend']} | {dev} | {r['batch']} | {r['prefill']:.1f} | {r['decode']:.1f} | {ratio} |")
    print("\ntpu_jax compile (seconds per program and bucket: trace, lower, XLA compile; in warm-up order):")
    for run in runs:
        progs = ", ".join(f"{name}: {secs:.1f}" for name, secs in run["compile_s"])
        print(f"- {run['devices']} device(s), {run['mesh']}: warm-up {run['warmup_s']:.1f} s: {progs}")


if __name__ == "__main__":
    main()
