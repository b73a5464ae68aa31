"""The hooks a polyengine plugin may implement (pluggy project ``polyengine``).

A plugin is any module or object registered through an entry point in the group
``polyengine.backends`` (also for plugins that add only tools or model names), or
in-process with :func:`polyengine.plugins.register_plugin`. It implements some of
the hooks below, each marked with :data:`hookimpl`::

    from polyengine.plugins import BackendSpec, Probe, hookimpl

    @hookimpl
    def polyengine_backends():
        return [BackendSpec(name="mine", ...)]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from polyengine.specs import BackendSpec
    from polyengine.tools import Tool

PROJECT = "polyengine"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class PolyengineSpecs:
    """Hook specifications. Each hook returns a list; results are gathered per plugin
    so that an error can always be blamed on the plugin that caused it."""

    @hookspec
    def polyengine_backends(self) -> "list[BackendSpec]":
        """Return the backends this plugin provides.

        Must import nothing heavy: the spec's probe and factory do the real work
        lazily (the factory may be a ``"module:attribute"`` string).
        """

    @hookspec
    def polyengine_tools(self) -> "list[Tool]":
        """Return tools the driver's tool machine can call (the calculator is built in)."""

    @hookspec
    def polyengine_models(self) -> "dict[str, Any]":
        """Return model names this plugin can resolve: ``{name: path_or_callable}``.

        A callable takes no argument and returns a path (a GGUF file or an HF folder).
        """
