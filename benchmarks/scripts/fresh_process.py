"""One benchmark configuration in a fresh Python process, so that its peak resident
memory (``VmHWM``) is its own: the scripts that compare memory (kv_memory.py,
weight_dtype.py) and installations (installed_wheel.py) run their child code through
:func:`run_fresh`."""

from __future__ import annotations

import json
import subprocess
import sys


def run_fresh(child: str, options: dict, *args: str, timeout: float = 1800, python: str = sys.executable,
              env: dict[str, str] | None = None, cwd: str | None = None) -> dict:
    """Run ``child`` (Python source; it reads the options as JSON from ``sys.argv[1]``
    and ``args`` after them, and prints one JSON object last) in ``python`` (this
    interpreter by default; ``env`` and ``cwd`` as :func:`subprocess.run` takes them)
    and return that object."""
    proc = subprocess.run([python, "-c", child, json.dumps(options), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)
    if proc.returncode != 0:
        raise SystemExit(f"the run with options {options} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
