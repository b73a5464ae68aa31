"""The suite accepts every correct backend: honest variants pass it whole (those that
draw the reference's very tokens leave the sampler statistics to the reference's run).

Each variant (tests/honest_backends.py, plus tests/restricted_backend.py) differs from
the reference the way a real accelerator backend does (precision, padding, row layout,
lazy results, declared features, KV ownership, donated prefixes, several tokens per
step). A failure here is the suite's own bug: a check that is too strict.
"""

from __future__ import annotations

import json

import pytest

import polyengine.conformance.suite  # noqa: F401  (kept in pytester's module snapshot)
from polyengine.conformance.layer_differential import PROGRAMS
from polyengine.conformance.models import DEFAULT_MODEL
from polyengine.plugins import register_plugin, unregister_plugin

from broken_backends import PLUGIN
from differential_report import SHAPE_CONFIGURATIONS, SHAPE_MODELS_ONLY, assert_programs_exercised
from honest_backends import BUCKET_AWARE, HONEST, SAME_DRAWS

pytest_plugins = ["pytester"]

BUCKET_CONFIGURATIONS = [p for p in PROGRAMS if p.startswith(f"{DEFAULT_MODEL}-")]

# What a variant legitimately skips: numerics in the dtypes and architectures it does not
# declare, and checks of features it does not declare (their refusal is tested elsewhere).
_EXPECTED_SKIPS = {
    "restricted": ("test_differential[",  # the configurations of the architectures it does not declare
                   "test_prefix_lifetime",  # continuations, imports, exports: no prefix_reuse, no portable_prefix
                   "test_bulk_insert_refusals", "test_override_counts_for_penalties",  # no bulk_insert, no penalties
                   "test_prefix_reuse_at_bucket_edges", "test_prefix_reuse_leaves_the_prefix",  # no prefix_reuse
                   "test_sampling_support[min_p]", "test_sampling_support[combined]", "test_sampling_support[penalties]",
                   "test_sampling_distribution[min_p]", "test_sampling_distribution[combined]",
                   "test_sampling_distribution[penalties]"),
    "honest_no_logprobs": ("test_decode_logprobs", "test_prefill_logits", "test_greedy_matches"),
}


@pytest.fixture(scope="module")
def registered():
    name = register_plugin(PLUGIN, "conformance-honest-backends")
    yield
    unregister_plugin(name)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [*sorted(HONEST), "restricted"])
def test_honest_backend_passes_the_whole_suite(pytester, registered, tmp_path, backend):
    report = tmp_path / f"{backend}.json"
    # The shape models only: a variant of the reference is honest or not whatever the
    # architecture (the reference itself runs every architecture in test_conformance_cli).
    selection = SHAPE_MODELS_ONLY
    if backend in SAME_DRAWS:  # the reference's own draws: its statistics (honest_backends.SAME_DRAWS)
        selection += " and not test_sampling_support and not test_sampling_distribution"
    configurations = SHAPE_CONFIGURATIONS
    if backend not in BUCKET_AWARE:
        # Its outputs do not depend on the prefill buckets: the bucket configurations' programs
        # would be more seeds of the very checks the standard one runs (the reference and every
        # built-in backend run them, test_conformance_cli.py; the padding variant here).
        selection += " and not (test_differential and (buckets or one_bucket))"
        configurations -= len(BUCKET_CONFIGURATIONS)
    rec = pytester.inline_run("--pyargs", "polyengine.conformance", "--polyengine-backend", backend,
                              "-p", "no:cacheprovider", "--polyengine-report-json", str(report), "-k", selection)
    failed = {}
    for rep in rec.getreports("pytest_runtest_logreport"):
        if rep.failed:
            crash = getattr(rep.longrepr, "reprcrash", None)
            failed[rep.nodeid.rsplit("::", 1)[-1]] = crash.message if crash else str(rep.longrepr)
    assert not failed, f"{backend}: the suite rejects a correct backend: {failed}"
    doc = json.loads(report.read_text())
    tests = doc["tests"]
    # test_architecture skips each architecture the backend declares (the numerics layer runs it);
    # test_page_rules, test_portable_prefix_tail_shares_pages and
    # test_programs_under_page_pressure run only on engines that declare pages, which
    # no variant does.
    allowed = ("test_prefill_logits", "test_decode_logprobs", "test_greedy_matches",
               "test_architecture", "test_page_rules", "test_portable_prefix_tail_shares_pages",
               "test_programs_under_page_pressure"
               ) + _EXPECTED_SKIPS.get(backend, ())
    unexpected = [t["id"] for t in tests if t["status"] == "skipped" and not t["id"].startswith(allowed)]
    assert not unexpected, f"{backend}: skipped beyond undeclared features: {unexpected}"
    assert sum(t["status"] == "passed" for t in tests) >= 60
    assert_programs_exercised(tests, token_masks=doc["capabilities"]["token_masks"], configurations=configurations)

