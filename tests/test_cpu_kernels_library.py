"""The CPU kernels as a library (``backends/cpu/csrc``, ``build.py``, ``docs/cpu-kernels.md``):
one translation unit of self-contained headers; the struct layout checked at load (a
mismatch is a refusal, never a call with the wrong offsets); the compiler's version in
the cache key; old builds pruned, never one a load may be using.

The cache tests use a private cache and a stand-in compiler (``CXX``) that copies this
session's real library to its ``-o`` target and counts its runs, as
``test_kernel_cache.py`` does: a build costs a copy, not a compile. The only compiles
here are the session's "auto" library (shared through the kernel cache with the other
kernel tests) and one syntax-only pass over the headers.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import shutil
import subprocess
import time

import pytest

pytest.importorskip("torch")

from polyengine.cache import check  # noqa: E402

from polyengine.backends.cpu import build, kernels  # noqa: E402

from isa_paths import kernels_for  # noqa: E402

TWO_DAYS = 2 * 24 * 3600


@pytest.fixture(scope="module")
def real_library():
    return kernels_for("auto", threads=1).path


class FakeCompiler:
    """A ``CXX`` that answers ``--version`` with :attr:`version` and "compiles" by copying
    the real library; :meth:`upgrade` replaces it as a package manager would (a new file
    renamed over the old one)."""

    def __init__(self, folder, library):
        self.path, self.log, self.library = folder / "fake-c++", folder / "compiles.log", library
        self.upgrade("fake-c++ (polyengine tests) 12.2.0")

    def upgrade(self, version: str) -> None:
        self.version = version
        tmp = self.path.with_name("fake-c++.new")
        tmp.write_text("#!/bin/sh\n"
                       f'[ "$1" = --version ] && {{ echo "{version}"; echo "second line, not in the key"; exit 0; }}\n'
                       'while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
                       f"echo compiled >> '{self.log}'\n"
                       f"cp '{self.library}' \"$out\"\n")
        tmp.chmod(0o755)
        os.replace(tmp, self.path)

    @property
    def compiles(self) -> int:
        return len(self.log.read_text().splitlines()) if self.log.exists() else 0


@pytest.fixture
def cxx(tmp_path, monkeypatch, real_library):
    fake = FakeCompiler(tmp_path, real_library)
    monkeypatch.setenv("CXX", str(fake.path))
    monkeypatch.setenv("POLYENGINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(kernels, "_loaded", {})
    return fake


def _load():
    kernels._loaded.clear()
    return kernels.load(1)


def _age(*paths, seconds=TWO_DAYS):
    then = time.time() - seconds
    for p in paths:
        os.utime(p, (then, then), follow_symlinks=False)


def _record(path):
    return path.with_name(path.name + ".json")


# -- one translation unit of headers ----------------------------------------------------


def test_the_library_is_one_unity_file_of_self_contained_headers():
    """csrc/ holds one .cpp, which includes every header; no source includes a .cpp; and
    each header compiles on its own (it includes what it uses), for the ISA path "auto"."""
    files = sorted(p.name for p in build.CSRC.iterdir() if p.suffix in (".cpp", ".h"))
    assert [f for f in files if f.endswith(".cpp")] == [build.SOURCE.name]
    includes = {p.name: set(re.findall(r'^\s*#\s*include\s+"([^"]+)"', p.read_text(), flags=re.M))
                for p in build.CSRC.iterdir() if p.suffix in (".cpp", ".h")}
    assert includes[build.SOURCE.name] == {f for f in files if f.endswith(".h")}
    assert not any(i.endswith(".cpp") for found in includes.values() for i in found), includes
    headers = [str(build.CSRC / f) for f in files if f.endswith(".h")]
    cmd = [build.compiler(), "-fsyntax-only", "-x", "c++", *build.isa_flags("auto"), "-fopenmp", *headers]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 0 and not errors, proc.stderr[-3000:]


# -- the layout of the structs Python fills ----------------------------------------------


def test_the_library_reports_the_layout_that_python_fills(real_library):
    lib = kernels.load(1).lib
    have = kernels._library_layout(lib)
    assert have == kernels._mirror_layout({"pe_layer": kernels._Layer, "pe_dims": kernels._Dims})
    assert have["pe_dims"][""] == (0, ctypes.sizeof(kernels._Dims)) and len(have["pe_layer"]) == 27
    kernels.check_layout(lib, real_library)


class _DimsWithoutBf16(ctypes.Structure):  # the field added last, missing here
    _fields_ = [f for f in kernels._Dims._fields_ if f[0] != "bf16"]


class _DimsWithDoubleEps(ctypes.Structure):  # a field retyped here: every field after it moves
    _fields_ = [(n, ctypes.c_double if n == "eps" else t) for n, t in kernels._Dims._fields_]


@pytest.mark.parametrize("mirror, says", [
    (_DimsWithoutBf16, r"pe_dims\.bf16 is missing here"),  # sizeof is the same: bf16 sat in padding's place
    # the report names the first six differences (by name): eps, then some field after it, moved
    (_DimsWithDoubleEps, r"sizeof\(pe_dims\).*pe_dims\.eps is \(offset 64, 4 bytes\) in the library, \(offset 64, "
                         r"8 bytes\) here; .*pe_dims\.\w+ is \(offset \d+, 8 bytes\) in the library, "
                         r"\(offset \d+, 8 bytes\) here"),
], ids=["field-missing", "field-retyped"])
def test_a_layout_mismatch_is_a_refusal_not_a_crash(real_library, monkeypatch, mirror, says):
    """The session's cached library (no compile) against a ctypes mirror that disagrees:
    load refuses, naming each difference and the fix, and keeps nothing."""
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(kernels, "_Dims", mirror)
    with pytest.raises(kernels.KernelsUnavailable, match=says) as refused:
        kernels.load(1)
    assert "fix: reinstall polyengine" in str(refused.value) and kernels._loaded == {}


def test_a_library_that_cannot_report_its_layout_is_refused(tmp_path):
    """A library without ``pe_layout_field`` (here: the process's own symbols) is refused."""
    with pytest.raises(kernels.KernelsUnavailable, match="do not report their struct layout"):
        kernels.check_layout(ctypes.CDLL(None), tmp_path / "cpu-step-auto-0-0.so")


def test_a_struct_the_library_describes_and_python_lacks_is_refused(real_library):
    lib = kernels.load(1).lib
    with pytest.raises(kernels.KernelsUnavailable, match="pe_layer is not mirrored here"):
        kernels.check_layout(lib, real_library, {"pe_dims": kernels._Dims})


# -- the cache key and pruning ------------------------------------------------------------


def test_a_compiler_upgrade_builds_anew_and_prunes_the_old_build(cxx):
    """The first line of ``$CXX --version`` is in the key: an upgraded compiler builds a
    new library (its record says which compiler), and the build it replaces goes once
    nobody has loaded it for a day; a load marks its build used."""
    first = _load().path
    assert cxx.compiles == 1 and check(first)[0]["compiler_version"] == cxx.version
    _age(first, _record(first))
    _load()  # from the cache: no compile, but marked used
    assert cxx.compiles == 1 and time.time() - first.stat().st_mtime < 600
    cxx.upgrade("fake-c++ (polyengine tests) 13.1.0-1")
    assert build.cache_entry()[0] != first  # same sources and flags, another compiler
    second = _load().path
    assert cxx.compiles == 2 and check(second)[0]["compiler_version"] == cxx.version
    assert first.exists(), "a build loaded a moment ago was pruned"
    _age(first, _record(first))
    cxx.upgrade("fake-c++ (polyengine tests) 14.0.0-upgraded")
    third = _load().path
    assert cxx.compiles == 3 and not first.exists() and not _record(first).exists()
    assert second.exists() and third.exists()


def test_without_a_compiler_a_build_of_the_same_sources_still_loads(cxx, monkeypatch):
    """The key needs the compiler's version; with no compiler left, the build of the same
    sources and flags is loaded (as before the version joined the key), and where there is
    none the refusal says to install a compiler."""
    built = _load().path
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert _load().path == built and cxx.compiles == 1
    monkeypatch.setattr(build, "source_digest", lambda isa="auto": "0" * 16)  # edited sources
    with pytest.raises(kernels.KernelsUnavailable, match="no C\\+\\+ compiler found.*fix: install one"):
        _load()


def test_pruning_removes_only_old_builds_of_its_own_kind(cxx, tmp_path):
    folder = build._cache_dir()
    tag, other = build._isa_tag(), "0123456789ab"
    old = [folder / f"cpu-step-auto-{'1' * 16}-{tag}.so", folder / f"cpu-step-auto-{'1' * 16}-{tag}.so.json",
           folder / f".cpu-step-auto-{'2' * 16}-{tag}.so.4242.tmp"]  # a killed compile's leftover
    recent = [folder / f"cpu-step-auto-{'3' * 16}-{tag}.so",  # loaded a minute ago
              folder / f".cpu-step-auto-{'8' * 16}-{tag}.so.4343.tmp"]  # a compile under way
    kept = [*recent,
            folder / f"cpu-step-avx2-{'4' * 16}-{tag}.so",  # another ISA path
            folder / f"cpu-step-auto-{'5' * 16}-{other}.so",  # another CPU sharing the cache
            folder / f"cpu-step-auto-{'6' * 16}-{tag}.so.bak",  # a name the cache never writes
            folder / "notes.txt"]
    outside = tmp_path / "outside.so"
    outside.write_bytes(b"not ours")
    link = folder / f"cpu-step-auto-{'7' * 16}-{tag}.so"
    for p in old + kept:
        p.write_bytes(b"x")
    link.symlink_to(outside)
    _age(*old, *kept[len(recent):], link)
    _age(*recent, seconds=60)
    current = _load().path
    assert cxx.compiles == 1
    assert not any(p.exists() for p in old)
    assert all(p.exists() for p in kept) and link.is_symlink() and outside.read_bytes() == b"not ours"
    assert current.exists() and check(current)[1] == "ok"


def test_pruning_skips_while_another_load_holds_the_cache_lock(cxx):
    """A load holds the lock shared from its check to its dlopen; pruning needs it
    exclusively and skips meanwhile (a later build prunes), so it never removes a build
    between another process's check and its load."""
    folder = build._cache_dir()
    old = folder / f"cpu-step-auto-{'1' * 16}-{build._isa_tag()}.so"
    old.write_bytes(b"x")
    _age(old)
    other = os.open(folder / build.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)  # another process's load
    try:
        fcntl.flock(other, fcntl.LOCK_SH)
        current = _load().path
        assert cxx.compiles == 1 and old.exists()
    finally:
        os.close(other)
    with build.cache_lock(folder) as lock:
        assert build.prune(current, lock) == [old] and not old.exists()
