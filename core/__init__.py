"""polyengine: one engine protocol for LLM inference on any accelerator.

The core (this package) defines the protocol, the sampler semantics, the tool state
machine, model loading and the driver; it imports no torch, jax or ray. Backends are
plugins (entry-point group ``polyengine.backends``).

    >>> import polyengine
    >>> llm = polyengine.LLM(backend="auto")          # the embedded default model
    >>> llm.generate(["Hello"], polyengine.SamplingParams(temperature=0))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polyengine._version import PROTOCOL_VERSION, __version__

if TYPE_CHECKING:  # pragma: no cover
    from polyengine.driver import LLM, AsyncLLM, Completion
    from polyengine.engine import (
        Capabilities, DecodeState, Engine, EngineBase, EngineConfig, Override, Prefix, ResultLayout, ResultTokens,
    )
    from polyengine.errors import (
        BackendUnavailable, EngineClosed, EngineDead, InsufficientMemory, InvalidRequest, ModelConfigError, ModelNotFound,
        NumericalError, PluginError, PolyengineError, QueueFull, SlotError, UnknownBackend, UnsupportedFeature,
        WeightsError,
    )
    from polyengine.plugins import (
        BackendSpec, Probe, create_engine, hookimpl, list_backends, register_plugin,
        select_backend, unregister_plugin,
    )
    from polyengine.sampling.params import SamplingParams, StructuredOutput

# Public names and the module that defines each. They load on first use, so importing
# polyengine (which the conformance pytest plugin does in every pytest run of the
# environment, and every CLI call) costs almost nothing.
_LAZY = {
    "LLM": "polyengine.driver",
    "AsyncLLM": "polyengine.driver",
    "Completion": "polyengine.driver",
    **dict.fromkeys(
        ("Capabilities", "DecodeState", "Engine", "EngineBase", "EngineConfig", "Override", "Prefix", "ResultLayout",
         "ResultTokens"),
        "polyengine.engine",
    ),
    **dict.fromkeys(
        ("PolyengineError", "BackendUnavailable", "UnknownBackend", "UnsupportedFeature", "InvalidRequest",
         "SlotError", "QueueFull", "EngineClosed", "EngineDead", "PluginError", "WeightsError", "ModelConfigError", "ModelNotFound",
         "InsufficientMemory", "NumericalError"),
        "polyengine.errors",
    ),
    **dict.fromkeys(
        ("BackendSpec", "Probe", "hookimpl", "create_engine", "list_backends", "register_plugin",
         "select_backend", "unregister_plugin"),
        "polyengine.plugins",
    ),
    "SamplingParams": "polyengine.sampling.params",
    "StructuredOutput": "polyengine.sampling.params",
}

__all__ = [
    "__version__",
    "PROTOCOL_VERSION",
    "LLM",
    "AsyncLLM",
    "Completion",
    "Capabilities",
    "DecodeState",
    "Engine",
    "EngineBase",
    "EngineConfig",
    "Override",
    "Prefix",
    "ResultLayout",
    "ResultTokens",
    "SamplingParams",
    "StructuredOutput",
    "BackendSpec",
    "Probe",
    "hookimpl",
    "create_engine",
    "list_backends",
    "register_plugin",
    "select_backend",
    "unregister_plugin",
    "PolyengineError",
    "BackendUnavailable",
    "UnknownBackend",
    "UnsupportedFeature",
    "InvalidRequest",
    "SlotError",
    "QueueFull",
    "EngineClosed",
    "EngineDead",
    "PluginError",
    "WeightsError",
    "ModelConfigError",
    "ModelNotFound",
    "InsufficientMemory",
    "NumericalError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'polyengine' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
