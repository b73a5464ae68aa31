"""The plugin API in one import: what a plugin registers, and how the core finds,
chooses and builds backends.

    from polyengine.plugins import BackendSpec, Probe, hookimpl

The work is split by job: :mod:`polyengine.specs` (the data a plugin returns),
:mod:`polyengine.discovery` (entry points, broken and excluded plugins, the
``POLYENGINE_BACKENDS`` allowlist), :mod:`polyengine.selection` (``backend="auto"``)
and :mod:`polyengine.construction` (``create_engine``).
"""

from __future__ import annotations

from polyengine.construction import create_engine
from polyengine.discovery import (
    ALLOWLIST_ENV,
    ENTRY_POINT_GROUP,
    BackendInfo,
    PluginRegistry,
    get_registry,
    list_backends,
    register_plugin,
    reset_registry,
    unregister_plugin,
)
from polyengine.hookspecs import hookimpl
from polyengine.selection import select_backend
from polyengine.specs import BackendSpec, Probe

__all__ = [
    "ALLOWLIST_ENV",
    "ENTRY_POINT_GROUP",
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
