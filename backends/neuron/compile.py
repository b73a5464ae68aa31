"""The compile seam: a graph module and example inputs in, a loaded artifact out.

Three compilers, one interface (:func:`compile_graph` compiles and returns the graph with
the function that writes its artifact file, or None where nothing is kept; :func:`load_graph`
reads one back without compiling anything; the artifact cache, ``cache.py``, decides
where files go and that only this user's intact files are ever loaded: both formats run
code when loaded):

``"export"`` (the CPU compile path's default)
    ``torch.export.export`` captures the graph as a static, verified program, as for
    Inductor, and that program's module runs as it is, op by op in eager torch: no C++
    is generated or built. What the CPU compile path checks is kept: the static graph
    per bucket (the module is called only with its bucket's shapes and dtypes, checked
    at every call: :class:`_StaticShapes`), the KV cache as an input the program
    mutates (the graphs write it with ``index_put_``, ``inplace=True``, which the
    exported program keeps as an input mutation), sampling inside the graph. Nothing
    is written to disk: an export costs 0.2-1 CPU s per graph of the suite's models,
    the same as reading a serialized program back (``torch._export.serde``: 0.2 s
    for a context graph, measured when this compiler was added), and
    ``torch.export.save`` pickles, so each process exports again and the artifact
    cache's memo shares the programs between the engines of one static configuration.
    Inductor compiles a graph in 10-60 CPU s; docs/neuron.md has the measured
    choice between the two.

``"inductor"`` (the CPU compile path, compiled to C++)
    ``torch.export.export`` captures the graph as a static, verified program (no
    data-dependent control flow); Inductor compiles it ahead of the first call into C++
    kernels (``torch._inductor.standalone_compile``, shapes fixed by the example
    inputs); the ``CompiledArtifact`` is saved as one binary file and loaded with
    ``CompiledArtifact.load``, which unpickles torch's cache entries inside it and loads
    the kernels they carry. AOTInductor's package would load without pickle (a C++
    loader), but it is a shared library all the same and pays ~20 s of C++ wrapper
    compilation per graph on two cores (measured when this seam was written), which
    the CI budget cannot carry (docs/neuron.md has what CI compiles and its cost).
    The file the cache keeps is a tar bundle: the ``CompiledArtifact`` and the files of
    Inductor's own cache it needs (generated code, the kernel libraries), so a warm
    start builds no kernel. Inductor's cache itself is a private directory of this
    process, removed at exit, filled only from bundles the artifact cache has verified:
    nothing another process left in a shared directory is ever loaded.

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

import atexit
import collections
import contextlib
import os
import shutil
import tarfile
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree

from polyengine.backends.neuron.options import COMPILERS

__all__ = ["COMPILERS", "PERSISTED", "CompiledGraph", "compile_graph", "load_graph", "compiler_version", "COUNTS"]

# The compilers whose artifacts the cache keeps on disk ("export" keeps none: see above).
PERSISTED = ("inductor", "neuronx")

# Inductor inlines a pointwise chain into every consumer until it has 50 ops (on the
# CPU). The sampler's Threefry stream is a chain of some 300 integer ops read by several
# reductions (the Gumbel argmax, the top-p sort), so inlined it was generated again and
# again: 103 CPU seconds to compile the sampler alone, 18 with chains of 8 ops stored.
_INDUCTOR_OPTIONS = {"realize_cpu_opcount_threshold": 8}
# POLYENGINE_NEURON_FAST_COMPILE=1: Inductor writes scalar C++ (no vector ISA), which
# compiles ~30% faster and runs slower; for test runs, where compiling dominates (the
# project's tests set it: tests/conftest.py). Part of the artifact cache key.
FAST_COMPILE_ENV = "POLYENGINE_NEURON_FAST_COMPILE"


def _fast_compile() -> bool:
    return os.environ.get(FAST_COMPILE_ENV, "") == "1"


def _inductor_options() -> dict:
    return {**_INDUCTOR_OPTIONS, **({"cpp.vec_isa_ok": False} if _fast_compile() else {})}
# "compiled": graphs compiled (for "export": exported) in this process; "loaded":
# artifacts read from disk.
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
    if compiler == "export":
        return f"torch {torch.__version__}; export"
    vector = "scalar (fast compile)" if _fast_compile() else torch.backends.cpu.get_cpu_capability()
    return f"torch {torch.__version__}; inductor; cpu {vector}"


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


def _exported(module: torch.nn.Module, args: tuple) -> torch.fx.GraphModule:
    """The ``export`` compiler's program: :func:`_flat_program` without the export's
    input check (which expects the nested inputs; :class:`_StaticShapes` checks the flat
    ones) and without the self-copies an in-place write leaves for its alias
    (``copy_(cache, cache)``: the cache already holds its new value)."""
    gm = _flat_program(_WithAliases(module), args)
    gm._forward_pre_hooks.clear()
    for node in list(gm.graph.nodes):
        if (node.op == "call_function" and node.target is torch.ops.aten.copy_.default
                and node.args[0] is node.args[1] and not node.users):
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


class _StaticShapes:
    """An exported program called only with the shapes and dtypes it was exported for:
    the static graph of one bucket, as a compiled artifact is (eager ops would accept
    other shapes and hide a call routed to the wrong bucket)."""

    def __init__(self, program: torch.fx.GraphModule, args: tuple):
        self.program = program
        self.signature = tuple((tuple(a.shape), a.dtype) for a in pytree.tree_leaves(args))

    def __call__(self, *flat):
        got = tuple((tuple(a.shape), a.dtype) for a in flat)
        if got != self.signature:
            wrong = next(i for i, (g, w) in enumerate(zip(got, self.signature)) if g != w) if len(got) == len(
                self.signature) else None
            where = (f"input {wrong}: {got[wrong]} where the bucket has {self.signature[wrong]}" if wrong is not None
                     else f"{len(got)} inputs where the bucket has {len(self.signature)}")
            raise ValueError(f"a static graph called outside its bucket ({where})")
        return self.program(*flat)


class CompiledGraph:
    """A loaded artifact: ``graph(*args)`` flattens the inputs, runs the compiled code
    and returns the graph's outputs without the aliased ones (those inputs are updated)."""

    def __init__(self, fn: Callable[..., Any], aliases: tuple[tuple[int, int], ...], *, returns_aliases: bool,
                 path: Path | None, seconds: float, source: str):
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


