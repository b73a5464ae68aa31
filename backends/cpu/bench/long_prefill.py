"""A long prompt's prefill as one forward and as pieces under ``prefill_forward_tokens``
(the engine's bound on a prefill forward's rows): time and the process's peak resident
memory above what it held before the call, on one engine, the two settings alternating
call by call so the host's drift falls on both alike. Each call's prefix is dropped and
freed memory handed back before the next (``return_freed_memory``); the peak is read
from ``VmHWM`` after resetting it (``/proc/self/clear_refs``: Linux only).

    python -m polyengine.backends.cpu.bench.long_prefill [--tokens 2048] [--cap 512] [--reps 3] [MODEL]

MODEL: a GGUF file or model name (default: the embedded default model). What docs/cpu.md's
"Prefill rows" cites.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from polyengine import EngineConfig, SamplingParams
from polyengine.memory import reset_peak_resident, resident_bytes, return_freed_memory
from polyengine.models import default_model_path, load_model
from polyengine.backends.cpu.engine import CpuEngine

MIB = 1 << 20


def _status(field: str) -> int:
    value = resident_bytes(field)
    if value is None:
        raise RuntimeError(f"no {field}: this bench reads /proc (Linux only)")
    return value


def _measured(engine: CpuEngine, params, tokens: list[int]) -> tuple[float, float, np.ndarray, int]:
    """One prefill: seconds, peak MiB over the resident memory before it, logits, first token."""
    return_freed_memory()
    reset_peak_resident()  # VmHWM := VmRSS
    before = _status("VmRSS")
    start = time.perf_counter()
    prefix, first = engine.prefill(params=params, tokens=tokens, sampling=SamplingParams(temperature=0))
    seconds = time.perf_counter() - start
    peak = (_status("VmHWM") - before) / MIB
    logits, token = prefix.host_logits(), int(first.row_tokens(0)[0])
    del prefix, first
    return seconds, peak, logits, token


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--cap", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    model = load_model(a.model or str(default_model_path()), exclusive=True)
    engine = CpuEngine(model, EngineConfig(max_slots=1, max_prefill_length=a.tokens, max_cache_length=a.tokens + 8))
    params = engine.load_params()
    default = engine.prefill_forward_tokens
    rng = np.random.default_rng(0)
    tokens = rng.integers(100, model.config.vocab_size, a.tokens).tolist()
    settings = {"one forward": None, f"pieces of at most {a.cap}": a.cap}
    rows: dict[str, list] = {name: [] for name in settings}
    engine.prefill_forward_tokens = None
    _measured(engine, params, tokens[:64])  # first-call costs (threads, scratch) out of the rows
    for _ in range(a.reps):
        for name, cap in settings.items():
            engine.prefill_forward_tokens = cap
            rows[name].append(_measured(engine, params, tokens))
    base = rows["one forward"]
    print(f"{model.source}: a {a.tokens}-token prompt, {a.reps} calls a setting, alternating (medians); "
          f"the engine's own bound for this model: {default} tokens a forward")
    print("| setting | seconds | tok/s | peak over start, MiB | greedy first token as one forward | logits max diff |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    for name, got in rows.items():
        sec = statistics.median(r[0] for r in got)
        peak = statistics.median(r[1] for r in got)
        same = all(r[3] == base[0][3] for r in got)
        diff = max(float(np.abs(r[2] - base[0][2]).max()) for r in got)
        print(f"| {name} | {sec:.2f} | {a.tokens / sec:.1f} | {peak:.0f} | {'yes' if same else 'no'} | {diff:.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
