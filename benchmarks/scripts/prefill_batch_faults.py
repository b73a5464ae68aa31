"""The cpu engine's ``prefill_batch`` on paged K/V: the same 16 prompts of 470 tokens in
one forward, or in batches of fewer, with the process's user and system CPU seconds and
minor page faults over each (``resource.getrusage``). A big batch's activations are fresh
memory maps, faulted in page by page in every layer (docs/prefix-caching.md, "The memory
target").

    python benchmarks/scripts/prefill_batch_faults.py [PER_BATCH ...]
    e.g. python benchmarks/scripts/prefill_batch_faults.py 16 4
"""

from __future__ import annotations

import resource
import sys


def usage() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def main(batches: list[int]) -> None:
    import numpy as np

    from polyengine import SamplingParams, create_engine
    from polyengine.engine import PrefillRequest
    from polyengine.hostinfo import cpu_model
    from polyengine.models import load_model

    model = load_model(None)
    engine = create_engine("cpu", model=model, config=dict(
        max_slots=16, max_prefill_length=512, max_cache_length=4096,
        options={"threads": 1, "page_size": 16, "kv_pages": 1024}))
    params, rng = engine.load_params(), np.random.default_rng(0)
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    print(f"cpu: {cpu_model()}; default model, 1 thread, pages of 16")
    for per in batches:
        requests = [PrefillRequest(tokens=rng.integers(3, model.config.vocab_size, 470), sampling=sampling)
                    for _ in range(16)]
        u0, s0, f0 = usage()
        kept = []
        for i in range(0, len(requests), per):
            kept += engine.prefill_batch(params=params, requests=requests[i: i + per])
        u1, s1, f1 = usage()
        print(f"16 prompts of 470 tokens in batches of {per}: user {u1 - u0:.1f} s, sys {s1 - s0:.1f} s, "
              f"minor faults {f1 - f0}", flush=True)
        del kept  # the prefixes' pages back to the pool for the next pass


if __name__ == "__main__":
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    main([int(a) for a in sys.argv[1:]] or [16, 4])
