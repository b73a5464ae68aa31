"""Option sets: a backend declares the engine options worth checking
(``[[conformance_options]]``), the runner passes ``--option``, and the suite judges each
run under the set's tolerances (exactly where it is lossless). Each broken backend of
tests/broken_options.py passes the selection without options and is caught in its
option set's run."""

from __future__ import annotations

import argparse

import pytest

import polyengine.conformance.suite  # noqa: F401  (kept in pytester's module snapshot)
from polyengine.conformance.cli import option_runs
from polyengine.conformance.models import MODEL_NAMES
from polyengine.conformance.suite import suite_test_names
from polyengine.conformance.tolerances import ConformanceConfigError, Tolerances, option_sets, parse_option
from polyengine.plugins import select_backend

from broken_options import OPTION_BROKEN, OPTION_HONEST

pytest_plugins = ["pytester"]

SUBCLASS = """
import pytest
from polyengine.conformance import BackendConformance
from broken_options import TOLERANCES, create_engine_for


class TestOptioned(BackendConformance):
    @pytest.fixture
    def engine_factory(self):
        return create_engine_for({name!r})

    @pytest.fixture
    def conformance_tolerances(self):
        return TOLERANCES
"""


def _failures(rec) -> dict[str, str]:
    out = {}
    for rep in rec.getreports("pytest_runtest_logreport"):
        if rep.failed:
            crash = getattr(rep.longrepr, "reprcrash", None)
            out[rep.nodeid.rsplit("::", 1)[-1]] = crash.message if crash else str(rep.longrepr)
    return out


@pytest.mark.parametrize("backend", sorted(OPTION_BROKEN))
def test_option_fault_is_caught_in_its_option_set(pytester, backend):
    _, option, selection, test, phrase = OPTION_BROKEN[backend]
    path = pytester.makepyfile(**{f"test_{backend}": SUBCLASS.format(name=backend)})
    plain = _failures(pytester.inline_run(str(path), "-k", selection, "-p", "no:cacheprovider"))
    assert plain == {}, f"{backend} fails without its option: {plain}"
    failures = _failures(pytester.inline_run(str(path), "-k", selection, "-p", "no:cacheprovider",
                                             "--polyengine-option", option))
    assert test in failures, f"{backend} with --polyengine-option {option} was not caught by {test}: {sorted(failures)}"
    assert phrase in failures[test], f"{backend}: the message does not name the fault: {failures[test]}"


def _tolerances(data):
    return Tolerances(data, known_tests=suite_test_names(), known_models=MODEL_NAMES)


@pytest.mark.parametrize("backend", sorted(OPTION_HONEST))
def test_a_lossy_option_within_its_declared_tolerances_passes(pytester, backend):
    """The masked greedy prefill of test_edges (the mask word at the vocabulary's end)
    excuses another allowed id within the run's tie_gap, as the greedy streams do."""
    _, option, selection = OPTION_HONEST[backend]
    path = pytester.makepyfile(**{f"test_{backend}": SUBCLASS.format(name=backend)})
    rec = pytester.inline_run(str(path), "-k", selection, "-p", "no:cacheprovider", "--polyengine-option", option)
    assert _failures(rec) == {}
    assert [r for r in rec.getreports("pytest_runtest_logreport") if r.when == "call" and r.passed]


