"""The compile seam: a graph module and example inputs in, a loaded artifact out.

Two compilers, one interface (:func:`compile_graph` writes an artifact file,
:func:`load_graph` reads one back without compiling anything):

``"inductor"`` (the CPU compile path)
    ``torch.export.export`` captures the graph as a static, verified program (no
    data-dependent control flow); Inductor compiles it ahead of the first call into C++
    kernels (``torch._inductor.standalone_compile``, shapes fixed by the example
    inputs); the ``CompiledArtifact`` is saved as one binary file and loaded with
    ``CompiledArtifact.load``. AOTInductor would also do, but pays ~20 s of C++ wrapper
    compilation per graph on two cores (measured when this seam was written), which
    the CI budget cannot carry (docs/neuron.md has what CI compiles and its cost).

``"neuronx"`` (Neuron devices)
    Not a graph but an engine's whole program: :mod:`.nxd` builds every graph of every
    bucket as one neuronx-distributed model (weights and KV cache kept on the
    NeuronCores, the cache updated through the compiler's input/output aliasing, tensor
    parallel over ``tp_degree`` cores), saved with ``torch.jit.save`` and loaded with
    ``torch.jit.load``; ``module`` is then an :class:`.nxd.ProgramSpec` and the loaded
    program is :attr:`CompiledGraph.fn`. Not run here: no Neuron device or installable
    torch-neuronx was available (docs/neuron.md); a recording stand-in checks it.

Aliases (the KV cache, on the CPU compile path): a graph's ``aliases`` pairs an input
with the output that is its new value; the CPU artifact writes those inputs in place
inside the compiled code (the export keeps the input mutation and Inductor turns the
scatter into an in-place write), and callers see only the other outputs.

Every compile and load is counted in :data:`COUNTS` (what the no-recompilation
tests read); nothing is imported from torch_neuronx or neuronx_distributed unless the
"neuronx" compiler is asked for.
"""

from __future__ import annotations

import collections
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

__all__ = ["COMPILERS", "CompiledGraph", "compile_graph", "load_graph", "compiler_version", "COUNTS"]

COMPILERS = ("inductor", "neuronx")
# Inductor inlines a pointwise chain into every consumer until it has 50 ops (on the
# CPU). The sampler's Threefry stream is a chain of some 300 integer ops read by several
# reductions (the Gumbel argmax, the top-p sort), so inlined it was generated again and
# again: 103 CPU seconds to compile the sampler alone, 18 with chains of 8 ops stored.
_INDUCTOR_OPTIONS = {"realize_cpu_opcount_threshold": 8}
# "compiled": graphs compiled in this process; "loaded": artifacts read from disk.
COUNTS: collections.Counter[str] = collections.Counter()


