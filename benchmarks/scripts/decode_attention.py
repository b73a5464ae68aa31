"""The fused decode step's attention as the streams' contexts grow, on the cpu backend.

``--streams`` greedy streams (16-token prompts) decode ``--tokens`` tokens each on the
default model; for every step, the attention phase's time and the whole step's. The
attention is read from the kernels' phase timers (``csrc/decode.h``, ``-DPE_PROFILE``:
thread 0's clock, so with two threads it is the phase's wall time): each thread count runs
in a worker process whose kernels are built with that flag, into a private cache of its
own (a temporary folder: the build's digest does not cover the flag, so that build must
never reach the user's cache) through a compiler wrapper that adds it. A line fitted to
each series against the context length gives its cost per token of context (the slope,
microseconds per step per token of each stream's context) and its base; the table also
gives the medians of the steps at a short context (positions 36-86) and of the last 50.
Steps run synchronously (``async_steps`` off) so a step's time is its own.

    python benchmarks/scripts/decode_attention.py [--streams 4] [--tokens 700] [--threads 1,2]
                                                  [--option KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPT = 16
SHORT = slice(20, 70)  # steps at positions 36-86


def _fit(ys: list[float]) -> tuple[float, float]:
    """(base ms, slope us per token of context) of a line through the steps after the first 20."""
    import numpy as np

    x = np.arange(len(ys))[20:] + PROMPT
    slope, base = np.polyfit(x, np.asarray(ys[20:]), 1)
    return float(base), float(slope) * 1000


def worker(streams: int, tokens: int, threads: int, options: dict) -> None:
    import ctypes
    import time

    import polyengine
    from polyengine import SamplingParams

    llm = polyengine.LLM(backend="cpu", options={"threads": threads, "async_steps": False, **options})
    lib = llm.engine.plan.kernels.lib
    if not hasattr(lib, "pe_profile"):
        raise SystemExit("the kernels were not built with -DPE_PROFILE (was CXX the wrapper?)")
    phases = (ctypes.c_double * 8)()
    lib.pe_profile(phases)  # the load's and the warm-up's phases dropped
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(streams):
        llm.submit([1 + i] * PROMPT, sp)
    att, step = [], []
    while llm.scheduler.busy:
        start = time.perf_counter()
        llm.step()
        step.append((time.perf_counter() - start) * 1000)
        lib.pe_profile(phases)
        att.append(phases[3] / 1e6)  # PE_MARK(3): the attention of every layer
    att, step = att[:tokens], step[:tokens]
    print(json.dumps({"att": att, "step": step}))


def _compiler() -> str:
    """The compiler the cpu backend would pick ($CXX, else g++, c++, clang++ on the PATH;
    the bench reaches no backend module but through the registry)."""
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not found:
        raise SystemExit("no C++ compiler found (g++, c++ or clang++): the kernels cannot be built")
    return found


def run(args: argparse.Namespace, threads: int, folder: Path) -> dict:
    wrapper = folder / "cxx"
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(_compiler())} -DPE_PROFILE \"$@\"\n")
    wrapper.chmod(0o700)
    env = {**os.environ, "CXX": str(wrapper), "POLYENGINE_CACHE": str(folder / "cache")}
    cmd = [sys.executable, __file__, "--worker", "--streams", str(args.streams), "--tokens", str(args.tokens),
           "--threads", str(threads)] + [x for kv in args.option for x in ("--option", kv)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--option", action="append", default=[], help="an engine option, KEY=VALUE (VALUE as JSON)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    options = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.option)}
    if args.worker:
        worker(args.streams, args.tokens, int(args.threads), options)
        return
    from polyengine.hostinfo import cpu_model

    print(f"cpu: {cpu_model()}; {args.streams} streams x {args.tokens} tokens; options {options or '{}'}")
    print("| threads | attention ms at 36-86 / last 50 | its base ms + us per token | step ms at 36-86 / last 50 "
          "| its base ms + us per token |")
    print("| ---: | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:  # 0700: the kernels' cache checks it is private
        for threads in (int(t) for t in args.threads.split(",")):
            r = run(args, threads, Path(tmp))
            cells = []
            for series in (r["att"], r["step"]):
                base, slope = _fit(series)
                cells += [f"{statistics.median(series[SHORT]):.2f} / {statistics.median(series[-50:]):.2f}",
                          f"{base:.2f} + {slope:.2f}"]
            print(f"| {threads} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
