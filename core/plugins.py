"""Backend discovery and selection.

Backends are pluggy plugins found through the entry-point group
``polyengine.backends`` (plugins that only add tools or model names may use
``polyengine.plugins``). Built-in backends register the same way as third-party ones.

Discovery imports each plugin module, which must itself import nothing heavy: a
:class:`BackendSpec` carries a cheap ``probe`` and a lazy ``factory``. Nothing is
dropped silently: a plugin that fails to import or returns a malformed spec is listed
as *broken*, with a :class:`PluginError` naming the plugin and its distribution, and
using it raises that error. Two plugins claiming one backend name is an error at
discovery, since either choice would surprise someone.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pluggy

from polyengine._version import PROTOCOL_VERSION
from polyengine.errors import BackendUnavailable, PluginError, UnknownBackend
from polyengine.hookspecs import PROJECT, PolyengineSpecs, hookimpl

__all__ = [
    "ACCELERATOR_ORDER",
    "ENTRY_POINT_GROUPS",
    "BackendInfo",
    "BackendSpec",
    "Probe",
    "PluginRegistry",
    "hookimpl",
    "get_registry",
    "reset_registry",
    "register_plugin",
    "unregister_plugin",
    "list_backends",
    "select_backend",
    "create_engine",
]

ENTRY_POINT_GROUPS = ("polyengine.backends", "polyengine.plugins")
# backend="auto" prefers a present accelerator in this order, then CPU paths by priority.
ACCELERATOR_ORDER = ("tpu", "neuron", "cuda")
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


@dataclass(frozen=True)
class Probe:
    """A backend's answer to "can you run here?".

    ``available``: its dependencies import and it can build an engine here.
    ``accelerator``: the hardware it targets is present (False for CPU paths).
    ``reason``: why it is unavailable, or what it found (shown to users).
    """

    available: bool
    accelerator: bool = False
    reason: str = ""


@dataclass(frozen=True)
class BackendSpec:
    """What a plugin registers for one backend.

    ``factory`` is a callable or a ``"module:attribute"`` string resolved on first use;
    it is called as ``factory(model=Model, config=EngineConfig)`` and returns an Engine.
    ``probe`` must import nothing heavy (``importlib.util.find_spec`` is the tool).
    ``extra`` is the pip extra of the backend's distribution that installs its
    dependencies. ``tolerances`` and ``xfail`` are ``"package:resource"`` names of the
    backend's conformance tolerance overrides and expected-failure file.
    ``accelerator`` is ``"tpu"``, ``"neuron"``, ``"cuda"`` or another kind, or None for a
    CPU-only backend; ``priority`` orders CPU paths for ``backend="auto"`` (higher wins).
    """

    name: str
    description: str
    protocol_version: str
    probe: Callable[[], Probe]
    factory: Callable[..., Any] | str
    extra: str | None = None
    priority: int = 0
    accelerator: str | None = None
    tolerances: str | None = None
    xfail: str | None = None

    def problems(self) -> list[str]:
        """What is malformed about this spec (empty when it is fine)."""
        out = []
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            out.append(f"name {self.name!r} must match {_NAME_RE.pattern}")
        if not isinstance(self.description, str) or not self.description.strip() or "\n" in self.description:
            out.append("description must be one non-empty line")
        major = str(self.protocol_version).split(".")[0]
        if major != PROTOCOL_VERSION.split(".")[0]:
            out.append(
                f"implements protocol {self.protocol_version!r} but this polyengine speaks "
                f"{PROTOCOL_VERSION!r} (major versions must match)"
            )
        if not callable(self.probe):
            out.append("probe must be callable")
        if isinstance(self.factory, str):
            if ":" not in self.factory:
                out.append(f"factory {self.factory!r} must look like 'package.module:attribute'")
        elif not callable(self.factory):
            out.append("factory must be callable or a 'module:attribute' string")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            out.append("priority must be an int")
        for attr in ("extra", "accelerator", "tolerances", "xfail"):
            val = getattr(self, attr)
            if val is not None and not isinstance(val, str):
                out.append(f"{attr} must be a string or None")
        for attr in ("tolerances", "xfail"):
            val = getattr(self, attr)
            if isinstance(val, str) and ":" not in val:
                out.append(f"{attr} {val!r} must look like 'package:resource'")
        return out


@dataclass
class BackendInfo:
    """One discovered backend, usable or broken."""

    name: str
    plugin: str
    distribution: str | None
    version: str | None
    spec: BackendSpec | None = None
    error: PluginError | None = None
    _probe: Probe | None = field(default=None, repr=False)

    @property
    def broken(self) -> bool:
        return self.error is not None

    @property
    def install_hint(self) -> str | None:
        if self.spec is None or not self.spec.extra:
            return None
        return f"pip install '{self.distribution or 'polyengine'}[{self.spec.extra}]'"

    def probe(self) -> Probe:
        """The spec's probe, run once. A probe that raises marks the backend broken."""
        if self.error is not None:
            return Probe(False, False, str(self.error))
        if self._probe is None:
            try:
                result = self.spec.probe()
                if not isinstance(result, Probe):
                    raise TypeError(f"probe returned {type(result).__name__}, expected Probe")
            except Exception as exc:  # a plugin's bug must not break discovery of others
                self.error = PluginError(
                    self.plugin, self.distribution, f"probe of backend {self.name!r} raised {exc!r}"
                )
                return Probe(False, False, str(self.error))
            self._probe = result
        return self._probe

    def require_usable(self) -> BackendSpec:
        """The spec, or the error that explains why this backend cannot be used."""
        probe = self.probe()
        if self.error is not None:
            raise self.error
        if not probe.available:
            raise BackendUnavailable(self.name, probe.reason or "its probe said no", self.install_hint)
        return self.spec

    def load_factory(self) -> Callable[..., Any]:
        spec = self.require_usable()
        if callable(spec.factory):
            return spec.factory
        module, _, attr = spec.factory.partition(":")
        try:
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except ImportError as exc:
            raise BackendUnavailable(
                self.name, f"importing {module!r} failed: {exc}", self.install_hint
            ) from exc
        except AttributeError as exc:
            raise PluginError(
                self.plugin, self.distribution, f"factory {spec.factory!r} does not exist: {exc}"
            ) from exc
        return obj

    def to_dict(self) -> dict[str, Any]:
        probe = self.probe()
        spec = self.spec
        return {
            "name": self.name,
            "available": bool(probe.available and not self.broken),
            "accelerator": bool(probe.accelerator and not self.broken),
            "reason": probe.reason,
            "install_hint": self.install_hint,
            "distribution": self.distribution,
            "version": self.version,
            "priority": spec.priority if spec else None,
            "broken": self.broken,
            "error": str(self.error) if self.error else None,
            "description": spec.description if spec else None,
            "protocol_version": spec.protocol_version if spec else None,
            "accelerator_kind": spec.accelerator if spec else None,
            "extra": spec.extra if spec else None,
            "tolerances": spec.tolerances if spec else None,
            "xfail": spec.xfail if spec else None,
        }