_INDUCTOR_DIR: str | None = None
_ARTIFACT = "artifact.bin"  # the CompiledArtifact inside a bundle; Inductor's files under "inductor/"
_SKIP = ("locks", "__pycache__")  # transient or derived: never bundled


def _inductor_dir() -> str:
    """Inductor's cache for this process: a fresh private directory (``mkdtemp``: mode
    0700), removed at exit."""
    global _INDUCTOR_DIR
    if _INDUCTOR_DIR is None:
        _INDUCTOR_DIR = tempfile.mkdtemp(prefix="polyengine-inductor-")
        atexit.register(shutil.rmtree, _INDUCTOR_DIR, ignore_errors=True)
    return _INDUCTOR_DIR


def _kernel_cache():
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    return temporary_cache_dir(_inductor_dir())


def _write_bundle(path: Path, artifact) -> None:
    """``artifact`` and every file of this process's Inductor cache (what it compiled or
    unpacked so far: a superset of what the artifact needs, so loading it builds nothing)."""
    root = Path(_inductor_dir())
    with tempfile.TemporaryDirectory(dir=root.parent) as work:
        blob = Path(work) / _ARTIFACT
        artifact.save(path=str(blob), format="binary")
        with tarfile.open(path, "w") as tar:
            tar.add(blob, arcname=_ARTIFACT)
            for f in sorted(root.rglob("*")):
                if f.is_file() and not f.is_symlink() and not any(part in _SKIP for part in f.relative_to(root).parts):
                    tar.add(f, arcname=f"inductor/{f.relative_to(root).as_posix()}")


