"""Running one system in its own worker subprocess, and hearing back from it.

One process per (system, part): the standard phases of a system share one process (its
peak RSS is that row's), the full-context batch gets a fresh one (its peak RSS is the
``long`` column's). A worker that crashes, is killed (out of memory, a segfault in a
native library) or runs past its time limit becomes a failed row with the reason and
the tail of its output, keeping the phases it finished (the worker reports each one as
it ends); the run goes on with the next system.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Job", "run_job"]


@dataclass
class Job:
    """What one worker runs: ``kind`` names the system, ``params`` build it."""

    row: str  # the table row this job fills, e.g. "polyengine reference float64"
    kind: str  # polyengine | transformers | llamacpp
    params: dict[str, Any]
    part: str  # standard | long
    meta: dict[str, Any] = field(default_factory=dict)  # copied into the report row (peer, setting)
    long: bool = True  # whether this system runs the full-context batch (in a second worker)
    prefix: bool = True  # whether it runs the prefix part (prefix caching, chunked prefill)
    pages: bool = True  # whether it runs the pages part (paged K/V against full reservations: polyengine's)
    parts: list[str] = field(default_factory=lambda: ["standard", "long"])  # what this run asks of it
    phases: tuple[str, ...] = ("decode", "prefill", "serve")  # the standard part's phases this run asks for
    env: dict[str, str] = field(default_factory=dict)  # set in its worker's environment (an emulation's, a library)


def _tail(log: Any, limit: int = 2000) -> str:
    log.seek(0, os.SEEK_END)
    size = log.tell()
    log.seek(max(0, size - limit))
    return log.read().decode("utf-8", errors="replace")


def run_job(job: Job, *, workload: dict[str, Any], repeats: int, timeout: float,
            on_progress: Callable[[str, str], None]) -> dict[str, Any]:
    """Run ``job`` in a worker; return its result event or an error event."""
    read_fd, write_fd = os.pipe()
    payload = json.dumps({"kind": job.kind, "params": job.params, "part": job.part, "phases": list(job.phases),
                          "workload": workload, "repeats": repeats})
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "polyengine.benchmarks.worker", str(write_fd)],
            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, pass_fds=(write_fd,),
            env={**os.environ, "PYTHONUNBUFFERED": "1", **job.env},
        )
        os.close(write_fd)
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            proc.kill()

        watchdog = threading.Timer(timeout, kill)
        watchdog.start()
        result: dict[str, Any] | None = None
        partial: dict[str, Any] | None = None
        details: dict[str, Any] = {}
        try:
            proc.stdin.write(payload.encode("utf-8"))
            proc.stdin.close()
        except BrokenPipeError:
            pass  # the worker died at start; its log says why
        try:
            with os.fdopen(read_fd, encoding="utf-8") as events:
                for line in events:  # ends when the worker closes the pipe or dies
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if event.get("event") == "progress":
                        on_progress(event["phase"], event["detail"])
                    elif event.get("event") == "partial":
                        partial, details = event["metrics"], event.get("details") or details
                    elif event.get("event") == "system":
                        details = event["details"]
                    else:
                        result = event
            code = proc.wait()
        except KeyboardInterrupt:  # the user stopped the run: keep what this worker finished
            return {"event": "error", "error": "interrupted by the user", "interrupted": True,
                    "traceback": "", "partial_metrics": partial, "system": details}
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if result is not None:
            if result.get("event") == "error":
                result.update(partial_metrics=partial, system=details)
            return result
        if timed_out.is_set():
            why = f"the worker ran past the time limit ({timeout:.0f} s) and was stopped"
        elif code < 0:
            why = f"the worker was killed by {_signal_cause(-code)}"
        else:
            why = f"the worker exited with code {code} without a result"
        return {"event": "error", "error": why, "traceback": _tail(log), "partial_metrics": partial, "system": details}


def _signal_cause(number: int) -> str:
    """A signal's name and what usually sends it to a benchmark worker."""
    import signal

    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
    causes = {
        "SIGKILL": "the kernel's out-of-memory killer, or another process",
        "SIGTERM": "another process, or a shutdown",
        "SIGINT": "an interrupt",
        "SIGSEGV": "a crash in native code",
        "SIGBUS": "a crash in native code, or a memory-mapped file that shrank",
        "SIGABRT": "native code that aborted",
        "SIGILL": "an instruction this CPU lacks, in native code",
        "SIGFPE": "an arithmetic fault in native code",
    }
    return f"{name} ({causes[name]})" if name in causes else name
