"""The CPU kernel library's build: compiler flags per ISA path, the cache key, the
compile, and the pruning of builds nobody uses any more.

The library is one translation unit, ``csrc/polyengine_cpu.cpp``, which includes the
headers beside it (one part each: ``docs/cpu-kernels.md``). A build is a cache entry
``<cache>/kernels/cpu-step-<isa>-<digest>-<cpu>.so`` with its signed record
(``polyengine.cache``: private folder, loaded only when the record matches), where

- ``<isa>`` is the ISA path (engine option ``isa``),
- ``<digest>`` covers everything the machine code depends on: every file in ``csrc/``,
  the path's compiler flags (:func:`isa_flags`) and the compiler's version
  (:func:`compiler_version`: the first line of ``$CXX --version``), so an edited
  source, another path or an upgraded compiler builds anew and never loads a stale
  library,
- ``<cpu>`` is a digest of this CPU's ISA flags (a cache shared by several hosts keeps
  one build per CPU kind).

Without a compiler (none installed any more) the newest intact build of the same sources
and flags for this CPU is loaded, whichever compiler made it: its record keeps the
sources' digest apart (:func:`source_digest`).

Builds of one kind (the same ``<isa>`` and ``<cpu>``) with another digest are the old
builds: :func:`prune` removes them when a new build lands, once nobody has loaded them
for :data:`PRUNE_UNUSED_S` (a load marks its build used), so two installs used in turn
do not rebuild each other's kernels. It never removes a file while another process may
be between checking and loading it: every load holds a shared lock on the folder's lock
file (:func:`cache_lock`) and pruning takes it exclusively, or skips this time. Removing
a library a process has already mapped is harmless (the mapping keeps the file alive);
truncating one would not be, and nothing here does.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator

from polyengine.cache import cache_root, check, private_dir
from polyengine.errors import UnsafeCache
from polyengine.hostinfo import cpu_flags

__all__ = ["KernelsUnavailable", "isa_flags", "compiler", "compiler_version", "compile_library", "source_digest",
           "cache_entry", "cache_lock", "mark_used", "prune", "SOURCE", "PRUNE_UNUSED_S"]

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "polyengine_cpu.cpp"  # the one translation unit: includes every header of csrc/
PRUNE_UNUSED_S = 24 * 3600
LOCK_NAME = "cpu-step.lock"
_COMPILE_SECONDS = 300
_VERSION_SECONDS = 60


class KernelsUnavailable(RuntimeError):
    """The kernels cannot be built or loaded here; the message says why and names the fix."""


def _cache_dir() -> Path:
    """The kernel cache: private to this user (``polyengine.cache``: created 0700, refused
    when someone else could write it), under ``$POLYENGINE_CACHE`` or ``~/.cache/polyengine``."""
    return private_dir(cache_root() / "kernels", what="CPU kernel cache")


def _isa_tag() -> str:
    flags = " ".join(sorted(cpu_flags()))
    return hashlib.blake2b((platform.machine() + flags).encode(), digest_size=6).hexdigest()


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def isa_flags(isa: str) -> list[str]:
    """The compiler flags of an ISA path (docs/decisions.md, "forced ISA paths").

    "auto" is ``-march=native``: everything this CPU has. A forced path names a fixed
    target so that its instructions are those of the hosts it stands for, whatever the
    host it runs on: "avx2" is ``-march=haswell`` (AVX2, FMA: the AVX2-only hosts; no
    AVX-VNNI even where the host has it), "scalar" ``-march=x86-64`` (SSE2, the vector
    extensions' 8-float fallback), "avx512" ``-march=skylake-avx512`` plus VNNI and BF16
    where this CPU has them (never AMX). Each keeps ``-mtune=native``, so a forced path
    differs from "auto" in its instructions, not in its scheduling."""
    if isa == "auto":
        return ["-march=native"]
    if not _x86():
        return []  # off x86 only "scalar" exists: the compiler's default target
    march = {"avx512": "skylake-avx512", "avx2": "haswell", "scalar": "x86-64"}[isa]
    flags = [f"-march={march}", "-mtune=native"]
    if isa == "avx512":
        flags += [f for flag, f in (("avx512_vnni", "-mavx512vnni"), ("avx512_bf16", "-mavx512bf16"))
                  if flag in cpu_flags()]
    return flags


def compiler() -> str:
    """``$CXX``, else the first of g++, c++ and clang++ on the PATH."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise KernelsUnavailable("no C++ compiler found (g++, c++ or clang++); fix: install one (Debian/Ubuntu: "
                                 "apt-get install g++; Fedora: dnf install gcc-c++) or set CXX to one")
    return cxx


def compiler_version(cxx: str) -> str:
    """The first line of ``cxx --version`` ("g++ (Debian 12.2.0-14+deb12u1) 12.2.0"): the
    vendor, version and distribution patch level, so any upgrade changes the cache key.
    Asked once per compiler binary (path, size and modification time) and process."""
    exe = shutil.which(cxx) or cxx
    try:
        st = os.stat(exe)
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        stamp = None
    return _version(exe, stamp)


@functools.lru_cache(maxsize=16)
def _version(exe: str, stamp: tuple[int, int, int] | None) -> str:
    try:
        proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=_VERSION_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelsUnavailable(f"running the C++ compiler {exe} --version failed ({exc}); fix: install g++ or "
                                 f"set CXX to a working compiler") from None
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise KernelsUnavailable(f"the C++ compiler {exe} did not report its version ({exe} --version: exit "
                                 f"{proc.returncode}, {proc.stderr.strip()[-300:] or 'no output'}); fix: set CXX to "
                                 f"a working g++ or clang++")
    return lines[0]


def compile_library(cxx: str, target: Path, isa: str = "auto") -> None:
    """Compile :data:`SOURCE` for ISA path ``isa`` into ``target``, or raise
    :class:`KernelsUnavailable` with the command, the compiler's errors and the fix."""
    cmd = [cxx, "-O3", *isa_flags(isa), "-fopenmp", "-shared", "-fPIC", "-I", str(CSRC), "-o", str(target),
           str(SOURCE)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_SECONDS)
    except subprocess.TimeoutExpired:
        raise KernelsUnavailable(f"compiling {SOURCE.name} took over {_COMPILE_SECONDS} s: {' '.join(cmd)}; fix: "
                                 f"retry on a less busy machine (the result is cached)") from None
    except OSError as exc:
        raise KernelsUnavailable(f"running the C++ compiler {cxx} failed ({exc.strerror or exc}); fix: install g++ "
                                 f"or set CXX to a working compiler") from None
    if proc.returncode != 0 or not target.exists() or target.stat().st_size == 0:
        raise KernelsUnavailable(f"compiling {SOURCE.name} failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}\nfix: "
                                 f"set CXX to another compiler (g++ >= 9 or clang >= 10), or option "
                                 f"cpu_kernels=False to use torch's matmul without this warning")


def _sources() -> list[Path]:
    return [p for p in sorted(CSRC.iterdir()) if p.suffix in (".cpp", ".h")]


def source_digest(isa: str = "auto") -> str:
    """A digest of every kernel source and the compiler flags of ISA path ``isa``: the
    cache key less the compiler (kept in each build's record)."""
    code = b"".join(p.read_bytes() for p in _sources()) + " ".join(isa_flags(isa)).encode()
    return hashlib.blake2b(code, digest_size=8).hexdigest()


def cache_entry(isa: str = "auto") -> tuple[Path, list[str]]:
    """Where this host's library for ISA path ``isa`` lives in the cache (named by a
    digest of every kernel source, the path's compiler flags and the compiler's version,
    and the CPU's ISA flags) and the sources it is built from. Without a compiler, the
    newest intact build of the same sources and flags for this CPU, whichever compiler
    made it (none: :class:`KernelsUnavailable` saying to install one)."""
    names = [p.name for p in _sources()]
    code = source_digest(isa)
    try:
        folder = _cache_dir()
    except UnsafeCache as exc:
        raise KernelsUnavailable(str(exc)) from None
    try:
        version = compiler_version(compiler())
    except KernelsUnavailable:
        built = _built_before(folder, isa, code)
        if built is None:
            raise
        return built, names
    digest = hashlib.blake2b(f"{code}\0{version}".encode(), digest_size=8).hexdigest()
    return folder / f"cpu-step-{isa}-{digest}-{_isa_tag()}.so", names


def _built_before(folder: Path, isa: str, code: str) -> Path | None:
    ours = re.compile(rf"cpu-step-{re.escape(isa)}-[0-9a-f]{{16}}-{_isa_tag()}\.so")
    found = []
    for entry in os.scandir(folder):
        if ours.fullmatch(entry.name):
            record, _ = check(entry.path)
            if record is not None and record.get("source_digest") == code:
                found.append(Path(entry.path))
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


@contextlib.contextmanager
def cache_lock(folder: Path) -> Iterator[int | None]:
    """A shared lock on ``folder``'s lock file for a whole load (check, compile, store,
    mark, ``dlopen``): :func:`prune` cannot remove a build meanwhile. Yields the lock's
    descriptor for :func:`prune`, or None where the lock file cannot be opened (a
    read-only cache: loads go on, nothing is pruned)."""
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        yield None
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield fd
    finally:
        os.close(fd)


def mark_used(path: Path) -> None:
    """Record that ``path`` is loaded now (its modification time; its bytes and the signed
    record stay as they are), so :func:`prune` keeps it."""
    with contextlib.suppress(OSError):  # a read-only cache: then nothing is pruned either
        os.utime(path)


def prune(current: Path, lock: int | None, *, unused_for: float | None = None) -> list[Path]:
    """Remove the builds of ``current``'s kind (ISA path and CPU) with another digest that
    nobody has loaded for ``unused_for`` seconds (default :data:`PRUNE_UNUSED_S`), with
    their records, and this kind's temporary files older than that (left by a killed
    compile). Only regular files of this user whose names are this module's own; only
    while holding the cache lock exclusively (``lock`` from :func:`cache_lock`; when
    another process holds it, this skips and a later build prunes). Returns what was
    removed."""
    m = re.fullmatch(r"cpu-step-(.+)-([0-9a-f]{16})-([0-9a-f]{12})\.so", current.name)
    if lock is None or m is None:
        return []
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return []
    isa, digest, tag = m.groups()
    ours = re.compile(rf"(\.?)cpu-step-{re.escape(isa)}-([0-9a-f]{{16}})-{tag}\.so(\.json)?(\.[0-9]+\.tmp)?")
    try:
        entries = list(os.scandir(current.parent))
    except OSError:
        return []
    cutoff = time.time() - (PRUNE_UNUSED_S if unused_for is None else unused_for)
    builds: dict[str, list[tuple[Path, os.stat_result]]] = {}
    stale: list[Path] = []
    for entry in entries:
        name = ours.fullmatch(entry.name)
        if name is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not entry.is_file(follow_symlinks=False) or st.st_uid != os.geteuid():
            continue
        dot, other, _, tmp = name.groups()
        if bool(dot) != bool(tmp):
            continue  # not a name this module writes
        if tmp:
            if st.st_mtime < cutoff:
                stale.append(Path(entry.path))
        elif other != digest:
            builds.setdefault(other, []).append((Path(entry.path), st))
    for files in builds.values():
        if max(st.st_mtime for _, st in files) < cutoff:  # the library's mtime: its last load
            stale += [p for p, _ in sorted(files, key=lambda f: f[0].suffix == ".json")]  # library first
    removed = []
    for p in stale:
        try:
            p.unlink()
        except OSError:  # gone already, or a read-only cache: pruning never fails a load
            continue
        removed.append(p)
    return removed