@contextlib.contextmanager
def _read_bundle(path: Path) -> Iterator[Path]:
    """Unpack a verified bundle's Inductor files into this process's Inductor cache;
    yields the path of its artifact (in a private scratch folder, removed after)."""
    root = Path(_inductor_dir())
    with tempfile.TemporaryDirectory(dir=root.parent, prefix="polyengine-artifact-") as scratch:
        _unpack(path, root, Path(scratch))
        yield Path(scratch) / _ARTIFACT


def _unpack(path: Path, root: Path, scratch: Path) -> None:
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            name = Path(member.name)
            if not member.isfile() or name.is_absolute() or ".." in name.parts:
                raise ValueError(f"{path}: unexpected member {member.name!r}")
            if member.name == _ARTIFACT:
                target = scratch / _ARTIFACT
            elif name.parts[0] == "inductor" and len(name.parts) > 1:
                target = root.joinpath(*name.parts[1:])
            else:
                raise ValueError(f"{path}: unexpected member {member.name!r}")
            if target.exists():
                # Inductor names its files by content, so this one is already here; and it
                # may be a kernel library loaded in this process, which rewriting in place
                # would pull from under it (SIGBUS/SIGSEGV): never write over a file.
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            with tar.extractfile(member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.chmod(tmp, 0o700 if member.mode & 0o100 else 0o600)
            os.replace(tmp, target)


@torch.no_grad()
def compile_graph(module: torch.nn.Module, args: tuple, compiler: str, *,
                  workdir: Path | None = None) -> tuple[CompiledGraph, Callable[[Path], None] | None]:
    """Compile ``module`` for the shapes of ``args``: the loaded graph, and ``save(path)``
    that writes its artifact (the cache writes it through ``polyengine.cache.store``), or
    None for a compiler whose graphs are not kept (``"export"``).
    ``workdir``: where neuronx-cc keeps its intermediate files."""
    start = time.perf_counter()
    if compiler == "neuronx":  # the Neuron path only; nothing of it is imported at module import
        from polyengine.backends.neuron.nxd import compile_program

        traced = compile_program(module, workdir if workdir is not None else Path(tempfile.mkdtemp(prefix="nxd-")))
        fn, returns = traced, False

        def save(p: Path) -> None:
            torch.jit.save(traced, str(p))
    elif compiler == "export":
        fn, returns, save = _StaticShapes(_exported(module, args), args), False, None
    elif compiler == "inductor":
        program = _flat_program(_WithAliases(module), args)
        with _kernel_cache(), torch._inductor.config.patch(_inductor_options()):
            artifact = torch._inductor.standalone_compile(
                program, pytree.tree_leaves(args), dynamic_shapes="from_example_inputs")
        fn, returns = artifact, False

        def save(p: Path) -> None:
            _write_bundle(p, artifact)
    else:
        raise ValueError(f"unknown compiler {compiler!r}; known: {COMPILERS}")
    COUNTS["compiled"] += 1
    graph = CompiledGraph(fn, module.aliases, returns_aliases=returns, path=None,
                          seconds=time.perf_counter() - start, source="compiled")
    return graph, save


def load_graph(path: Path, aliases: tuple[tuple[int, int], ...], compiler: str) -> CompiledGraph:
    """Load an artifact :func:`compile_graph` wrote; compiles nothing. Loading runs code
    (unpickling, shared libraries): the artifact cache calls it only on a file it has
    verified (``polyengine.cache.check``)."""
    if compiler not in PERSISTED:
        raise ValueError(f"the {compiler!r} compiler writes no artifacts; nothing to load from {path}")
    start = time.perf_counter()
    if compiler == "neuronx":
        from polyengine.backends.neuron.nxd import load_program

        fn, returns = load_program(path), False
    else:
        with _read_bundle(path) as blob, _kernel_cache(), torch._inductor.config.patch(_inductor_options()):
            fn, returns = torch._inductor.CompiledArtifact.load(path=str(blob), format="binary"), False
    COUNTS["loaded"] += 1
    return CompiledGraph(fn, aliases, returns_aliases=returns, path=path,
                         seconds=time.perf_counter() - start, source="disk")
