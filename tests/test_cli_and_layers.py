"""The CLI's listing and the layer rules: no torch, jax or ray in the core, backends that
import only the core, their own package and shared packages, and no import cycle
between the core's modules."""

from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys

import polyengine
from polyengine.cli import main

from imports import assert_imports_light

def test_importing_the_core_imports_no_framework():
    assert_imports_light(
        "import polyengine, polyengine.driver, polyengine.models, polyengine.sampling, "
        "polyengine.tools, polyengine.prefix, polyengine.plugins, polyengine.cli"
    )


def test_listing_backends_imports_no_framework():
    assert_imports_light("from polyengine.cli import main; main(['backends', '--json'])")


def test_running_the_reference_backend_imports_no_framework():
    assert_imports_light(
        "import polyengine\n"
        "llm = polyengine.LLM('random:tiny', backend='reference', max_slots=1, max_prefill_length=8, max_cache_length=16)\n"
        "llm.generate([[1, 2, 3]], polyengine.SamplingParams(max_tokens=2, seed=0))"
    )


def test_core_sources_never_name_a_framework_or_the_shared_torch_package():
    """A static check beside the import probes above: no module of the core imports
    torch (or jax/ray) or the torch backends' shared package, even lazily."""
    core = pathlib.Path(polyengine.__file__).parent
    pattern = re.compile(r"^\s*(from|import)\s+(torch|jax|ray|torchax)\b|torch_common", re.M)
    offenders = [str(p.relative_to(core)) for p in core.rglob("*.py") if pattern.search(p.read_text(encoding="utf-8"))]
    assert offenders == []


def _imports(path: pathlib.Path) -> list[str]:
    """The modules a file imports (module level and inside functions), not counting
    imports under ``if TYPE_CHECKING:``, which never run."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body for n in ast.walk(child)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_backends_import_only_the_core_their_own_package_and_shared_packages():
    """The layer rule: a backend never imports another backend (shared code lives in a
    package under backends/ that registers no backend, i.e. has no plugin.py), and the
    core, the suite, the server and the bench never import a backend's modules except
    through the plugin registry."""
    root = pathlib.Path(__file__).resolve().parents[1]
    backends = root / "backends"
    registered = {d.name for d in backends.iterdir() if (d / "plugin.py").exists()}
    shared = {d.name for d in backends.iterdir() if d.is_dir() and (d / "__init__.py").exists()} - registered
    assert "torch_common" in shared and {"reference", "cpu", "cuda_torch", "tpu_jax", "neuron"} <= registered
    offenders = []
    for folder in backends.iterdir():
        for path in folder.rglob("*.py") if folder.is_dir() else ():
            for name in _imports(path):
                parts = name.split(".")
                if parts[:2] == ["polyengine", "backends"] and len(parts) > 2:
                    other = parts[2]
                    if other != folder.name and other not in shared:
                        offenders.append(f"{path.relative_to(root)} imports {name}")
    for top in ("core", "conformance", "serving", "benchmarks"):
        for path in (root / top).rglob("*.py"):
            for name in _imports(path):
                parts = name.split(".")
                if parts[:2] == ["polyengine", "backends"] and len(parts) > 2 and parts[2] != "reference":
                    offenders.append(f"{path.relative_to(root)} imports {name}")
    assert offenders == [], "\n".join(offenders)


def test_the_cores_modules_and_packages_import_no_cycle():
    """Between the core's modules and subpackages (a subpackage counted as one node:
    its own modules may defer imports of each other), no import cycle, lazy imports
    included. The loader and the tool machine once imported the plugins facade, whose
    engine construction imports the models package back."""
    core = pathlib.Path(polyengine.__file__).parent

    def node(module: str) -> str | None:
        parts = module.split(".")
        if parts[0] != "polyengine" or len(parts) == 1 or parts[1] in ("backends", "conformance", "serving", "benchmarks"):
            return None
        return parts[1]

    edges: dict[str, set[str]] = {}
    for path in core.rglob("*.py"):
        rel = path.relative_to(core).parts
        here = rel[0].removesuffix(".py")
        if here == "__init__":
            continue  # the package root re-exports lazily
        for name in _imports(path):
            there = node(name)
            if there and there != here:
                edges.setdefault(here, set()).add(there)

    def cycle_from(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            at, path = stack.pop()
            for nxt in sorted(edges.get(at, ())):
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    cycles = {" -> ".join(c) for c in (cycle_from(n) for n in edges) if c}
    assert not cycles, cycles


def test_version_flag(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert polyengine.__version__ in capsys.readouterr().out


def test_backends_json_has_the_documented_fields(capsys):
    assert main(["backends", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    ref = {r["name"]: r for r in rows}["reference"]
    assert {"name", "available", "accelerator", "reason", "install_hint", "distribution", "priority", "broken"} <= set(ref)
    assert ref["available"] is True and ref["broken"] is False


def test_backends_verbose_says_what_each_backend_would_run(capsys, monkeypatch):
    """--verbose asks each available backend's diagnose; a backend without one, or whose
    diagnose fails, is reported as such and the others still answer."""
    from polyengine import BackendSpec, Probe, hookimpl, register_plugin
    from polyengine.plugins import reset_registry

    class Quiet:
        @hookimpl
        def polyengine_backends(self):
            ok = lambda: Probe(True, False, "always")  # noqa: E731
            return [BackendSpec(name="silent_one", description="no diagnose", protocol_version=polyengine.PROTOCOL_VERSION,
                                probe=ok, factory="x.y:z"),
                    BackendSpec(name="failing_one", description="a broken diagnose",
                                protocol_version=polyengine.PROTOCOL_VERSION, probe=ok, factory="x.y:z",
                                diagnose=lambda: 1 / 0)]

    monkeypatch.setenv("POLYENGINE_BACKENDS", "reference,silent_one,failing_one")
    reset_registry()
    register_plugin(Quiet(), "quiet")
    try:
        assert main(["backends", "--verbose", "--json"]) == 0
        rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
        assert rows["reference"]["paths"]["compute"].startswith("NumPy")
        assert "no diagnose" in rows["silent_one"]["paths"]["paths"]
        assert rows["failing_one"]["paths"] == {"error": "diagnose raised ZeroDivisionError: division by zero"}
        assert main(["backends", "--verbose"]) == 0
        out = capsys.readouterr().out
        assert "\nreference:\n  device: cpu\n  compute: NumPy" in out
    finally:
        reset_registry()


def test_backends_table(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "reference" in out and "available" in out


def test_the_core_cli_does_not_import_the_conformance_suite():
    """Commands outside the core register through the polyengine.commands entry points;
    building the parser loads only their small add_command modules."""
    assert_imports_light("from polyengine.cli import build_parser\nbuild_parser()",
                         heavy=("polyengine.conformance.suite", "pytest"))


def test_backends_lists_what_the_allowlist_excludes():
    env = {**__import__("os").environ, "POLYENGINE_BACKENDS": "nothing_else"}
    out = subprocess.run([sys.executable, "-m", "polyengine.cli", "backends", "--json"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    ref = {r["name"]: r for r in json.loads(out.stdout)}["reference"]
    assert ref["excluded"] is True and ref["available"] is False and "POLYENGINE_BACKENDS" in ref["reason"]
    table = subprocess.run([sys.executable, "-m", "polyengine.cli", "backends"], capture_output=True, text=True, env=env)
    assert "excluded" in table.stdout
