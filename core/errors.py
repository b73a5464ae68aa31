"""Typed errors. Everything a user can trigger raises one of these, never a bare assert.

Each message says what was wrong and how to fix it. The classes also derive from the
builtin exception a caller would naturally catch (``ValueError``, ``LookupError``, ...),
so code that does not know polyengine still handles them sensibly.
"""

from __future__ import annotations

__all__ = [
    "PolyengineError",
    "UnsafeCache",
    "FallbackWarning",
    "BackendUnavailable",
    "UnknownBackend",
    "UnsupportedFeature",
    "InvalidRequest",
    "ContextLengthExceeded",
    "SlotError",
    "QueueFull",
    "EngineClosed",
    "EngineDead",
    "Unreachable",
    "PluginError",
    "WeightsError",
    "ModelConfigError",
    "ModelNotFound",
    "MissingExtra",
    "InsufficientMemory",
    "NumericalError",
    "ToolError",
]


class PolyengineError(Exception):
    """Base class of every error polyengine raises on purpose."""


class BackendUnavailable(PolyengineError, RuntimeError):
    """A backend is installed but cannot run here; ``install_hint`` says what fixes it."""

    def __init__(self, backend: str, reason: str, install_hint: str | None = None):
        self.backend = backend
        self.reason = reason
        self.install_hint = install_hint
        msg = f"backend {backend!r} is unavailable: {reason}"
        if install_hint:
            msg += f"; fix: {install_hint}"
        super().__init__(msg)


class UnknownBackend(PolyengineError, LookupError):
    """No installed plugin provides a backend of that name."""

    def __init__(self, name: str, installed: list[str]):
        self.name = name
        self.installed = list(installed)
        listing = ", ".join(sorted(installed)) or "none"
        super().__init__(
            f"no backend named {name!r}; installed backends: {listing} "
            f"(run `polyengine backends` for details)"
        )

    def __str__(self) -> str:  # LookupError would otherwise repr() the message
        return self.args[0]


class UnsupportedFeature(PolyengineError, NotImplementedError):
    """The backend does not implement a feature the request asks for.

    Raised before any work starts, so nothing is half done. ``field`` names the
    request field that asks for it when one does (``"min_p"``, ``"n"``), as
    :class:`InvalidRequest`'s does.
    """

    def __init__(self, feature: str, backend: str | None = None, detail: str = "", *, field: str | None = None):
        self.feature = feature
        self.backend = backend
        self.field = field
        who = f"backend {backend!r}" if backend else "this backend"
        msg = f"{who} does not support {feature}"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


class InvalidRequest(PolyengineError, ValueError):
    """A request (prompt, sampling parameters, slot) is malformed or over a limit.

    ``field`` names the request field at fault when one is (a SamplingParams field
    such as ``"top_p"``), so a server can report it without parsing the message.
    """

    def __init__(self, message: str = "", *, field: str | None = None):
        super().__init__(message)
        self.field = field


class ContextLengthExceeded(InvalidRequest):
    """A prompt (with what it asks to generate) does not fit the engine's context."""


class SlotError(InvalidRequest):
    """A slot index is out of range, or the slot is occupied (insert) or empty."""


class QueueFull(PolyengineError, RuntimeError):
    """The driver's bounded request queue is full; retry later or raise ``max_queue``."""


class EngineClosed(PolyengineError, RuntimeError):
    """The engine is shutting down or has stopped; it takes no new requests."""


class EngineDead(PolyengineError, RuntimeError):
    """The engine can serve no more requests: its thread died, or a device or worker it
    needs is gone. Every pending and later request fails with it; build a new engine
    (a server reports it on ``/health`` so that an orchestrator restarts it)."""


class Unreachable(PolyengineError, ConnectionError):
    """An external system (a Ray cluster, a worker) refused the connection or did not
    answer within its timeout; ``address`` names it."""

    def __init__(self, message: str, *, address: str | None = None):
        super().__init__(message)
        self.address = address

    def __str__(self) -> str:  # OSError's own __str__ would show the args tuple
        return self.args[0] if self.args else ""


class PluginError(PolyengineError, RuntimeError):
    """A plugin failed to import, registered a malformed spec, or clashes with another."""

    def __init__(self, plugin: str, distribution: str | None, problem: str):
        self.plugin = plugin
        self.distribution = distribution
        self.problem = problem
        dist = f" (distribution {distribution!r})" if distribution else ""
        super().__init__(f"plugin {plugin!r}{dist}: {problem}")


class WeightsError(PolyengineError, ValueError):
    """A weights file is missing, truncated, corrupt, or holds an unexpected tensor."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.file = None if file is None else str(file)
        self.tensor = tensor
        where = []
        if file is not None:
            where.append(f"file {str(file)!r}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        prefix = (", ".join(where) + ": ") if where else ""
        super().__init__(prefix + message)


class ModelConfigError(PolyengineError, ValueError):
    """A model configuration is invalid or names an unsupported architecture."""


class ModelNotFound(PolyengineError, FileNotFoundError):
    """A model argument names nothing that can be loaded; the message says how to get it."""

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


class MissingExtra(PolyengineError, ImportError):
    """A feature needs an optional package that is not installed; the message names the
    package and the ``pip install 'polyengine[extra]'`` that brings it."""

    def __init__(self, feature: str, *, package: str, install: str):
        self.feature, self.package, self.install = feature, package, install
        super().__init__(f"{feature} needs the {package} package, which is not installed; fix: {install}")


class InsufficientMemory(PolyengineError, MemoryError):
    """Something polyengine was about to allocate (weights, KV caches) would not fit.

    Raised before the allocation, by :func:`polyengine.memory.check_fits`, or for an
    allocation that failed anyway (:func:`polyengine.memory.as_insufficient`); the message
    names what needed the memory, where (host or a device), the numbers known (either may
    be None when the allocator did not say), and what to change.
    """

    def __init__(self, message: str, *, needed: int | None, available: int | None, where: str = "host memory"):
        self.needed = needed
        self.available = available
        self.where = where
        super().__init__(message)


class NumericalError(PolyengineError, ArithmeticError):
    """The model's output at a step is not a number (NaN logits): an overflow in the
    backend's arithmetic, or non-finite weights. Not caused by the request's parameters."""


class ToolError(PolyengineError, ValueError):
    """A tool refused its input (the tool machine turns this into the tool's output)."""


class UnsafeCache(PolyengineError, PermissionError):
    """A cache directory or file that another user could have written (owned by someone
    else, or writable by group or others): nothing in it is loaded. The message names the
    path and the fix (make it private, or point the cache elsewhere)."""


class FallbackWarning(UserWarning):
    """A backend runs a slower path than it could (e.g. torch's matmul instead of its
    compiled kernels): the message says why and names the fix."""
