"""``polyengine conformance --backend NAME|all [--report-json PATH] [-k EXPR]``.

Runs the same tests as ``pytest --pyargs polyengine.conformance --polyengine-backend
NAME`` (it is that command, run in-process with an empty pytest configuration so the
current project's ini file and options do not leak in). With ``--backend all`` it
runs every installed backend that can run here, one after the other, then prints a
backend x test scoreboard in Markdown (written next to the JSON report as
``<name>.scoreboard.md`` when ``--report-json`` is given; the JSON then holds one
report per backend under ``runs``). A backend that declares option sets
(``[[conformance_options]]`` in its tolerance file) runs once without options and once
per set with ``--option-sets declared``, each a column of the scoreboard; ``--option
KEY=VALUE`` runs one set of the user's instead.

A backend whose tolerance file declares a suite environment (``[[suite_environment]]``:
compile settings that suit the suite's tiny models, e.g. tpu_jax's XLA flags) runs in a
child process with it, where the variables are not set that way already (the user's own
values win); ``--suite-environment none`` runs it as the environment is. A child that dies
without a pytest exit code (XLA aborts on a flag its jaxlib does not know) is run again
here without it, and the runner says so.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from polyengine.errors import InvalidRequest, PolyengineError
from polyengine.files import check_writable, write_report

__all__ = ["add_command", "run_backend", "scoreboard"]

_CELL = {"passed": "pass", "failed": "**FAIL**", "xfailed": "xfail", "skipped": "skip"}


def add_command(sub: Any) -> None:
    p = sub.add_parser(
        "conformance",
        help="run the conformance suite on a backend (or on all of them)",
        description="Run the conformance suite (layers: surface, contract, numerics, sampler, honesty, differential) "
                    "on a registered backend. Same tests as `pytest --pyargs polyengine.conformance "
                    "--polyengine-backend NAME`.",
    )
    p.add_argument("--backend", required=True, help="a backend name (see `polyengine backends`) or 'all'")
    p.add_argument("--report-json", metavar="PATH", default=None, help="write the JSON report here")
    p.add_argument("-k", dest="keyword", metavar="EXPR", default=None,
                   help="run only tests matching the pytest -k expression (layers match layer_<name>, e.g. layer_contract)")
    p.add_argument("--differential-examples", metavar="N", type=int, default=None,
                   help="random programs per configuration in the differential layer (default 10): more to look longer")
    p.add_argument("--differential-seed", metavar="SEED", type=int, default=None,
                   help="the differential layer's seed: another one draws other programs")
    p.add_argument("--option", metavar="KEY=VALUE", action="append", default=None,
                   help="run with this engine option (repeatable: one option set; the value is read as TOML, else a "
                        "string); instead of the backend's declared option sets")
    p.add_argument("--option-sets", choices=("declared", "none"), default="none",
                   help="'declared': after the run without options, one run per option set the backend declares "
                        "([[conformance_options]] in its tolerance file); 'none' (default): the run without options only")
    p.add_argument("--suite-environment", choices=("declared", "none"), default="declared",
                   help="'declared' (default): run a backend that declares a suite environment ([[suite_environment]] "
                        "in its tolerance file, e.g. tpu_jax's XLA compile flags for tiny models) in a child process "
                        "with it; 'none': run it with the environment as it is")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per test, and skip reasons")
    p.set_defaults(func=_cmd_conformance)


# Set in a child the runner starts with a backend's suite environment: it never starts another.
_CHILD = "POLYENGINE_CONFORMANCE_SUITE_ENVIRONMENT"


def environment_changes(info: Any) -> dict[str, str]:
    """The variables to set for ``info``'s suite (its ``[[suite_environment]]``) that the
    environment does not hold already, with their values."""
    from polyengine.conformance.tolerances import suite_environment

    changes = {}
    for var in suite_environment(info.spec.tolerances):
        value = var.apply(os.environ.get(var.name))
        if value != os.environ.get(var.name):
            changes[var.name] = value
    return changes


def run_backend(name: str, *, report_json: str | Path | None = None, keyword: str | None = None,
                exitfirst: bool = False, verbose: bool = False, differential_examples: int | None = None,
                differential_seed: int | None = None, options: Sequence[str] = (),
                suite_environment: str = "declared") -> int:
    """Run the suite on one registered backend (``options``: ``KEY=VALUE`` engine options
    of this run), in this process, or in a child with the backend's suite environment
    (``suite_environment="declared"``, where it is not in effect); return pytest's exit
    code."""
    from polyengine.plugins import select_backend

    info = select_backend(name)  # an unknown or unusable backend: say why before pytest starts
    if report_json:
        check_writable(report_json, what="JSON report", error=InvalidRequest)
    kwargs = {"report_json": report_json, "keyword": keyword, "exitfirst": exitfirst, "verbose": verbose,
              "differential_examples": differential_examples, "differential_seed": differential_seed,
              "options": options}
    changes = environment_changes(info) if suite_environment == "declared" and not os.environ.get(_CHILD) else {}
    if changes:
        code = _run_child(name, changes, **kwargs)
        if 0 <= code <= 5:  # pytest's exit codes
            return code
        how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"exit code {code}"
        print(f"polyengine conformance: the suite's process for {name} ended by {how} before it finished, with "
              f"{_shown(changes)}: taken as that environment not working on this installation; running the suite "
              f"again without it (--suite-environment none)", file=sys.stderr, flush=True)
    return _run_here(name, **kwargs)


def _shown(changes: dict[str, str]) -> str:
    return " ".join(f"{k}={v!r}" if " " in v else f"{k}={v}" for k, v in changes.items())


def _run_child(name: str, changes: dict[str, str], **kwargs: Any) -> int:
    """The suite in a child pytest process with ``changes`` added to the environment."""
    print(f"polyengine conformance: {name}'s suite runs in a child process with {_shown(changes)} (the backend's "
          f"declared suite environment; --suite-environment none runs it without)", flush=True)
    return _pytest(name, changes, **kwargs)


def _run_here(name: str, **kwargs: Any) -> int:
    return _pytest(name, None, **kwargs)


def _pytest(name: str, changes: dict[str, str] | None, *, report_json: str | Path | None, keyword: str | None,
            exitfirst: bool, verbose: bool, differential_examples: int | None, differential_seed: int | None,
            options: Sequence[str]) -> int:
    """``pytest --pyargs polyengine.conformance`` on ``name`` with an empty configuration:
    in this process, or (``changes``) in a child with that environment."""
    import polyengine.conformance as pkg

    package_dir = Path(pkg.__file__).resolve().parent
    with tempfile.TemporaryDirectory(prefix="polyengine-conformance-") as tmp:
        ini = Path(tmp) / "pytest.ini"
        ini.write_text("[pytest]\n", encoding="utf-8")
        args = [
            "--pyargs", "polyengine.conformance",
            "--polyengine-backend", name,
            "-c", str(ini), "--rootdir", tmp, "--confcutdir", str(package_dir),
            "-p", "polyengine_conformance", "-p", "no:cacheprovider",
            "--tb=short", "-v" if verbose else "-q", "-rfEs" if verbose else "-rfE",
            # A second run in one process (--backend all) finds the suite imported already.
            "-W", "ignore::pytest.PytestAssertRewriteWarning",
        ]
        if report_json:
            args += ["--polyengine-report-json", str(Path(report_json).resolve())]
        if keyword:
            args += ["-k", keyword]
        if exitfirst:
            args.append("-x")
        if differential_examples is not None:
            args += ["--polyengine-differential-examples", str(differential_examples)]
        if differential_seed is not None:
            args += ["--polyengine-differential-seed", str(differential_seed)]
        for option in options:
            args += ["--polyengine-option", option]
        if changes:
            return subprocess.run([sys.executable, "-m", "pytest", *args],
                                  env={**os.environ, **changes, _CHILD: "1"}).returncode
        import pytest

        return int(pytest.main(args))


def _check_deps() -> None:
    """The suite runs on pytest and hypothesis, which a plain install lacks: name the
    extra that brings them instead of failing on the first import."""
    import importlib.util

    missing = [m for m in ("pytest", "hypothesis") if importlib.util.find_spec(m) is None]
    if missing:
        raise PolyengineError(f"`polyengine conformance` needs {' and '.join(missing)}; fix: "
                              f"pip install 'polyengine[conformance]'")


def _cmd_conformance(args: argparse.Namespace) -> int:
    from polyengine.plugins import select_backend

    _check_deps()
    if args.backend == "all":
        return _run_all(args)
    runs = option_runs(select_backend(args.backend), args)
    if len(runs) == 1:
        return run_backend(args.backend, report_json=args.report_json, keyword=args.keyword,
                           exitfirst=args.exitfirst, verbose=args.verbose, options=runs[0],
                           suite_environment=args.suite_environment, **_differential(args))
    return _run_all(args, only=args.backend)


def option_runs(info: Any, args: argparse.Namespace) -> list[tuple[str, ...]]:
    """The runs of one backend, each its ``KEY=VALUE`` options: ``--option``'s set alone,
    else the run without options, then (``--option-sets declared``) one per set the
    backend declares."""
    from polyengine.conformance.tolerances import option_sets

    if args.option:
        return [tuple(args.option)]
    runs: list[tuple[str, ...]] = [()]
    if args.option_sets == "declared":
        for s in option_sets(info.spec.tolerances):
            runs.append(tuple(f"{k}={_toml_value(v)}" for k, v in s.options))
    return runs


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def _differential(args: argparse.Namespace) -> dict[str, Any]:
    return {"differential_examples": args.differential_examples, "differential_seed": args.differential_seed}


def _run_all(args: argparse.Namespace, only: str | None = None) -> int:
    from polyengine.conformance import SUITE_VERSION
    from polyengine.plugins import list_backends

    if args.report_json:
        check_writable(args.report_json, what="JSON report", error=InvalidRequest)
    reports: list[dict[str, Any]] = []
    not_run: list[tuple[str, str]] = []
    worst = 0
    with tempfile.TemporaryDirectory(prefix="polyengine-conformance-all-") as tmp:
        for info in list_backends():
            if only is not None and info.name != only:
                continue
            if info.broken:
                not_run.append((info.name, f"broken: {info.error}"))
                worst = max(worst, 1)
                continue
            probe = info.probe()
            if not probe.available:
                not_run.append((info.name, f"unavailable: {probe.reason}"))
                continue
            for n, options in enumerate(option_runs(info, args)):
                path = Path(tmp) / f"{info.name}.{n}.json"
                shown = "".join(f" --option {o}" for o in options)
                print(f"\n### polyengine conformance --backend {info.name}{shown}", flush=True)
                code = run_backend(info.name, report_json=path, keyword=args.keyword, exitfirst=args.exitfirst,
                                   verbose=args.verbose, options=options, suite_environment=args.suite_environment,
                                   **_differential(args))
                worst = max(worst, 0 if code == 0 else 1)
                if path.is_file():
                    reports.append(json.loads(path.read_text(encoding="utf-8")))
                else:
                    not_run.append((info.name + shown, f"the run ended before any test finished (pytest exit code {code})"))
    board = scoreboard(reports, not_run)
    print("\n" + board)
    if args.report_json:
        doc = {"suite_version": SUITE_VERSION, "runs": reports,
               "not_run": [{"backend": n, "why": why} for n, why in not_run]}
        out = write_report(args.report_json, json.dumps(doc, indent=2, default=str) + "\n", what="JSON report")
        md = write_report(out.with_name(out.stem + ".scoreboard.md"), board + "\n", what="scoreboard")
        print(f"JSON report: {out}\nscoreboard: {md}")
    if not reports:
        print("polyengine conformance: no backend could run here", file=sys.stderr)
        return 1
    return worst


def _options_label(report: dict[str, Any]) -> str:
    options = (report.get("options") or {}).get("options")
    return f" [{', '.join(f'{k}={v}' for k, v in options.items())}]" if options else ""


def scoreboard(reports: list[dict[str, Any]], not_run: list[tuple[str, str]] = ()) -> str:
    """A Markdown table: one row per test (in suite order), one column per backend."""
    names = [(r.get("backend") or r.get("test_class")) + _options_label(r) for r in reports]
    rows: dict[str, dict[str, Any]] = {}
    for name, report in zip(names, reports):
        for t in report["tests"]:
            row = rows.setdefault(t["id"], {"layer": t["layer"]})
            row[name] = t["status"]
    lines = [
        "| test | layer | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for test_id, row in rows.items():
        cells = [_CELL.get(row.get(n), "-") for n in names]
        lines.append(f"| `{test_id}` | {row['layer']} | " + " | ".join(cells) + " |")
    from polyengine.conformance import LAYERS

    for layer in LAYERS:  # per layer, per backend and option set: the rules that passed of those that ran
        cells = []
        for report in reports:
            c = report["summary"].get(layer, {})
            ran = c.get("passed", 0) + c.get("failed", 0) + c.get("xfailed", 0)
            cells.append(f"{c.get('passed', 0)}/{ran}" if ran else "-")
        lines.append(f"| **layer {layer}** (passed/ran) | {layer} | " + " | ".join(cells) + " |")
    totals = []
    for name, report in zip(names, reports):
        counts = {s: sum(layer[s] for layer in report["summary"].values()) for s in _CELL}
        totals.append(f"{counts['passed']} pass, {counts['failed']} fail, {counts['xfailed']} xfail, {counts['skipped']} skip")
    lines.append("| **total** | | " + " | ".join(totals) + " |")
    for name, why in not_run:
        lines.append(f"\nnot run: `{name}`: {why}")
    return "\n".join(lines)
