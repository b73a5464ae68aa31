"""The neuron CPU compile path's two compilers on one graph: what building the default
model's token-generation graph costs under ``export`` and ``inductor``, and a decode step
of each, called alternately (interleaved A/B, medians), as docs/neuron.md's "Choosing the
CPU compiler" records.

    python benchmarks/scripts/neuron_compilers.py [--model M] [--slots 1] [--positions 256]
                                      [--threads 1] [--steps 15] [--compilers export,inductor]

The graph is ``TokenGeneration`` over every slot (all occupied), built by
``compile.compile_graph`` as the engine builds it (``export``: K/V written in place;
Inductor: vectorized C++ unless ``POLYENGINE_NEURON_FAST_COMPILE=1``). Build CPU seconds
are this process's (Inductor's C++ builds run in child processes: see the total that
``/usr/bin/time`` prints). One thread is the fair setting on a shared machine: with two,
OpenMP's spinning inflates CPU time under load. Prints the CPU model and the load average.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from polyengine.benchmarks.host import cpu_info, load_average
from polyengine.models import load_model
from polyengine.sampling.masks import full_mask

from polyengine.backends.neuron.compile import compile_graph
from polyengine.backends.neuron.graphs import TokenGeneration
from polyengine.backends.torch_common.model import TorchWeights
from polyengine.backends.torch_common.sampling import SamplerState


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--compilers", default="export,inductor")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    c, slots, positions = model.config, args.slots, args.positions
    weights = TorchWeights.from_model(model, dtype=torch.float32, max_positions=positions)
    names = tuple(sorted(weights.tensors))

    def inputs() -> tuple:
        k, v = weights.new_cache(slots, positions)
        return (tuple(weights.tensors[n] for n in names), k, v, torch.arange(slots), torch.ones(slots, dtype=torch.bool),
                torch.full((slots,), 20, dtype=torch.int64), torch.from_numpy(full_mask(c.vocab_size, slots)),
                torch.zeros(slots, dtype=torch.bool), SamplerState.neutral(slots, c.vocab_size, list(c.eos_token_ids)).as_dict())

    out: dict = {"cpu": cpu_info(), "load_before": load_average(), "threads": args.threads, "slots": slots,
                 "positions": positions}
    graphs = {}
    for compiler in args.compilers.split(","):
        module = TokenGeneration(c, names, batch=slots, tokens=1, kv_len=positions, max_cache_length=positions,
                                 num_top=20, inplace=compiler == "export")
        wall, cpu = time.perf_counter(), time.process_time()
        graphs[compiler] = (compile_graph(module, inputs(), compiler)[0], inputs())
        out[f"{compiler}_build"] = {"wall_s": round(time.perf_counter() - wall, 1),
                                    "cpu_s_this_process": round(time.process_time() - cpu, 1)}
        print(compiler, out[f"{compiler}_build"], flush=True)
    times: dict = {k: ([], []) for k in graphs}
    with torch.no_grad():
        for graph, a in graphs.values():
            for _ in range(3):
                graph(*a)
        for _ in range(args.steps):
            for name, (graph, a) in graphs.items():
                wall, cpu = time.perf_counter(), time.process_time()
                graph(*a)
                times[name][0].append(time.perf_counter() - wall)
                times[name][1].append(time.process_time() - cpu)
    for name, (wall, cpu) in times.items():
        out[f"{name}_step"] = {"median_wall_ms": round(1000 * statistics.median(wall), 1),
                               "median_cpu_ms": round(1000 * statistics.median(cpu), 1)}
    out["load_after"] = load_average()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
