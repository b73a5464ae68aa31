"""The compiled-graph cache: on disk by config, bucket, dtype and compiler; in memory per process.

A key names what a compiled graph depends on and nothing else:

- the graph kind and its bucket (prompt length; batch, tokens per row, attended
  length, cache shape; the sampler's rows),
- the model's architecture (:func:`architecture`: sizes, layer count, norm epsilon,
  biases, tied head), never its weights: the graphs take the weights as inputs, so a
  second checkpoint of the same shape reuses every artifact,
- the compute dtype,
- the compiler and its version (:func:`.compile.compiler_version`), and a digest of
  the source that defines the graphs (``graphs.py``, the Neuron path's ``nxd.py`` and
  ``torch_common``'s model, sampler and Threefry), so changed code never loads a stale
  artifact.

Files: ``<root>/<kind>-<digest>.bin`` (the artifact) and ``<kind>-<digest>.bin.json``
beside it (the key in words, the compile time, and the artifact's size, SHA-256 and
signature). Loading an artifact runs code (Inductor's loader unpickles; TorchScript
archives too), so the cache follows ``polyengine.cache``: the root is private to this
user (created 0700; refused, naming the fix, when someone else could write it), and an
artifact is loaded only when its signed record matches it; a missing, damaged, planted
or foreign one is compiled again and replaced. Writes are atomic, so this user's
processes may share a root. Within a process, loaded CPU graphs are kept by path, so the
many engines a test suite builds for one config load each artifact once; a Neuron
program, which holds an engine's weights and KV cache on the device, is loaded per
engine. The ``export`` compiler's programs are kept in that memo only (by key, no
root, no file: :mod:`.compile` says why), so each process exports a configuration's
graphs once.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from polyengine.cache import cache_root, check, env_dir, private_dir, store
from polyengine.logs import compiling
from polyengine.models import ModelConfig

from polyengine.backends.neuron.compile import PERSISTED, CompiledGraph, compile_graph, compiler_version, load_graph

__all__ = ["GraphKey", "ArtifactCache", "architecture", "default_cache_dir", "CACHE_ENV"]

CACHE_ENV = "POLYENGINE_NEURON_CACHE"
_SOURCES = ("neuron/graphs.py", "neuron/nxd.py", "torch_common/model.py", "torch_common/sampling.py",
            "torch_common/threefry.py")
_MEMO: dict[str, CompiledGraph] = {}


def default_cache_dir() -> Path:
    """``$POLYENGINE_NEURON_CACHE``, else ``neuron`` under polyengine's cache root
    (``$POLYENGINE_CACHE``, else ``$XDG_CACHE_HOME/polyengine``, else ``~/.cache/polyengine``);
    absolute, as :func:`polyengine.cache.cache_root` makes it."""
    return env_dir(CACHE_ENV) or cache_root() / "neuron"


def architecture(config: ModelConfig) -> dict[str, Any]:
    """The config fields a compiled graph depends on (RoPE settings, the context and
    token ids are not among them: the RoPE tables and the EOS mask are inputs)."""
    inputs = ("rope_theta", "rope_scaling", "rope_local_theta", "max_position_embeddings", "bos_token_id",
              "eos_token_ids", "pad_token_id")
    return config.model_dump(mode="json", exclude=set(inputs))


def _source_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.blake2b(digest_size=8)
    for rel in _SOURCES:
        h.update((root / rel).read_bytes())
    return h.hexdigest()


@dataclass(frozen=True)
class GraphKey:
    """What one compiled graph depends on; ``digest`` names its files."""

    kind: str
    fields: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, kind: str, *, config: ModelConfig | None, bucket: dict[str, Any], dtype: str, compiler: str) -> "GraphKey":
        fields = {"bucket": bucket, "dtype": dtype, "compiler": compiler_version(compiler), "source": _source_digest()}
        if config is not None:
            fields["architecture"] = architecture(config)
        return cls(kind, tuple(sorted(fields.items())))

    @property
    def description(self) -> dict[str, Any]:
        return {"kind": self.kind, **dict(self.fields)}

    @property
    def digest(self) -> str:
        return hashlib.blake2b(json.dumps(self.description, sort_keys=True).encode(), digest_size=12).hexdigest()


class ArtifactCache:
    """Compiled graphs under one root for one compiler: memory, then disk, then compile.
    A compiler whose graphs are not kept on disk (``"export"``) has no root (None):
    memory, then compile."""

    def __init__(self, root: Path | None, compiler: str):
        if (root is None) != (compiler not in PERSISTED):
            raise ValueError(f"the {compiler!r} compiler " + ("needs an artifact root" if root is None else
                                                               "keeps no artifacts: pass root=None"))
        self.root = None if root is None else private_dir(
            root, what="neuron artifact cache", env=f"{CACHE_ENV} (or the option cache_dir)")
        self.compiler = compiler

    def path(self, key: GraphKey) -> Path:
        return self.root / f"{key.kind}-{key.digest}.bin"

    def _memory_only(self, key: GraphKey, build: Callable[[], tuple[Any, tuple]]) -> tuple[CompiledGraph, str]:
        memo = f"{self.compiler}:{key.kind}-{key.digest}"
        graph = _MEMO.get(memo)
        if graph is not None:
            return graph, "memory"
        module, args = build()
        with compiling(f"the {key.kind} graph for {dict(key.fields).get('bucket')} with {self.compiler}", first_run=False):
            graph, _ = compile_graph(module, args, self.compiler)
        _MEMO[memo] = graph
        return graph, graph.source

    def get(self, key: GraphKey, aliases: tuple[tuple[int, int], ...],
            build: Callable[[], tuple[Any, tuple]]) -> tuple[CompiledGraph, str]:
        """The graph for ``key`` (its ``aliases`` as the graph class declares them) and
        where it came from: ``"memory"`` (loaded earlier in this process), ``"disk"`` or
        ``"compiled"``. ``build()`` gives ``(module, example_args)`` only when it must be
        compiled. Only an artifact whose signed record matches it is loaded; any other
        (missing, damaged, planted, foreign), or one that fails to load, is compiled again
        and replaces it."""
        if self.root is None:
            return self._memory_only(key, build)
        path = self.path(key)
        # A loaded Neuron program holds an engine's weights and KV cache on the device, so
        # it is never shared between engines; CPU artifacts are stateless and are.
        shared = self.compiler != "neuronx"
        graph = _MEMO.get(str(path)) if shared else None
        if graph is not None:
            return graph, "memory"
        record, reason = check(path)
        if record is not None:
            try:
                graph = load_graph(path, aliases, self.compiler)
            except Exception as exc:
                warnings.warn(f"neuron: cannot load the compiled graph {path} ({exc!r}); compiling it again", stacklevel=3)
        elif reason != "missing":
            warnings.warn(f"neuron: not loading the cached graph {path} ({reason}); compiling it again", stacklevel=3)
        if graph is None:
            module, args = build()
            bucket = dict(key.fields).get("bucket")
            with compiling(f"the {key.kind} graph for {bucket} with {self.compiler}"):
                graph, save = compile_graph(module, args, self.compiler, workdir=path.with_suffix(".nxd-work"))
            graph.path = path
            store(path, save, {**key.description, "compile_seconds": round(graph.seconds, 2)})
        if shared:
            _MEMO[str(path)] = graph
        return graph, graph.source
