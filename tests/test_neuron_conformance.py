"""The conformance suite on the neuron backend's CPU compile path, run exactly as CI
documents it: ``polyengine conformance --backend neuron`` in its own process, with the
default options, so plain decoding (one token per step) and asynchronous results are
what the suite exercises (speculation has its own tests in test_neuron_engine.py).

The default compiler off Neuron is ``export`` (the exported graphs run as they are;
docs/neuron.md, "Choosing the CPU compiler"), which writes no artifact: the run leaves
the session's artifact cache (tests/neuron_support.py) as it found it. A process of
its own, not pytester's in-process run: the inner session's module snapshot would
drop torch's compiler modules, whose operator registrations cannot be imported twice.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")


@pytest.mark.slow
def test_conformance_suite_passes_with_the_default_options(tmp_path):
    from neuron_support import wait_suite

    suite = wait_suite()  # started when this test was collected (tests/conftest.py)
    out = suite["output"].read_text()
    assert suite["returncode"] == 0, out[-6000:]
    report, cache = suite["report"], suite["cache"]
    doc = json.loads(report.read_text())
    caps = doc["capabilities"]
    assert doc["backend"] == "neuron" and doc["device"]["backend"].startswith("cpu (compile path: torch.export, run without")
    assert caps["tokens_per_step"] == 1 and caps["async_results"] and caps["dtypes"] == ["float32"]
    assert all(v["failed"] == 0 for v in doc["summary"].values()) and doc["summary"]["contract"]["passed"] > 0
    assert not any(json.loads(p.read_text())["compiler"].endswith("; export") for p in cache.glob("*.json"))
    print(out[-1200:])
