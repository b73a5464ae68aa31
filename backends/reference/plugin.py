"""Registers the reference backend. Imports nothing but the core."""

from __future__ import annotations

import importlib.util

from polyengine import PROTOCOL_VERSION
from polyengine.plugins import BackendSpec, Probe, hookimpl


def probe() -> Probe:
    if importlib.util.find_spec("numpy") is None:  # pragma: no cover - numpy is a core dependency
        return Probe(False, False, "numpy is not installed")
    return Probe(True, False, "pure NumPy on the CPU (always available; slow, exact)")


@hookimpl
def polyengine_backends():
    return [
        BackendSpec(
            name="reference",
            description="Pure NumPy float64 oracle: slow, obviously correct, runs anywhere.",
            protocol_version=PROTOCOL_VERSION,
            probe=probe,
            factory="polyengine.backends.reference.engine:create_engine",
            diagnose="polyengine.backends.reference.engine:diagnose",
            weight_formats="polyengine.models.blocks:FORMATS",  # every one, dequantized exactly at load
            options="polyengine.backends.reference.engine:OPTIONS",
            extra=None,
            priority=0,
            accelerator=None,
            tolerances="polyengine.backends.reference:conformance.toml",
            xfail=None,
        )
    ]
