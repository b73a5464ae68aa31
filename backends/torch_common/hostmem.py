"""KV cache memory on the host that grows with use and is given back on free.

A decode state's cache is ``[layers, slots, kv_heads, positions, head_dim]``, sized for
every slot at the full context. ``torch.zeros`` writes every byte of it, so a CPU engine
held all of it from the start (2.8 GiB for the default model's 32 x 2048). Here the
cache is an anonymous memory map instead: the kernel hands out zero pages as they are
first written, so what is resident is what the slots have written (one page per 4 KiB of
each ``(layer, slot, kv_head)`` run of positions, rounded up), and :func:`release_row`
gives a freed slot's pages back (``madvise(MADV_DONTNEED)``: they read as zeros again,
exactly what ``torch.zeros`` held). The contents are the same as before at every step;
only what the process holds changes. Reads of never-written positions (attention over
a ``kv_block`` rounded length) read the shared zero page and hold nothing.

Linux only (``MADV_DONTNEED`` on private anonymous maps is what makes the pages zero
again); elsewhere, and on accelerators, :func:`new_cache_tensor` is ``torch.zeros``.
See docs/cpu.md and docs/benchmarks/2026-11-cpu-paths.md (KV cache memory).

:class:`HostArena` is weight memory the same way: one anonymous map for many tensors made
once (the cpu backend's repacked block weights), optionally aligned to 2 MiB and marked
``MADV_HUGEPAGE`` so that the kernel backs it with transparent huge pages where the host
allows them (``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or
``always``): a decode step that streams the whole model then walks 2 MiB pages instead of
4 KiB ones (docs/cpu.md, "Weights in huge pages").
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import re
import sys
import threading
import weakref

import torch

__all__ = ["new_cache_tensor", "release_row", "resident_bytes", "mapping_fields", "lazy", "grows_with_use", "HostArena",
           "transparent_huge_pages", "huge_pages_available", "HUGE_PAGE"]

_PAGE = mmap.PAGESIZE
# data_ptr -> the map behind a lazily backed cache tensor, weakly: the map lives as long as
# any tensor on its memory (their storage holds it), whichever Python object that is
_MAPS: dict[int, weakref.ref] = {}
_LOCK = threading.Lock()


def grows_with_use(device: torch.device) -> bool:
    """Whether :func:`new_cache_tensor` on ``device`` holds pages only as they are written."""
    return torch.device(device).type == "cpu" and sys.platform.startswith("linux") and hasattr(mmap, "MADV_DONTNEED")


def new_cache_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor of ``shape``; on a Linux host, backed by pages made on first write."""
    device = torch.device(device)
    if not grows_with_use(device):
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for n in shape:
        numel *= int(n)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # A guard page on each side, mapped PROT_NONE: the kernel merges neighbouring
    # anonymous maps of the same protection into one region, and the cache's own region
    # is what /proc/self/smaps reports for it (resident_bytes).
    # The tensor's storage is the region between them only: whatever reads a tensor's
    # whole storage (pickle, deepcopy) never touches a guard page.
    span = -(-nbytes // _PAGE) * _PAGE
    mm = mmap.mmap(-1, span + 2 * _PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    inner = torch.frombuffer(memoryview(mm)[_PAGE:_PAGE + span], dtype=torch.uint8)  # keeps mm alive
    for start in (inner.data_ptr() - _PAGE, inner.data_ptr() + span):
        if _libc().mprotect(ctypes.c_void_p(start), ctypes.c_size_t(_PAGE), 0) != 0:  # PROT_NONE
            raise OSError(ctypes.get_errno(), "mprotect of a KV cache guard page failed")
    t = inner[:nbytes].view(dtype).view(shape)
    with _LOCK:
        for key in [k for k, ref in _MAPS.items() if ref() is None]:
            del _MAPS[key]
        _MAPS[t.data_ptr()] = weakref.ref(mm)
    return t


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _LIBC


def _map_of(t: torch.Tensor) -> mmap.mmap | None:
    with _LOCK:
        ref = _MAPS.get(t.data_ptr())
    return None if ref is None else ref()


def lazy(t: torch.Tensor) -> bool:
    """Whether ``t`` is a cache tensor made by :func:`new_cache_tensor` on the host."""
    return _map_of(t) is not None


def release_row(t: torch.Tensor, row: int) -> int:
    """Give back the pages of cache row ``row`` (dimension 1) of a lazily backed cache:
    they read as zeros afterwards. Pages shared with a neighbouring row's data are kept
    (and so are their contents). Returns the bytes released; 0 for any other tensor."""
    mm = _map_of(t)
    if mm is None:
        return 0
    if not t.is_contiguous():
        raise ValueError("release_row needs the contiguous cache tensor it allocated")
    layers, rows = t.shape[0], t.shape[1]
    run = t[0, 0].numel() * t.element_size()  # one (layer, row): kv_heads x positions x head_dim
    released = 0
    for layer in range(layers):
        start = (layer * rows + row) * run
        lo = -(-start // _PAGE) * _PAGE  # whole pages inside the run only
        hi = (start + run) // _PAGE * _PAGE
        if hi > lo:
            mm.madvise(mmap.MADV_DONTNEED, _PAGE + lo, hi - lo)  # after the guard page
            released += hi - lo
    return released


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s memory map the process holds now (``Rss`` of its mapping in
    ``/proc/self/smaps``); for a tensor not made by :func:`new_cache_tensor`, its size."""
    if _map_of(t) is None:
        return t.numel() * t.element_size()
    rss = mapping_fields(t.data_ptr()).get("Rss")
    return 0 if rss is None else int(rss.split()[0]) * 1024


def mapping_fields(ptr: int) -> dict[str, str]:
    """The ``/proc/self/smaps`` fields (``Rss``, ``AnonHugePages``, ``VmFlags``, ...) of
    this process's mapping that holds address ``ptr``, as text; empty where none does."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                if inside:
                    break
                lo, _, hi = head.partition("-")
                inside = int(lo, 16) <= ptr < int(hi, 16)
            elif inside:
                name, _, value = line.partition(":")
                fields[name] = value.strip()
    return fields


# -- weight memory in one map, huge pages where the host has them ----------------------------

HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB granule) PMD size
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_pages(path: str = THP_SETTING) -> str:
    """The host's transparent huge page mode for anonymous memory (``always``, ``madvise``,
    ``never``), ``""`` where there is none to read (not Linux, no THP)."""
    try:
        with open(path, encoding="ascii") as f:
            found = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return ""
    return found.group(1) if found else ""


def huge_pages_available() -> bool:
    """Whether :class:`HostArena` ``(huge=True)`` gets huge pages here: Linux with THP in
    ``madvise`` or ``always`` mode (``never``: the advice would change nothing)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and transparent_huge_pages() in ("always", "madvise")


class HostArena:
    """``nbytes`` of host memory in one private anonymous map, handed out by :meth:`take`
    in pieces aligned to 64 bytes. With ``huge`` the map is aligned to :data:`HUGE_PAGE`
    and advised ``MADV_HUGEPAGE``. Pages are made as they are first written (a piece never
    taken holds nothing); the map lives as long as any tensor taken from it."""

    ALIGN = 64

    def __init__(self, nbytes: int, *, huge: bool) -> None:
        align = HUGE_PAGE if huge else _PAGE
        span = max(align, -(-nbytes // align) * align)
        try:
            mm = mmap.mmap(-1, span + align, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:
            if exc.errno == errno.ENOMEM:
                raise MemoryError(f"cannot map {nbytes:,} bytes of host memory") from None
            raise
        whole = torch.frombuffer(mm, dtype=torch.uint8)  # its storage keeps mm alive
        start = (-whole.data_ptr()) % align
        if huge:
            mm.madvise(mmap.MADV_HUGEPAGE, start, span)
        self.huge, self.nbytes, self.used = huge, nbytes, 0
        self._memory = whole[start:start + span]

    @classmethod
    def size_of(cls, sizes) -> int:
        """The arena bytes that pieces of ``sizes`` take, each aligned."""
        return sum(-(-int(n) // cls.ALIGN) * cls.ALIGN for n in sizes)

    def take(self, nbytes: int) -> torch.Tensor:
        """The next ``nbytes`` as a uint8 tensor (64-byte aligned)."""
        end = self.used + -(-nbytes // self.ALIGN) * self.ALIGN
        if end > self.nbytes:
            raise ValueError(f"the arena has {self.nbytes - self.used:,} of its {self.nbytes:,} bytes left, "
                             f"{nbytes:,} asked")
        piece, self.used = self._memory[self.used:self.used + nbytes], end
        return piece
