"""What the neuron backend's tests share: one artifact cache per test session.

The conformance suite and the engine tests build many engines of the same few configs;
sharing one cache directory (through ``POLYENGINE_NEURON_CACHE``, which the suite's
factory calls read) makes each graph compile once per session. Unless that variable is
set already, the directory is fresh per session, so CI pays, and measures, the cold
compiles once.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from polyengine import EngineConfig

# The conformance suite's limits: engines built with them reuse the suite's graphs.
LIMITS = dict(max_slots=4, max_prefill_length=24, max_cache_length=64)
_DIR: Path | None = None


def shared_cache() -> Path:
    """The session's artifact cache: ``$POLYENGINE_NEURON_CACHE`` when set (subprocesses
    of a test inherit it), else a fresh directory, removed at exit."""
    global _DIR
    if _DIR is None:
        if os.environ.get("POLYENGINE_NEURON_CACHE"):
            _DIR = Path(os.environ["POLYENGINE_NEURON_CACHE"])
        else:
            _DIR = Path(tempfile.mkdtemp(prefix="polyengine-neuron-cache-"))
            atexit.register(shutil.rmtree, _DIR, ignore_errors=True)
            os.environ["POLYENGINE_NEURON_CACHE"] = str(_DIR)
    return _DIR


def config(prefill_buckets: tuple[int, ...] | None = None, **options) -> EngineConfig:
    """The suite's limits, the session's cache, and ``options`` for the engine."""
    return EngineConfig(**LIMITS, prefill_buckets=prefill_buckets, options={"cache_dir": str(shared_cache()), **options})


_SUITE: dict | None = None


def start_suite() -> dict:
    """``polyengine conformance --backend neuron`` in a process of its own, started once
    per session: by the conftest as soon as the test that checks it is collected, so
    its compiling (minutes, mostly one core) overlaps the rest of the test session on
    the machine's other core; the test waits for it. Returns the process and the paths
    of its report and output."""
    global _SUITE
    if _SUITE is None:
        import subprocess
        import sys

        cache = shared_cache()
        out = Path(tempfile.mkdtemp(prefix="polyengine-neuron-suite-"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        report, log = out / "neuron.json", open(out / "output.txt", "w")
        env = {**os.environ, "POLYENGINE_NEURON_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "polyengine.cli", "conformance", "--backend", "neuron", "--report-json", str(report)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        atexit.register(lambda: proc.poll() is None and proc.kill())
        _SUITE = {"proc": proc, "report": report, "output": out / "output.txt", "cache": cache}
    return _SUITE
