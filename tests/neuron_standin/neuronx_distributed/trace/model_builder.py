"""Stand-in for ``neuronx_distributed.trace.model_builder``: ModelBuilder and its NxD model.

The API polyengine uses, with NxD's rules (see ``.._device`` for the device's):
``ModelBuilder(router, tp_degree, checkpoint_loader, compiler_workdir=...)``,
``add(key, model_instance, example_inputs, compiler_args)``,
``trace(initialize_model_weights=...)`` returning an executor whose
``nxd_model.initialize(weights_per_core, start_rank_tensor)`` loads weights and
zeroes the states, and whose call routes to a model by its inputs' shapes. ``save`` and
``load`` stand in for ``torch.jit.save``/``torch.jit.load`` of the executor (the test
fixture routes them here).
"""

from __future__ import annotations

import copy
import itertools
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neuronx_distributed._device import RECORD, AutoCast, Group, _Context, auto_cast, parse_flags, rank_context

__all__ = ["BaseModelInstance", "ModelBuilder", "save", "load"]

_DEFAULT_ARGS = "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"  # NxD's default


class BaseModelInstance:
    def __init__(self, module_cls, input_output_aliases):
        self.module_cls = module_cls
        self.module = None
        self.input_output_aliases = [input_output_aliases]

    def load_module(self):
        self.module = self.module_cls()

    def get(self, bucket_rank, **kwargs):
        return self.module, self.input_output_aliases[0]


def _signature(inputs) -> str:
    return str([list(t.shape) for t in inputs])


@dataclass
class _Compiled:
    """One model as the stand-in "compiled" it: the module (a template: its parameters are
    replaced per call, in a copy per core, see :class:`Executor`), flags, states by output
    index, weights and states specs."""

    key: str
    module: torch.nn.Module
    flags: dict[str, Any]
    alias_of: dict[str, int]  # state parameter name -> output index
    weights: dict[str, tuple[tuple[int, ...], torch.dtype]]
    states: dict[str, tuple[tuple[int, ...], torch.dtype]]
    outputs: int  # non-aliased outputs
    signature: str


def _run(module: torch.nn.Module, params: dict[str, torch.Tensor], inputs, flags) -> tuple:
    cast = auto_cast(flags)
    with torch.no_grad(), (AutoCast(cast) if cast is not None else _nothing()):
        out = torch.func.functional_call(module, params, tuple(inputs))
    return tuple(out) if isinstance(out, (list, tuple)) else (out,)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class ModelBuilder:
    def __init__(self, router, tp_degree, checkpoint_loader, start_rank_id=0, compiler_workdir=None, **kwargs):
        self.tp_degree, self.checkpoint_loader = int(tp_degree), checkpoint_loader
        self.compiler_workdir = compiler_workdir
        self.collection: dict[str, tuple[Any, list, str]] = {}

    def add(self, key, model_instance, example_inputs, compiler_args=None, bucket_config=None, priority_model_idx=None):
        if bucket_config is not None:
            raise NotImplementedError("the stand-in has no bucketing (polyengine adds one model per bucket)")
        self.collection[key] = (model_instance, list(example_inputs), compiler_args or _DEFAULT_ARGS)
        return self

    def _compile(self, key: str, instance, examples: list, args: str) -> _Compiled:
        flags = parse_flags(args)  # CompilerError, as neuronx-cc would exit
        instance.load_module()
        module, aliases = instance.get(0)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"model {key!r}: ModelBuilder traces a torch.nn.Module, got {type(module).__name__}")
        named = dict(module.named_parameters())
        alias_of: dict[str, int] = {}
        for param, index in (aliases or {}).items():
            name = next((n for n, p in named.items() if p is param), None)
            if name is None:
                raise ValueError(f"model {key!r}: an input_output_aliases key is not a parameter of the model "
                                 f"(aliases name the module's own state parameters)")
            alias_of[name] = int(index)
        (example,) = examples
        with rank_context(_Context(tp=self.tp_degree)):
            out = _run(module, {n: p.detach() for n, p in named.items()}, example, flags)
        for name, index in alias_of.items():
            if not 0 <= index < len(out):
                raise ValueError(f"model {key!r}: alias of {name!r} names output {index}, but there are {len(out)}")
            if out[index].shape != named[name].shape or out[index].dtype != named[name].dtype:
                raise ValueError(f"model {key!r}: output {index} ({tuple(out[index].shape)} {out[index].dtype}) cannot "
                                 f"alias {name!r} ({tuple(named[name].shape)} {named[name].dtype})")
        weights = {n: (tuple(p.shape), p.dtype) for n, p in named.items() if n not in alias_of}
        states = {n: (tuple(named[n].shape), named[n].dtype) for n in alias_of}
        return _Compiled(key, module, flags, alias_of, weights, states, len(out) - len(alias_of), _signature(example))

    def trace(self, initialize_model_weights=True):
        compiled = {k: self._compile(k, *v) for k, v in self.collection.items()}
        counts = {c.outputs for c in compiled.values()}
        if len(counts) > 1:
            raise ValueError(f"NxDModel unpacks every model's outputs with one packer: the models return "
                             f"{sorted(counts)} non-aliased outputs")
        signatures: dict[str, str] = {}
        states: dict[str, tuple] = {}
        for c in compiled.values():
            if c.signature in signatures:
                raise ValueError(f"models {signatures[c.signature]!r} and {c.key!r} take inputs of the same shapes: "
                                 f"the router cannot tell them apart")
            signatures[c.signature] = c.key
            for name, spec in c.states.items():
                if states.setdefault(name, spec) != spec:
                    raise ValueError(f"state {name!r} has two shapes: {states[name]} and {spec}")
        RECORD.traces.append({"tp_degree": self.tp_degree, "models": {
            c.key: {"flags": c.flags, "aliases": dict(c.alias_of), "weights": sorted(c.weights), "states": sorted(c.states)}
            for c in compiled.values()}})
        exe = Executor(compiled, self.tp_degree)
        if initialize_model_weights:  # NxD shards the loader's checkpoint into the traced model
            exe.nxd_model.initialize([self.checkpoint_loader()] * self.tp_degree, torch.tensor([0]))
            exe.nxd_model.with_saved_weights = True
        return exe


