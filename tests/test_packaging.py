"""Every backend folder is packaged and registered, and hardware markers skip with a reason."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
pytest_plugins = ["pytester"]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_every_backend_folder_is_packaged_and_registered():
    """A backends/<name>/ folder with a plugin.py must be a package of the distribution
    (packages + package-dir) and registered in the polyengine.backends entry points; a
    folder without one (shared code) must still be packaged. backends/README.md says how."""
    data = _pyproject()
    setup = data["tool"]["setuptools"]
    packages, dirs = set(setup["packages"]), setup["package-dir"]
    entry_points = data["project"]["entry-points"]["polyengine.backends"]
    problems = []
    for folder in sorted(p for p in (ROOT / "backends").iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        package = f"polyengine.backends.{folder.name}"
        if package not in packages:
            problems.append(f"{package} is not in [tool.setuptools] packages")
        if dirs.get(package) != f"backends/{folder.name}":
            problems.append(f"{package} has no package-dir entry 'backends/{folder.name}'")
        if (folder / "plugin.py").exists() and f"{package}.plugin" not in entry_points.values():
            problems.append(f"backends/{folder.name}/plugin.py is not registered in [project.entry-points.\"polyengine.backends\"]")
        if not (folder / "plugin.py").exists() and any(v.startswith(package + ".") for v in entry_points.values()):
            problems.append(f"{package} registers an entry point but has no plugin.py")
    for name, target in entry_points.items():
        module = target.split(":")[0]
        folder = ROOT / "backends" / module.split(".")[2] if module.startswith("polyengine.backends.") else None
        if folder is not None and not (folder / "plugin.py").exists():
            problems.append(f"entry point {name} = {target} names a module that does not exist")
    assert not problems, "; ".join(problems)


def test_extras_ship_with_their_backends():
    """An extra exists only beside the backend (or command) it installs."""
    extras = set(_pyproject()["project"]["optional-dependencies"])
    backends = {p.name for p in (ROOT / "backends").iterdir() if (p / "plugin.py").exists()}
    known = {"test", "all", "serve", "conformance"} | {"cuda" if b == "cuda_torch" else "tpu" if b == "tpu_jax" else b for b in backends}
    assert extras <= known, f"extras without their backend: {sorted(extras - known)}"


@pytest.mark.gpu
def test_gpu_marker_skips_without_a_gpu():
    from conftest import hardware_present

    assert hardware_present("gpu")  # reached only where a GPU is present


def test_hardware_markers_say_why(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text(encoding="utf-8"))
    pytester.makepyfile("""
        import pytest

        @pytest.mark.neuron
        def test_needs_neuron():
            pass
    """)
    from conftest import hardware_present

    result = pytester.runpytest("-rs", "-p", "no:cacheprovider")
    if hardware_present("neuron"):
        result.assert_outcomes(passed=1)
    else:
        result.assert_outcomes(skipped=1)
        result.stdout.fnmatch_lines(["*needs hardware marker 'neuron'*no Neuron device here*"])
