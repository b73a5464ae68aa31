"""Cost of the torch sampler per decode step: the Threefry stream and whole sample() calls.

    python benchmarks/scripts/torch_sampler_step.py [--rows 1 8 32] [--vocab 49152] [--repeat 9] [--threads N] [--compile]

For each row count, milliseconds per step (the minimum over ``--repeat`` runs, then
the median in brackets: with two shared cores the minimum is the better estimate of
the cost, the median shows the noise) of:

- the core's NumPy Threefry uniforms, one call per row (what the reference pays);
- the torch uniforms, int32 and int64 formulations, and float32 Gumbel noise;
- ``TorchSampler.sample`` for greedy rows, plain sampling, top-k 50, top-p 0.9
  without top-k (a full vocabulary sort) and every parameter at once;
- with ``--compile``: the int32 uniforms and the plain sample() under
  ``torch.compile`` (the first call compiles for ~30-60 s, not counted).

The CPU model, its ISA flags and torch's thread count are printed first: ratios
mean something only within one run on one host. On a shared machine pass
``--threads 1``: with two threads, every parallel op waits at a barrier for a thread
another process may have descheduled, and small ops then take ~20 ms instead of µs.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch

from polyengine.sampling import SamplingParams
from polyengine.sampling import threefry as ref_threefry

from polyengine.backends.torch_common import threefry
from polyengine.backends.torch_common.sampling import TorchSampler, sample


def _cpu() -> str:
    model, flags = platform.processor() or "?", []
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in have]
                break
    except OSError:
        pass
    return f"{model} [{' '.join(flags)}], torch {torch.__version__}, {torch.get_num_threads()} threads, capability {torch.backends.cpu.get_cpu_capability()}"


def _time(fn, repeat: int) -> str:
    fn()  # warm-up (allocations, lazy init)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return f"{1e3 * times[0]:7.1f} ({1e3 * times[len(times) // 2]:.1f})"


_REQUESTS = {
    "greedy": dict(temperature=0.0),
    "plain": dict(temperature=0.8),
    "top-k 50": dict(temperature=0.8, top_k=50),
    "top-p 0.9": dict(temperature=0.8, top_p=0.9),
    "everything": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                       presence_penalty=0.5, frequency_penalty=0.2, logit_bias={5: 2.0}, min_tokens=2,
                       logprobs=True, top_logprobs=5),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    v = args.vocab
    print(_cpu())
    print(f"vocab {v}; ms per step: min (median) of {args.repeat}\n")
    ids = torch.arange(v)[None, :]
    compiled_uniforms = torch.compile(threefry.uniforms, dynamic=False) if args.compile else None
    for rows in args.rows:
        gen = torch.Generator().manual_seed(rows)
        lo, hi, ctr = (torch.randint(0, 2**32, (rows, 1), generator=gen) for _ in range(3))
        seeds = [int(a) | int(b) << 32 for a, b in zip(lo[:, 0], hi[:, 0])]
        cases = {
            "numpy uniforms (reference)": lambda: [ref_threefry.uniforms(s, np.arange(v), 5, 0) for s in seeds],
            "torch uniforms int32": lambda: threefry.uniforms(lo, hi, ids, ctr),
            "torch uniforms int64": lambda: threefry.uniforms(lo, hi, ids, ctr, int64=True),
            "torch gumbel float32": lambda: threefry.gumbel(lo, hi, ids, ctr),
        }
        if compiled_uniforms is not None:
            compiled_uniforms(lo, hi, ids, ctr)  # compile outside the timing
            cases["torch uniforms int32, compiled"] = lambda: compiled_uniforms(lo, hi, ids, ctr)
        logits = torch.randn((rows, v), generator=gen) * 3
        for name, kw in _REQUESTS.items():
            sampler = TorchSampler(v, rows, (2,))
            for r in range(rows):
                sampler.install(r, SamplingParams(seed=seeds[r], **kw), [1, 2, 3])
            cases[f"sample(): {name}"] = lambda s=sampler: s.sample(logits)
            if args.compile and name == "plain":
                # The pure function with static flags: what a compiled engine step calls.
                step = torch.compile(sample, dynamic=False)
                step(sampler.state, logits, None, sampler.flags, 0)
                cases["sample(): plain, compiled"] = lambda f=step, s=sampler: f(s.state, logits, None, s.flags, 0)
        print(f"| rows {rows:<3} {'':30} | ms/step |")
        print(f"|{'-' * 40}|{'-' * 17}|")
        for name, fn in cases.items():
            print(f"| {name:38} | {_time(fn, args.repeat):>15} |", flush=True)
        print()


if __name__ == "__main__":
    main()
