"""Backend discovery: plugins found through entry points, and what they register.

Plugins are pluggy plugins found through the entry-point group ``polyengine.backends``
(backends, tools and model names alike; see :mod:`polyengine.hookspecs`). Built-in
backends register the same way as third-party ones. Discovery imports each plugin
module, which must itself import nothing heavy: a :class:`~polyengine.specs.BackendSpec`
carries a cheap ``probe`` and a lazy ``factory``.

Nothing is dropped silently: a plugin that fails to import or returns a malformed
spec is listed as *broken*, with a :class:`PluginError` naming the plugin and its
distribution, and using it raises that error. Two plugins claiming one backend name is
an error at discovery, since either choice would surprise someone.

``POLYENGINE_BACKENDS`` (comma-separated names) is an allowlist: an entry point whose
name is not on it is not imported at all, a backend whose name is not on it is not
used, and both are listed as *excluded*. Unset or empty, everything is allowed.

Choosing among the backends is :mod:`polyengine.selection`; building an engine is
:mod:`polyengine.construction`.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pluggy

from polyengine.errors import BackendUnavailable, PluginError
from polyengine.hookspecs import PROJECT, PolyengineSpecs
from polyengine.specs import BackendSpec, Probe

__all__ = [
    "ENTRY_POINT_GROUP",
    "ALLOWLIST_ENV",
    "BackendInfo",
    "PluginRegistry",
    "allowlist",
    "get_registry",
    "reset_registry",
    "register_plugin",
    "unregister_plugin",
    "list_backends",
]

ENTRY_POINT_GROUP = "polyengine.backends"
ALLOWLIST_ENV = "POLYENGINE_BACKENDS"


def allowlist() -> frozenset[str] | None:
    """The names ``POLYENGINE_BACKENDS`` allows, or None when it is unset or empty."""
    raw = os.environ.get(ALLOWLIST_ENV, "")
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    return names or None


def _excluded_reason() -> str:
    return (
        f"excluded by {ALLOWLIST_ENV}={os.environ.get(ALLOWLIST_ENV, '')!r} (an allowlist of backend and "
        f"plugin names); add this name to use it"
    )


@dataclass
class BackendInfo:
    """One discovered backend: usable, broken or excluded."""

    name: str
    plugin: str
    distribution: str | None
    version: str | None
    spec: BackendSpec | None = None
    error: PluginError | None = None
    excluded: bool = False
    _probe: Probe | None = field(default=None, repr=False)

    @property
    def broken(self) -> bool:
        return self.error is not None

    @property
    def install_hint(self) -> str | None:
        if self.spec is None:
            return None
        if self.spec.install_hint:
            return self.spec.install_hint
        if not self.spec.extra:
            return None
        return f"pip install '{self.distribution or 'polyengine'}[{self.spec.extra}]'"

    def probe(self) -> Probe:
        """The spec's probe, run once. A probe that raises marks the backend broken."""
        if self.excluded:
            return Probe(False, False, _excluded_reason())
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

    @property
    def usable(self) -> bool:
        return self.probe().available and not self.broken and not self.excluded

    def require_usable(self) -> BackendSpec:
        """The spec, or the error that explains why this backend cannot be used."""
        probe = self.probe()
        if self.excluded:
            raise BackendUnavailable(self.name, _excluded_reason())
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
            "available": self.usable,
            "accelerator": bool(probe.accelerator and self.usable),
            "reason": probe.reason,
            "by_name_only": bool(probe.by_name_only and self.usable),
            "install_hint": self.install_hint,
            "distribution": self.distribution,
            "version": self.version,
            "priority": spec.priority if spec else None,
            "accelerator_priority": spec.accelerator_priority if spec else None,
            "broken": self.broken,
            "excluded": self.excluded,
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
    excluded: bool = False


class PluginRegistry:
    """Discovers plugins once and answers questions about them.

    Thread-safe for reads after discovery; ``register``/``unregister`` rebuild caches.
    ``allow`` is the allowlist (default: ``POLYENGINE_BACKENDS``; None allows all).
    """

    _DEFAULT = object()

    def __init__(self, *, entry_points: bool = True, allow: Any = _DEFAULT):
        self._lock = threading.RLock()
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(PolyengineSpecs)
        self._plugins: dict[str, _Plugin] = {}
        self._entry_points = entry_points
        self._allow: frozenset[str] | None = allowlist() if allow is self._DEFAULT else allow
        self._discovered = False
        self._backends: dict[str, BackendInfo] | None = None

    def allowed(self, name: str) -> bool:
        return self._allow is None or name in self._allow

    # -- registration --------------------------------------------------------------

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        if not self._entry_points:
            return
        seen: set[tuple[str, str]] = set()
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            key = (ep.name, ep.value)
            if key in seen:  # the same distribution visible twice on sys.path
                continue
            seen.add(key)
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else None
            dist_version = dist.version if dist is not None else None
            if not self.allowed(ep.name):
                self._plugins[ep.name] = _Plugin(ep.name, None, dist_name, dist_version, excluded=True)
                continue
            try:
                obj = ep.load()
            except Exception as exc:
                err = PluginError(
                    ep.name, dist_name,
                    f"failed to import entry point {ep.value!r} (group {ENTRY_POINT_GROUP}): "
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
        """Every backend, broken and excluded ones included, keyed by name. Raises
        PluginError when two plugins claim the same backend name."""
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
                if plugin.excluded:
                    add(BackendInfo(plugin.name, plugin.name, plugin.distribution, plugin.version, excluded=True))
                elif plugin.error is not None:
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
                        add(BackendInfo(spec.name, pname, dist, ver, spec=spec, excluded=not self.allowed(spec.name)))
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
    """Forget discovered plugins (the next call discovers again, re-reading the allowlist)."""
    global _registry
    with _registry_lock:
        _registry = None


def register_plugin(obj: Any, name: str | None = None) -> str:
    """Register an in-process plugin object or module; returns its name."""
    return get_registry().register(obj, name)


def unregister_plugin(name: str) -> None:
    get_registry().unregister(name)


def list_backends() -> list[BackendInfo]:
    """Every installed backend, broken and excluded ones included, sorted by name."""
    return sorted(get_registry().backends().values(), key=lambda b: b.name)
