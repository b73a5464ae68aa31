"""Tolerance and xfail files, fixtures of subclass mode, and a plugin that stays out
of the way of every other pytest run."""

from __future__ import annotations


import pytest

from polyengine.conformance.models import MODEL_NAMES
from polyengine.conformance.suite import suite_test_names
from polyengine.conformance.tolerances import ConformanceConfigError, Tolerances
from polyengine.conformance.xfail import XfailList

from imports import assert_imports_light

pytest_plugins = ["pytester"]

TESTS = suite_test_names()


def _tol(backend=None):
    return Tolerances(backend, known_tests=TESTS, known_models=MODEL_NAMES)


def _override(**entry):
    return {"override": [{"quantity": "logits_rel_l2", "value": 1e-3, "reason": "because", **entry}]}


def test_defaults_and_their_source():
    t = _tol().get("logits_rel_l2", test="test_prefill_logits_match_reference", dtype="float32")
    assert t.value == 1e-4 and "[dtype.float32]" in t.source and "tolerances.toml" in t.source


def test_suite_per_test_override_beats_the_dtype_default():
    t = _tol().get("tie_gap", test="test_portable_prefix_roundtrip", dtype="float64")
    assert t.value == 1e-5 and t.source.startswith("suite override") and "float32" in t.reason


def test_backend_override_wins_and_the_most_specific_first():
    tol = _tol({"override": [
        {"quantity": "logits_rel_l2", "dtype": "float32", "value": 3e-4, "reason": "dtype-wide"},
        {"quantity": "logits_rel_l2", "dtype": "float32", "model": "odd_qwen2", "value": 9e-4, "reason": "odd sizes"},
    ]})
    general = tol.get("logits_rel_l2", test="test_prefill_logits_match_reference", dtype="float32", model="mha_tied")
    odd = tol.get("logits_rel_l2", test="test_prefill_logits_match_reference", dtype="float32", model="odd_qwen2")
    assert (general.value, general.reason) == (3e-4, "dtype-wide")
    assert (odd.value, odd.reason) == (9e-4, "odd sizes") and "backend override" in odd.source
    assert tol.get("logits_rel_l2", test="x", dtype="float64").value == 1e-9  # other dtypes untouched


@pytest.mark.parametrize("entry, message", [
    ({"reason": ""}, "has no reason"),
    ({"reason": None}, "has no reason"),
    ({"quantity": "speed"}, "unknown quantity"),
    ({"test": "test_nonexistent"}, "is not a test of this suite"),
    ({"model": "gpt5"}, "is not a test model"),
    ({"value": -1}, "positive number"),
    ({"colour": "red"}, "unknown key"),
])
def test_malformed_overrides_are_refused(entry, message):
    data = _override(**entry)
    if entry.get("reason", "x") is None:
        del data["override"][0]["reason"]
    with pytest.raises(ConformanceConfigError, match=message):
        _tol(data)


def test_a_backend_file_holds_only_overrides(tmp_path):
    path = tmp_path / "tol.toml"
    path.write_text("[dtype.float32]\nlogits_rel_l2 = 1\n")
    with pytest.raises(ConformanceConfigError, match="only \\[\\[override\\]\\]"):
        _tol(path)
    path.write_text("[[override]]\nquantity = 'tie_gap'\nvalue = 0.1\n")
    with pytest.raises(ConformanceConfigError, match="no reason") as err:
        _tol(path)
    assert str(path) in str(err.value)


def test_unknown_dtype_needs_backend_overrides():
    with pytest.raises(ConformanceConfigError, match="no default tolerance for dtype 'int4'"):
        _tol().get("logits_rel_l2", test="x", dtype="int4")


