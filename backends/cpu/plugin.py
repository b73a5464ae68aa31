"""Registers the cpu backend. Imports nothing heavy: torch is found with
``importlib.util.find_spec``; the kernels compile when an engine (or ``polyengine
backends --verbose``) first needs them, not at discovery."""

from __future__ import annotations

import importlib.util

from polyengine.plugins import Probe, hookimpl

from polyengine.backends.torch_common.spec import torch_backend_spec


def probe() -> Probe:
    if importlib.util.find_spec("torch") is None:
        return Probe(False, False, "PyTorch is not installed")
    return Probe(True, False, "PyTorch on this CPU, with host-compiled kernels where a C++ compiler is present")


@hookimpl
def polyengine_backends():
    # The best CPU path: above cuda_torch's device path run on a CPU and the NumPy oracle.
    return [torch_backend_spec(
        "cpu", "The host CPU: PyTorch plus kernels compiled for this CPU's ISA (AVX-512, AVX2 or scalar).", probe,
        diagnose="plan", extra="cpu", priority=60, weight_formats=True)]
