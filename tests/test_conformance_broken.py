"""The suite catches broken backends, with messages that point at the fault.

Each broken backend (tests/broken_backends.py) is registered in-process and run
through registry mode on only the tests meant to catch it (pytester runs pytest
inside this process, so the in-process registration is visible). A correct backend
that declares little (tests/restricted_backend.py) must pass the layers where
undeclared features are tested for refusal.
"""

from __future__ import annotations

import pytest

# Imported here so pytester's module snapshot keeps them (and their caches) between runs.
import polyengine.conformance.suite  # noqa: F401
from polyengine.plugins import register_plugin, unregister_plugin

from broken_backends import ALSO_CAUGHT_BY, CAUGHT_BY, PLUGIN

pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def broken_registered():
    name = register_plugin(PLUGIN, "conformance-broken-backends")
    yield
    unregister_plugin(name)


def _run(pytester, backend: str, selection: str, *extra: str):
    return pytester.inline_run(
        "--pyargs", "polyengine.conformance", "--polyengine-backend", backend,
        "-k", selection, "-p", "no:cacheprovider", *extra,
    )


def _failures(rec) -> dict[str, str]:
    out = {}
    for rep in rec.getreports("pytest_runtest_logreport"):
        if rep.failed:
            crash = getattr(rep.longrepr, "reprcrash", None)
            out[rep.nodeid.rsplit("::", 1)[-1]] = crash.message if crash else str(rep.longrepr)
    return out


@pytest.mark.parametrize("backend", sorted(CAUGHT_BY))
def test_broken_backend_is_caught(pytester, broken_registered, backend):
    selection, test, phrase = CAUGHT_BY[backend]
    rec = _run(pytester, backend, selection)
    failures = _failures(rec)
    assert test in failures, f"{backend} was not caught by {test}; failures: {sorted(failures)}"
    assert phrase in failures[test], f"{backend}: the message of {test} does not name the fault: {failures[test]}"


_ALSO = [(backend, *entry) for backend, entries in sorted(ALSO_CAUGHT_BY.items()) for entry in entries]


@pytest.mark.parametrize(("backend", "selection", "test", "phrase"), _ALSO, ids=[f"{b}-{t}" for b, _, t, _ in _ALSO])
def test_broken_backend_is_also_caught(pytester, broken_registered, backend, selection, test, phrase):
    """Faults that more than one test must catch (e.g. log-probs reported after the
    temperature, seen both by the numerics and the honesty layer)."""
    failures = _failures(_run(pytester, backend, selection))
    assert test in failures, f"{backend} was not caught by {test}; failures: {sorted(failures)}"
    assert phrase in failures[test], f"{backend}: the message of {test} does not name the fault: {failures[test]}"


def test_reference_passes_what_catches_the_broken_ones(pytester):
    """The same selections pass on the reference: the failures above are the faults'."""
    selections = [sel for sel, _, _ in CAUGHT_BY.values()] + [sel for _, sel, _, _ in _ALSO]
    selection = " or ".join(f"({sel})" for sel in selections)
    rec = _run(pytester, "reference", selection)
    assert _failures(rec) == {}
    passed, skipped, failed = rec.listoutcomes()
    assert len(passed) >= len(CAUGHT_BY)


def test_restricted_backend_passes_with_refusals_tested(pytester, broken_registered, tmp_path):
    """Undeclared capabilities are tested for refusal (they pass, not skip)."""
    report = tmp_path / "restricted.json"
    rec = _run(pytester, "restricted",
               "layer_honesty or bulk_insert or prefix_reuse or portable or layer_surface",
               "--polyengine-report-json", str(report))
    assert _failures(rec) == {}
    import json

    tests = {t["id"]: t for t in json.loads(report.read_text())["tests"]}
    for refused in ("test_bulk_insert_independent_first_tokens", "test_prefix_reuse", "test_portable_prefix_roundtrip",
                    "test_sampling_parameter[repetition_penalty]", "test_sampling_parameter[min_p]",
                    "test_top_logprobs_limit", "test_dtype[float64]", "test_dtype[bfloat16]"):
        assert tests[refused]["status"] == "passed", (refused, tests[refused])
