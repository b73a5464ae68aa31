"""``polyengine device-check``: the dry run of every backend's device check, as CI runs it.

The device check itself needs the accelerator (a GPU, a TPU, Neuron devices), which no
CI machine of this project has; its ``--dry-run`` runs the same steps on the CPU with
tiny shapes, so these tests know the command starts and every step's code runs. They
run it as a user does (the installed command, a fresh process) and read its Markdown
report and JSON facts. The neuron dry run uses the conformance model at the suite's
engine shape and the test session's artifact cache (tests/neuron_support.py), so it
compiles nothing the neuron tests do not compile anyway.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from polyengine.benchmarks.device_check import HBM_GB_S, hbm_bandwidth  # noqa: E402


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("polyengine")
    return [str(script)] if script.exists() else [sys.executable, "-m", "polyengine.cli"]


def _run(args: list[str], tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*_cli(), "device-check", *args], cwd=tmp_path, capture_output=True, text=True, timeout=1500,
                          env={**os.environ, **(env or {})})


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cuda_torch", "tpu_jax", "neuron"])
def test_the_dry_run_runs_every_step_and_reports_them(backend, tmp_path):
    env = {}
    if backend == "tpu_jax":
        pytest.importorskip("jax")
    if backend == "neuron":
        from neuron_support import shared_cache

        env["POLYENGINE_NEURON_CACHE"] = str(shared_cache())
    facts = tmp_path / "facts.json"
    proc = _run(["--backend", backend, "--dry-run", "--output", "report.md", "--json", str(facts)], tmp_path, env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = (tmp_path / "report.md").read_text()
    assert report == proc.stdout
    assert f"## Device check: `{backend}`, dry run on the CPU" in report
    doc = json.loads(facts.read_text())
    steps = {s["name"]: s for s in doc["steps"]}
    assert list(steps) == ["device", "conformance", "cuda_graphs", "greedy", "bench"]
    assert {s["status"] for s in steps.values()} <= {"pass", "skip"}
    assert steps["cuda_graphs"]["status"] == "skip"  # needs a GPU, or not this backend's
    assert steps["conformance"]["facts"]["summary"]["surface"]["passed"] > 0
    assert steps["greedy"]["facts"]["equal"] is True
    rows = steps["bench"]["facts"]["rows"]
    assert [r["batch"] for r in rows] == [1, 4] and all(r["tok_s"] > 0 for r in rows)
    assert steps["bench"]["facts"]["copy_gb_s"] > 0
    print(f"{backend}: " + ", ".join(f"{s['name']} {s['seconds']:.1f} s" for s in doc["steps"]))


def test_without_the_accelerator_it_refuses_rather_than_report_cpu_numbers(tmp_path):
    proc = _run(["--backend", "cuda_torch"], tmp_path, {"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "has no accelerator here" in proc.stderr and "--dry-run" in proc.stderr
    proc = _run(["--backend", "cuda_torch", "--dry-run", "--steps", "device,warp"], tmp_path)
    assert proc.returncode == 2 and "unknown step(s) ['warp']" in proc.stderr


def test_the_bandwidth_table_names_the_devices_it_knows():
    assert hbm_bandwidth("NVIDIA H200") == 4800.0
    assert hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3350.0 and hbm_bandwidth("NVIDIA H100 PCIe") == 2000.0
    assert hbm_bandwidth("NVIDIA A100-SXM4-80GB") == 2039.0 and hbm_bandwidth("NVIDIA A100-PCIE-40GB") == 1555.0
    assert hbm_bandwidth("TPU v5 lite") == 819.0 and hbm_bandwidth("TPU v4") == 1200.0
    assert hbm_bandwidth("trn1.32xlarge") == 410.0
    assert hbm_bandwidth("Some Future GPU") is None
    assert all(gb > 0 for _, gb in HBM_GB_S)
