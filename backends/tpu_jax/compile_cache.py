"""JAX's persistent compilation cache in a private folder: the engine option ``compile_cache``.

XLA executables are what an engine spends its first calls on (on the CPU, the
conformance suite's ~30 engines spend most of their time compiling); JAX can keep
them on disk and read them back in a later process that compiles the same program
(same HLO, same JAX and jaxlib, same devices). The option:

- ``""`` (default): off, unless JAX's own ``jax_compilation_cache_dir`` is set
  (``$JAX_COMPILATION_CACHE_DIR``), which is then left as the user made it;
- ``"auto"``: ``jax`` under polyengine's cache root (:func:`polyengine.cache.cache_root`);
- an absolute path.

The folder is checked with :func:`polyengine.cache.private_dir` (mode 0700, nobody but
this user can write it or any folder above it): JAX's entries are not signed the way
:func:`polyengine.cache.store` signs polyengine's own, so what keeps another user from
planting an executable is that no one else can write there. The setting is
process-wide (JAX has one cache per process): an engine asking for another folder
than the one in use is refused, naming both. Every program is cached, however quick
its compile (``jax_persistent_cache_min_compile_time_secs`` 0): the suite's programs
compile in a second or two each, under JAX's default threshold of one second at idle.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from polyengine.cache import CACHE_ENV, cache_root, private_dir
from polyengine.errors import InvalidRequest

__all__ = ["use_compile_cache"]


def use_compile_cache(value: str) -> Path | None:
    """Point JAX's persistent compilation cache at the folder option ``compile_cache``
    names (``""``: leave JAX's setting alone); return the folder in use, or None."""
    current = jax.config.jax_compilation_cache_dir
    if not value:
        return Path(current) if current else None
    path = cache_root() / "jax" if value == "auto" else Path(os.path.expanduser(value))
    if not path.is_absolute():
        raise InvalidRequest(f"option compile_cache={value!r} is a relative path; give an absolute one or 'auto'")
    path = private_dir(path, what="JAX compilation cache", env=CACHE_ENV)
    if current and Path(current).resolve() != path.resolve():
        raise InvalidRequest(f"option compile_cache={value!r}: this process already caches JAX's compiled programs in "
                             f"{current} (one folder per process); use that folder or start another process")
    if not current:
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path
