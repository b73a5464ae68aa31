"""The compiled-graph cache: on disk by config, bucket, dtype and compiler; in memory per process.

A key names what a compiled graph depends on and nothing else:

- the graph kind and its bucket (prompt length; batch, tokens per row, attended
  length, cache shape; the sampler's rows),
- the model's architecture (:func:`architecture`: sizes, layer count, norm epsilon,
  biases, tied head), never its weights: the graphs take the weights as inputs, so a
  second checkpoint of the same shape reuses every artifact,
- the compute dtype,
- the compiler and its version (:func:`.compile.compiler_version`), and a digest of
  the source that defines the graphs (``graphs.py`` and ``torch_common``'s model,
  sampler and Threefry), so changed code never loads a stale artifact.

Files: ``<root>/<kind>-<digest>.bin`` (the artifact) and ``.json`` beside it (the key
in words and the compile time). Writes are atomic, so processes may share a root.
Within a process, loaded graphs are kept by path, so the many engines a test suite
builds for one config load each artifact once.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from polyengine.models import ModelConfig

from polyengine.backends.neuron.compile import CompiledGraph, compile_graph, compiler_version, load_graph

__all__ = ["GraphKey", "ArtifactCache", "architecture", "default_cache_dir", "CACHE_ENV"]

CACHE_ENV = "POLYENGINE_NEURON_CACHE"
_SOURCES = ("neuron/graphs.py", "torch_common/model.py", "torch_common/sampling.py", "torch_common/threefry.py")
_MEMO: dict[str, CompiledGraph] = {}


def default_cache_dir() -> Path:
    """``$POLYENGINE_NEURON_CACHE``, else ``$XDG_CACHE_HOME/polyengine/neuron`` (``~/.cache``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "polyengine" / "neuron"


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
    """Compiled graphs under one root for one compiler: memory, then disk, then compile."""

    def __init__(self, root: Path, compiler: str):
        self.root, self.compiler = Path(root), compiler

    def path(self, key: GraphKey) -> Path:
        return self.root / f"{key.kind}-{key.digest}.bin"

    def get(self, key: GraphKey, aliases: tuple[tuple[int, int], ...],
            build: Callable[[], tuple[Any, tuple]]) -> tuple[CompiledGraph, str]:
        """The graph for ``key`` (its ``aliases`` as the graph class declares them) and
        where it came from: ``"memory"`` (loaded earlier in this process), ``"disk"`` or
        ``"compiled"``. ``build()`` gives ``(module, example_args)`` only when it must be
        compiled. A file that cannot be loaded (truncated, written by another build) is
        compiled again."""
        path = self.path(key)
        graph = _MEMO.get(str(path))
        if graph is not None:
            return graph, "memory"
        if path.exists():
            try:
                graph = load_graph(path, aliases, self.compiler)
            except Exception as exc:
                warnings.warn(f"neuron: cannot load the compiled graph {path} ({exc!r}); compiling it again", stacklevel=3)
        if graph is None:
            self.root.mkdir(parents=True, exist_ok=True)
            module, args = build()
            graph = compile_graph(module, args, path, self.compiler)
            meta = {**key.description, "compile_seconds": round(graph.seconds, 2)}
            path.with_suffix(".json").write_text(json.dumps(meta, indent=1, sort_keys=True, default=str))
        _MEMO[str(path)] = graph
        return graph, graph.source