def test_xfail_file_rules():
    xf = XfailList.load({"xfail": {"test_slot_isolation": "known", "test_dtype[float16]": "later"}})
    assert xf.reason_for("test_slot_isolation") == "known"
    assert xf.reason_for("test_dtype[float16]") == "later" and xf.reason_for("test_dtype[float32]") is None
    xf.check_against(["test_slot_isolation", "test_dtype[float16]", "test_dtype[float32]"])
    with pytest.raises(ConformanceConfigError, match="match no test"):
        xf.check_against(["test_slot_isolation"])
    with pytest.raises(ConformanceConfigError, match="has no reason"):
        XfailList.load({"xfail": {"test_slot_isolation": ""}})


_SUBCLASS = """
import pytest
from polyengine.conformance import BackendConformance
from broken_backends import ForgetsFreeEngine
from polyengine.backends.reference.engine import ReferenceEngine

class TestMine(BackendConformance):
    @pytest.fixture
    def engine_factory(self):
        return lambda model, config: {engine}(model, config)

    @pytest.fixture
    def conformance_xfail(self):
        return {xfail!r}

    @pytest.fixture
    def conformance_tolerances(self):
        return {tolerances!r}
"""


def _subclass(pytester, engine="ReferenceEngine", xfail=None, tolerances=None, select="test_free_resource_then_reuse"):
    pytester.makepyfile(test_mine=_SUBCLASS.format(engine=engine, xfail=xfail, tolerances=tolerances))
    return pytester.inline_run("-p", "no:cacheprovider", "-k", select)


def test_strict_xfail_of_a_known_failure(pytester):
    rec = _subclass(pytester, "ForgetsFreeEngine", {"xfail": {"test_free_resource_then_reuse": "free is a no-op"}})
    (rep,) = [r for r in rec.getreports("pytest_runtest_logreport") if r.when == "call"]
    assert rep.skipped and "free is a no-op" in rep.wasxfail


def test_xfail_entry_of_a_passing_test_fails_the_run(pytester):
    rec = _subclass(pytester, xfail={"xfail": {"test_free_resource_then_reuse": "stale"}})
    passed, skipped, failed = rec.listoutcomes()
    assert len(failed) == 1 and "XPASS(strict)" in str(failed[0].longrepr)


def test_xfail_entry_matching_no_test_is_an_error(pytester):
    rec = _subclass(pytester, xfail={"xfail": {"test_frobnicate": "typo"}})
    (rep,) = [r for r in rec.getreports("pytest_runtest_logreport") if r.when == "setup"]
    assert rep.failed and "'test_frobnicate'" in str(rep.longrepr) and "match no test" in str(rep.longrepr)


def test_tolerance_override_without_reason_is_an_error(pytester):
    rec = _subclass(pytester, tolerances={"override": [{"quantity": "tie_gap", "value": 1.0}]})
    (rep,) = [r for r in rec.getreports("pytest_runtest_logreport") if r.when == "setup"]
    assert rep.failed and "has no reason" in str(rep.longrepr)


