"""Backend discovery: plugins found through entry points, and what they register.

Plugins are pluggy plugins found through the entry-point group ``polyengine.backends``
(backends, tools and model names alike; see :mod:`polyengine.hookspecs`). Built-in
backends register the same way as third-party ones. Discovery imports each plugin
module, which must itself import nothing heavy: a :class:`~polyengine.specs.BackendSpec`
carries a cheap ``probe`` and a lazy ``factory``.

Nothing is dropped silently, and no plugin takes the others down: a plugin that fails
to import (whatever it raises, ``SystemExit`` and ``KeyboardInterrupt`` included),
hangs, or returns malformed specs is listed as *broken*, with a :class:`PluginError`
naming the plugin once and its distribution, and using it raises that error. Plugin
code (imports, hooks, probes) runs through :func:`polyengine.isolation.call_plugin`:
bounded in time (``POLYENGINE_PLUGIN_TIMEOUT``, default 10 s), its output captured.
Two plugins claiming one backend name make that name broken (using it says who
clashes), since either choice would surprise someone; the other backends keep working.
A plugin whose ``polyengine_tools``/``polyengine_models`` hook fails is skipped with a
:class:`PluginWarning`.

``POLYENGINE_BACKENDS`` (comma-separated names) is an allowlist: an entry point is
imported only when the list names it or a backend of its family (a name that begins
with the entry point's and an underscore: ``tpu_jax_ray`` imports ``tpu_jax``, whose
plugin registers it); a backend whose name is not on the list is not used; both are
listed as *excluded*. Unset or empty, everything is allowed.

Choosing among the backends is :mod:`polyengine.selection`; building an engine is
:mod:`polyengine.construction`.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pluggy

from polyengine.errors import BackendUnavailable, PluginError
from polyengine.hookspecs import PROJECT, PolyengineSpecs
from polyengine.isolation import call_plugin, describe_failure
from polyengine.specs import NAME_PATTERN, BackendSpec, Probe

log = logging.getLogger(__name__)

__all__ = [
    "PluginWarning",
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


class PluginWarning(UserWarning):
    """A plugin's tools or model names were skipped because its hook failed."""


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
            call = call_plugin(self.spec.probe)  # a plugin's bug must not break discovery of others
            problem = None
            if not call.ok:
                problem = describe_failure(call, f"probe of backend {self.name!r}")
            elif not isinstance(call.result, Probe):
                problem = f"probe of backend {self.name!r} returned {type(call.result).__name__}, expected Probe"
            if problem is not None:
                self.error = PluginError(self.plugin, self.distribution, problem)
                return Probe(False, False, str(self.error))
            self._probe = call.result
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
        return self._resolve(spec.factory, "factory")

    def _resolve(self, target: Callable[..., Any] | str, what: str) -> Callable[..., Any]:
        """A spec's callable, importing ``"module:attribute"`` strings. Not bounded in time:
        the module imports the backend's framework, which may legitimately take a while.
        Whatever it raises is still blamed on the plugin."""
        if callable(target):
            return target
        module, _, attr = target.partition(":")
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
                self.plugin, self.distribution, f"{what} {target!r} does not exist: {exc}"
            ) from exc
        except SystemExit as exc:
            raise PluginError(self.plugin, self.distribution, f"importing {module!r} called sys.exit({exc.code!r})") from None
        except Exception as exc:
            raise PluginError(
                self.plugin, self.distribution, f"importing {module!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        return obj

    def option_table(self) -> dict[str, Any]:
        """The backend's option table (its spec's ``options``), empty when it names none
        or it cannot be read: a listing or another backend's message must not fail on it."""
        if not self.usable or self.spec.options is None:
            return {}
        try:
            table = self._resolve(self.spec.options, "options")
        except Exception:  # noqa: BLE001 - reported by the backend's own engine when built
            return {}
        return dict(table) if isinstance(table, dict) else {}

    def weight_formats(self) -> tuple[str, ...] | None:
        """The weight formats the backend's engines compute on as stored (its spec's
        ``weight_formats`` table), None when it names none or cannot run here. A table
        that cannot be read raises (the plugin's error, named)."""
        if not self.usable or self.spec.weight_formats is None:
            return None
        return tuple(self._resolve(self.spec.weight_formats, "weight_formats"))

    def diagnose(self) -> dict[str, str]:
        """What the backend would run here (its spec's ``diagnose``), for ``polyengine
        backends --verbose``; a failure is reported in the result, never raised: a
        diagnosis must not hide the other backends'."""
        if not self.usable:
            return {}
        if self.spec.diagnose is None:
            return {"paths": "this backend does not describe its paths (no diagnose in its spec)"}
        try:
            result = self._resolve(self.spec.diagnose, "diagnose")()
        except SystemExit as exc:
            return {"error": f"diagnose called sys.exit({exc.code!r})"}
        except Exception as exc:  # noqa: BLE001 - a plugin's bug, reported as such
            return {"error": f"diagnose raised {type(exc).__name__}: {exc}"}
        if not isinstance(result, dict):
            return {"error": f"diagnose returned {type(result).__name__}, expected a dict of str"}
        return {str(k): str(v) for k, v in result.items()}

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

    def plugin_allowed(self, name: str) -> bool:
        """Whether the entry point ``name`` may be imported: the allowlist names it, or a
        backend of its family (``tpu_jax_ray`` of the plugin ``tpu_jax``), which only
        importing the plugin can register."""
        return self.allowed(name) or any(n.startswith(name + "_") for n in self._allow or ())

    # -- registration --------------------------------------------------------------

    def _discover(self) -> None:
        if self._discovered:
            return
        if self._entry_points:
            try:
                self._load_entry_points()
            except BaseException:
                # A real Ctrl-C (or anything else) mid-way: forget the half-done discovery,
                # so the next call starts over instead of silently missing plugins.
                for name in list(self._plugins):
                    self.unregister(name)
                raise
        self._discovered = True

    def _load_entry_points(self) -> None:
        seen: set[tuple[str, str]] = set()
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            key = (ep.name, ep.value)
            if key in seen:  # the same distribution visible twice on sys.path
                continue
            seen.add(key)
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else None
            dist_version = dist.version if dist is not None else None
            if not self.plugin_allowed(ep.name):
                self._add_plugin(_Plugin(ep.name, None, dist_name, dist_version, excluded=True))
                continue
            call = call_plugin(ep.load)
            if not call.ok:
                err = PluginError(
                    ep.name, dist_name,
                    describe_failure(call, f"importing entry point {ep.value!r} (group {ENTRY_POINT_GROUP})"),
                )
                self._add_plugin(_Plugin(ep.name, None, dist_name, dist_version, err))
                continue
            if call.output.strip():
                log.info("plugin %r printed while it was imported: %r", ep.name, call.output[:200])
            self._register(call.result, ep.name, dist_name, dist_version)

    def _add_plugin(self, plugin: _Plugin) -> None:
        key = plugin.name
        if key in self._plugins:  # two distributions with one entry-point name: keep both visible
            key = f"{plugin.name}@{plugin.distribution}"
        self._plugins[key] = plugin

    def _register(self, obj: Any, name: str, distribution: str | None, version: str | None) -> None:
        if name in self._plugins:
            other = self._plugins[name]
            err = PluginError(
                name, distribution,
                f"its entry-point name is also used by distribution {other.distribution!r}; rename one entry point",
            )
            self._add_plugin(_Plugin(name, None, distribution, version, err))
            return
        try:
            self._pm.register(obj, name=name)
        except Exception as exc:  # pluggy's validation, or an object that breaks when inspected
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

    def _results(self, hook_name: str) -> Iterable[tuple[_Plugin, Any, str | None]]:
        """Each plugin's answer to one hook: ``(plugin, result, problem)``, where problem
        says what went wrong (raised, exited, hung) or is None."""
        hook = getattr(self._pm.hook, hook_name)
        for impl in hook.get_hookimpls():  # registration order
            plugin = self._plugins.get(impl.plugin_name)
            call = call_plugin(impl.function)
            if call.ok:
                yield plugin, call.result, None
            else:
                yield plugin, None, describe_failure(call, f"{hook_name}()")

    def backends(self) -> dict[str, BackendInfo]:
        """Every backend, broken and excluded ones included, keyed by name.

        One plugin can never make another unusable: a name two plugins claim becomes a
        broken entry saying so, and a broken entry whose name is taken is listed under
        ``name@plugin``."""
        with self._lock:
            self._discover()
            if self._backends is not None:
                return self._backends
            found: dict[str, BackendInfo] = {}
            for plugin in self._plugins.values():
                if plugin.excluded:
                    _add(found, BackendInfo(plugin.name, plugin.name, plugin.distribution, plugin.version, excluded=True))
                elif plugin.error is not None:
                    _add(found, BackendInfo(plugin.name, plugin.name, plugin.distribution, plugin.version,
                                            error=plugin.error))
            for plugin, result, problem in self._results("polyengine_backends"):
                for info in _backend_infos(plugin, result, problem):
                    if info.spec is not None:
                        info.excluded = not self.allowed(info.name)
                    _add(found, info)
            # A failing optional hook is listed too (its backends, if any, still work), so
            # `polyengine backends` shows why a plugin's tools or model names are missing.
            for hook, expected, what in _OPTIONAL_HOOKS:
                for plugin, result, problem in self._results(hook):
                    problem = _hook_problem(hook, result, problem, expected)
                    if problem is not None:
                        err = PluginError(plugin.name, plugin.distribution,
                                          f"{problem}; {what} are left out (its backends, if any, still work)")
                        _add(found, BackendInfo(plugin.name, plugin.name, plugin.distribution, plugin.version,
                                                error=err))
            self._backends = found
            return found

    def tools(self) -> list[Any]:
        """The tools every plugin returns; a plugin whose hook fails is skipped with a warning."""
        with self._lock:
            self._discover()
            out = []
            for plugin, result, problem in self._results("polyengine_tools"):
                problem = _hook_problem("polyengine_tools", result, problem, (list, tuple))
                if problem is not None:
                    _skip(plugin, problem, "its tools")
                    continue
                out.extend(result)
            return out

    def models(self) -> dict[str, tuple[Any, _Plugin]]:
        """Model names plugins register; a plugin whose hook fails is skipped with a
        warning, and a name two plugins register is left to neither."""
        with self._lock:
            self._discover()
            out: dict[str, tuple[Any, _Plugin]] = {}
            clashes: set[str] = set()
            for plugin, result, problem in self._results("polyengine_models"):
                problem = _hook_problem("polyengine_models", result, problem, dict)
                if problem is not None:
                    _skip(plugin, problem, "its model names")
                    continue
                for name, target in result.items():
                    if name in out:
                        clashes.add(name)
                        _skip(plugin, f"model name {name!r} is also registered by plugin {out[name][1].name!r}",
                              f"model name {name!r}")
                    out[name] = (target, plugin)
            for name in clashes:
                del out[name]
            return out


# The hooks a plugin may leave out, the type each returns, and what a failure loses.
_OPTIONAL_HOOKS = (("polyengine_tools", (list, tuple), "its tools"),
                   ("polyengine_models", dict, "its model names"))


def _hook_problem(hook: str, result: Any, problem: str | None, expected: type | tuple[type, ...]) -> str | None:
    if problem is None and not isinstance(result, expected):
        want = "a list" if expected is not dict else "a dict"
        problem = f"{hook}() returned {type(result).__name__}, expected {want}"
    return problem


def _skip(plugin: _Plugin, problem: str, what: str) -> None:
    err = PluginError(plugin.name, plugin.distribution, f"{problem}; {what} are left out")
    log.warning("%s", err)
    warnings.warn(str(err), PluginWarning, stacklevel=4)


def _add(found: dict[str, BackendInfo], info: BackendInfo) -> None:
    """Add one entry. A name claimed by two usable specs turns into a broken entry naming
    both; a broken or excluded entry whose name is taken moves to ``name@plugin``."""
    prev = found.get(info.name)
    if prev is None:
        found[info.name] = info
        return
    if info.spec is not None and prev.spec is not None and not prev.broken:
        if prev.plugin == info.plugin:
            problem = f"returns two backends named {info.name!r}; rename one of them"
        else:
            problem = (f"backend name {info.name!r} is also claimed by plugin {prev.plugin!r} (distribution "
                       f"{prev.distribution!r}); uninstall one of them, or pick one with POLYENGINE_BACKENDS")
        found[info.name] = BackendInfo(info.name, info.plugin, info.distribution, info.version,
                                       error=PluginError(info.plugin, info.distribution, problem))
        return
    if info.spec is not None and (prev.broken or prev.excluded):
        found[info.name], info = info, prev  # the usable one keeps the name
    key, n = f"{info.name}@{info.plugin}", 2
    while key in found:
        key, n = f"{info.name}@{info.plugin}#{n}", n + 1
    info.name = key
    found[key] = info


def _backend_infos(plugin: _Plugin, result: Any, problem: str | None) -> list[BackendInfo]:
    """The entries one plugin's ``polyengine_backends()`` answer makes: one per valid
    spec; one broken entry per malformed spec that has a usable name (so using that
    name says what is wrong); one broken entry, named after the plugin, for the rest."""
    pname, dist, ver = plugin.name, plugin.distribution, plugin.version
    if problem is None and not isinstance(result, (list, tuple)):
        problem = f"polyengine_backends() must return a list of BackendSpec, got {type(result).__name__}"
    if problem is not None:
        return [BackendInfo(pname, pname, dist, ver, error=PluginError(pname, dist, problem))]
    infos, unnamed = [], []
    for i, spec in enumerate(result):
        if not isinstance(spec, BackendSpec):
            unnamed.append(f"item {i} is a {type(spec).__name__}, expected BackendSpec")
            continue
        problems = spec.problems()
        if not problems:
            infos.append(BackendInfo(spec.name, pname, dist, ver, spec=spec))
        elif isinstance(spec.name, str) and NAME_PATTERN.match(spec.name):
            err = PluginError(pname, dist, f"malformed spec for backend {spec.name!r}: " + "; ".join(problems))
            infos.append(BackendInfo(spec.name, pname, dist, ver, error=err))
        else:
            unnamed.append(f"spec {i}: " + "; ".join(problems))
    if unnamed:
        err = PluginError(pname, dist, f"polyengine_backends() returned {len(unnamed)} malformed spec(s): "
                          + " | ".join(unnamed))
        infos.append(BackendInfo(pname, pname, dist, ver, error=err))
    return infos


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
