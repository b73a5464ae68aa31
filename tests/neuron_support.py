"""What the neuron backend's tests share: one artifact cache per test session (all its
``pytest -n 2`` workers).

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


def session_dir() -> Path:
    """The test session's private scratch folder: made by the conftest before any worker
    starts (``$POLYENGINE_TEST_SESSION``, which ``pytest -n 2`` workers inherit), so every
    worker of one session shares it; else one of this process's own."""
    if os.environ.get("POLYENGINE_TEST_SESSION"):
        return Path(os.environ["POLYENGINE_TEST_SESSION"])
    path = Path(tempfile.mkdtemp(prefix="polyengine-tests-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["POLYENGINE_TEST_SESSION"] = str(path)
    return path


def shared_cache() -> Path:
    """The session's artifact cache: ``$POLYENGINE_NEURON_CACHE`` when set (subprocesses
    of a test inherit it), else a folder in the session's scratch folder."""
    global _DIR
    if _DIR is None:
        if os.environ.get("POLYENGINE_NEURON_CACHE"):
            _DIR = Path(os.environ["POLYENGINE_NEURON_CACHE"])
        else:
            _DIR = session_dir() / "neuron-cache"
            _DIR.mkdir(mode=0o700, exist_ok=True)
            os.environ["POLYENGINE_NEURON_CACHE"] = str(_DIR)
    return _DIR


def config(prefill_buckets: tuple[int, ...] | None = None, **options) -> EngineConfig:
    """The suite's limits and ``options`` for the engine; an engine whose compiler keeps
    artifacts (``compiler="inductor"``) gets the session's cache (the default ``export``
    compiler keeps none and refuses the option)."""
    if options.get("compiler") == "inductor":
        options = {"cache_dir": str(shared_cache()), **options}
    return EngineConfig(**LIMITS, prefill_buckets=prefill_buckets, options=options)


def _suite_dir() -> Path:
    return session_dir() / "neuron-suite"


def start_suite() -> None:
    """``polyengine conformance --backend neuron`` in a process of its own, started once
    per session: by the conftest as soon as the test that checks it is collected, so
    its compiling (minutes, mostly one core) overlaps the rest of the test session on
    the machine's other core; the test waits for it (:func:`wait_suite`). Under
    ``pytest -n 2`` every worker collects that test: the first to create the run's
    folder starts it, and the test waits on the folder, from whichever worker runs it."""
    import subprocess
    import sys

    out = _suite_dir()
    try:
        out.mkdir(mode=0o700)
    except FileExistsError:
        return  # started by this session already (another worker, or an earlier call)
    report = out / "neuron.json"
    env = {**os.environ, "POLYENGINE_NEURON_CACHE": str(shared_cache()), "OMP_NUM_THREADS": "1"}
    # The exit status lands in a file (written whole, then renamed): a waiting worker
    # other than this one has no process handle.
    script = ("import subprocess, sys, os; rc = subprocess.call(sys.argv[2:]); "
              "open(sys.argv[1] + '.tmp', 'w').write(str(rc)); os.replace(sys.argv[1] + '.tmp', sys.argv[1])")
    with open(out / "output.txt", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", script, str(out / "returncode"),
             sys.executable, "-m", "polyengine.cli", "conformance", "--backend", "neuron", "--report-json", str(report)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    atexit.register(lambda: proc.poll() is None and os.killpg(proc.pid, 9))


def wait_suite(timeout: float = 1800) -> dict:
    """Waits for the run :func:`start_suite` started (starting it if nobody has); returns
    its exit status and the paths of its report, output and artifact cache."""
    import time

    start_suite()
    out = _suite_dir()
    deadline = time.monotonic() + timeout
    while not (out / "returncode").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the neuron conformance run did not finish in {timeout:.0f} s; its output so far:\n"
                               + (out / "output.txt").read_text()[-4000:])
        time.sleep(1.0)
    return {"returncode": int((out / "returncode").read_text()), "report": out / "neuron.json",
            "output": out / "output.txt", "cache": shared_cache()}