def test_registry_mode_needs_a_backend(pytester):
    result = pytester.runpytest("--pyargs", "polyengine.conformance", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*pass --polyengine-backend NAME*installed: *reference*"])


def test_plugin_is_inert_in_other_test_runs(pytester):
    pytester.makepyfile(test_plain="def test_one():\n    assert 1\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "polyengine conformance" not in result.stdout.str()
    help_text = pytester.runpytest("--help").stdout.str()
    assert "--polyengine-backend" in help_text and "--polyengine-report-json" in help_text


def test_plugin_imports_nothing_of_the_suite():
    assert_imports_light("import polyengine.conformance.pytest_plugin", heavy=(
        "torch", "jax", "scipy", "polyengine.conformance.suite", "polyengine.backends.reference.engine",
        "polyengine.driver"))


def test_layers_select_with_k(pytester):
    rec = pytester.inline_run("--pyargs", "polyengine.conformance", "--polyengine-backend", "reference",
                              "-k", "layer_surface", "-p", "no:cacheprovider")
    passed, skipped, failed = rec.listoutcomes()
    assert len(passed) == 4 and not failed


def test_layers_run_in_order(pytester):
    rec = pytester.inline_run("--pyargs", "polyengine.conformance", "--polyengine-backend", "reference",
                              "--collect-only", "-p", "no:cacheprovider")
    from polyengine.conformance import LAYER_ATTR, LAYERS

    items = rec.getcalls("pytest_collection_finish")[0].session.items
    ranks = [LAYERS.index(getattr(it.function, LAYER_ATTR)) for it in items]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(LAYERS)


def test_near_tie_divergence_is_reported_not_failed(pytester, tmp_path):
    """With tie_gap overridden to cover any margin, a backend that leaves the
    reference's stream passes, and the divergence appears in the report and the summary."""
    import json

    report = tmp_path / "r.json"
    pytester.makepyfile(test_mine=_SUBCLASS.format(
        engine="GlobalStream", xfail=None,
        tolerances={"override": [{"quantity": "tie_gap", "test": "test_seeded_stream_matches_reference",
                                  "value": 1e9, "reason": "exercise the near-tie path"}]},
    ).replace("from broken_backends import ForgetsFreeEngine", "from broken_backends import GlobalStreamEngine as GlobalStream"))
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", "test_seeded_stream_matches_reference",
                                "--polyengine-report-json", str(report))
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*reported, not failed (*", "*test_seeded_stream_matches_reference: seed*near tie*"])
    (test,) = json.loads(report.read_text())["tests"]
    assert test["notes"] and test["tolerances"]["tie_gap"]["reason"] == "exercise the near-tie path"


def test_suite_test_ids_are_the_collected_ids(pytester):
    """The xfail file is checked against suite_test_ids(): they must be pytest's ids."""
    from polyengine.conformance.suite import suite_test_ids

    rec = pytester.inline_run("--pyargs", "polyengine.conformance", "--polyengine-backend", "reference",
                              "--collect-only", "-p", "no:cacheprovider")
    items = rec.getcalls("pytest_collection_finish")[0].session.items
    assert sorted(it.name for it in items) == sorted(suite_test_ids())


def test_xfail_check_ignores_what_this_run_selected(pytester):
    rec = _subclass(pytester, "ForgetsFreeEngine", {"xfail": {"test_free_resource_then_reuse": "no-op free",
                                                              "test_dtype[float16]": "not collected in this run"}})
    (rep,) = [r for r in rec.getreports("pytest_runtest_logreport") if r.when == "call"]
    assert rep.skipped and rep.wasxfail


def test_params_cache_is_not_fooled_by_a_reused_engine_id():
    """The harness caches load_params() per engine; a freed engine's id can be reused by
    the next one, which must then get its own weights, not the stale entry's."""
    from polyengine.conformance.harness import Harness
    from polyengine.conformance.suite import suite_test_names

    class Eng:
        def __init__(self, tag):
            self.tag = tag

        def load_params(self):
            return f"params of {self.tag}"

    harness = Harness(lambda **kw: None, test_names=suite_test_names())
    old, new = Eng("old"), Eng("new")
    assert harness.params(old) == "params of old"
    harness._params[id(new)] = harness._params.pop(id(old))  # what id reuse looks like
    assert harness.params(new) == "params of new"


# -- the suite environment ([[suite_environment]], docs/conformance.md "Suite environment") --

def _env_file(tmp_path, text):
    path = tmp_path / "backend.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_suite_environment_entries_and_how_they_meet_the_users_values(tmp_path):
    from polyengine.conformance.tolerances import suite_environment

    env = suite_environment(_env_file(tmp_path, """
[[suite_environment]]
name = "A_SETTING"
value = "1"
reason = "compile less"
[[suite_environment]]
name = "SOME_FLAGS"
value = "--fast=true"
append = true
reason = "compile faster"
"""))
    plain, flags = env
    assert (plain.name, plain.value, plain.append) == ("A_SETTING", "1", False)
    assert plain.apply(None) == "1" and plain.apply("") == "1" and plain.apply("0") == "0"  # the user's value wins
    assert flags.apply(None) == "--fast=true"
    assert flags.apply("--other=2") == "--other=2 --fast=true"
    assert flags.apply("--other=2 --fast=false") == "--other=2 --fast=false"  # the user chose this flag already
    # a tolerance file with the table is still a valid tolerance file
    Tolerances(_env_file(tmp_path, '[[suite_environment]]\nname = "X"\nvalue = "1"\nreason = "r"\n'),
               known_tests=suite_test_names(), known_models=MODEL_NAMES)


@pytest.mark.parametrize("entry, message", [
    ('name = "X"\nvalue = "1"', "has no reason"),
    ('name = "not a name"\nvalue = "1"\nreason = "r"', "environment variable's name"),
    ('name = "X"\nvalue = ""\nreason = "r"', "non-empty string"),
    ('name = "X"\nvalue = 1\nreason = "r"', "non-empty string"),
    ('name = "X"\nvalue = "1"\nreason = "r"\nappend = "yes"', "append must be"),
    ('name = "X"\nvalue = "1"\nreason = "r"\nwhen = "always"', "unknown key"),
])
def test_malformed_suite_environment_is_refused(tmp_path, entry, message):
    from polyengine.conformance.tolerances import suite_environment

    with pytest.raises(ConformanceConfigError, match=message):
        suite_environment(_env_file(tmp_path, f"[[suite_environment]]\n{entry}\n"))
    with pytest.raises(ConformanceConfigError, match="declared twice"):
        suite_environment(_env_file(tmp_path, '[[suite_environment]]\nname = "X"\nvalue = "1"\nreason = "r"\n' * 2))


def test_runner_starts_a_child_only_for_a_declared_environment_not_in_effect(monkeypatch):
    from polyengine.conformance import cli
    from polyengine.plugins import select_backend

    monkeypatch.delenv("JAX_DISABLE_MOST_OPTIMIZATIONS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert cli.environment_changes(select_backend("reference")) == {}
    assert cli.environment_changes(select_backend("tpu_jax")) == {
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_cpu_use_fusion_emitters=false"}
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false")
    assert cli.environment_changes(select_backend("tpu_jax")) == {}


@pytest.mark.parametrize("child_code, runs_here", [(1, False), (-6, True), (134, True)])
def test_runner_runs_here_without_the_environment_when_the_child_dies(monkeypatch, capsys, child_code, runs_here):
    """A child killed by a signal (XLA aborts on a flag it does not know) or ending with a
    code pytest never gives is run again here without the environment; a pytest exit code
    (a failed test) is the answer."""
    from polyengine.conformance import cli

    calls = []
    monkeypatch.delenv(cli._CHILD, raising=False)
    monkeypatch.delenv("JAX_DISABLE_MOST_OPTIMIZATIONS", raising=False)
    monkeypatch.setattr(cli, "_run_child", lambda name, changes, **kw: calls.append(("child", changes)) or child_code)
    monkeypatch.setattr(cli, "_run_here", lambda name, **kw: calls.append(("here", kw["options"])) or 0)
    code = cli.run_backend("tpu_jax", options=("page_size=16",))
    assert calls[0][0] == "child" and calls[0][1]["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"
    assert (calls[1:] == [("here", ("page_size=16",))]) is runs_here
    assert code == (0 if runs_here else child_code)
    err = capsys.readouterr().err
    assert ("running the suite again without it" in err) is runs_here
    if child_code == -6:
        assert "signal SIGABRT" in err
    calls.clear()
    assert cli.run_backend("tpu_jax", suite_environment="none") == 0 and calls == [("here", ())]
    monkeypatch.setenv(cli._CHILD, "1")  # a child never starts another
    calls.clear()
    assert cli.run_backend("tpu_jax") == 0 and calls == [("here", ())]
