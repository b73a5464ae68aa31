"""The cpu backend's block kernels (``backends/cpu/csrc/gguf.h``) in cache on one core:
Gweights/s per row of x for each GGUF format, 1 to 16 rows, int8 and int8x2 activations.

    python -m polyengine.backends.cpu.bench.block_kernel_rates [--isa auto|avx512|avx2|scalar] [--against REV]

Compiles ``block_kernel_rates.cpp`` (beside this module) against the backend's sources with
the ISA path's flags (``polyengine.backends.cpu.build.isa_flags``) and runs it: the best
of 200 calls on a 128 x 2048 matrix (L2-resident), so the table is the kernels' compute
rate, not memory's. ``--against REV`` also builds the kernels of git revision REV
(``git archive`` of its csrc/, needs a git checkout) and prints REV's table beside this
tree's, run by run in one process order: a same-run A/B of a kernel change. What
docs/cpu.md's in-cache rates cite. Needs a C++ compiler.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from polyengine.backends.cpu.build import CSRC, compiler, isa_flags

HERE = Path(__file__).resolve().parent


def _build(csrc: Path, isa: str, exe: Path) -> None:
    cmd = [compiler(), "-O3", *isa_flags(isa), "-fopenmp", "-I", str(csrc), "-o", str(exe),
           str(HERE / "block_kernel_rates.cpp")]
    subprocess.run(cmd, check=True)


def _table(title: str, out: str) -> None:
    rows: dict[str, dict[tuple[int, str], str]] = {}
    for line in out.split("\n"):
        if line.strip():
            fmt, m, act, rate = line.split()
            rows.setdefault(fmt, {})[(int(m), act)] = rate
    cols = sorted({c for r in rows.values() for c in r})
    print(title)
    print("| format | " + " | ".join(f"M={m} {a}" for m, a in cols) + " |")
    print("| --- |" + " ---: |" * len(cols))
    for fmt, r in rows.items():
        print(f"| {fmt} | " + " | ".join(r.get(c, "") for c in cols) + " |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", default="auto", choices=("auto", "avx512", "avx2", "scalar"))
    p.add_argument("--against", metavar="REV", help="also the kernels of this git revision, in the same run")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"this tree": Path(tmp) / "rates"}
        _build(CSRC, args.isa, builds["this tree"])
        if args.against:
            old = Path(tmp) / "old"
            old.mkdir()
            top = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=CSRC, check=True,
                                      capture_output=True, text=True).stdout.strip())
            rel = CSRC.relative_to(top)
            archive = subprocess.run(["git", "archive", args.against, str(rel)], cwd=top, check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
            builds[args.against] = Path(tmp) / "rates-old"
            _build(old / rel, args.isa, builds[args.against])
        outs = {name: "" for name in builds}
        for _ in range(2):  # alternately, twice: each case's best of both
            for name, exe in builds.items():
                outs[name] += subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    for name, out in outs.items():
        best: dict[tuple[str, str, str], float] = {}
        for line in out.split("\n"):
            if line.strip():
                fmt, m, act, rate = line.split()
                best[(fmt, m, act)] = max(best.get((fmt, m, act), 0.0), float(rate))
        _table(f"block kernels in cache, one core, Gweights/s per row of x (isa {args.isa}; {name})",
               "\n".join(f"{f} {m} {a} {r:.1f}" for (f, m, a), r in best.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