@dataclass
class _Plugin:
    name: str
    obj: Any
    distribution: str | None
    version: str | None
    error: PluginError | None = None


class PluginRegistry:
    """Discovers plugins once and answers questions about them.

    Thread-safe for reads after discovery; ``register``/``unregister`` rebuild caches.
    """

    def __init__(self, *, entry_points: bool = True):
        self._lock = threading.RLock()
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(PolyengineSpecs)
        self._plugins: dict[str, _Plugin] = {}
        self._entry_points = entry_points
        self._discovered = False
        self._backends: dict[str, BackendInfo] | None = None

    # -- registration --------------------------------------------------------------

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        if not self._entry_points:
            return
        seen: set[tuple[str, str]] = set()
        for group in ENTRY_POINT_GROUPS:
            for ep in md.entry_points(group=group):
                key = (ep.name, ep.value)
                if key in seen:  # the same distribution visible twice on sys.path
                    continue
                seen.add(key)
                dist = getattr(ep, "dist", None)
                dist_name = dist.metadata["Name"] if dist is not None else None
                dist_version = dist.version if dist is not None else None
                try:
                    obj = ep.load()
                except Exception as exc:
                    err = PluginError(
                        ep.name, dist_name,
                        f"failed to import entry point {ep.value!r} (group {group}): "
                        f"{type(exc).__name__}: {exc}",
                    )
                    self._plugins[ep.name] = _Plugin(ep.name, None, dist_name, dist_version, err)
                    continue
                self._register(obj, ep.name, dist_name, dist_version)

    def _register(self, obj: Any, name: str, distribution: str | None, version: str | None) -> None:
        if name in self._plugins:
            other = self._plugins[name]
            err = PluginError(
                name, distribution,
                f"plugin name also used by distribution {other.distribution!r}; rename one entry point",
            )
            self._plugins[f"{name}@{distribution}"] = _Plugin(name, None, distribution, version, err)
            return
        try:
            self._pm.register(obj, name=name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            err = PluginError(name, distribution, f"invalid hook implementation: {exc}")
            self._plugins[name] = _Plugin(name, None, distribution, version, err)
            return
        self._plugins[name] = _Plugin(name, obj, distribution, version)

    def register(self, obj: Any, name: str | None = None, *, distribution: str | None = None) -> str:
        """Register an in-process plugin (tests, notebooks, subclass-mode conformance)."""
        with self._lock:
            self._discover()
            name = name or getattr(obj, "__name__", None) or f"plugin-{id(obj)}"
            self._register(obj, name, distribution, None)
            self._backends = None
            return name

    def unregister(self, name: str) -> None:
        with self._lock:
            plugin = self._plugins.pop(name, None)
            if plugin is not None and plugin.obj is not None:
                self._pm.unregister(name=name)
            self._backends = None

    # -- hooks, gathered per plugin -----------------------------------------------------

    def _results(self, hook_name: str) -> Iterable[tuple[_Plugin, Any, Exception | None]]:
        hook = getattr(self._pm.hook, hook_name)
        for impl in hook.get_hookimpls():  # registration order
            plugin = self._plugins.get(impl.plugin_name)
            try:
                yield plugin, impl.function(), None
            except Exception as exc:
                yield plugin, None, exc

    def backends(self) -> dict[str, BackendInfo]:
        """Every backend, broken ones included, keyed by name. Raises PluginError when
        two plugins claim the same backend name."""
        with self._lock:
            self._discover()
            if self._backends is not None:
                return self._backends
            found: dict[str, BackendInfo] = {}

            def add(info: BackendInfo) -> None:
                if info.name in found:
                    prev = found[info.name]
                    raise PluginError(
                        info.plugin, info.distribution,
                        f"backend name {info.name!r} is claimed by both plugin {prev.plugin!r} "
                        f"(distribution {prev.distribution!r}) and plugin {info.plugin!r} "
                        f"(distribution {info.distribution!r}); uninstall one of them",
                    )
                found[info.name] = info

            for plugin in self._plugins.values():
                if plugin.error is not None:
                    add(BackendInfo(plugin.name, plugin.name, plugin.distribution, plugin.version, error=plugin.error))
            for plugin, result, exc in self._results("polyengine_backends"):
                pname, dist, ver = plugin.name, plugin.distribution, plugin.version
                if exc is not None:
                    err = PluginError(pname, dist, f"polyengine_backends() raised {type(exc).__name__}: {exc}")
                    add(BackendInfo(pname, pname, dist, ver, error=err))
                    continue
                if not isinstance(result, (list, tuple)):
                    err = PluginError(pname, dist, f"polyengine_backends() must return a list of BackendSpec, got {type(result).__name__}")
                    add(BackendInfo(pname, pname, dist, ver, error=err))
                    continue
                for spec in result:
                    if not isinstance(spec, BackendSpec):
                        err = PluginError(pname, dist, f"polyengine_backends() returned {type(spec).__name__}, expected BackendSpec")
                        add(BackendInfo(pname, pname, dist, ver, error=err))
                        continue
                    problems = spec.problems()
                    label = spec.name if isinstance(spec.name, str) and spec.name else pname
                    if problems:
                        err = PluginError(pname, dist, f"malformed spec for backend {label!r}: " + "; ".join(problems))
                        add(BackendInfo(label, pname, dist, ver, error=err))
                    else:
                        add(BackendInfo(spec.name, pname, dist, ver, spec=spec))
            self._backends = found
            return found

    def tools(self) -> list[Any]:
        with self._lock:
            self._discover()
            out = []
            for plugin, result, exc in self._results("polyengine_tools"):
                if exc is not None or not isinstance(result, (list, tuple)):
                    problem = f"raised {exc!r}" if exc else f"returned {type(result).__name__}, expected a list"
                    raise PluginError(plugin.name, plugin.distribution, f"polyengine_tools() {problem}")
                out.extend(result)
            return out

    def models(self) -> dict[str, tuple[Any, _Plugin]]:
        with self._lock:
            self._discover()
            out: dict[str, tuple[Any, _Plugin]] = {}
            for plugin, result, exc in self._results("polyengine_models"):
                if exc is not None or not isinstance(result, dict):
                    problem = f"raised {exc!r}" if exc else f"returned {type(result).__name__}, expected a dict"
                    raise PluginError(plugin.name, plugin.distribution, f"polyengine_models() {problem}")
                for name, target in result.items():
                    if name in out:
                        raise PluginError(
                            plugin.name, plugin.distribution,
                            f"model name {name!r} is also registered by plugin {out[name][1].name!r}",
                        )
                    out[name] = (target, plugin)
            return out


_registry: PluginRegistry | None = None
_registry_lock = threading.Lock()


def get_registry() -> PluginRegistry:
    """The process-wide registry (entry points discovered on first use)."""
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = PluginRegistry()
        return _registry


def reset_registry() -> None:
    """Forget discovered plugins (the next call discovers again)."""
    global _registry
    with _registry_lock:
        _registry = None


def register_plugin(obj: Any, name: str | None = None) -> str:
    """Register an in-process plugin object or module; returns its name."""
    return get_registry().register(obj, name)


def unregister_plugin(name: str) -> None:
    get_registry().unregister(name)


def list_backends() -> list[BackendInfo]:
    """Every installed backend, broken ones included, sorted by name."""
    return sorted(get_registry().backends().values(), key=lambda b: b.name)


def _auto_key(info: BackendInfo) -> tuple:
    probe = info.probe()
    kind = info.spec.accelerator
    accel_rank = ACCELERATOR_ORDER.index(kind) if kind in ACCELERATOR_ORDER else len(ACCELERATOR_ORDER)
    return (0 if probe.accelerator else 1, accel_rank if probe.accelerator else 0, -info.spec.priority, info.name)


def select_backend(backend: str = "auto") -> BackendInfo:
    """Resolve a backend name (or ``"auto"``) to a usable backend, or raise why not.

    ``auto`` picks among the backends that can run here: a present accelerator first
    (TPU, Neuron, CUDA, then others), then CPU paths by declared priority.
    """
    backends = get_registry().backends()
    if backend != "auto":
        if backend not in backends:
            raise UnknownBackend(backend, list(backends))
        info = backends[backend]
        info.require_usable()
        return info
    usable = [b for b in backends.values() if b.probe().available and not b.broken]  # a raising probe marks it broken
    if not usable:
        why = "; ".join(f"{b.name}: {b.probe().reason or 'unavailable'}" for b in backends.values()) or "no backends are installed"
        raise BackendUnavailable("auto", f"no backend can run here ({why})", "pip install 'polyengine[cuda]'")
    return min(usable, key=_auto_key)


def create_engine(backend: str = "auto", model: Any = None, config: Any = None, **config_kwargs: Any):
    """Build an engine: pick the backend, load the model, call the backend's factory.

    ``model`` is anything :func:`polyengine.models.load_model` takes (None: the
    embedded default) or an already loaded :class:`polyengine.models.Model`.
    ``config`` is an :class:`EngineConfig` or a dict; keyword arguments override it.
    Limits left unset are fitted to the model: ``max_cache_length`` defaults to
    ``min(1024, max_position_embeddings)`` and ``max_prefill_length`` to
    ``min(512, max_cache_length - 1)``.
    """
    from polyengine.engine import Engine, EngineConfig
    from polyengine.errors import PolyengineError
    from polyengine.models import Model

    info = select_backend(backend)
    if isinstance(config, EngineConfig):
        values, explicit = config.model_dump(), set(config.model_fields_set)
    else:
        values = dict(config or {})
        explicit = set(values)
    values.update(config_kwargs)
    explicit |= set(config_kwargs)
    fields = EngineConfig.model_fields

    def fitted(positions: int | None = None) -> EngineConfig:
        v = dict(values)
        if "max_cache_length" not in explicit:
            v["max_cache_length"] = min(fields["max_cache_length"].default, positions or 1 << 62)
        if "max_prefill_length" not in explicit:
            v["max_prefill_length"] = min(fields["max_prefill_length"].default, v.get("max_cache_length", 2) - 1)
        return _engine_config(EngineConfig, v)

    fitted()  # refuse a bad config before loading weights
    factory = info.load_factory()
    if isinstance(model, Model):
        loaded = model
    else:
        from polyengine.models import load_model

        loaded = load_model(model)
    engine_config = fitted(loaded.config.max_position_embeddings)
    try:
        engine = factory(model=loaded, config=engine_config)
    except PolyengineError:
        raise
    except Exception as exc:  # a backend's bug or an untyped device error: say whose
        raise PluginError(
            info.plugin, info.distribution,
            f"factory of backend {info.name!r} raised {type(exc).__name__}: {exc}",
        ) from exc
    if not isinstance(engine, Engine):
        missing = [n for n in ("capabilities", "prefill", "insert", "generate", "free_resource", "init_decode_state", "load_params") if not hasattr(engine, n)]
        raise PluginError(info.plugin, info.distribution, f"factory of backend {info.name!r} returned {type(engine).__name__}, which lacks {missing}")
    return engine


def _engine_config(cls: type, values: dict[str, Any]):
    from pydantic import ValidationError

    from polyengine.errors import InvalidRequest

    try:
        return cls(**values)
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
        raise InvalidRequest(f"invalid engine config: {msgs}") from None
