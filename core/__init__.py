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
from polyengine.engine import (
    Capabilities,
    DecodeState,
    Engine,
    EngineBase,
    EngineConfig,
    Prefix,
    ResultTokens,
)
from polyengine.errors import (
    BackendUnavailable,
    InvalidRequest,
    ModelConfigError,
    ModelNotFound,
    PluginError,
    PolyengineError,
    QueueFull,
    SlotError,
    UnknownBackend,
    UnsupportedFeature,
    WeightsError,
)
from polyengine.plugins import (
    BackendSpec,
    Probe,
    create_engine,
    hookimpl,
    list_backends,
    register_plugin,
    select_backend,
    unregister_plugin,
)
from polyengine.sampling.params import SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from polyengine.driver import LLM, Completion

__all__ = [
    "__version__",
    "PROTOCOL_VERSION",
    "LLM",
    "Completion",
    "Capabilities",
    "DecodeState",
    "Engine",
    "EngineBase",
    "EngineConfig",
    "Prefix",
    "ResultTokens",
    "SamplingParams",
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
    "PluginError",
    "WeightsError",
    "ModelConfigError",
    "ModelNotFound",
]


def __getattr__(name: str) -> Any:
    # The driver pulls in model loading and tokenizers; import it on first use.
    if name in ("LLM", "Completion"):
        from polyengine import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'polyengine' has no attribute {name!r}")
