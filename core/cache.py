"""Private, verified caches for compiled code.

What polyengine caches on disk is code it will run later: the CPU kernels' shared
library (``dlopen``) and the neuron backend's compiled graphs (Inductor's artifacts,
which its loader unpickles; TorchScript archives on Neuron). Such a file is loaded only
if **this user wrote it and it is intact**. The rules, for every backend that caches:

- **Directories are private.** :func:`private_dir` creates each missing level with mode
  0700 and refuses (:class:`~polyengine.errors.UnsafeCache`, naming the path and the fix)
  a directory that another user owns or that group or others can write, and the same for
  every directory above it (a world-writable one only with the sticky bit, as ``/tmp``),
  as ssh does for ``~/.ssh``: whoever can write a directory on the path can swap what
  lies below it.
- **Entries are signed.** :func:`store` writes an entry through a temporary file and a
  rename (atomic: readers see the old file or the new one, never half of one), then a
  JSON sidecar ``<entry>.json``, the same way, with the entry's size, its SHA-256 and an
  HMAC-SHA256 of them under this user's key. :func:`check` accepts an entry only when
  entry and sidecar are regular files this user owns that nobody else can write, the size
  and digest match the bytes on disk and the signature is valid. Anything else (missing,
  truncated, empty, edited, a planted file without a sidecar or with a forged one, a cache
  copied from another user or machine) is reported as a reason, never loaded; the caller
  builds the entry again and :func:`store` replaces it.
- **Paths are absolute** (:func:`cache_root`, :func:`config_root`), never resolved against
  the working directory: ``$POLYENGINE_CACHE`` must be absolute (else UnsafeCache), a
  relative ``$XDG_*_HOME`` is ignored (as the XDG specification says), and a process
  with no home (no ``$HOME`` and no passwd entry, as in some containers) uses a private
  folder of its own under the system temporary directory, ``polyengine-<uid>``, created
  0700 and checked before use; if another user's process holds that name, the refusal
  names ``$POLYENGINE_CACHE``.
- **The key** (:func:`user_key`): 32 random bytes in ``$XDG_CONFIG_HOME/polyengine/cache-key``
  (``~/.config``; ``config`` in the folder above without a home), mode 0600 in a private directory, created on first use, kept apart
  from the caches so that copying a cache directory does not copy what signs it. Where
  it cannot be written, a key for this process alone is used (with a warning): entries
  written then verify only in this process.

Between :func:`check` and the load a file could in principle change; the private
directories are what make that impossible for anyone but this user (and root).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

from polyengine.errors import UnsafeCache

__all__ = ["cache_root", "config_root", "env_dir", "private_dir", "store", "check", "user_key", "KEY_BYTES",
           "CACHE_ENV"]

CACHE_ENV = "POLYENGINE_CACHE"
KEY_BYTES = 32
_SIDECAR_FORMAT = 1
_process_key: bytes | None = None
_warned: set[str] = set()


def env_dir(name: str) -> Path | None:
    """The absolute directory the environment variable ``name`` names (``~`` expanded),
    None when it is unset or empty; UnsafeCache for a relative one, which would put the
    cache wherever the process happens to run."""
    value = os.environ.get(name)
    if not value:
        return None
    path = Path(os.path.expanduser(value))
    if not path.is_absolute():
        raise UnsafeCache(f"${name} is {value!r}, a relative path: it would put the cache in whatever directory "
                          f"polyengine runs in; set it to an absolute path")
    return path


def _home() -> Path | None:
    """This user's home directory, or None when there is none to find (no ``$HOME`` and no
    passwd entry: ``~`` would stay a relative ``~``)."""
    home = os.path.expanduser("~")
    return Path(home) if os.path.isabs(home) else None


def _xdg(name: str, fallback: str) -> Path | None:
    value = os.environ.get(name)
    if value and os.path.isabs(value):  # the XDG specification: a relative value is invalid, ignore it
        return Path(value)
    home = _home()
    return None if home is None else home / fallback


def _homeless(part: str) -> Path:
    """``<tmp>/polyengine-<uid>/<part>`` for a process without a home: the folder above is
    created 0700 and checked now (the temporary directory is shared with other users)."""
    root = Path(os.path.abspath(tempfile.gettempdir())) / f"polyengine-{os.geteuid()}"
    try:
        private_dir(root, what="polyengine folder in the temporary directory")
    except UnsafeCache as exc:
        raise UnsafeCache(f"this process has no home directory (no $HOME, no passwd entry) and {exc}; "
                          f"set {CACHE_ENV} to an absolute directory you own") from None
    return root / part


def cache_root() -> Path:
    """``$POLYENGINE_CACHE``, else ``$XDG_CACHE_HOME/polyengine``, else ``~/.cache/polyengine``,
    else (no home) ``<tmp>/polyengine-<uid>/cache``; always absolute (the cache folder
    itself is not created here: :func:`private_dir` does that)."""
    explicit = env_dir(CACHE_ENV)
    if explicit is not None:
        return explicit
    base = _xdg("XDG_CACHE_HOME", ".cache")
    return _homeless("cache") if base is None else base / "polyengine"


def config_root() -> Path:
    """``$XDG_CONFIG_HOME/polyengine``, else ``~/.config/polyengine``, else (no home)
    ``<tmp>/polyengine-<uid>/config``: where the cache key lives, apart from the caches."""
    base = _xdg("XDG_CONFIG_HOME", ".config")
    return _homeless("config") if base is None else base / "polyengine"


def state_root() -> Path:
    """``$XDG_STATE_HOME/polyengine``, else ``~/.local/state/polyengine``, else (no home)
    ``<tmp>/polyengine-<uid>/state``: what a user's sessions leave (chat's history)."""
    base = _xdg("XDG_STATE_HOME", ".local/state")
    return _homeless("state") if base is None else base / "polyengine"


def _problem(path: Path, st: os.stat_result, *, sticky_ok: bool) -> str | None:
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o022 and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if st.st_mode & bit)
        return f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def private_dir(path: str | os.PathLike, *, what: str = "cache", env: str = CACHE_ENV) -> Path:
    """``path``, created with mode 0700 where missing, after checking that it and every
    directory above it can be written by this user (or root) alone; else UnsafeCache
    naming the fix (``env``: the variable that moves this cache)."""
    path = Path(os.path.abspath(os.path.expanduser(path)))
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for level in reversed(missing):
        try:
            level.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise UnsafeCache(f"cannot create the {what} directory {level} ({exc.strerror or exc}); "
                              f"set {env} to a directory you own") from None
        os.chmod(level, 0o700)  # mkdir's mode passes through the umask; make it exact
    for level in [path, *path.parents]:
        try:
            st = os.stat(level)
        except OSError as exc:
            raise UnsafeCache(f"cannot inspect {level} ({exc.strerror or exc}); set {env} to a directory you own") from None
        if level == path and not stat.S_ISDIR(st.st_mode):
            raise UnsafeCache(f"the {what} path {path} is not a directory; remove it or set {env} elsewhere")
        problem = _problem(level, st, sticky_ok=level != path)
        if problem is not None:
            fix = (f"chmod 700 {path}" if level == path and st.st_uid == os.geteuid()
                   else f"set {env} to a directory only you can write (e.g. under your home)")
            raise UnsafeCache(f"refusing the {what} directory {path}: {problem}, so another user could plant "
                              f"code that polyengine would load; fix: {fix}")
    return path


def user_key() -> bytes:
    """This user's cache-signing key (see the module docstring)."""
    global _process_key
    try:
        folder = private_dir(config_root(), what="configuration", env="XDG_CONFIG_HOME")
        path = folder / "cache-key"
        if not path.exists():
            # Written whole under a name of this process's own, then linked into place:
            # a process starting at the same moment sees no key or a complete one, never a
            # half-written file, and the first link wins for everyone.
            tmp = folder / f".cache-key.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(secrets.token_bytes(KEY_BYTES))
                os.link(tmp, path)
            except FileExistsError:
                pass
            finally:
                tmp.unlink(missing_ok=True)
        st = os.stat(path)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077 or st.st_size != KEY_BYTES:
            raise UnsafeCache(f"the cache key {path} must be {KEY_BYTES} bytes, yours, mode 0600 (it is "
                              f"{st.st_size} bytes, uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); "
                              f"fix: delete it (a new one is made; cached code is then rebuilt once)")
        return path.read_bytes()
    except (OSError, UnsafeCache) as exc:
        if _process_key is None:
            _process_key = secrets.token_bytes(KEY_BYTES)
        if str(exc) not in _warned:
            _warned.add(str(exc))
            warnings.warn(f"polyengine: no cache key ({exc}); cached code written by this process will be "
                          f"rebuilt by the next one", stacklevel=2)
        return _process_key


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _signature(key: bytes, name: str, size: int, digest: str) -> str:
    return hmac.new(key, f"{_SIDECAR_FORMAT}\0{name}\0{size}\0{digest}".encode(), hashlib.sha256).hexdigest()


