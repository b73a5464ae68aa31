"""Every backend folder is packaged and registered, the wheel carries every file the code
reads at run time, and hardware markers skip with a reason."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
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
    """An extra exists only beside the backend (or command, or core feature) it installs:
    ``structured`` is the grammar engine the driver imports for a constrained request,
    ``hub`` the client the loader imports for a model named on the Hugging Face Hub."""
    extras = set(_pyproject()["project"]["optional-dependencies"])
    backends = {p.name for p in (ROOT / "backends").iterdir() if (p / "plugin.py").exists()}
    known = {"test", "all", "serve", "conformance", "structured", "hub"} | {"cuda" if b == "cuda_torch" else "tpu" if b == "tpu_jax" else b for b in backends}
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
        result.stdout.fnmatch_lines(["*needs hardware marker 'neuron'*neuron: *Neuron*"])


def test_hardware_markers_ask_the_probes_auto_ranks_by(monkeypatch):
    """A TPU that the tpu_jax probe (and so backend="auto") recognizes, here a v5e-style
    /dev/vfio/N with libtpu, makes the tpu marker run; the old device-file glob missed it."""
    import conftest
    from polyengine.backends.tpu_jax import plugin as tpu_plugin
    from polyengine.discovery import reset_registry

    monkeypatch.setattr(tpu_plugin, "tpu_devices", lambda: ["/dev/vfio/0"])
    monkeypatch.setattr(tpu_plugin, "libtpu_installed", lambda: True)
    reset_registry()
    try:
        assert conftest.hardware_present("tpu")
        monkeypatch.setattr(tpu_plugin, "libtpu_installed", lambda: False)
        reset_registry()
        present, why = conftest._hardware("tpu")
        assert not present and "libtpu is not installed" in why
    finally:
        monkeypatch.undo()
        reset_registry()


# -- the wheel: what a `pip install` user gets ---------------------------------------------


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> set[str]:
    """The file names in a wheel built from this checkout's files (tracked and untracked
    but not ignored), copied elsewhere so the build leaves the checkout as it was."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True)
    if listed.returncode == 0:
        for rel in filter(None, listed.stdout.decode().split("\0")):
            if (ROOT / rel).is_file():
                (src / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, src / rel)
    else:  # not a git checkout (an sdist): the tree without build products
        shutil.copytree(ROOT, src, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("polyengine-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def _package_folders() -> dict[str, Path]:
    """Each package of [tool.setuptools] packages -> its source folder (package-dir)."""
    setup = _pyproject()["tool"]["setuptools"]
    dirs = setup["package-dir"]
    out = {}
    for package in setup["packages"]:
        base = max((k for k in dirs if package == k or package.startswith(k + ".")), key=len)
        rest = package[len(base):].lstrip(".").replace(".", "/")
        out[package] = ROOT / dirs[base] / rest
    return out


def test_the_wheel_has_every_file_a_kernel_source_includes(wheel_files):
    """The CPU kernels compile at run time from the installed package: every source and
    everything it ``#include "..."``s must be in the wheel (parallel.h once was not, so
    every pip install fell back to torch's matmul)."""
    kernels = ROOT / "backends" / "cpu" / "csrc"
    prefix = "polyengine/backends/cpu/csrc/"
    sources = [p for p in kernels.iterdir() if p.suffix in (".cpp", ".h")]
    needed = {p.name for p in sources}
    for p in sources:
        needed |= set(re.findall(r'^\s*#\s*include\s+"([^"]+)"', p.read_text(), flags=re.M))
    assert "parallel.h" in needed
    missing = sorted(name for name in needed if prefix + name not in wheel_files)
    assert not missing, f"kernel files missing from the wheel: {missing} (add them to package-data)"


def test_the_wheel_has_every_file_of_every_package(wheel_files):
    """Whatever sits in a package folder (code, TOML tolerances, kernel sources, and the
    folders below it that are not packages themselves) ships in the wheel."""
    folders = _package_folders()
    packaged = set(folders.values())
    missing = []
    for package, folder in folders.items():
        for path in folder.rglob("*"):
            if not path.is_file() or "__pycache__" in path.parts or path.suffix in (".pyc", ".so"):
                continue
            if any(parent in packaged and parent != folder for parent in path.parents if folder in parent.parents):
                continue  # belongs to a sub-package, checked under its own name
            name = package.replace(".", "/") + "/" + path.relative_to(folder).as_posix()
            if name not in wheel_files:
                missing.append(name)
    assert not missing, f"files of the packages missing from the wheel: {missing}"
