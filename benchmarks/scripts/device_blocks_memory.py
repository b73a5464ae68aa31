"""A device backend on a GGUF file's blocks against the same file widened to float32 at
load: peak RSS, load time, decode rate and the greedy tokens, each in a fresh process.

The device backends (cuda_torch, tpu_jax) keep every block format in its blocks
(docs/models.md, "Device paths"); ``load_model(path, dtype="float32")`` is the option
that widens the file instead. On this host the backends run on the CPU (cuda_torch's
stand-in, ``device=cpu``; tpu_jax on JAX's CPU platform), so the decode rate is the
stand-in's, not a device's; the memory is what the forms hold.

    python benchmarks/scripts/device_blocks_memory.py --model FILE.gguf
        [--backends cuda_torch,tpu_jax] [--tokens 16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_RUN = r"""
import json, sys, time
t0 = time.perf_counter()
import polyengine as pe
from polyengine.benchmarks.stats import peak_rss_bytes
from polyengine.models import load_model

path, backend, mode, tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model = load_model(path, dtype="float32" if mode == "widened" else None)
options = {"device": "cpu"} if backend == "cuda_torch" else {}
llm = pe.LLM(model, backend=backend, max_slots=1, max_cache_length=256, max_prefill_length=128, options=options)
llm.generate(["warm up"], pe.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
load = time.perf_counter() - t0
t1 = time.perf_counter()
out = llm.generate(["The quick brown fox"], pe.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
rate = tokens / (time.perf_counter() - t1)
print(json.dumps({"load_s": load, "tok_s": rate, "peak_mib": peak_rss_bytes() >> 20, "tokens": out[0].outputs[0].token_ids,
                  "weights": llm.engine.speed_paths().get("weights", "")}))
"""


def run(model: str, backend: str, mode: str, tokens: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", _RUN, model, backend, mode, str(tokens)],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{backend} {mode} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a .gguf file")
    ap.add_argument("--backends", default="cuda_torch", help="comma-separated device backends")
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens decoded and compared")
    args = ap.parse_args()
    print("| backend | weights | peak RSS MiB | load + first engine s | decode tok/s (stand-in) | tokens |")
    print("| --- | --- | --- | --- | --- | --- |")
    for backend in args.backends.split(","):
        rows = {mode: run(args.model, backend, mode, args.tokens) for mode in ("blocks", "widened")}
        same = rows["blocks"]["tokens"] == rows["widened"]["tokens"]
        for mode, r in rows.items():
            print(f"| {backend} | {mode} | {r['peak_mib']} | {r['load_s']:.1f} | {r['tok_s']:.2f} | "
                  f"{'the same' if same else r['tokens']} |")
        print(f"\n{backend}, blocks: {rows['blocks']['weights'] or '(no block matrices)'}\n", file=sys.stderr)


if __name__ == "__main__":
    main()
