"""Peak resident memory of each phase of the bench's standard workload, in one process.

``polyengine bench`` reports one peak RSS per row: the worker's high-water mark over
every phase. This runs the same phases (benchmarks/phases.py, the same system class the
bench's worker builds) in this process and resets the kernel's high-water mark
(``/proc/self/clear_refs``, value 5) before each run, so each line says which phase
sets the peak, what it started from and what it left behind; the last lines show what
stays after every engine is released, and what of it is free heap (``malloc_trim``).

    python benchmarks/scripts/phase_rss.py --options '{"weight_dtype": "bfloat16", "bf16_compute": "bf16", "kv_dtype": "bfloat16"}'

Linux only (``/proc``). Memory, not time: a busy host does not change what it prints.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys

from polyengine.memory import reset_peak_resident, resident_bytes

MIB = 1 << 20


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, MiB."""
    return {key: (resident_bytes(key) or 0) // MIB for key in ("VmRSS", "VmHWM")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--options", default="{}", help="engine options, JSON")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", default=None, help="a model path (default: the embedded default model)")
    args = ap.parse_args(argv)
    if not sys.platform.startswith("linux"):
        ap.error("reads /proc: Linux only")

    from polyengine.benchmarks.phases import run_standard
    from polyengine.benchmarks.run_polyengine import PolyengineSystem
    from polyengine.benchmarks.workload import STANDARD

    now = _status()
    rows = [("start", None, now["VmHWM"], now["VmRSS"])]
    system = PolyengineSystem(model=args.model, backend=args.backend, dtype=args.dtype,
                              options=json.loads(args.options))
    now = _status()
    rows.append(("model loaded", None, now["VmHWM"], now["VmRSS"]))
    for name in ("decode", "prefill", "serve"):
        run = getattr(system, name)

        def measured(*a, _run=run, _name=name, **k):
            reset_peak_resident()
            before = _status()["VmRSS"]
            out = _run(*a, **k)
            now = _status()
            rows.append((f"{_name} ({len(a[0])} {'tokens' if _name == 'prefill' else 'prompts'})", before,
                         now["VmHWM"], now["VmRSS"]))
            return out

        setattr(system, name, measured)
    run_standard(system, STANDARD, args.repeats, lambda phase, detail: None)
    system._llm = system._engine = system._key = None
    gc.collect()
    rows.append(("every engine released", None, None, _status()["VmRSS"]))
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        rows.append(("then malloc_trim(0)", None, None, _status()["VmRSS"]))
    except OSError:
        pass
    print(f"{args.backend} {args.dtype} {args.options}, {args.repeats} run(s) a phase after its warm-up; MiB")
    print("| phase run | RSS before | peak during | RSS after |")
    print("| --- | ---: | ---: | ---: |")
    for what, before, peak, after in rows:
        cells = ["" if v is None else str(v) for v in (before, peak, after)]
        print(f"| {what} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
