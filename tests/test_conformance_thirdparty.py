"""A third-party backend package, installed without network into its own folder, runs
the suite through both ways in: the registry (`polyengine conformance` and `pytest
--pyargs polyengine.conformance`) and subclass mode (a test file in its own repo).

The package's engine is tests/thirdparty_engine.py, written only against the kit
(EngineBase, the protocol types, the core sampler): it passes the whole suite, and its
twin that skips one refusal fails it with a message naming the refusal. The package
ships a tolerance override file. It is installed
with `pip --target` into a temporary folder used only by subprocesses (PYTHONPATH), so
it never joins this process's plugin discovery (pip offline needs --no-build-isolation --no-index --no-deps). The runs are
limited with -k to a few fast tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent
SELECTION = "layer_surface or test_bulk_insert or (test_prefill_logits_match_reference and mha_tied)"

PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "polyengine-thirdparty"
version = "0.3.0"
description = "A third-party polyengine backend (conformance test fixture)"
requires-python = ">=3.10"

[project.entry-points."polyengine.backends"]
thirdparty = "pe_thirdparty.plugin"

[tool.setuptools]
packages = ["pe_thirdparty"]

[tool.setuptools.package-data]
pe_thirdparty = ["*.toml"]
"""

PLUGIN = """\
from polyengine import PROTOCOL_VERSION
from polyengine.plugins import BackendSpec, Probe, hookimpl


@hookimpl
def polyengine_backends():
    return [
        BackendSpec(
            name="thirdparty",
            description="A third-party NumPy float32 backend built on EngineBase alone.",
            protocol_version=PROTOCOL_VERSION,
            probe=lambda: Probe(True, False, "CPU"),
            factory="pe_thirdparty.engine:create_engine",
            tolerances="pe_thirdparty:conformance.toml",
            xfail="pe_thirdparty:xfail.toml",
        ),
        BackendSpec(
            name="thirdparty_lax",
            description="The same backend, skipping one refusal (unknown options).",
            protocol_version=PROTOCOL_VERSION,
            probe=lambda: Probe(True, False, "CPU"),
            factory="pe_thirdparty.engine:create_lax_engine",
        ),
    ]
"""

TOLERANCES = """\
[[override]]
quantity = "logits_rel_l2"
dtype = "float32"
value = 2e-4
reason = "this backend sums attention in a different order (an example override for the suite's own test)"
"""

XFAIL = """\
# No known failures; entries look like "test id" = "reason".
[xfail]
"""

SUBCLASS_TEST = """\
import pytest

from polyengine.conformance import BackendConformance


class TestThirdParty(BackendConformance):
    @pytest.fixture
    def engine_factory(self):
        from pe_thirdparty.engine import create_engine
        return create_engine

    @pytest.fixture
    def conformance_tolerances(self):
        return "pe_thirdparty:conformance.toml"
"""


@pytest.fixture(scope="module")
def thirdparty(tmp_path_factory):
    root = tmp_path_factory.mktemp("thirdparty")
    src = root / "src"
    pkg = src / "pe_thirdparty"
    (src / "tests").mkdir(parents=True)
    pkg.mkdir()
    (src / "pyproject.toml").write_text(PYPROJECT)
    (pkg / "__init__.py").write_text('"""A third-party polyengine backend."""\n')
    (pkg / "engine.py").write_text((HERE / "thirdparty_engine.py").read_text())
    (pkg / "plugin.py").write_text(PLUGIN)
    (pkg / "conformance.toml").write_text(TOLERANCES)
    (pkg / "xfail.toml").write_text(XFAIL)
    (src / "tests" / "test_conformance.py").write_text(SUBCLASS_TEST)
    target = root / "site"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-index", "--no-deps",
         "--target", str(target), str(src)],
        capture_output=True, text=True, cwd=root,
    )
    assert pip.returncode == 0, (
        f"installing the throwaway backend package failed (it needs setuptools>=70.1, from the [test] "
        f"extra, in this environment):\n{pip.stdout}{pip.stderr}"
    )
    # The installed copy is what the subprocesses import; the source tree only keeps the tests.
    shutil.rmtree(pkg)
    env = {**os.environ, "PYTHONPATH": str(target), "PYTEST_ADDOPTS": ""}
    return root, src, env


def _run(cmd, env, cwd):
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("polyengine")
    return [str(script)] if script.exists() else [sys.executable, "-m", "polyengine.cli"]


def test_registry_cli_runs_the_whole_suite_on_the_installed_backend(thirdparty):
    """A backend built on EngineBase and the docs alone passes the whole suite."""
    root, _, env = thirdparty
    report = root / "cli.json"
    code, out = _run([*_cli(), "conformance", "--backend", "thirdparty", "--report-json", str(report)], env, root)
    assert code == 0, out
    doc = json.loads(report.read_text())
    assert (doc["backend"], doc["distribution"], doc["version"]) == ("thirdparty", "polyengine-thirdparty", "0.3.0")
    tests = {t["id"]: t for t in doc["tests"]}
    logits = tests["test_prefill_logits_match_reference[mha_tied-float32]"]
    assert logits["status"] == "passed"
    tol = logits["tolerances"]["logits_rel_l2"]
    assert tol["value"] == 2e-4 and "pe_thirdparty:conformance.toml" in tol["source"] and tol["reason"]
    assert tests["test_prefill_logits_match_reference[mha_tied-float64]"]["status"] == "skipped"
    # bulk_insert, portable prefixes, prefix reuse are not declared: their refusals are tested, and pass
    for refused in ("test_bulk_insert_independent_first_tokens", "test_portable_prefix_roundtrip", "test_prefix_reuse",
                    "test_config_refusals", "test_dtype[float64]"):
        assert tests[refused]["status"] == "passed", (refused, tests[refused])
    assert sum(t["status"] == "failed" for t in doc["tests"]) == 0
    assert "polyengine conformance: thirdparty" in out


def test_a_backend_that_skips_a_refusal_fails_naming_it(thirdparty):
    root, _, env = thirdparty
    code, out = _run([*_cli(), "conformance", "--backend", "thirdparty_lax", "-k", "test_config_refusals"], env, root)
    assert code != 0, out
    assert "test_config_refusals" in out and "an unknown option" in out and "it must refuse it" in out, out


def test_registry_pytest_pyargs_runs_the_installed_backend(thirdparty):
    root, _, env = thirdparty
    code, out = _run([sys.executable, "-m", "pytest", "--pyargs", "polyengine.conformance",
                      "--polyengine-backend", "thirdparty", "-k", SELECTION, "-p", "no:cacheprovider"], env, root)
    assert code == 0, out
    assert "polyengine conformance: thirdparty" in out and " failed" not in out.split("=====")[-1]


def test_subclass_mode_in_the_backends_own_repo(thirdparty):
    root, src, env = thirdparty
    report = root / "subclass.json"
    code, out = _run([sys.executable, "-m", "pytest", "tests", "-k", SELECTION, "-p", "no:cacheprovider",
                      "--polyengine-report-json", str(report)], env, src)
    assert code == 0, out
    doc = json.loads(report.read_text())
    assert doc["test_class"].endswith("test_conformance.py::TestThirdParty")
    assert (doc["backend"], doc["distribution"]) == ("thirdparty", "polyengine-thirdparty")
    assert doc["summary"]["surface"]["passed"] == 4


def test_subclass_mode_without_engine_factory_fails_at_collection(pytester):
    pytester.makepyfile(test_mine=textwrap.dedent("""
        from polyengine.conformance import BackendConformance

        class TestMine(BackendConformance):
            pass
    """))
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*TestMine*no fixture 'engine_factory'*"])

