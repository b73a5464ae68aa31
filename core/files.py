"""Opening files whose names come from untrusted input: regular files only.

A model path, a file inside a model folder or a saved prefix may name a FIFO (reading
it blocks until someone writes), a device (``/dev/zero`` never ends, ``/dev/tty``
waits for the user), a socket or a directory. Each of those is refused at once, by
kind, before anything reads it: :func:`regular` checks what a name points at
(following symlinks, which the Hugging Face cache uses for every file) without opening
it, :func:`open_regular` opens without blocking and checks the open file itself, and
:func:`read_regular` reads one whole, bounded. The caller chooses the error type
(``error(message)``), so a weights file gives ``WeightsError`` and a prefix
``InvalidRequest``; messages do not repeat the path, which the caller's error names.

The reports a long command writes at its end (``polyengine conformance --report-json``,
``polyengine bench --json``) are checked before the run (:func:`check_writable`) and
written so that a failure at the end loses nothing (:func:`write_report`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO, Callable

__all__ = ["regular", "open_regular", "read_regular", "file_kind", "check_writable", "write_report"]

ErrorFactory = Callable[[str], Exception]


def file_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _refusal(mode: int, what: str) -> str:
    return f"the {what} is {file_kind(mode)}, not a regular file (it must be a plain file)"


def regular(path: str | Path, *, what: str, error: ErrorFactory) -> Path:
    """``path`` if it names a regular file (after symlinks); ``error`` otherwise (also
    when it cannot be examined). Nothing is opened, so nothing can block."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise error(f"cannot read the {what}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise error(_refusal(mode, what))
    return path


def open_regular(path: str | Path, *, what: str, error: ErrorFactory) -> IO[bytes]:
    """Open ``path`` for binary reading if it is a regular file. The open itself does not
    block (``O_NONBLOCK``: a FIFO without a writer opens at once), and the kind is
    checked on the open descriptor, so a name swapped after a check cannot slip by."""
    path = Path(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise error(f"cannot read the {what}: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(_refusal(mode, what))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | Path, *, limit: int, what: str, error: ErrorFactory) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes."""
    with open_regular(path, what=what, error=error) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise error(f"the {what} is {size:,} bytes; at most {limit:,} are accepted")
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew while being read
        raise error(f"the {what} is over {limit:,} bytes")
    return data


# -- reports a command writes at the end of a long run ---------------------------------------


def check_writable(path: str | Path, *, what: str, error: ErrorFactory) -> Path:
    """Fail *before* a long run when its report could not be written at ``path``: the
    folder is created if missing, and a file is created in it (and removed) to prove
    it, without touching an existing report. ``error(message)`` otherwise."""
    import tempfile

    path = Path(path)
    try:
        if path.is_dir():
            raise error(f"cannot write the {what} to {path}: it is a directory; name a file")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".check"):
            pass
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise error(f"cannot write the {what} to {path}: {exc.strerror or exc}; pick another path "
                    f"(nothing was run)") from None
    return path


def write_report(path: str | Path, text: str, *, what: str) -> Path:
    """Write ``text`` to ``path``; if that fails now (the disk filled, the folder went
    away), write it to a new file in the temporary directory instead, say so on standard
    error, and return where it went: a finished run's results are never lost to a traceback."""
    import sys
    import tempfile

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.partial")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)  # a reader never sees half a report
        return path
    except OSError as exc:
        fd, fallback = tempfile.mkstemp(prefix="polyengine-", suffix=f"-{path.name}")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"polyengine: could not write the {what} to {path} ({exc.strerror or exc}); it is in {fallback}",
              file=sys.stderr, flush=True)
        return Path(fallback)
