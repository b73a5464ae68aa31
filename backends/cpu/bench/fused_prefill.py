"""Short prefills as one call of the fused decode step (option ``fused_prefill``) against
the torch forward: a chunked prompt's pieces of T tokens, each continuing the last, after
a prefix of START positions (a prefill's own buffer extended in place, as the driver runs
them), and a fresh prompt of T tokens. Two engines in one process, calls interleaved so
that the shared host's noise falls on both alike; wall ms per piece, the median over the
repeats.

    python -m polyengine.backends.cpu.bench.fused_prefill [--start 1000] [--tokens 1,4,8,16] [--reps 5]
        [--against torch|rows] [--scores N] [MODEL]

``--against rows``: both engines in the fused step, the second attending row by row
(``attention_runs`` off, csrc/decode.h) instead of a prefill's rows as one run.
``--scores N``: the engines' bound on a fused prefill's attention past 16 tokens
(``fused_prefill_scores``; 0: none; by default none where the rows attend as runs).

MODEL: a GGUF file or model name (default: the embedded default model). What docs/cpu.md's
"Short prefills in the fused step" cites.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from polyengine import EngineConfig, SamplingParams
from polyengine.models import default_model_path, load_model
from polyengine.backends.cpu.engine import CpuEngine

PIECES = 4  # chained pieces timed per repeat


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--start", type=int, default=1000)
    p.add_argument("--tokens", default="1,4,8,16", help="piece sizes, comma-separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--against", choices=("torch", "rows"), default="torch")
    p.add_argument("--scores", type=int, default=None)
    a = p.parse_args(argv)
    sizes = [int(t) for t in a.tokens.split(",")]
    model = load_model(a.model or str(default_model_path()))
    longest = a.start + PIECES * max(sizes)
    config = EngineConfig(max_slots=1, max_cache_length=longest + 64, max_prefill_length=longest)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=1)
    engines = {}
    names = ("fused step", "torch forward") if a.against == "torch" else ("runs", "row by row")
    for first, name in zip((True, False), names):
        eng = CpuEngine(model, config.model_copy(update={"options": {"fused_prefill": first or a.against == "rows"}}))
        eng._worker = None  # calls on this thread (one OpenMP team for both engines)
        if a.against == "rows":
            eng.attention_runs = first
        if a.scores is not None:
            eng.fused_prefill_scores = a.scores or sys.maxsize
        engines[name] = (eng, eng.load_params())
    if not next(iter(engines.values()))[0].plan.fused_prefill:
        print("the fused step does not run here (no kernels, or not a Llama-family model)", file=sys.stderr)
        return 1
    times: dict[tuple[str, str, int], list[float]] = {}
    for rep in range(a.reps + 1):  # the first round warms up and is not counted
        head = rng.integers(100, vocab, a.start).astype(np.int32)
        for n in sizes:
            pieces = [rng.integers(100, vocab, n).astype(np.int32) for _ in range(PIECES)]
            for name, (eng, params) in engines.items():
                prefix, _ = eng.prefill(params=params, tokens=head, sampling=greedy)
                for piece in pieces:
                    t = time.perf_counter()
                    prefix, _ = eng.prefill(params=params, tokens=piece, sampling=greedy, existing_prefix=prefix)
                    if rep:
                        times.setdefault(("piece", name, n), []).append(time.perf_counter() - t)
                t = time.perf_counter()
                eng.prefill(params=params, tokens=pieces[0], sampling=greedy)
                if rep:
                    times.setdefault(("fresh", name, n), []).append(time.perf_counter() - t)
    print(f"{model.config.num_hidden_layers} layers; pieces continue a prefix of {a.start} positions; "
          f"wall ms, median of {a.reps} repeats x {PIECES} pieces (fresh prompts: x 1)")
    one, two = names
    print(f"| tokens | piece: {one} | piece: {two} | ratio | fresh prompt: {one} | {two} | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in sizes:
        med = {key: statistics.median(v) * 1e3 for key, v in times.items() if key[2] == n}
        pf, pt = med[("piece", one, n)], med[("piece", two, n)]
        ff, ft = med[("fresh", one, n)], med[("fresh", two, n)]
        print(f"| {n} | {pf:.1f} | {pt:.1f} | {pf / pt:.2f} | {ff:.1f} | {ft:.1f} | {ff / ft:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
