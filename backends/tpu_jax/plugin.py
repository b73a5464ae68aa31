"""Registers the tpu_jax backends. Imports nothing heavy: jax, torchax and ray are found
with ``importlib.util.find_spec``, and a TPU by its device files (``/dev/accel*``,
``/dev/vfio/<n>``) or an installed ``libtpu``, never by starting a JAX runtime (which
would grab the TPU at discovery).

- ``tpu_jax``: the single-process engine. Accelerator ``tpu`` when a TPU is present
  (ranked above CUDA); otherwise a CPU path ranked below the ``cpu`` backend.
- ``tpu_jax_ray``: the same engine as a multi-host JAX program on Ray workers (a
  leader engine here, one worker per host); needs ray as well. Never picked by
  ``backend="auto"`` (priority below the NumPy reference): it is chosen by name.
"""

from __future__ import annotations

import glob
import importlib.util
import os

from polyengine import PROTOCOL_VERSION
from polyengine.plugins import BackendSpec, Probe, hookimpl


def tpu_devices() -> list[str]:
    """TPU chips visible here, by their device files: ``/dev/accelN`` (v2-v4) and
    ``/dev/vfio/N`` (v5e and later). No runtime is started."""
    return sorted(glob.glob("/dev/accel[0-9]*")) + sorted(
        p for p in glob.glob("/dev/vfio/*") if os.path.basename(p).isdigit())


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def libtpu_installed() -> bool:
    """JAX's TPU runtime library (``jax[tpu]``), found without importing it."""
    return importlib.util.find_spec("libtpu") is not None


def probe() -> Probe:
    missing = _missing("jax", "torchax", "torch")
    if missing:
        return Probe(False, False, f"{', '.join(missing)} not installed")
    chips = tpu_devices()
    if chips and libtpu_installed():
        return Probe(True, True, f"TPU: {len(chips)} device file(s) ({chips[0]}) and libtpu")
    if chips:
        return Probe(True, False, f"TPU device files found ({chips[0]}) but libtpu is not installed: "
                                  f"JAX will run on the CPU (pip install 'jax[tpu]')")
    return Probe(True, False, "no TPU found (no /dev/accelN or /dev/vfio/N): JAX on the CPU (or a GPU JAX build)")


def probe_ray() -> Probe:
    base = probe()
    if not base.available:
        return base
    if _missing("ray"):
        return Probe(False, False, "ray not installed")
    return Probe(True, False, f"Ray workers on this cluster; each: {base.reason}")


@hookimpl
def polyengine_backends():
    return [
        BackendSpec(
            name="tpu_jax",
            description="JAX on TPU (the CPU elsewhere): the shared torch model through torchax, Mesh sharding.",
            protocol_version=PROTOCOL_VERSION,
            probe=probe,
            factory="polyengine.backends.tpu_jax.engine:create_engine",
            diagnose="polyengine.backends.tpu_jax.observe:diagnose",
            extra="tpu",
            # A present TPU ranks first among accelerators (CUDA is 100); on the CPU it
            # ranks below cpu (60) and cuda_torch (50) and above the NumPy reference (0).
            priority=40,
            accelerator="tpu",
            accelerator_priority=300,
            tolerances="polyengine.backends.tpu_jax:conformance.toml",
            options="polyengine.backends.tpu_jax.options:OPTIONS",
            weight_formats="polyengine.backends.tpu_jax.options:WEIGHT_FORMATS",
        ),
        BackendSpec(
            name="tpu_jax_ray",
            description="tpu_jax as one multi-host JAX program on Ray workers (a leader drives one worker per host).",
            protocol_version=PROTOCOL_VERSION,
            probe=probe_ray,
            factory="polyengine.backends.tpu_jax.ray_engine:create_engine",
            diagnose="polyengine.backends.tpu_jax.observe:diagnose",
            extra="tpu",
            priority=-10,
            accelerator=None,
            tolerances="polyengine.backends.tpu_jax:conformance.toml",
            options="polyengine.backends.tpu_jax.options:OPTIONS",
            weight_formats="polyengine.backends.tpu_jax.options:WEIGHT_FORMATS",
        ),
    ]
