"""A continued prefill's piece (a chunked prefill's later piece, a prefix-cache hit): T new
tokens after a cached prefix of START positions, with its attention on the host kernel
(option prefill_attention "kernel", ``StepSpec.causal_tail``) and on the general masked
path (option "sdpa": torch's SDPA with a boolean mask, what every continued prefill ran
before the kernel took an offset). Two engines in one process, their calls interleaved
so that the shared host's noise falls on both alike; CPU seconds of the whole process
(both threads), the median over the repeats, and the share spent in the attention
function itself.

    python -m polyengine.backends.cpu.bench.continued_prefill [--start 1500] [--tokens 64] [--reps 9] [--threads N] [MODEL]

MODEL: a GGUF file or model name (default: the embedded default model). What docs/cpu.md's
"a continued prefill's attention" cites.
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
from polyengine.backends.torch_common import model as torch_model


class _Timed:
    """Wraps an attention function, summing the CPU seconds spent inside it."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t = time.process_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.process_time() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--start", type=int, default=1500)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=0,
                   help="option threads (0: the engine's default); 1 times the work alone, without the "
                        "spinning a busy host adds to two threads' CPU seconds")
    a = p.parse_args(argv)
    model = load_model(a.model or str(default_model_path()))
    longest = max(2000, a.start + a.tokens)  # the brief's engine: prefill 2000, cache 2200
    config = EngineConfig(max_slots=1, max_cache_length=longest + 200, max_prefill_length=longest)
    rng = np.random.default_rng(0)
    head = rng.integers(100, model.config.vocab_size, a.start).astype(np.int32)
    piece = rng.integers(100, model.config.vocab_size, a.tokens).astype(np.int32)
    greedy = SamplingParams(temperature=0, max_tokens=1)
    masked = _Timed(torch_model._attend)
    torch_model._attend = masked  # attention_block's general path looks it up by name
    runs = {}
    for choice in ("kernel", "sdpa"):
        eng = CpuEngine(model, config.model_copy(update={"options": {"prefill_attention": choice, "threads": a.threads}}))
        # Calls on this thread: two engines' step threads would be two OpenMP teams, which
        # libgomp puts to sleep between regions (csrc/parallel.h), timing that instead.
        eng._worker = None
        if eng._causal_attention is not None:
            eng._causal_attention = _Timed(eng._causal_attention)
        params = eng.load_params()
        prefix, _ = eng.prefill(params=params, tokens=head, sampling=greedy)
        runs[choice] = (eng, params, prefix, [], [])
        print(f"{choice}: plan prefill_attention={eng.plan.prefill_attention}", file=sys.stderr)
    first = {}
    for rep in range(a.reps + 1):  # the first round warms up and is not counted
        for choice, (eng, params, prefix, total, attention) in runs.items():
            timer = eng._causal_attention if eng._causal_attention is not None else masked
            before = timer.seconds
            t = time.process_time()
            out, _ = eng.prefill(params=params, tokens=piece, sampling=greedy, existing_prefix=prefix)
            spent = time.process_time() - t
            first[choice] = out.first_token
            if rep:
                total.append(spent)
                attention.append(timer.seconds - before)
    print(f"a {a.tokens}-token piece after {a.start} positions, {model.config.num_hidden_layers} layers, "
          f"threads {a.threads or 'default'}, {a.reps} interleaved repeats, CPU ms (median [min, max]):")
    for choice, (_, _, _, total, attention) in runs.items():
        ms = [x * 1e3 for x in total]
        att = [x * 1e3 for x in attention]
        print(f"  {choice:6s}: piece {statistics.median(ms):7.1f} [{min(ms):.1f}, {max(ms):.1f}]  "
              f"attention {statistics.median(att):6.1f} [{min(att):.1f}, {max(att):.1f}]  first token {first[choice]}")
    k, s = (statistics.median(runs[c][3]) for c in ("kernel", "sdpa"))
    k_min, s_min = (min(runs[c][3]) for c in ("kernel", "sdpa"))
    print(f"  piece: kernel / sdpa = {k / s:.3f} (medians), {k_min / s_min:.3f} (minima)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
