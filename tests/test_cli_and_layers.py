"""The CLI's listing and the core's layer rule (no torch, jax or ray in the core)."""

from __future__ import annotations

import json
import subprocess
import sys

import polyengine
from polyengine.cli import main

HEAVY = ("torch", "jax", "ray", "torchax")


def _modules_after(code: str) -> list[str]:
    probe = f"""
import sys
{code}
print("HEAVY:", *[m for m in {HEAVY!r} if m in sys.modules])
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1].split()[1:]


def test_importing_the_core_imports_no_framework():
    code = (
        "import polyengine, polyengine.driver, polyengine.models, polyengine.sampling, "
        "polyengine.tools, polyengine.prefix, polyengine.plugins, polyengine.cli"
    )
    assert _modules_after(code) == []


def test_listing_backends_imports_no_framework():
    assert _modules_after("from polyengine.cli import main; main(['backends', '--json'])") == []


def test_running_the_reference_backend_imports_no_framework():
    code = (
        "import polyengine\n"
        "llm = polyengine.LLM('random:tiny', backend='reference', max_slots=1, max_prefill_length=8, max_cache_length=16)\n"
        "llm.generate([[1, 2, 3]], polyengine.SamplingParams(max_tokens=2, seed=0))"
    )
    assert _modules_after(code) == []


def test_core_sources_never_name_a_framework_or_the_shared_torch_package():
    """A static check beside the import probes above: no module of the core imports
    torch (or jax/ray) or the torch backends' shared package, even lazily."""
    import pathlib
    import re

    core = pathlib.Path(polyengine.__file__).parent
    pattern = re.compile(r"^\s*(from|import)\s+(torch|jax|ray|torchax)\b|torch_common", re.M)
    offenders = [str(p.relative_to(core)) for p in core.rglob("*.py") if pattern.search(p.read_text(encoding="utf-8"))]
    assert offenders == []


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
    code = (
        "import sys\nfrom polyengine.cli import build_parser\nbuild_parser()\n"
        "print('SUITE:', 'polyengine.conformance.suite' in sys.modules, 'pytest' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "SUITE: False False"


def test_backends_lists_what_the_allowlist_excludes():
    env = {**__import__("os").environ, "POLYENGINE_BACKENDS": "nothing_else"}
    out = subprocess.run([sys.executable, "-m", "polyengine.cli", "backends", "--json"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    ref = {r["name"]: r for r in json.loads(out.stdout)}["reference"]
    assert ref["excluded"] is True and ref["available"] is False and "POLYENGINE_BACKENDS" in ref["reason"]
    table = subprocess.run([sys.executable, "-m", "polyengine.cli", "backends"], capture_output=True, text=True, env=env)
    assert "excluded" in table.stdout
