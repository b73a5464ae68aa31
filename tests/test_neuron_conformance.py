"""The conformance suite on the neuron backend's CPU compile path, run exactly as CI
documents it: ``polyengine conformance --backend neuron`` in its own process, with the
default options, so plain decoding (one token per step) and asynchronous results are
what the suite exercises (speculation has its own tests in test_neuron_engine.py).

It runs first among the neuron tests (file order) and fills the session's artifact
cache (tests/neuron_support.py), which the engine tests then load from. A process of
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
    assert doc["backend"] == "neuron" and doc["device"]["backend"].startswith("cpu (compile path")
    assert caps["tokens_per_step"] == 1 and caps["async_results"] and caps["dtypes"] == ["float32"]
    assert all(v["failed"] == 0 for v in doc["summary"].values()) and doc["summary"]["contract"]["passed"] > 0
    kinds = {json.loads(p.read_text())["kind"] for p in cache.glob("*.json")}
    assert {"context", "token_generation"} <= kinds
    print(out[-1200:])
