"""What a fresh interpreter imports: the one helper behind every "imports stay light" test.

Listing backends, loading the core, the conformance plugin that loads in every pytest
run, the CLI's commands: each promises to import no framework (torch, jax, ray, ...)
until one is needed. :func:`assert_imports_light` runs a snippet in a new process (the
test process has imported everything already) and fails naming what it pulled in.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Iterable

# The frameworks the core must never import, and the backends only lazily.
FRAMEWORKS = ("torch", "jax", "jaxlib", "ray", "torchax")


def imported_by(code: str, modules: Iterable[str], **env: str) -> list[str]:
    """Which of ``modules`` (or their submodules) a fresh interpreter has imported after
    running ``code``; the snippet's own failure fails the caller with its stderr."""
    probe = (f"{code}\nimport sys as _s\n"
             f"print('IMPORTED:', *[w for w in {tuple(modules)!r} "
             f"if any(m == w or m.startswith(w + '.') for m in _s.modules)])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert out.returncode == 0, f"the snippet failed:\n{code}\n{out.stderr}"
    return out.stdout.strip().splitlines()[-1].split()[1:]


def assert_imports_light(code: str, heavy: Iterable[str] = FRAMEWORKS, **env: str) -> None:
    """``code``, run in a fresh interpreter, imports none of ``heavy``."""
    pulled = imported_by(code, heavy, **env)
    assert not pulled, f"{code!r} imported {pulled}"
