"""The cpu backend's kernel cache follows ``polyengine.cache``: a library is ``dlopen``'ed only
when this user's signed record matches it; a truncated, empty, planted or foreign one is
compiled again, and a cache directory others can write is refused with the fix.

Each test has a private cache of its own and a stand-in compiler (``CXX``) that copies
the real library, built once for this host, to its ``-o`` target and counts its runs, so
a rebuild costs a copy, not a compile (``--version``, asked for the cache key, is not
counted). A damaged entry is made before anything at its path is loaded in this
process: truncating a library some process has mapped is what SIGBUSes that process,
and is exactly what the cache must never lead to.
"""

from __future__ import annotations

import os
import shutil
import stat
import warnings

import pytest

pytest.importorskip("torch")

from polyengine.cache import check, store  # noqa: E402
from polyengine.errors import FallbackWarning  # noqa: E402

from polyengine.backends.cpu import kernels as cpu_kernels  # noqa: E402


@pytest.fixture(scope="module")
def real_library():
    try:
        return cpu_kernels.load(1).path
    except cpu_kernels.KernelsUnavailable as exc:
        pytest.skip(f"the CPU kernels cannot be built here: {exc}")


class Cache:
    def __init__(self, root, log):
        self.root, self.log = root, log

    @property
    def compiles(self) -> int:
        return len(self.log.read_text().splitlines()) if self.log.exists() else 0

    @property
    def path(self):
        return cpu_kernels.cache_entry()[0]


@pytest.fixture
def cache(tmp_path, monkeypatch, real_library):
    log = tmp_path / "compiles.log"
    cxx = tmp_path / "fake-c++"
    cxx.write_text("#!/bin/sh\n"
                   '[ "$1" = --version ] && { echo "fake-c++ 1.0"; exit 0; }\n'
                   'while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
                   f"echo compiled >> '{log}'\n"
                   f"cp '{real_library}' \"$out\"\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("POLYENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    return Cache(tmp_path / "cache", log)


def _load_quietly():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernels = cpu_kernels.load(1)
    return kernels, [str(w.message) for w in caught]


def test_a_cold_cache_compiles_once_and_is_private(cache):
    kernels, _ = _load_quietly()
    assert cache.compiles == 1 and kernels.vector_width > 0
    assert check(kernels.path)[1] == "ok"
    assert stat.S_IMODE(os.stat(cache.root / "kernels").st_mode) == 0o700
    cpu_kernels._loaded.clear()
    _load_quietly()
    assert cache.compiles == 1  # signed and intact: loaded, not compiled


def _signed_copy(cache, real_library):
    """The real library stored at the expected path with a valid record (never loaded)."""
    path = cache.path
    store(path, lambda tmp: shutil.copy(real_library, tmp))
    assert check(path)[1] == "ok"
    return path


@pytest.mark.parametrize("damage, reason", [
    (lambda p: os.truncate(p, p.stat().st_size // 2), "truncated"),
    (lambda p: os.truncate(p, 0), "has 0 bytes"),
    (lambda p: p.with_name(p.name + ".json").unlink(), "no signed record"),
], ids=["truncated", "empty", "no-record"])
def test_a_damaged_library_is_compiled_again_never_loaded(cache, real_library, damage, reason):
    path = _signed_copy(cache, real_library)
    damage(path)
    kernels, warned = _load_quietly()
    assert cache.compiles == 1, "the damaged library was loaded instead of rebuilt"
    assert any(reason in w and "compiling them again" in w for w in warned), warned
    assert check(path)[1] == "ok" and kernels.vector_width > 0


def test_an_empty_library_without_a_record_is_rebuilt(cache):
    path = cache.path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")  # what a crash mid-write left behind once, and was never rebuilt
    kernels, _ = _load_quietly()
    assert cache.compiles == 1 and path.stat().st_size > 0 and kernels.vector_width > 0


def test_a_planted_library_with_a_forged_record_is_never_loaded(cache, real_library, tmp_path):
    """Someone writes a library and a record with its true size and SHA-256; without this
    user's key the signature cannot match, so it is replaced, not dlopen'ed."""
    import hashlib
    import json

    path = _signed_copy(cache, real_library)
    planted = path.read_bytes()[:-16] + b"PLANTED-PAYLOAD!"  # any bytes: never mapped
    path.write_bytes(planted)
    side = path.with_name(path.name + ".json")
    record = json.loads(side.read_text())
    side.write_text(json.dumps({**record, "size": len(planted), "sha256": hashlib.sha256(planted).hexdigest()}))
    _, warned = _load_quietly()
    assert cache.compiles == 1 and not path.read_bytes().endswith(b"PLANTED-PAYLOAD!")
    assert any("signature is not this user's" in w for w in warned), warned


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_library_another_user_owns_is_compiled_again(cache, real_library):
    path = _signed_copy(cache, real_library)
    os.chown(path, 54321, -1)
    _, warned = _load_quietly()
    assert cache.compiles == 1 and path.stat().st_uid == os.geteuid()
    assert any("owned by uid 54321" in w for w in warned), warned


def test_a_cache_others_can_write_is_refused_and_the_engine_says_the_fix(cache):
    from polyengine import EngineConfig
    from polyengine.models import load_model

    from polyengine.backends.cpu.engine import CpuEngine

    (cache.root / "kernels").mkdir(parents=True)
    os.chmod(cache.root / "kernels", 0o777)
    with pytest.raises(cpu_kernels.KernelsUnavailable, match="writable by group and others.*fix: chmod 700"):
        cpu_kernels.load(1)
    with pytest.warns(FallbackWarning, match="torch's matmul.*fix: chmod 700"):
        eng = CpuEngine(load_model("random:tiny"), EngineConfig(max_slots=1, max_prefill_length=16, max_cache_length=32))
    assert eng.speed_paths()["decode"].endswith("(FALLBACK)") and "chmod 700" in eng.speed_paths()["kernels"]
    assert cache.compiles == 0


def test_without_a_compiler_the_engine_warns_with_the_fix_and_says_so_at_startup(cache, monkeypatch, caplog):
    import logging

    from polyengine import create_engine

    monkeypatch.delenv("CXX")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(cpu_kernels.KernelsUnavailable, match="no C\\+\\+ compiler found.*fix: install one"):
        cpu_kernels.load(1)
    with caplog.at_level(logging.INFO, logger="polyengine"), \
            pytest.warns(FallbackWarning, match="apt-get install g\\+\\+"):
        eng = create_engine("cpu", model="random:tiny", max_slots=1, max_prefill_length=16,
                            max_cache_length=32)
    paths = eng.speed_paths()
    assert paths["decode"].endswith("(FALLBACK)") and "install one" in paths["kernels"]
    # the startup lines: a warning naming the fix, and the paths on the polyengine logger
    assert any(r.levelno == logging.WARNING and "apt-get install g++" in r.getMessage() for r in caplog.records)
    assert any(r.name == "polyengine" and "backend cpu: device: cpu" in r.getMessage()
               and "FALLBACK" in r.getMessage() for r in caplog.records)
