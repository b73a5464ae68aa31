"""Registers the neuron backend. Imports nothing heavy: torch and torch-neuronx are
found with ``importlib.util.find_spec`` and Neuron devices by their device files
(``/dev/neuronN``), so discovery starts no runtime.

Two paths, one backend:

- **Neuron**: torch-neuronx and neuronx-distributed importable and Neuron devices
  present. The probe reports the accelerator, so ``backend="auto"`` ranks it among
  accelerators.
- **CPU compile path**: anywhere PyTorch is installed. It compiles and runs the same
  static-shape graphs on the CPU for development and CI; it is available only when
  asked for by name (``by_name_only``), so ``auto`` never picks it without a device.
"""

from __future__ import annotations

import glob
import importlib.util

from polyengine import PROTOCOL_VERSION
from polyengine.models.blocks import FLOAT_FORMATS
from polyengine.plugins import BackendSpec, Probe, hookimpl

# The weight formats the engine computes on as stored: floats only. Its graphs are
# compiled over float weights (torch.export here, run as exported or by Inductor; the NxD program on
# Neuron), so a file's blocks are converted one tensor at a time as the weights load
# (TorchWeights.from_model reads the Model's records one by one), never a float32
# copy of the whole model before the compute dtype.
WEIGHT_FORMATS = FLOAT_FORMATS

NEURONX_HINT = (
    "install torch-neuronx and neuronx-distributed from AWS's Neuron package index "
    "(pip install torch-neuronx neuronx-distributed --extra-index-url https://pip.repos.neuron.amazonaws.com); "
    "the torch-neuronx name on PyPI is a placeholder"
)


def neuron_devices() -> list[str]:
    """Neuron devices visible here, by their device files (no runtime is started)."""
    return sorted(glob.glob("/dev/neuron[0-9]*"))


def neuronx_installed() -> bool:
    """torch-neuronx (the compiler's torch front end) and neuronx-distributed (the model
    the graphs are built as: shared weights and KV cache, tensor parallelism)."""
    return all(importlib.util.find_spec(m) is not None for m in ("torch_neuronx", "neuronx_distributed"))


def probe() -> Probe:
    if importlib.util.find_spec("torch") is None:
        return Probe(False, False, "PyTorch is not installed")
    devices = neuron_devices()
    if devices and neuronx_installed():
        return Probe(True, True, f"Neuron: {len(devices)} device(s) ({devices[0]}); graphs compile as one NxD model "
                                 f"(neuronx-distributed, torch_neuronx)")
    why = (f"{len(devices)} Neuron device(s) but torch-neuronx or neuronx-distributed is not installed ({NEURONX_HINT})"
           if devices
           else "no Neuron device (no /dev/neuronN)")
    return Probe(True, False, f"{why}: CPU compile path (torch.export; Inductor by option), by name only",
                 by_name_only=True)


@hookimpl
def polyengine_backends():
    return [
        BackendSpec(
            name="neuron",
            description="NxD-style static graphs (context encoding, token generation, speculation) on AWS Neuron; CPU compile path by name.",
            protocol_version=PROTOCOL_VERSION,
            probe=probe,
            factory="polyengine.backends.neuron.engine:create_engine",
            diagnose="polyengine.backends.neuron.engine:diagnose",
            extra="neuron",
            # Below the reference's 0 as well: on the CPU the probe also says by_name_only,
            # so auto skips it; the priority only orders it in listings.
            priority=-10,
            accelerator="neuron",
            accelerator_priority=100,
            tolerances="polyengine.backends.neuron:conformance.toml",
            weight_formats="polyengine.backends.neuron.plugin:WEIGHT_FORMATS",
            options="polyengine.backends.neuron.options:OPTIONS",
        )
    ]
