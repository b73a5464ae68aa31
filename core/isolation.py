"""Calling plugin code without letting it take the process down.

Discovery imports plugin modules and calls their hooks and probes; the CLI imports
command plugins. Any of them may be broken in ways an ``except Exception`` does not
catch: ``sys.exit()`` or ``raise KeyboardInterrupt`` at import would end the process
silently, a ``time.sleep`` would hang every command, a ``print`` would corrupt
``--json`` output. :func:`call_plugin` runs one such call on a worker thread and
returns what happened, never raising on the plugin's behalf:

- every ``BaseException`` the plugin raises (``SystemExit`` and ``KeyboardInterrupt``
  included) is caught on the worker thread and reported as the call's error;
- the caller waits at most :func:`polyengine.limits.plugin_seconds` (``POLYENGINE_PLUGIN_TIMEOUT``,
  default 10 s); a call still running then is reported as hanging and abandoned (it
  keeps a daemon thread until it returns; Python cannot stop a thread);
- what the plugin writes to ``sys.stdout``/``sys.stderr`` from its own thread is
  captured (its first :data:`~polyengine.limits.MAX_PLUGIN_OUTPUT_CHARS` characters are
  kept for the error message); other threads' output passes through untouched.

A real Ctrl-C from the user is delivered to the main thread, which is the one waiting
here, so it still interrupts discovery and the command: only a ``KeyboardInterrupt``
raised *by plugin code* is caught.

Limits: plugin code runs in this process with the user's rights. This isolates
broken plugins, not malicious ones (``os._exit``, writes to file descriptor 1, or
anything else a program may do cannot be prevented; ``docs/security.md``).
"""

from __future__ import annotations

import io
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from polyengine.limits import MAX_PLUGIN_OUTPUT_CHARS, PLUGIN_TIMEOUT_ENV, plugin_seconds

__all__ = ["PluginCall", "call_plugin", "describe_failure"]

_capturing = threading.local()  # .buffer on a worker thread whose output is kept
_install_lock = threading.Lock()


@dataclass
class PluginCall:
    """What one call of plugin code did: ``result``, or ``error`` (the exception it
    raised, or None) and ``hung`` (it did not finish in time); ``output`` is what it
    printed."""

    result: Any = None
    error: BaseException | None = None
    hung: bool = False
    seconds: float = 0.0
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None and not self.hung


class _Router:
    """Stands in for ``sys.stdout``/``sys.stderr`` while plugin code runs: text written by
    a capturing worker thread is kept, everything else goes to the real stream. Every
    other attribute (``encoding``, ``fileno``, ``isatty``, ``buffer``) is the real
    stream's, so code that inspects the stream sees what it would without us."""

    def __init__(self, real: Any):
        self.real = real

    def write(self, text: str) -> int:
        buffer = getattr(_capturing, "buffer", None)
        if buffer is None:
            return self.real.write(text)
        if buffer.tell() < MAX_PLUGIN_OUTPUT_CHARS:
            buffer.write(text[: MAX_PLUGIN_OUTPUT_CHARS - buffer.tell()])
        return len(text)

    def flush(self) -> None:
        if getattr(_capturing, "buffer", None) is None:
            self.real.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _install() -> tuple[Any, Any]:
    """Route sys.stdout/sys.stderr through :class:`_Router` (once; nested calls share it)."""
    with _install_lock:
        saved = (sys.stdout, sys.stderr)
        if not isinstance(sys.stdout, _Router):
            sys.stdout = _Router(sys.stdout)
        if not isinstance(sys.stderr, _Router):
            sys.stderr = _Router(sys.stderr)
        return saved


def _uninstall(saved: tuple[Any, Any]) -> None:
    with _install_lock:
        # Only undo what is still ours: the caller may have replaced the streams meanwhile.
        if isinstance(sys.stdout, _Router) and sys.stdout is not saved[0]:
            sys.stdout = saved[0]
        if isinstance(sys.stderr, _Router) and sys.stderr is not saved[1]:
            sys.stderr = saved[1]


def call_plugin(fn: Callable[[], Any], *, seconds: float | None = None) -> PluginCall:
    """Run ``fn()`` (plugin code) on a worker thread, bounded in time, its output
    captured and every exception caught; see the module docstring."""
    seconds = plugin_seconds() if seconds is None else seconds
    call = PluginCall()
    done = threading.Event()

    def worker() -> None:
        _capturing.buffer = io.StringIO()
        try:
            call.result = fn()
        except BaseException as exc:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from a plugin are its bugs
            call.error = exc
        finally:
            call.output = _capturing.buffer.getvalue()
            _capturing.buffer = None
            done.set()

    saved = _install()
    start = time.monotonic()
    try:
        thread = threading.Thread(target=worker, name="polyengine-plugin", daemon=True)
        thread.start()
        if not done.wait(seconds):
            call.hung = True
    finally:
        call.seconds = time.monotonic() - start
        _uninstall(saved)
    return call


def describe_failure(call: PluginCall, what: str) -> str:
    """One sentence for a failed call: what it did, and what it printed, shortened."""
    seconds = plugin_seconds()
    if call.hung:
        text = (f"{what} did not finish within {seconds:g} s (it hangs, or does heavy work that belongs in "
                f"the backend's factory; {PLUGIN_TIMEOUT_ENV} sets the bound)")
    elif isinstance(call.error, SystemExit):
        text = f"{what} called sys.exit({call.error.code!r})"
    elif isinstance(call.error, KeyboardInterrupt):
        text = f"{what} raised KeyboardInterrupt (not from the user: the plugin's own code raised it)"
    else:
        err = call.error
        text = f"{what} raised {type(err).__name__}: {err}"
    output = call.output.strip()
    if output:
        text += f" (it printed: {output[:200]!r}{'...' if len(output) > 200 else ''})"
    return text