def _sha256(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.chmod(tmp, 0o600)  # dlopen needs no execute bit
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def store(path: str | os.PathLike, write: Callable[[Path], None], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write an entry at ``path`` (``write(tmp)`` creates the file at the temporary path it
    is given), then its signed sidecar; both atomically. ``meta`` (JSON) is kept in the
    sidecar. Returns the sidecar's content. The directory must be a :func:`private_dir`."""
    path = Path(path)
    _write_atomic(path, write)
    size, digest = _sha256(path)
    record = {**(meta or {}), "file": path.name, "size": size, "sha256": digest,
              "signature": _signature(user_key(), path.name, size, digest), "format": _SIDECAR_FORMAT}
    data = json.dumps(record, indent=1, sort_keys=True, default=str).encode()
    _write_atomic(_sidecar(path), lambda tmp: tmp.write_bytes(data))
    return record


def check(path: str | os.PathLike) -> tuple[dict[str, Any] | None, str]:
    """``(sidecar, "ok")`` when the entry at ``path`` may be loaded, else ``(None, reason)``
    (``"missing"`` for an entry never written)."""
    path = Path(path)
    side = _sidecar(path)
    if not path.exists() and not side.exists():
        return None, "missing"
    if not side.exists():
        return None, f"{path.name} has no signed record ({side.name}): not written by this polyengine"
    for p in (path, side):
        try:
            st = os.lstat(p)
        except OSError:
            return None, f"{p.name} is missing"
        if not stat.S_ISREG(st.st_mode):
            return None, f"{p.name} is not a regular file"
        if st.st_uid != os.geteuid():
            return None, f"{p.name} is owned by uid {st.st_uid}, not by this user"
        if st.st_mode & 0o022:
            return None, f"{p.name} is writable by group or others"
    try:
        record = json.loads(side.read_bytes())
        size, digest, signature = int(record["size"]), str(record["sha256"]), str(record["signature"])
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
        # OverflowError: a size of 1e999 (JSON's infinity); RecursionError: nesting json cannot parse
        return None, f"{side.name} is not a valid sidecar"
    actual = path.stat().st_size
    if actual != size:
        return None, f"{path.name} has {actual} bytes, {size} were written (truncated or replaced)"
    if _sha256(path)[1] != digest:
        return None, f"{path.name}'s SHA-256 differs from the one recorded when it was written"
    if not hmac.compare_digest(signature, _signature(user_key(), path.name, size, digest)):
        return None, f"{side.name}'s signature is not this user's (written by another user or machine)"
    return record, "ok"
