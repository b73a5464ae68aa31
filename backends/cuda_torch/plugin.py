"""Registers the cuda_torch backend. Imports nothing heavy: torch is found with
``importlib.util.find_spec`` and a GPU by its device files or NVML, never by starting
CUDA (``torch.cuda.is_available()`` would initialise a runtime at discovery)."""

from __future__ import annotations

import glob
import importlib.util
import os

from polyengine import PROTOCOL_VERSION
from polyengine.plugins import BackendSpec, Probe, hookimpl


def cuda_devices() -> list[str]:
    """NVIDIA GPUs visible to this process, without starting a CUDA runtime: NVML's
    names when pynvml is installed, else the device files (``/dev/nvidiaN``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return []
    if importlib.util.find_spec("pynvml") is not None:
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
            finally:
                pynvml.nvmlShutdown()
            return [n.decode() if isinstance(n, bytes) else str(n) for n in names]
        except Exception:  # no driver, or NVML refuses: fall back to the device files
            pass
    return sorted(glob.glob("/dev/nvidia[0-9]*"))


def probe() -> Probe:
    if importlib.util.find_spec("torch") is None:
        return Probe(False, False, "PyTorch is not installed")
    gpus = cuda_devices()
    if gpus:
        return Probe(True, True, f"CUDA: {len(gpus)} NVIDIA GPU(s) ({gpus[0]}); will use cuda:0")
    return Probe(True, False, "no NVIDIA GPU found (no /dev/nvidiaN): will run PyTorch on the CPU")


@hookimpl
def polyengine_backends():
    return [
        BackendSpec(
            name="cuda_torch",
            description="PyTorch: CUDA on NVIDIA GPUs, the CPU otherwise (float32 there).",
            protocol_version=PROTOCOL_VERSION,
            probe=probe,
            factory="polyengine.backends.cuda_torch.engine:create_engine",
            diagnose="polyengine.backends.cpu.plan:diagnose",
            extra="cuda",
            # Above the NumPy reference on any CPU; a present GPU ranks it among accelerators.
            priority=50,
            accelerator="cuda",
            accelerator_priority=100,
            tolerances="polyengine.backends.cuda_torch:conformance.toml",
        )
    ]
