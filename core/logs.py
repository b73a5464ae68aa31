"""The package's logging, set up in one place.

Every module logs on a child of the ``polyengine`` logger. The library installs no
handler and never touches the root logger: an application's own logging setup decides
what it shows. The command line calls :func:`cli_logging` around each command: one
handler on ``polyengine`` writing to standard error, at a level from ``-q``/``-v``:

- ``-q`` (verbosity -1): errors only;
- default (0): warnings, and the lines of :data:`PROGRESS_LOGGER` (a compile that takes
  seconds says what it compiles, then how long it took);
- ``-v`` (1): every INFO line too (what runs on which path, weight loading);
- ``-vv`` (2): DEBUG lines too.

Python warnings (``warnings.warn``: random weights, a fallback) raised while the
command runs become one ``polyengine: warning:`` line each, at the warning level, so
``-q`` hides them and a warning both warned and logged shows once. Everything is put
back as it was when the command ends (in-process callers and tests see no leftovers).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings
from typing import Iterator

__all__ = ["PROGRESS_LOGGER", "cli_logging", "compiling", "level_for"]

PROGRESS_LOGGER = "polyengine.progress"

_progress = logging.getLogger(PROGRESS_LOGGER)


@contextlib.contextmanager
def compiling(what: str, *, first_run: bool = True) -> Iterator[None]:
    """Around a compile that can take seconds: ``compiling WHAT (first run, cached
    after)...`` before, ``compiled WHAT in N s`` after, on :data:`PROGRESS_LOGGER`
    (INFO, shown by the command line by default). ``first_run``: the result is cached,
    so later runs skip it."""
    _progress.info("compiling %s%s...", what, " (first run, cached after)" if first_run else "")
    start = time.perf_counter()
    yield
    _progress.info("compiled %s in %.1f s", what, time.perf_counter() - start)


def level_for(verbosity: int) -> int:
    """The ``polyengine`` logger's level for a verbosity (-1 quiet ... 2 -vv)."""
    if verbosity < 0:
        return logging.ERROR
    return (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbosity, 2)]


class _Stderr(logging.StreamHandler):
    """A handler on whatever ``sys.stderr`` is when a record is written (a test's
    capture, a command that redirected it), not the stream of the moment it was made."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:  # once each: the same warning warned and logged
            text = record.getMessage()
            if text in self.seen:
                return False
            self.seen.add(text)
        return super().filter(record)


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        paths = getattr(record, "speed_paths", None)
        if isinstance(paths, dict):  # the engine's startup line (construction): one path a line
            return "\n".join([f"backend: {getattr(record, 'engine_name', '?')}",
                              *(f"  {k}: {v}" for k, v in paths.items())])
        text = super().format(record)
        if record.levelno >= logging.ERROR:
            return f"polyengine: error: {text}"
        if record.levelno >= logging.WARNING:
            return f"polyengine: warning: {text}"
        return text


@contextlib.contextmanager
def cli_logging(verbosity: int) -> Iterator[None]:
    """The command line's logging for one command (see the module docstring)."""
    root = logging.getLogger("polyengine")
    saved = (root.level, _progress.level, list(root.handlers), warnings.showwarning)
    for h in root.handlers:
        if isinstance(h, _Stderr):
            root.removeHandler(h)  # a command run inside another (tests): one handler
    handler = _Stderr()
    handler.setFormatter(_Format("%(message)s"))
    root.addHandler(handler)
    root.setLevel(level_for(verbosity))
    _progress.setLevel(logging.INFO if verbosity >= 0 else logging.ERROR)

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if category.__module__.startswith("polyengine"):
            root.warning("%s", message)
        else:  # another library's: say whose
            root.warning("%s: %s (%s:%s)", category.__name__, message, filename, lineno)

    warnings.showwarning = show
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        _progress.setLevel(saved[1])
        for h in saved[2]:
            if h not in root.handlers:
                root.addHandler(h)
        warnings.showwarning = saved[3]
