"""The spec of a torch backend laid out like ``cpu`` and ``cuda_torch``: ``engine.py``
with ``create_engine``, ``options.py`` with ``OPTIONS`` and ``conformance.toml`` in the
backend's package. Imports no torch (plugins import it at discovery)."""

from __future__ import annotations

from typing import Any, Callable

from polyengine import PROTOCOL_VERSION
from polyengine.plugins import BackendSpec, Probe

__all__ = ["torch_backend_spec"]


def torch_backend_spec(name: str, description: str, probe: Callable[[], Probe], *, diagnose: str,
                       weight_formats: bool = False, **ranking: Any) -> BackendSpec:
    """``diagnose``: the module (in the backend's package) whose ``diagnose`` describes
    what the backend would run here; ``weight_formats``: its ``options.py`` has a
    ``WEIGHT_FORMATS`` table (the formats its engines compute on); ``ranking``: ``extra``,
    ``priority``, ``accelerator`` and the other BackendSpec fields that differ per backend."""
    package = f"polyengine.backends.{name}"
    return BackendSpec(name=name, description=description, protocol_version=PROTOCOL_VERSION, probe=probe,
                       factory=f"{package}.engine:create_engine", diagnose=f"{package}.{diagnose}:diagnose",
                       options=f"{package}.options:OPTIONS", tolerances=f"{package}:conformance.toml",
                       weight_formats=f"{package}.options:WEIGHT_FORMATS" if weight_formats else None, **ranking)
