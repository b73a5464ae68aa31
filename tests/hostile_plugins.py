"""Throwaway plugin distributions, pip-installed without network into a ``--target``
folder that only a child process puts on its path (so a hostile plugin never reaches
the test process's own discovery).

:func:`install` builds one distribution per entry in ``dists`` and installs them all
with one pip call; :func:`polyengine` runs the CLI (or ``python -c``) with that folder
on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

__all__ = ["Dist", "install", "polyengine", "python"]

SPEC = '''
from polyengine import PROTOCOL_VERSION, BackendSpec, Probe, hookimpl

def spec(name, probe=None, **kw):
    return BackendSpec(name=name, description=name + " (hostile test plugin)", protocol_version=PROTOCOL_VERSION,
                       probe=probe or (lambda: Probe(True, False, "ok")),
                       factory="polyengine.backends.reference.engine:create_engine", **kw)
'''


class Dist:
    """One distribution: ``modules`` (name -> source, in package ``pkg``) and entry points
    ``{group: {name: "module:attr" or "module"}}``."""

    def __init__(self, name: str, pkg: str, modules: dict[str, str], entry_points: dict[str, dict[str, str]]):
        self.name, self.pkg, self.modules, self.entry_points = name, pkg, modules, entry_points

    def write(self, root: Path) -> Path:
        where = root / self.name
        (where / self.pkg).mkdir(parents=True)
        (where / self.pkg / "__init__.py").write_text("")
        for module, body in self.modules.items():
            (where / self.pkg / f"{module}.py").write_text(SPEC + textwrap.dedent(body))
        groups = "".join(
            f'\n[project.entry-points."{group}"]\n' + "".join(f'{k} = "{v}"\n' for k, v in eps.items())
            for group, eps in self.entry_points.items()
        )
        (where / "pyproject.toml").write_text(textwrap.dedent(f'''
            [build-system]
            requires = ["setuptools"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{self.name}"
            version = "6.6.6"

            [tool.setuptools]
            packages = ["{self.pkg}"]
            ''') + groups)
        return where


def install(root: Path, dists: list[Dist]) -> Path:
    """Install ``dists`` into ``root / "site"`` (one pip call, no network); returns it."""
    target = root / "site"
    sources = [str(d.write(root / "src")) for d in dists]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-index", "--no-deps",
         "--no-compile", "--target", str(target), *sources],
        check=True, capture_output=True, text=True,
    )
    return target


MEMORY_LIMIT = 3 * 1024**3  # address space of every child (what `ulimit -v` limits)


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def python(site: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 60,
           stdin: str | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` with ``site`` on the path, under :data:`MEMORY_LIMIT` and ``timeout``."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).parent)]), **(env or {})}
    # Bytes in and out: stdin may carry undecodable bytes (written as surrogate escapes).
    proc = subprocess.run([sys.executable, *args], capture_output=True, env=full_env, timeout=timeout,
                          input=None if stdin is None else stdin.encode("utf-8", "surrogateescape"),
                          preexec_fn=_limit_memory)
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode("utf-8", "replace"),
                                       proc.stderr.decode("utf-8", "replace"))


def polyengine(site: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    """The ``polyengine`` command line with ``site`` on the path."""
    return python(site, "-m", "polyengine.cli", *args, **kw)
