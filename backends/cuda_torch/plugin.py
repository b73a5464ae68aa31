"""Registers the cuda_torch backend. Imports nothing heavy: torch is found with
``importlib.util.find_spec`` and a GPU by its device files or NVML, never by starting
a runtime (``torch.cuda.is_available()`` would initialise one at discovery)."""

from __future__ import annotations

import glob
import importlib.util
import os

from polyengine.plugins import Probe, hookimpl

from polyengine.backends.torch_common.spec import torch_backend_spec


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


def rocm_devices() -> list[str]:
    """AMD GPUs through ROCm (torch's HIP build runs them as the ``cuda`` device type):
    the kernel driver's ``/dev/kfd`` plus its render nodes, hidden by
    ``HIP_VISIBLE_DEVICES``/``ROCR_VISIBLE_DEVICES`` set empty."""
    for var in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        visible = os.environ.get(var)
        if visible is not None and visible.strip() in ("", "-1"):
            return []
    if not os.path.exists("/dev/kfd"):
        return []
    return sorted(glob.glob("/dev/dri/renderD*")) or ["/dev/kfd"]


def probe() -> Probe:
    if importlib.util.find_spec("torch") is None:
        return Probe(False, False, "PyTorch is not installed")
    gpus = cuda_devices()
    if gpus:
        return Probe(True, True, f"CUDA: {len(gpus)} NVIDIA GPU(s) ({gpus[0]}); will use cuda:0")
    amd = rocm_devices()
    if amd:
        return Probe(True, True, f"ROCm: AMD GPU(s) ({len(amd)} device node(s)); will use cuda:0 through torch's HIP "
                                 f"build")
    return Probe(True, False, "no GPU found (no /dev/nvidiaN, no /dev/kfd): use backend 'cpu'; by name, with "
                              "option device='cpu', it runs its device path on the CPU as a test stand-in",
                 by_name_only=True)


@hookimpl
def polyengine_backends():
    # Below the cpu backend on a host without a GPU (where it runs by name only); a
    # present GPU ranks it among accelerators.
    return [torch_backend_spec("cuda_torch", "PyTorch on a GPU: NVIDIA (CUDA) or AMD (ROCm).", probe, diagnose="engine",
                               weight_formats=True, extra="cuda", priority=50, accelerator="cuda", accelerator_priority=100)]
