"""The stand-in's device: what neuronx-cc and the Neuron runtime would do, on the CPU, recorded.

Realism is the point (a wrong compiler flag, a missing alias or a cache kept on the
host must fail a test), so each rule below is one the real stack has:

- **Compiler flags** are parsed like neuronx-cc's command line: an unknown flag or
  value is an error, and unless ``--auto-cast=none`` is given the compiler's default
  (``--auto-cast=matmult --auto-cast-type=bf16``) applies: every float32 matmul's
  operands are rounded to bfloat16 (:class:`AutoCast` does that to the CPU run).
- **Aliases** name *parameters of the traced module* (matched by identity, as
  torch-neuronx matches them) and output indices of the same shape and dtype. A state
  is updated only through its alias: each call runs on a copy of the state, so a
  write without an alias is lost, as a write inside a traced graph is.
- **Placement**: weights and states live in per-core "device memory" once
  ``nxd_model.initialize`` put them there; a call's inputs cross from the host and its
  non-aliased outputs back, and every byte of both is counted in :data:`RECORD`.
- **Tensor parallelism**: each core runs in its own thread with its own weights and
  state; NxD's collectives (all-reduce, all-gather) meet at a barrier.
- **NxD's runtime**: one model per key, a call routed by its inputs' shapes, one
  packer for every model's outputs (so their count must agree), no call before
  ``initialize``, and an artifact that holds no weights unless asked to.
"""

from __future__ import annotations

import contextlib
import functools
import shlex
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["RECORD", "CompilerError", "parse_flags", "AutoCast", "Group", "context", "rank_context"]


class CompilerError(ValueError):
    """What neuronx-cc prints before it exits with an error."""


# flag -> allowed values (None: a flag without a value; "*": any value)
_FLAGS: dict[str, Any] = {
    "--model-type": {"generic", "transformer", "unet-inference", "cnn-training"},
    "--auto-cast": {"none", "matmult", "all"},
    "--auto-cast-type": {"bf16", "fp16", "tf32", "fp8_e4m3"},
    "--enable-mixed-precision-accumulation": None,
    "--enable-saturate-infinity": None,
    "--enable-fast-loading-neuron-binaries": None,
    "--target": {"trn1", "trn1n", "inf2", "trn2"},
    "--lnc": {"1", "2"},
    "--logfile": "*",
    "--tensorizer-options": "*",
    "--verbose": "*",
}
_LEVELS = {"-O1", "-O2", "-O3"}


def parse_flags(args: str | list[str] | None) -> dict[str, Any]:
    """neuronx-cc's reading of ``args``: ``{flag: value}`` (True for bare flags), the
    optimization level under ``"-O"``; unknown flags and values are CompilerError."""
    words = shlex.split(args) if isinstance(args, str) else list(args or [])
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = words[i]
        if word in _LEVELS:
            out["-O"] = word
            i += 1
            continue
        name, eq, value = word.partition("=")
        if name not in _FLAGS:
            raise CompilerError(f"neuronx-cc: error: unrecognized arguments: {word}")
        allowed = _FLAGS[name]
        if allowed is None:
            if eq:
                raise CompilerError(f"neuronx-cc: error: argument {name}: ignored explicit argument {value!r}")
            out[name] = True
            i += 1
            continue
        if not eq:
            if i + 1 >= len(words):
                raise CompilerError(f"neuronx-cc: error: argument {name}: expected one argument")
            value, i = words[i + 1], i + 1
        if allowed != "*" and value not in allowed:
            raise CompilerError(f"neuronx-cc: error: argument {name}: invalid choice: {value!r} "
                                f"(choose from {', '.join(sorted(allowed))})")
        out[name] = value
        i += 1
    return out


def auto_cast(flags: dict[str, Any]) -> torch.dtype | None:
    """The dtype float32 matmul operands are cast to under these flags (None: kept)."""
    mode = flags.get("--auto-cast", "matmult")  # neuronx-cc's default
    if mode == "none":
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(flags.get("--auto-cast-type", "bf16"), torch.bfloat16)


_MATMULS = {F.linear, torch.matmul, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.bmm, torch.mm,
            F.scaled_dot_product_attention}


class AutoCast(TorchFunctionMode):
    """Round the float32 operands of every matmul to ``dtype`` (and back), as the
    compiler's auto-cast computes them."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS:
            def cast(x):
                return x.to(self.dtype).to(torch.float32) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


class Group:
    """A tensor-parallel process group of ``size`` threads: collectives meet at a barrier."""

    def __init__(self, size: int):
        self.size = size
        self._barrier = threading.Barrier(size)
        self._slots: list[Any] = [None] * size

    def _exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = x
        self._barrier.wait()
        parts = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before every core has read them all
        return parts

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        return functools.reduce(torch.add, self._exchange(rank, x))  # rank order: the same sum on every core

    def all_gather_last(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(rank, x), dim=-1)


@dataclass
class _Context:
    tp: int
    rank: int = 0
    group: Group | None = None  # None while tracing (one run for the shapes, as NxD's SPMD trace)


_local = threading.local()


def context() -> _Context | None:
    return getattr(_local, "ctx", None)


@contextlib.contextmanager
def rank_context(ctx: _Context):
    previous = context()
    _local.ctx = ctx
    try:
        yield
    finally:
        _local.ctx = previous


@dataclass
class Recorder:
    """Everything the stand-in saw: per trace, each model's flags, aliases, weights and
    states; per call, bytes in and out; per initialize, the bytes moved; per save,
    whether weights were in the artifact."""

    traces: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    initializations: list[dict[str, Any]] = field(default_factory=list)
    saves: list[dict[str, Any]] = field(default_factory=list)

    def clear(self) -> None:
        self.traces.clear(), self.calls.clear(), self.initializations.clear(), self.saves.clear()


RECORD = Recorder()