def _version(distribution: str, module: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(distribution)
    except md.PackageNotFoundError:  # importable without metadata (a source tree): the module says
        import importlib.util

        if importlib.util.find_spec(module) is None:
            return None
        return getattr(importlib.import_module(module), "__version__", "unknown")


def compiler_version(compiler: str) -> str:
    """What the artifact cache keys on besides the graph: the compiler and what its output
    depends on (the torch build; for Inductor the CPU's vector ISA, since the kernels use it;
    on Neuron torch-neuronx, neuronx-cc and neuronx-distributed)."""
    if compiler == "neuronx":
        found = ((name, _version(name, mod)) for name, mod in (
            ("torch-neuronx", "torch_neuronx"), ("neuronx-cc", "neuronxcc"), ("neuronx-distributed", "neuronx_distributed")))
        return f"torch {torch.__version__}; " + "; ".join(f"{name} {v}" for name, v in found if v is not None)
    return f"torch {torch.__version__}; inductor; cpu {torch.backends.cpu.get_cpu_capability()}"


class _WithAliases(torch.nn.Module):
    """The graph with its aliased outputs written into their inputs and dropped from the
    outputs: what Inductor compiles (the copy becomes an in-place write)."""

    def __init__(self, graph: torch.nn.Module):
        super().__init__()
        self.graph = graph

    def forward(self, *args):
        out = self.graph(*args)
        for arg, res in self.graph.aliases:
            args[arg].copy_(out[res])
        dropped = {res for _, res in self.graph.aliases}
        return tuple(o for i, o in enumerate(out) if i not in dropped)


def _flat_program(module: torch.nn.Module, args: tuple) -> torch.fx.GraphModule:
    """``torch.export`` of ``module(*args)`` as a GraphModule taking the flattened inputs.

    The exported module keeps pytree handling in its calling convention and a guard
    call at its entry; Inductor's artifact needs a plain graph of tensor inputs (and
    cannot serialize the guard), and the shapes are pinned by the inputs anyway.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        program = torch.export.export(module, args, strict=False)
    gm = program.module()
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


class CompiledGraph:
    """A loaded artifact: ``graph(*args)`` flattens the inputs, runs the compiled code
    and returns the graph's outputs without the aliased ones (those inputs are updated)."""

    def __init__(self, fn: Callable[..., Any], aliases: tuple[tuple[int, int], ...], *, returns_aliases: bool,
                 path: Path, seconds: float, source: str):
        self._fn, self.aliases, self._returns_aliases = fn, aliases, returns_aliases
        self.path, self.seconds, self.source = path, seconds, source

    @property
    def fn(self) -> Callable[..., Any]:
        """The loaded artifact itself (a Neuron program is called through :mod:`.nxd`)."""
        return self._fn

    def __call__(self, *args):
        out = self._fn(*pytree.tree_leaves(args))
        if not self._returns_aliases:
            return tuple(out)
        for arg, res in self.aliases:
            args[arg].copy_(out[res])
        dropped = {res for _, res in self.aliases}
        return tuple(o for i, o in enumerate(out) if i not in dropped)


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a temporary file and rename: concurrent compiles of one key (two
    processes sharing a cache) never leave a half-written artifact."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _kernel_cache(path: Path):
    """Inductor's own cache (generated code, kernel libraries) beside the artifacts."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    return temporary_cache_dir(str(path.parent / "inductor"))


@torch.no_grad()
def compile_graph(module: torch.nn.Module, args: tuple, path: Path, compiler: str) -> CompiledGraph:
    """Compile ``module`` for the shapes of ``args``, save it at ``path`` and return it loaded."""
    start = time.perf_counter()
    if compiler == "neuronx":  # the Neuron path only; nothing of it is imported at module import
        from polyengine.backends.neuron.nxd import compile_program

        fn, returns = compile_program(module, path), False
    elif compiler == "inductor":
        program = _flat_program(_WithAliases(module), args)
        with _kernel_cache(path), torch._inductor.config.patch(_INDUCTOR_OPTIONS):
            artifact = torch._inductor.standalone_compile(
                program, pytree.tree_leaves(args), dynamic_shapes="from_example_inputs")
        _write_atomic(path, lambda p: artifact.save(path=str(p), format="binary"))
        fn, returns = artifact, False
    else:
        raise ValueError(f"unknown compiler {compiler!r}; known: {COMPILERS}")
    COUNTS["compiled"] += 1
    return CompiledGraph(fn, module.aliases, returns_aliases=returns, path=path,
                         seconds=time.perf_counter() - start, source="compiled")


def load_graph(path: Path, aliases: tuple[tuple[int, int], ...], compiler: str) -> CompiledGraph:
    """Load an artifact :func:`compile_graph` wrote; compiles nothing."""
    start = time.perf_counter()
    if compiler == "neuronx":
        from polyengine.backends.neuron.nxd import load_program

        fn, returns = load_program(path), False
    else:
        with _kernel_cache(path):
            fn, returns = torch._inductor.CompiledArtifact.load(path=str(path), format="binary"), False
    COUNTS["loaded"] += 1
    return CompiledGraph(fn, aliases, returns_aliases=returns, path=path,
                         seconds=time.perf_counter() - start, source="disk")
