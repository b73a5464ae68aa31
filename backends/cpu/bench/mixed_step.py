"""The mixed step against the two calls: S slots decode while a new request's piece of T
tokens, continuing a cached prefix of START positions (a chat template's), is prefilled.
Per round, one engine makes ``prefill_batch`` and then ``generate`` (what the driver does
without capability mixed_step) and ``generate_with_prefill`` (with it), in alternating
order; wall milliseconds of each, the median over the rounds, against a plain decode step
of the same S slots measured in the same rounds: the running streams' gap at that step.

    python -m polyengine.backends.cpu.bench.mixed_step [--slots 8] [--tokens 8] [--start 32] [--rounds 15] [MODEL]

MODEL: a GGUF file or model name (default: the embedded default model). What docs/cpu.md's
"The mixed step" cites.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from polyengine import EngineConfig, SamplingParams
from polyengine.engine import PrefillRequest
from polyengine.models import default_model_path, load_model
from polyengine.plugins import create_engine

GREEDY = SamplingParams(temperature=0, ignore_eos=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--start", type=int, default=32)
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args(argv)
    model = load_model(a.model or str(default_model_path()))
    eng = create_engine("cpu", model=model, config=EngineConfig(max_slots=a.slots, max_cache_length=512,
                                                                max_prefill_length=256))
    if not eng.capabilities.mixed_step:
        raise SystemExit("this engine does not declare mixed_step (options page_size, fused_decode, mixed_step)")
    params, state = eng.load_params(), eng.init_decode_state()
    rng = np.random.default_rng(0)
    for slot in range(a.slots):
        prefix, _ = eng.prefill(params=params, tokens=rng.integers(100, eng.vocab_size, 40).tolist(), sampling=GREEDY)
        state = eng.insert(prefix, state, slot)
    head, _ = eng.prefill(params=params, tokens=rng.integers(100, eng.vocab_size, a.start).tolist(), sampling=GREEDY)
    piece = [PrefillRequest(rng.integers(100, eng.vocab_size, a.tokens).tolist(), GREEDY, head)]
    times: dict[str, list[float]] = {"decode step": [], "prefill_batch + generate": [], "generate_with_prefill": []}
    for r in range(a.rounds + 2):
        if r and r % 20 == 0:
            for slot in range(a.slots):  # room again: fresh 40-token prompts
                state = eng.free_resource(state, slot)
                prefix, _ = eng.prefill(params=params, tokens=rng.integers(100, eng.vocab_size, 40).tolist(),
                                        sampling=GREEDY)
                state = eng.insert(prefix, state, slot)
        order = ["decode step", "prefill_batch + generate", "generate_with_prefill"]
        for name in (order if r % 2 else order[::-1]):
            state.wait()
            t = time.perf_counter()
            if name == "decode step":
                state, res = eng.generate(params, state)
            elif name == "generate_with_prefill":
                state, res, out = eng.generate_with_prefill(params, state, requests=piece)
                out.result()
            else:
                eng.prefill_batch(params=params, requests=piece)
                state, res = eng.generate(params, state)
            res.tokens  # noqa: B018  (the step's results on the host)
            if r >= 2:  # two warm-up rounds
                times[name].append(time.perf_counter() - t)
    base = statistics.median(times["decode step"])
    print(f"cpu engine, {a.slots} slots decoding, a piece of {a.tokens} tokens after {a.start} cached positions, "
          f"{a.rounds} rounds (mixed steps: {eng.mixed_steps})")
    print("| call | median ms | against a decode step |\n|---|---|---|")
    for name, xs in times.items():
        print(f"| {name} | {1000 * statistics.median(xs):.1f} | {statistics.median(xs) / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
