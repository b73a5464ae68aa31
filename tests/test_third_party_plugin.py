"""An out-of-tree plugin package, built in a temp dir and pip-installed without network
into its own folder, used by subprocesses: third-party discovery, selection and
every PluginError path, as a user would meet them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

GOOD = '''
import importlib.util
from polyengine import PROTOCOL_VERSION, BackendSpec, Probe, hookimpl

def create(*, model, config):
    from polyengine.backends.reference.engine import ReferenceEngine
    engine = ReferenceEngine(model, config)
    engine.name = "acme"
    return engine

@hookimpl
def polyengine_backends():
    return [
        BackendSpec(name="acme", description="ACME's CPU backend (wraps the reference)",
                    protocol_version=PROTOCOL_VERSION, probe=lambda: Probe(True, False, "cpu"),
                    factory="acme_backends.good:create", priority=80),
        BackendSpec(name="acme_gpu", description="ACME's accelerator backend",
                    protocol_version=PROTOCOL_VERSION,
                    probe=lambda: Probe(importlib.util.find_spec("acme_gpu_sdk") is not None, False,
                                        "acme_gpu_sdk is not installed"),
                    factory="acme_backends.good:create", extra="gpu", accelerator="acme"),
    ]
'''
CRASH = 'raise ImportError("acme_sdk is missing its shared library")\n'
MALFORMED = '''
from polyengine import BackendSpec, Probe, hookimpl

@hookimpl
def polyengine_backends():
    return [BackendSpec(name="acme_old", description="built for an old protocol", protocol_version="0.3",
                        probe=lambda: Probe(True), factory="acme_backends.good:create")]
'''


def _package(root: Path, dist: str, modules: dict[str, str], entry_points: dict[str, str]) -> Path:
    pkg = root / dist
    (pkg / "acme_backends").mkdir(parents=True)
    (pkg / "acme_backends" / "__init__.py").write_text("")
    for name, body in modules.items():
        (pkg / "acme_backends" / f"{name}.py").write_text(textwrap.dedent(body))
    eps = "\n".join(f'{k} = "{v}"' for k, v in entry_points.items())
    (pkg / "pyproject.toml").write_text(textwrap.dedent(f'''
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "1.2.3"

        [project.optional-dependencies]
        gpu = []

        [project.entry-points."polyengine.backends"]
        ''') + eps + "\n")
    return pkg


def _install(pkg: Path, target: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-index", "--no-deps",
         "--target", str(target), str(pkg)],
        check=True, capture_output=True, text=True,
    )
    return target


def _run(target: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(target)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def acme(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("acme")
    pkg = _package(root, "acme-backends", {"good": GOOD, "crash": CRASH, "malformed": MALFORMED},
                   {"acme": "acme_backends.good", "acme_crash": "acme_backends.crash",
                    "acme_old": "acme_backends.malformed"})
    return _install(pkg, root / "site")


def test_third_party_backends_are_listed_with_their_distribution(acme):
    proc = _run(acme, "-m", "polyengine.cli", "backends", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["reference"]["available"] and rows["reference"]["distribution"] == "polyengine"
    assert rows["acme"]["available"] and rows["acme"]["distribution"] == "acme-backends"
    assert rows["acme"]["version"] == "1.2.3" and rows["acme"]["priority"] == 80
    gpu = rows["acme_gpu"]
    assert not gpu["available"] and not gpu["broken"]
    assert gpu["reason"] == "acme_gpu_sdk is not installed"
    assert gpu["install_hint"] == "pip install 'acme-backends[gpu]'"
    crash = rows["acme_crash"]
    assert crash["broken"] and not crash["available"]
    assert "acme_crash" in crash["error"] and "acme-backends" in crash["error"] and "shared library" in crash["error"]
    old = rows["acme_old"]
    assert old["broken"] and "protocol" in old["error"] and "acme-backends" in old["error"]


def test_third_party_backend_is_selected_built_and_run(acme):
    script = textwrap.dedent('''
        import sys
        sys.path.insert(0, sys.argv[1])
        import polyengine
        from polyengine.errors import PluginError, BackendUnavailable
        from mock_engine import tiny_model
        assert polyengine.select_backend("auto").name == "acme"  # priority 80 beats cpu (60) and the reference (0)
        engine = polyengine.create_engine("acme", model=tiny_model(), max_slots=1, max_prefill_length=4, max_cache_length=8)
        prefix, first = engine.prefill(params=engine.load_params(), tokens=[1, 2], sampling=polyengine.SamplingParams(temperature=0))
        print("first", int(first.tokens[0, 0]))
        for name, err in (("acme_crash", PluginError), ("acme_old", PluginError), ("acme_gpu", BackendUnavailable)):
            try:
                polyengine.create_engine(name, model=tiny_model())
            except err as exc:
                print(name, type(exc).__name__, exc)
            else:
                raise SystemExit(name + " did not raise")
    ''')
    proc = _run(acme, "-c", script, str(Path(__file__).parent))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "first " in out
    assert "acme_crash PluginError plugin 'acme_crash' (distribution 'acme-backends')" in out
    assert "acme_old PluginError" in out and "acme_gpu BackendUnavailable" in out
    assert "pip install 'acme-backends[gpu]'" in out


def test_a_second_plugin_claiming_a_taken_name_breaks_only_that_name(tmp_path):
    pkg = _package(tmp_path, "impostor", {"good": GOOD.replace('name="acme"', 'name="reference"')},
                   {"impostor": "acme_backends.good"})
    target = _install(pkg, tmp_path / "site")
    proc = _run(target, "-m", "polyengine.cli", "backends", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["reference"]["broken"] and "'reference' is also claimed" in rows["reference"]["error"]
    assert "impostor" in rows["reference"]["error"] and "polyengine" in rows["reference"]["error"]
    assert rows["acme_gpu"]["broken"] is False  # the impostor's other backend is fine
