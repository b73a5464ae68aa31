"""Registers the cpu backend. Imports nothing heavy: torch is found with
``importlib.util.find_spec``; the kernels compile when an engine (or ``polyengine
backends --verbose``) first needs them, not at discovery."""

from __future__ import annotations

import importlib.util

from polyengine import PROTOCOL_VERSION
from polyengine.plugins import BackendSpec, Probe, hookimpl


def probe() -> Probe:
    if importlib.util.find_spec("torch") is None:
        return Probe(False, False, "PyTorch is not installed")
    return Probe(True, False, "PyTorch on this CPU, with host-compiled kernels where a C++ compiler is present")


@hookimpl
def polyengine_backends():
    return [
        BackendSpec(
            name="cpu",
            description="The host CPU: PyTorch plus kernels compiled for this CPU's ISA (AVX-512, AVX2 or scalar).",
            protocol_version=PROTOCOL_VERSION,
            probe=probe,
            factory="polyengine.backends.cpu.engine:create_engine",
            diagnose="polyengine.backends.cpu.plan:diagnose",
            options="polyengine.backends.cpu.options:OPTIONS",
            extra="cpu",
            # The best CPU path: above cuda_torch's device path run on a CPU and the NumPy oracle.
            priority=60,
            tolerances="polyengine.backends.cpu:conformance.toml",
        )
    ]
