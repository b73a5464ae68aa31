"""The suite catches broken backends, with messages that point at the fault.

Each broken backend (tests/broken_backends.py, one per row of the rule table in
docs/conformance.md) is registered in-process and run through registry mode on only
the tests meant to catch it (pytester runs pytest inside this process, so the
in-process registration is visible). The honest variants that must pass the whole
suite are in tests/test_conformance_honest.py. That every test named here passes on the
reference (so each failure is the fault's) is checked on the reference's whole-suite
run (tests/test_conformance_cli.py, CATCHING_TESTS).
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
    # The differential layer's catches run its default budget (10 programs): its draws
    # depend on the seed alone, not on what the session imported before
    # (layer_differential._draws_of_the_seed_alone, docs/conformance.md).
    rec = _run(pytester, backend, selection)
    failures = _failures(rec)
    assert test in failures, f"{backend} was not caught by {test}; failures: {sorted(failures)}"
    assert phrase in failures[test], f"{backend}: the message of {test} does not name the fault: {failures[test]}"
    if test.startswith("test_differential"):
        _assert_shows_a_short_program(backend, failures[test])


def test_the_page_pressure_catch_passes_on_the_paged_reference(pytester):
    """What catches broken_page_refusal_advances runs on engines with pages, so the
    reference's whole-suite run (contiguous) skips it: here it passes on the reference
    with pages of 16, so that catch is the fault's."""
    rec = _run(pytester, "reference", "test_programs_under_page_pressure", "--polyengine-option", "page_size=16")
    passed = [r.nodeid for r in rec.getreports("pytest_runtest_logreport") if r.passed and r.when == "call"]
    assert not _failures(rec) and any(n.endswith("test_programs_under_page_pressure") for n in passed), passed


def _assert_shows_a_short_program(backend: str, message: str) -> None:
    """The differential layer's message ends with the shrunk program that reproduces the
    failure, as protocol calls, the failing one marked."""
    assert "the program that fails, shrunk" in message, f"{backend}: no program in the message: {message}"
    program = message.split("the program that fails, shrunk", 1)[1]
    calls = [line.strip() for line in program.splitlines() if line.strip().startswith("[")]
    assert calls[0].startswith("[0] state = engine.init_decode_state()"), message
    assert any("engine.prefill(" in c or "engine.import_prefix(" in c for c in calls), message
    assert sum("<-- fails here" in c for c in calls) == 1, message
    assert len(calls) <= 20, f"{backend}: the program was not shrunk to a short one ({len(calls)} calls):\n{message}"


_ALSO = [(backend, *entry) for backend, entries in sorted(ALSO_CAUGHT_BY.items()) for entry in entries]


@pytest.mark.parametrize(("backend", "selection", "test", "phrase"), _ALSO, ids=[f"{b}-{t}" for b, _, t, _ in _ALSO])
def test_broken_backend_is_also_caught(pytester, broken_registered, backend, selection, test, phrase):
    """Faults that more than one test must catch (e.g. log-probs reported after the
    temperature, seen both by the numerics and the honesty layer)."""
    failures = _failures(_run(pytester, backend, selection))
    assert test in failures, f"{backend} was not caught by {test}; failures: {sorted(failures)}"
    assert phrase in failures[test], f"{backend}: the message of {test} does not name the fault: {failures[test]}"


def test_every_rule_row_names_a_caught_backend():
    """docs/conformance.md's rule table and CAUGHT_BY agree: every row's broken backend
    exists and every broken backend has a row."""
    import re
    from pathlib import Path

    table = (Path(__file__).resolve().parents[1] / "docs" / "conformance.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"`(broken_[a-z0-9_]+)`", table))
    assert rows == set(CAUGHT_BY), f"in the table only: {sorted(rows - set(CAUGHT_BY))}; in CAUGHT_BY only: {sorted(set(CAUGHT_BY) - rows)}"



def test_programs_under_pressure_collect_only_what_they_made():
    """The programs under page pressure run with the heap they started in frozen (each
    program's full collection then traverses only what the programs made), unfrozen
    after them, failing or not; a heap someone else froze is left as it was."""
    import gc

    from polyengine.conformance.layer_differential import _collections_of_the_programs_alone as alone

    if gc.get_freeze_count():
        pytest.skip("something in this process froze the heap before this test")
    with alone(True):
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), alone(True):
        raise RuntimeError("a program failed")
    assert gc.get_freeze_count() == 0
    with alone(False):
        assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with alone(True):
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