class NxDModel:
    """The runtime half: weights and states per core, on the stand-in's device."""

    def __init__(self, compiled: dict[str, _Compiled], tp: int):
        self.compiled, self.tp = compiled, tp
        self.weights: list[dict[str, torch.Tensor]] = []
        self.state: list[dict[str, torch.Tensor]] = []
        self.initialized = False
        self.with_saved_weights = False

    def initialize(self, checkpoint: list[dict[str, torch.Tensor]], start_rank_tensor: torch.Tensor):
        if len(checkpoint) != self.tp:
            raise ValueError(f"initialize takes one checkpoint per core: {self.tp} cores, {len(checkpoint)} given")
        needed = {n: s for c in self.compiled.values() for n, s in c.weights.items()}
        states = {n: s for c in self.compiled.values() for n, s in c.states.items()}
        moved = 0
        self.weights, self.state = [], []
        for rank, ckpt in enumerate(checkpoint):
            mine = {}
            for name, (shape, dtype) in needed.items():
                if name not in ckpt:
                    raise KeyError(f"core {rank}: the checkpoint has no weight {name!r}")
                t = ckpt[name]
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise ValueError(f"core {rank}: weight {name!r} is {tuple(t.shape)} {t.dtype}, the model was "
                                     f"traced with {shape} {dtype}")
                mine[name] = t.detach().clone()  # the device's copy
                moved += t.numel() * t.element_size()
            self.weights.append(mine)
            self.state.append({n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in states.items()})
        self.initialized = True
        RECORD.initializations.append({"bytes": moved, "cores": self.tp, "weights": sorted(needed),
                                       "states": {n: s[0] for n, s in states.items()}})


class Executor:
    """``traced(*inputs)``: route by shapes, run every core, update states through the
    aliases, return the non-aliased outputs (core 0's)."""

    _ids = itertools.count()

    def __init__(self, compiled: dict[str, _Compiled], tp: int):
        self.nxd_model = NxDModel(compiled, tp)
        self.id = next(self._ids)
        self._pool = ThreadPoolExecutor(tp, thread_name_prefix="standin-core") if tp > 1 else None
        # A program per core, as each NeuronCore loads its own: functional_call swaps a module's
        # parameters in place while it runs, so cores running one module object at once in
        # their threads would compute with each other's weights.
        self._modules = {key: [c.module] + [copy.deepcopy(c.module) for _ in range(tp - 1)]
                         for key, c in compiled.items()}
        self._lock = threading.Lock()

    def __call__(self, *inputs: torch.Tensor):
        nxd = self.nxd_model
        route = {c.signature: c for c in nxd.compiled.values()}
        compiled = route.get(_signature(inputs))
        if compiled is None:
            raise RuntimeError(f"no model of this NxD model takes inputs of shapes {_signature(inputs)}")
        if not nxd.initialized:
            raise ValueError("This model is not initialized, please call traced_model.nxd_model.initialize(sharded_checkpoint)")
        for t in inputs:
            if t.device.type != "cpu":
                raise TypeError("a traced Neuron model takes host (CPU) tensors")
        with self._lock:
            group = Group(nxd.tp) if nxd.tp > 1 else None

            def core(rank: int):
                params = {n: nxd.weights[rank][n] for n in compiled.weights}
                # Each call sees a copy of the state: only what an alias returns is kept.
                params.update({n: nxd.state[rank][n].clone() for n in compiled.states})
                with rank_context(_Context(tp=nxd.tp, rank=rank, group=group)):
                    return _run(self._modules[compiled.key][rank], params, inputs, compiled.flags)

            outs = list(self._pool.map(core, range(nxd.tp))) if self._pool else [core(0)]
            for rank, out in enumerate(outs):
                for name, index in compiled.alias_of.items():
                    nxd.state[rank][name] = out[index]
            aliased = set(compiled.alias_of.values())
            result = tuple(o for i, o in enumerate(outs[0]) if i not in aliased)
        RECORD.calls.append({"model": compiled.key, "to_device": sum(t.numel() * t.element_size() for t in inputs),
                             "to_host": sum(t.numel() * t.element_size() for t in result)})
        return result


_SAVED: dict[int, dict[str, _Compiled]] = {}


def save(executor: Executor, path: str) -> None:
    """``torch.jit.save`` of an executor: the compiled models, and weights only if they were loaded."""
    nxd = executor.nxd_model
    RECORD.saves.append({"path": str(path), "weights_in_artifact": bool(nxd.with_saved_weights or nxd.initialized)})
    _SAVED[executor.id] = (nxd.compiled, nxd.tp)
    Path(path).write_text(json.dumps({"neuronx_distributed_standin": executor.id}))


def load(path: str) -> Executor | None:
    """``torch.jit.load`` of what :func:`save` wrote: the compiled models, not initialized."""
    try:
        doc = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, ValueError):
        return None
    compiled, tp = _SAVED[doc["neuronx_distributed_standin"]]
    return Executor(compiled, tp)
