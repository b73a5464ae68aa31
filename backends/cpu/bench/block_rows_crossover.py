"""Where the cpu backend's block kernels stop beating the dequantized GEMM: one
projection of a GGUF file at M rows of x, on ``CpuKernels.gguf_linear`` (int8 or int8x2
activations, the path at most ``block_kernel_rows`` rows take) and on ``TiledBlockLinear``
(bands dequantized into torch's GEMM, the path of longer prefills): wall milliseconds (what
a prefill waits for, and what the engine's choice follows) and process CPU milliseconds
(both threads together), each the best of 5 calls.

    python -m polyengine.backends.cpu.bench.block_rows_crossover FILE.gguf [--tensor NAME ...] [--rows 16,24,32,48,64,128]

FILE: any GGUF of the block formats (``benchmarks/scripts/llama_shapes.py --write-only``
prints its files' paths). What docs/models.md's "overtake ... below 24-32 rows" cites.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from polyengine.backends.cpu import kernels as cpu_kernels
from polyengine.backends.cpu.blocks import BlockMatrix, TiledBlockLinear
from polyengine.models.blocks import BLOCK_FORMATS
from polyengine.models.loader import load_model


def _best(fn, reps: int = 5) -> tuple[float, float]:
    """(wall ms, CPU ms), each the best of ``reps`` calls."""
    fn()
    wall = cpu = float("inf")
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.process_time() - c)
    return wall * 1e3, cpu * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("--tensor", action="append", default=None,
                   help="HF-named weight (default: layer 0's gate and down projections)")
    p.add_argument("--rows", default="16,24,32,48,64,128")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pairs", type=int, default=2, choices=(1, 2), help="int8 rows per row of x (2: int8x2)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    kern = cpu_kernels.load(threads=args.threads)
    model = load_model(args.file)
    names = args.tensor or ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    print("| tensor | format | rows | kernels wall ms | tiled GEMM wall ms | kernels / tiled wall | "
          "kernels CPU ms | tiled CPU ms | kernels / tiled CPU |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        blocks = BlockMatrix.of(model.weight(name, formats=(*BLOCK_FORMATS, "float32")))
        tiled = TiledBlockLinear()
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, blocks.k)
            (kw, kc), (tw, tc) = (_best(lambda: kern.gguf_linear(x, blocks, pairs=args.pairs)),
                                  _best(lambda: tiled(x, blocks, None, kernels=kern)))
            print(f"| {name} | {blocks.format} | {m} | {kw:.2f} | {tw:.2f} | {kw / tw:.2f} | {kc:.2f} | {tc:.2f} | "
                  f"{kc / tc:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