def test_every_declared_option_set_is_on_the_docs_page():
    """docs/conformance.md names each option set a built-in backend declares (as the
    sorted ``k=v,k=v`` of its label), so the page's list and scoreboard follow the files."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "conformance.md").read_text(encoding="utf-8")
    for name in ("cpu", "cuda_torch", "neuron", "tpu_jax"):
        for s in option_sets(select_backend(name).spec.tolerances):
            label = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in s.options)
            assert f"`{label}`" in page, f"{name}'s option set {label} is not on docs/conformance.md"


def test_option_sets_are_checked_when_read():
    good = {"options": {"quantize": "int8"}, "reason": "int8 weights", "tolerances": {"logits_rel_l2": 0.05}}
    for entry, says in [
        ({**good, "reason": ""}, "has no reason"),
        ({**good, "options": {}}, "non-empty table"),
        ({**good, "tolerances": {}}, "declares the tolerances"),
        ({**good, "lossless": True}, "drop its tolerances"),
        ({**good, "tolerances": {"logit_rel": 0.1}}, "unknown quantity"),
        ({**good, "tolerances": {"logits_rel_l2": -1}}, "positive number"),
        ({**good, "speed": 1}, "unknown key"),
    ]:
        with pytest.raises(ConformanceConfigError, match=says):
            _tolerances({"conformance_options": [entry]})
    with pytest.raises(ConformanceConfigError, match="declared twice"):
        _tolerances({"conformance_options": [good, good]})


def test_an_option_set_floors_the_tolerances_of_its_run():
    tol = _tolerances({"conformance_options": [
        {"options": {"quantize": "int8"}, "reason": "int8 weights", "tolerances": {"logits_rel_l2": 0.05}}]})
    assert tol.use_options({"quantize": "int8"}).lossless is False
    got = tol.get("logits_rel_l2", test="test_prefill_logits_match_reference", dtype="float32")
    assert got.value == 0.05 and "option set [quantize=int8]" in got.source
    assert tol.get("tie_gap", test="test_differential", dtype="float32").value == 1e-3  # not declared: as usual
    assert tol.get("logits_rel_l2", test="test_differential", dtype="bfloat16").value == 5e-2  # a floor, never tighter
    undeclared = tol.use_options({"quantize": "int8-block32"})
    assert undeclared.lossless and "--option" in undeclared.origin
    assert tol.get("logits_rel_l2", test="test_differential", dtype="float32").value == 1e-4
    assert tol.use_options({}) is None


def test_options_declared_in_parts_are_judged_as_their_composition():
    """``--option kv_dtype=bfloat16 --option page_size=16``: no entry declares the two
    together, but each is declared: the run is judged lossy under the lossy part's
    tolerances (each the largest of any part), not as lossless; options some part does
    not cover keep the lossless default with its note."""
    tol = _tolerances({"conformance_options": [
        {"options": {"page_size": 16}, "lossless": True, "reason": "pages"},
        {"options": {"kv_dtype": "bfloat16"}, "reason": "bf16 K/V", "tolerances": {"kv_rel_l2": 0.01, "logits_rel_l2": 0.04}},
        {"options": {"weight_dtype": "bfloat16"}, "reason": "bf16 weights", "tolerances": {"kv_rel_l2": 0.02}},
    ]})
    both = tol.use_options({"kv_dtype": "bfloat16", "page_size": 16})
    assert not both.lossless and both.origin == "composed of [page_size=16] + [kv_dtype=bfloat16]"
    assert tol.get("kv_rel_l2", test="test_portable_prefix_roundtrip", dtype="float32").value == 0.01
    three = tol.use_options({"kv_dtype": "bfloat16", "weight_dtype": "bfloat16", "page_size": 16})
    assert dict(three.tolerances) == {"kv_rel_l2": 0.02, "logits_rel_l2": 0.04}
    assert tol.use_options({"page_size": 16}).lossless
    partial = tol.use_options({"kv_dtype": "bfloat16", "page_size": 8})  # page_size=8 is declared by nobody
    assert partial.lossless and "--option" in partial.origin
    assert tol.get("kv_rel_l2", test="test_portable_prefix_roundtrip", dtype="float32").value == 1e-4


def test_runner_options_and_declared_sets():
    assert parse_option("quantize=int8") == ("quantize", "int8")
    assert parse_option("speculation=3") == ("speculation", 3)
    assert parse_option("async_steps=false") == ("async_steps", False)
    assert parse_option("seq_buckets=[8, 16]") == ("seq_buckets", (8, 16))
    with pytest.raises(ConformanceConfigError, match="KEY=VALUE"):
        parse_option("int8")
    assert option_runs(select_backend("cuda_torch"), argparse.Namespace(option=None, option_sets="none")) == [()]
    args = argparse.Namespace(option=None, option_sets="declared")
    for name in ("cpu", "cuda_torch", "neuron", "tpu_jax"):
        info = select_backend(name)
        declared = option_sets(info.spec.tolerances)
        assert declared, f"{name} declares no option set"
        runs = option_runs(info, args)
        assert runs[0] == () and len(runs) == len(declared) + 1
        assert [dict(parse_option(o) for o in run) for run in runs[1:]] == [s.as_dict() for s in declared]
    assert option_runs(select_backend("reference"), args) == [()]
    assert option_runs(select_backend("cuda_torch"), argparse.Namespace(option=["quantize=int8"], option_sets="declared")) \
        == [("quantize=int8",)]


QUANT_ONLY = """
import pytest
from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.conformance import BackendConformance
from polyengine.engine import Option
from polyengine.errors import UnsupportedFeature


class QuantOnly(ReferenceEngine):
    OPTIONS = {"blocks_only": Option(False, "an option for a model's quantized blocks only")}

    def __init__(self, model, config):
        if config.options.get("blocks_only") and all(r.format in ("F32", "F16", "BF16")
                                                     for r in model.records.values()):
            raise UnsupportedFeature("blocks_only=True", "quant_only", "the model has no block weights")
        super().__init__(model, config)


class TestQuantOnly(BackendConformance):
    @pytest.fixture
    def engine_factory(self):
        return lambda model, config: QuantOnly(model, config)

    @pytest.fixture
    def conformance_tolerances(self):
        return {"conformance_options": [{"options": {"blocks_only": True}, "lossless": True,
                                         "reason": "the same computation"}]}
"""


def test_an_option_set_the_default_model_refuses(pytester):
    """An option only a quantized model takes: the surface layer and the capabilities
    read quant_mixed's engine, the default model's tests skip, quant_mixed's pass."""
    path = pytester.makepyfile(test_quant_only=QUANT_ONLY)
    rec = pytester.inline_run(str(path), "-k", "test_engine_attributes or test_capabilities_well_formed or "
                              "test_result_shapes or test_differential", "-p", "no:cacheprovider",
                              "--polyengine-option", "blocks_only=true")
    assert _failures(rec) == {}
    passed = {r.nodeid.rsplit("::", 1)[-1] for r in rec.getreports("pytest_runtest_logreport")
              if r.when == "call" and r.passed}
    assert {"test_engine_attributes", "test_capabilities_well_formed", "test_differential[quant_mixed]"} <= passed
    skipped = {r.nodeid.rsplit("::", 1)[-1] for r in rec.getreports("pytest_runtest_logreport") if r.skipped}
    assert "test_differential[mha_tied]" in skipped
