"""`polyengine conformance`: every built-in backend passes the whole suite and the
reports have what they promise.

The full run is a subprocess, as a user would start it; its wall time is printed
(`pytest -s` shows it) and recorded in the report's durations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polyengine.models.config import ARCHITECTURES

from polyengine.conformance import LAYERS, SUITE_VERSION
from polyengine.plugins import list_backends

from broken_backends import CATCHING_TESTS
from differential_report import assert_programs_exercised

AVAILABLE = [b.name for b in list_backends() if b.distribution == "polyengine" and not b.broken and b.probe().available]
# Backends whose whole-suite run lives in their own test file, beside what it needs there (a
# compile cache shared with the engine tests, a Ray cluster the module starts once): run
# here too, each would cost CI minutes twice. The test below checks the file really runs it.
DEDICATED = {
    # neuron's run is started by tests/neuron_support.py and awaited by its test file.
    "neuron": (("neuron_support.py", '"--backend", "neuron"'), ("test_neuron_conformance.py", "wait_suite()")),
    "tpu_jax_ray": (("test_tpu_jax_ray.py", '"--polyengine-backend", "tpu_jax_ray"'),),
    # cuda_torch needs a GPU; its device path runs the suite on the CPU as a stand-in there.
    "cuda_torch": (("test_cuda_torch.py", "class TestCudaTorchDevicePathStandIn(BackendConformance)"),),
}
BUILTIN = [name for name in AVAILABLE if name not in DEDICATED]


def test_every_builtin_backend_runs_the_suite_somewhere():
    here = Path(__file__).parent
    for name in AVAILABLE:
        if name in DEDICATED:
            for file, call in DEDICATED[name]:
                assert call in (here / file).read_text(encoding="utf-8"), f"{file} does not run the suite on {name}"
    assert {"reference", "cpu", "tpu_jax"} <= set(BUILTIN)


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("polyengine")
    return [str(script)] if script.exists() else [sys.executable, "-m", "polyengine.cli"]


def _run(args, cwd, env=None):
    proc = subprocess.run([*_cli(), *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=None if env is None else {**os.environ, **env})
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("backend", BUILTIN)
def test_builtin_backend_passes_the_whole_suite(backend, tmp_path):
    report = tmp_path / "report.json"
    start = time.perf_counter()
    # No environment of the test's own: the runner gives a backend its declared suite
    # environment (tpu_jax's XLA compile flags; docs/conformance.md, "Suite environment").
    code, out = _run(["conformance", "--backend", backend, "--report-json", str(report)], tmp_path)
    elapsed = time.perf_counter() - start
    print(f"\npolyengine conformance --backend {backend}: {elapsed:.1f} s wall")
    assert code == 0, out
    doc = json.loads(report.read_text())
    assert doc["suite_version"] == SUITE_VERSION
    assert (doc["backend"], doc["distribution"]) == (backend, "polyengine")
    if backend == "tpu_jax":
        assert "runs in a child process with JAX_DISABLE_MOST_OPTIMIZATIONS=1" in out, out[:2000]
        assert doc["environment"]["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"
        assert "--xla_cpu_use_fusion_emitters=false" in doc["environment"]["XLA_FLAGS"].split()
    else:
        assert doc["environment"] == {} and "child process" not in out
    assert doc["device"]["platform"] and doc["capabilities"]["dtypes"] and doc["seeds"]["model"]
    tests = doc["tests"]
    assert {t["status"] for t in tests} <= {"passed", "skipped"}
    for layer in LAYERS:
        assert doc["summary"][layer]["passed"] > 0, f"no {layer} test passed"
    # the only skips are numerics in dtypes the backend does not declare, the refusal
    # check of each architecture it declares (every built-in backend declares them all),
    # and the page rules, the tail's page sharing and the programs under page pressure
    # where the backend keeps its K/V contiguous (page_size 0)
    declared = set(doc["capabilities"]["dtypes"])
    assert set(doc["capabilities"]["architectures"]) == set(ARCHITECTURES)
    for t in tests:
        if t["status"] == "skipped":
            assert (t["layer"] == "numerics" and t["id"].split("-")[-1].rstrip("]") not in declared
                    or t["id"].startswith("test_architecture[")
                    or t["id"] in ("test_page_rules", "test_portable_prefix_tail_shares_pages",
                                   "test_programs_under_page_pressure")
                    and not doc["capabilities"]["page_size"]), t
        assert {"id", "layer", "status", "duration"} <= set(t)
    numeric = [t for t in tests if t["layer"] == "numerics" and t["status"] == "passed"]
    assert numeric and all(t["tolerances"] for t in numeric)
    for t in numeric:
        for tol in t["tolerances"].values():
            assert tol["value"] > 0 and tol["source"] and tol["measured"] <= tol["value"]
    assert doc["capabilities"]["token_masks"]  # every built-in backend declares them: the layer draws masks
    assert_programs_exercised(tests, token_masks=True, prefill_lane=doc["capabilities"]["prefill_lane"],
                              mixed_step=doc["capabilities"].get("mixed_step", 0))
    # the terminal table, one row per layer
    assert all(line in out for line in ("layer", *LAYERS, "total"))
    if backend == "reference":
        # What catches a broken backend (tests/test_conformance_broken.py) passes on the
        # reference, so each catch is the fault's. The reference declares every
        # architecture, so its refusal check is skipped here; the restricted variant passes
        # it (tests/test_conformance_honest.py).
        passed = {t["id"] for t in tests if t["status"] == "passed"}
        # (the programs under page pressure run on a paged engine: their catch passes on the
        # paged reference, tests/test_conformance_broken.py)
        named = {t for t in CATCHING_TESTS if not t.startswith("test_architecture[")
                 and t != "test_programs_under_page_pressure"}
        assert named <= passed, f"tests that catch a broken backend did not pass on the reference: {sorted(named - passed)}"


def test_all_backends_scoreboard(tmp_path):
    report = tmp_path / "all.json"
    # the allowlist keeps the static-graph and Ray backends (run in their own files) out
    code, out = _run(["conformance", "--backend", "all", "-k", "layer_surface", "--report-json", str(report)], tmp_path,
                     env={"POLYENGINE_BACKENDS": ",".join(BUILTIN)})
    assert code == 0, out
    doc = json.loads(report.read_text())
    assert {r["backend"] for r in doc["runs"]} == set(BUILTIN)
    board = (tmp_path / "all.scoreboard.md").read_text()
    assert board.startswith("| test | layer |") and "`test_engine_attributes` | surface | pass" in board
    assert board in out.replace("\r", "")


def test_unknown_backend_is_refused_with_the_installed_ones(tmp_path):
    code, out = _run(["conformance", "--backend", "no_such_backend"], tmp_path)
    assert code != 0 and "no backend named 'no_such_backend'" in out and "reference" in out


def test_an_unavailable_backend_stops_the_run_once(tmp_path):
    """cuda_torch without a GPU and without option device=cpu cannot build an engine: the
    run stops at once with that error and exit code 4, instead of 281 failures."""
    from polyengine.backends.cuda_torch.plugin import cuda_devices, rocm_devices

    if cuda_devices() or rocm_devices():
        pytest.skip("a GPU is present: cuda_torch is available here")
    code, out = _run(["conformance", "--backend", "cuda_torch", "-k", "layer_surface"], tmp_path)
    assert code == 4, out[-2000:]
    assert "is unavailable" in out and "Nothing was tested" in out and "device='cpu'" in out
    import re

    assert re.search(r"^total\s+\d+\s+0\s", out, re.M), out[-2000:]  # no test failed: the run stopped
