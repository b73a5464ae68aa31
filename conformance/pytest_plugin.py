"""The conformance suite's pytest plugin (entry point ``pytest11: polyengine_conformance``).

It loads in every pytest run of an environment that has polyengine installed, so it
imports nothing beyond pytest and the standard library, adds only ``--polyengine-*``
options, and does nothing unless those options are given or conformance tests are
collected. Then it:

* collects the registry-mode module (``from_registry.py``) when its folder is
  collected with ``--polyengine-backend`` (``pytest --pyargs polyengine.conformance``);
* at collection, fails with a usage error naming a required fixture a
  ``BackendConformance`` subclass lacks, or a backend the registry cannot provide;
* orders the suite's tests by layer (surface, contract, numerics, sampler, honesty,
  differential)
  so the first failure explains the rest, and lets ``-k layer_<name>`` select a layer;
* passes the differential layer its budget (``--polyengine-differential-examples``,
  ``--polyengine-differential-seed``);
* records each test's layer, status, duration, tolerances and measured errors, prints
  a table per layer, and writes the JSON report (``--polyengine-report-json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from polyengine.conformance import LAYER_ATTR, LAYERS, SUITE_VERSION

REGISTRY_MODULE = Path(__file__).resolve().with_name("from_registry.py")
REGISTRY_CLASS = "TestRegisteredBackend"
STATUSES = ("passed", "failed", "xfailed", "skipped")


class SuiteState:
    """Everything the plugin and the suite share during one pytest session."""

    def __init__(self) -> None:
        self.tests: dict[str, tuple[str, str, str]] = {}  # node id -> (test id, layer, class node id)
        self.harnesses: dict[str, Any] = {}  # class node id -> Harness, or the error that stopped it
        self.results: dict[str, dict[str, Any]] = {}  # node id -> report entry
        self.registry_backend: Any = None  # BackendInfo in registry mode
        self.report_path: Path | None = None

    # Registered as a plugin object per session (pytest_configure), so results go to
    # this session's state even when pytest runs nested inside another pytest.
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.nodeid not in self.tests:
            return
        test_id, layer, cls = self.tests[report.nodeid]
        entry = self.results.setdefault(
            report.nodeid, {"id": test_id, "layer": layer, "status": "passed", "duration": 0.0, "_class": cls}
        )
        entry["duration"] = round(entry["duration"] + report.duration, 4)
        if report.failed:
            if entry["status"] != "failed":  # an XPASS(strict) arrives here too
                entry["status"] = "failed"
                entry["message"] = _message(report)
        elif report.skipped and entry["status"] == "passed":
            if hasattr(report, "wasxfail"):
                entry["status"], entry["xfail_reason"] = "xfailed", report.wasxfail
            else:
                entry["status"], entry["reason"] = "skipped", _skip_reason(report)
        for key, value in report.user_properties:
            if key == "polyengine":
                for k in ("tolerances", "notes", "statistics"):
                    if value.get(k):
                        entry[k] = value[k]


_STATE = pytest.StashKey[SuiteState]()


def suite_state(config: pytest.Config) -> SuiteState:
    if _STATE not in config.stash:
        raise RuntimeError(
            "the polyengine conformance pytest plugin is not loaded (PYTEST_DISABLE_PLUGIN_AUTOLOAD?); "
            "run pytest with -p polyengine_conformance"
        )
    return config.stash[_STATE]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("polyengine", "polyengine conformance suite")
    group.addoption(
        "--polyengine-backend", metavar="NAME", default=None,
        help="run the conformance suite (pytest --pyargs polyengine.conformance) on this registered backend",
    )
    group.addoption(
        "--polyengine-report-json", metavar="PATH", default=None,
        help="write the conformance report (per test: layer, status, tolerance, measured error) as JSON",
    )
    group.addoption(
        "--polyengine-differential-examples", metavar="N", type=int, default=None,
        help="random programs per configuration in the differential layer (default 10): more to look longer",
    )
    group.addoption(
        "--polyengine-option", metavar="KEY=VALUE", action="append", default=None,
        help="build every engine of the run with this engine option (repeatable; the value is read as TOML, else a "
             "string); judged under the backend's [[conformance_options]] set with exactly these options, if any",
    )
    group.addoption(
        "--polyengine-differential-seed", metavar="SEED", type=int, default=None,
        help="the differential layer's seed (default: the suite's, reported in the JSON report): others draw other programs",
    )


def pytest_configure(config: pytest.Config) -> None:
    state = SuiteState()
    path = config.getoption("polyengine_report_json")
    if path:  # a report that could not be written must fail now, not after the run
        from polyengine.files import check_writable

        check_writable(path, what="JSON report", error=pytest.UsageError)
    state.report_path = Path(path) if path else None
    config.stash[_STATE] = state
    config.pluginmanager.register(state, "polyengine-conformance-state")


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    if file_path.name != REGISTRY_MODULE.name or file_path.resolve() != REGISTRY_MODULE:
        return None
    session = parent.session
    if session.isinitpath(file_path):
        return None  # named on the command line: pytest's own collector takes it
    # A sweep over the installed package (or a checkout) must not run the suite by
    # accident; it runs when asked for a backend or when its folder is named.
    if parent.config.getoption("polyengine_backend") is None and not session.isinitpath(file_path.parent):
        return None
    return pytest.Module.from_parent(parent, path=file_path)


def _layer_of(item: pytest.Item) -> str | None:
    return getattr(getattr(item, "function", None), LAYER_ATTR, None)


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection, so a missing fixture is named whatever runs
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [(i, it) for i, it in enumerate(items) if _layer_of(it)]
    if not ours:
        return
    state = suite_state(config)
    missing: dict[str, list[str]] = {}
    from polyengine.conformance.suite import REQUIRED_FIXTURES

    for _, it in ours:
        cls = it.getparent(pytest.Class)
        key = cls.nodeid if cls is not None else it.nodeid
        layer = _layer_of(it)
        state.tests[it.nodeid] = (it.name, layer, key)
        it.extra_keyword_matches.add(f"layer_{layer}")
        defs = getattr(getattr(it, "_fixtureinfo", None), "name2fixturedefs", None)
        if defs is not None:
            for name in REQUIRED_FIXTURES:
                if name not in defs:
                    missing.setdefault(name, [])
                    if key not in missing[name]:
                        missing[name].append(key)
    if missing:
        lines = [
            f"{', '.join(classes)} subclass{'es' if len(classes) > 1 else ''} BackendConformance but no fixture "
            f"{name!r} is defined for {'them' if len(classes) > 1 else 'it'}; define it in the class or a conftest.py "
            f"(it returns factory(model=Model, config=EngineConfig) -> Engine; see docs/conformance.md)"
            for name, classes in missing.items()
        ]
        raise pytest.UsageError("polyengine conformance: " + "; ".join(lines))
    if any(cls.endswith(f"::{REGISTRY_CLASS}") for _, _, cls in state.tests.values()):
        state.registry_backend = _resolve_backend(config)
    # Layer order within each class; classes keep their collection order.
    first_seen: dict[str, int] = {}
    for i, it in ours:
        first_seen.setdefault(state.tests[it.nodeid][2], i)
    ordered = sorted(
        (it for _, it in ours),
        key=lambda it: (first_seen[state.tests[it.nodeid][2]], LAYERS.index(state.tests[it.nodeid][1])),
    )
    for (i, _), it in zip(ours, ordered):
        items[i] = it


def _resolve_backend(config: pytest.Config):
    name = config.getoption("polyengine_backend")
    from polyengine.errors import PolyengineError
    from polyengine.plugins import list_backends, select_backend

    if not name:
        names = ", ".join(b.name for b in list_backends()) or "none installed"
        raise pytest.UsageError(
            f"polyengine conformance: pass --polyengine-backend NAME to choose the backend to test "
            f"(installed: {names})"
        )
    try:
        return select_backend(name)
    except PolyengineError as exc:
        raise pytest.UsageError(f"polyengine conformance: {exc}") from None


def registered_backend(config: pytest.Config):
    """The BackendInfo of ``--polyengine-backend`` (registry mode)."""
    state = suite_state(config)
    if state.registry_backend is None:
        state.registry_backend = _resolve_backend(config)
    return state.registry_backend


# -- results ---------------------------------------------------------------------------------


def _message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def build_reports(state: SuiteState) -> list[dict[str, Any]]:
    """One report per backend (test class) that ran."""
    from polyengine.conformance.harness import SEEDS

    by_class: dict[str, list[dict[str, Any]]] = {}
    for entry in state.results.values():
        by_class.setdefault(entry["_class"], []).append({k: v for k, v in entry.items() if k != "_class"})
    reports = []
    for cls, tests in by_class.items():
        harness = state.harnesses.get(cls)
        backend: dict[str, Any] = {}
        if cls.endswith(f"::{REGISTRY_CLASS}") and state.registry_backend is not None:
            info = state.registry_backend
            backend = {"name": info.name, "distribution": info.distribution, "version": info.version, "plugin": info.plugin}
        if harness is not None and not isinstance(harness, Exception):
            described = harness.describe()
            backend = {**described, **{k: v for k, v in backend.items() if v is not None}}
        elif isinstance(harness, Exception):
            backend["error"] = f"{type(harness).__name__}: {harness}"
        summary = {layer: dict.fromkeys(STATUSES, 0) for layer in LAYERS}
        for t in tests:
            summary[t["layer"]][t["status"]] += 1
        environment = {}
        if cls.endswith(f"::{REGISTRY_CLASS}") and state.registry_backend is not None:
            environment = _declared_environment(state.registry_backend)
        reports.append({
            "suite_version": SUITE_VERSION,
            "test_class": cls,
            "backend": backend.get("name"),
            "distribution": backend.get("distribution"),
            "version": backend.get("version"),
            "device": backend.get("device"),
            "capabilities": backend.get("capabilities"),
            "options": backend.get("options"),
            "seeds": backend.get("seeds", dict(SEEDS)),
            "backend_details": {k: v for k, v in backend.items()
                                if k not in ("name", "distribution", "version", "device", "capabilities", "seeds", "options")},
            "summary": summary,
            # The backend's declared suite environment ([[suite_environment]]): each variable's value in this run.
            "environment": environment,
            "duration": round(sum(t["duration"] for t in tests), 3),
            "tests": tests,
        })
    return reports


def _declared_environment(info: Any) -> dict[str, str | None]:
    import os

    from polyengine.conformance.tolerances import ConformanceConfigError, suite_environment

    try:
        return {var.name: os.environ.get(var.name) for var in suite_environment(info.spec.tolerances)}
    except ConformanceConfigError:  # the suite's own checks report a malformed file
        return {}


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    """Registry mode: name a declared suite environment this process lacks (the runner,
    ``polyengine conformance``, sets it; a plain pytest run does not)."""
    if not config.getoption("polyengine_backend", None):
        return None
    try:
        info = registered_backend(config)
        from polyengine.conformance.cli import environment_changes

        changes = environment_changes(info)
    except Exception:  # a usage error is reported at collection, with its reason
        return None
    if not changes:
        return None
    shown = " ".join(f"{k}={v!r}" for k, v in changes.items())
    return [f"polyengine: {info.name} declares a suite environment this process lacks ({shown}); "
            f"`polyengine conformance --backend {info.name}` sets it (docs/conformance.md, \"Suite environment\")"]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = session.config.stash.get(_STATE, None)
    if state is None or state.report_path is None or not state.results:
        return
    reports = build_reports(state)
    doc = reports[0] if len(reports) == 1 else {"suite_version": SUITE_VERSION, "runs": reports}
    from polyengine.files import write_report

    state.report_path = write_report(state.report_path, json.dumps(doc, indent=2, default=str) + "\n",
                                     what="JSON report")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is None or not state.results:
        return
    tr = terminalreporter
    for report in build_reports(state):
        name = report["backend"] or report["test_class"]
        dist = f" ({report['distribution']} {report['version']})" if report["distribution"] else ""
        if (report.get("options") or {}).get("options"):
            dist += f" with options {report['options']['options']}"
        tr.write_sep("=", f"polyengine conformance: {name}{dist}")
        for line in format_table(report["summary"]):
            tr.write_line(line)
        skipped = sum(c["skipped"] for c in report["summary"].values())
        if skipped:
            tr.write_line(f"{skipped} skipped: they did not run and are not passes (reasons: pytest -rs, or the JSON report)")
        notes = [(t["id"], n) for t in report["tests"] for n in t.get("notes", [])]
        if notes:
            tr.write_line(f"reported, not failed ({len(notes)}):")
            for test_id, note in notes:
                tr.write_line(f"  {test_id}: {note}")
        tr.write_line(f"time in tests: {report['duration']:.1f} s")
    if state.report_path is not None:
        tr.write_line(f"JSON report: {state.report_path}")


def format_table(summary: dict[str, dict[str, int]]) -> list[str]:
    """The per-layer table (passed / failed / xfailed / skipped), skips in their own column."""
    head = f"{'layer':<12}" + "".join(f"{s:>9}" for s in STATUSES)
    rows = [head]
    totals = dict.fromkeys(STATUSES, 0)
    for layer in LAYERS:
        counts = summary.get(layer, {})
        for s in STATUSES:
            totals[s] += counts.get(s, 0)
        rows.append(f"{layer:<12}" + "".join(f"{counts.get(s, 0):>9}" for s in STATUSES))
    rows.append(f"{'total':<12}" + "".join(f"{totals[s]:>9}" for s in STATUSES))
    return rows
