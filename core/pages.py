"""K/V pages: fixed-size runs of cache positions, shared between sequences by reference count.

An engine that declares ``Capabilities.page_size`` keeps its K/V in pages of that many
positions. A running sequence (a slot) and a :class:`~polyengine.protocol.Prefix` are
each a :class:`PageList`: page ids plus a length. Inserting a prefix into a slot, or
continuing it, shares the prefix's pages (their counts go up) instead of copying their
K/V; a page is written only while exactly one holder references it, so the first write
into a shared, partly filled last page copies it (copy on write). A page whose count
falls to zero returns to the pool and may be handed out again. docs/design.md ("Pages")
states the rules; this module keeps the counts and checks them, and holds no K/V: the
engine keeps the pages' contents wherever it likes (host arrays, device buffers) and
indexes them by page id.

Pure Python: the core never imports an array framework.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import weakref
from typing import Callable, Iterable, Sequence

from polyengine.errors import InsufficientMemory, InvalidRequest

__all__ = ["DEFAULT_PAGE_SIZE", "PagePool", "PageList", "PageError", "pages_for", "check_owner", "page_keys",
           "common_pages"]

# Tokens per page unless a backend states another size (vLLM's and SGLang's default block).
DEFAULT_PAGE_SIZE = 16


class PageError(RuntimeError):
    """A broken page rule (a release of a free page, a write into a shared one): an
    engine bug, never a request's fault."""


def pages_for(length: int, page_size: int) -> int:
    """Pages that ``length`` positions fill (the last one possibly in part)."""
    return -(-int(length) // int(page_size))


def page_keys(tokens: Sequence[int], page_size: int, *, fingerprint: str) -> list[str]:
    """The keys of ``tokens``' full pages of ``page_size`` positions under a model
    (``fingerprint``: its config and weights, ``Model.fingerprint``): key ``i`` (hex)
    names tokens ``[0, (i + 1) * page_size)`` of that model, so two prompts' keys agree
    exactly as far as their full pages do. A chained BLAKE2b-128: key ``i`` hashes key
    ``i - 1`` (the first hashes the page size and the fingerprint) and page ``i``'s ids
    as little-endian int32; a partly filled last page has no key (its K/V are not
    shared whole). A sender of a portable prefix and its receiver compare keys to find
    the leading full pages the receiver holds (:func:`common_pages`) and send only the
    rest (``PortablePrefix.tail``)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise InvalidRequest(f"page_size must be an integer >= 1, got {page_size!r}", field="page_size")
    ids = [int(t) for t in tokens]
    seed = hashlib.blake2b(f"polyengine.pages/{page_size}/{fingerprint}".encode(), digest_size=16).digest()
    keys, prev = [], seed
    for i in range(len(ids) // page_size):
        page = ids[i * page_size: (i + 1) * page_size]
        try:
            body = struct.pack(f"<{page_size}i", *page)
        except struct.error:
            raise InvalidRequest(f"token ids must be int32 values, got one of {page}", field="tokens") from None
        prev = hashlib.blake2b(prev + body, digest_size=16).digest()
        keys.append(prev.hex())
    return keys


def common_pages(keys: Sequence[str], held: Sequence[str]) -> int:
    """How many leading full pages two key lists (:func:`page_keys`, same page size and
    model) share: a sender's tail starts at that many pages times the page size."""
    n = 0
    for a, b in zip(keys, held):
        if a != b:
            break
        n += 1
    return n


class PagePool:
    """Page ids and their reference counts. ``capacity`` pages at most (None: as many as
    are asked for, for a host engine whose memory check counted its caches already).

    A page is free (count 0, on the free list) or held (count >= 1). :meth:`allocate`
    hands out free pages at count 1, lowest id first, so a page that was released is the
    next one reused; :meth:`share` adds a holder; :meth:`release` drops one and frees the
    page at zero. Releasing a free page, or sharing one, is :class:`PageError`.

    The counts change under one lock: an engine's prefill lane (docs/design.md, "The
    prefill lane") takes and shares pages on its own thread while the driver's thread
    inserts, frees and steps, and a :class:`PageList`'s finalizer releases on whichever
    thread collects it (re-entrant, so a collection inside a change is safe). A backend
    may take :attr:`lock` too, to make its storage for a new id with the id.
    """

    def __init__(self, page_size: int = DEFAULT_PAGE_SIZE, capacity: int | None = None):
        if int(page_size) < 1:
            raise ValueError(f"a page holds at least one position, got page_size={page_size}")
        if capacity is not None and int(capacity) < 0:
            raise ValueError(f"a page pool's capacity must be >= 0 pages, got {capacity}")
        self.page_size = int(page_size)
        self.capacity = None if capacity is None else int(capacity)
        self._refs: list[int] = []  # by page id; 0: free
        self._free: list[int] = []  # free ids, kept sorted descending so pop() gives the lowest
        self.lock = threading.RLock()

    # -- counts ---------------------------------------------------------------------------

    @property
    def allocated(self) -> int:
        """Pages ever created (held or free)."""
        return len(self._refs)

    @property
    def held(self) -> int:
        """Pages with at least one holder."""
        return len(self._refs) - len(self._free)

    @property
    def free(self) -> int | None:
        """Pages :meth:`allocate` can still hand out (None: unbounded)."""
        return None if self.capacity is None else self.capacity - self.held

    def storage_size(self, have: int | None, first: int) -> int | None:
        """The pages a backend's K/V storage must hold now, or None when its ``have`` pages
        (None: no storage yet) already cover every id handed out. Bounded: the capacity at
        once. Unbounded: ``first`` pages first (every slot's full context, what a contiguous
        cache holds), then half as many again whenever more ids are out."""
        if have is not None and self.allocated <= have:
            return None
        if self.capacity:
            return self.capacity
        return max(self.allocated, first if not have else have + have // 2)

    @property
    def shared(self) -> int:
        """Pages with more than one holder (a prefix and the slots continuing it, say)."""
        return sum(1 for r in self._refs if r > 1)

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._refs[page]

    def counts(self) -> list[int]:
        """Every page's count by id (0: free): what :meth:`from_counts` rebuilds."""
        with self.lock:
            return list(self._refs)

    @classmethod
    def from_counts(cls, page_size: int, capacity: int | None, counts: Iterable[int]) -> "PagePool":
        """A pool holding ``counts`` (:meth:`counts` of another): a copy for reading, such as
        a multi-host engine's leader keeps of the pool its workers hold."""
        pool = cls(page_size, capacity)
        pool._refs = [int(c) for c in counts]
        if any(c < 0 for c in pool._refs):
            raise PageError(f"a page count is negative in {pool._refs}")
        pool._free = [p for p in range(len(pool._refs) - 1, -1, -1) if pool._refs[p] == 0]
        return pool

    # -- lifetimes ------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` pages at count 1: freed pages first (lowest id first), then new ids.
        Refuses (InsufficientMemory, nothing allocated) when fewer than ``n`` are free."""
        with self.lock:
            n = int(n)
            if n < 0:
                raise ValueError(f"cannot allocate {n} pages")
            if self.capacity is not None and self.held + n > self.capacity:
                raise InsufficientMemory(
                    f"the K/V page pool has {self.free} free pages of {self.page_size} positions and "
                    f"{n} were asked for (capacity {self.capacity}); finish or preempt a sequence first",
                    needed=None, available=None, where="the K/V page pool")  # counted in pages, not bytes
            out = []
            for _ in range(n):
                if self._free:
                    page = self._free.pop()
                else:
                    page = len(self._refs)
                    self._refs.append(0)
                self._refs[page] = 1
                out.append(page)
            return out

    def share(self, pages: Iterable[int]) -> None:
        """One more holder for each of ``pages`` (each must be held)."""
        with self.lock:
            pages = list(pages)
            for page in pages:
                if self.refcount(page) < 1:
                    raise PageError(f"page {page} is free: only a held page may be shared")
            for page in pages:
                self._refs[page] += 1

    def release(self, pages: Iterable[int]) -> list[int]:
        """One holder fewer for each of ``pages``; returns the pages this freed. A page
        released more often than it was held is PageError (checked before any change)."""
        with self.lock:
            pages = list(pages)
            drops: dict[int, int] = {}
            for page in pages:
                drops[page] = drops.get(page, 0) + 1
            for page, n in drops.items():
                if self.refcount(page) < n:
                    raise PageError(f"page {page} released {n} time(s) but held by {self._refs[page]}: "
                                    f"a double free would hand out a page still in use")
            freed = []
            for page in pages:
                self._refs[page] -= 1
                if self._refs[page] == 0:
                    freed.append(page)
            if freed:
                self._free = sorted(self._free + freed, reverse=True)
            return freed

    def writable(self, page: int, copy: Callable[[int, int], None]) -> int:
        """The page to write in place of ``page`` (held): ``page`` itself when its holder
        is the only one, else a fresh page that ``copy(src, dst)`` fills with its contents
        (copy on write; the caller's reference moves from ``page`` to the copy)."""
        with self.lock:
            if self.refcount(page) < 1:
                raise PageError(f"page {page} is free: nothing may write into it")
            if self._refs[page] == 1:
                return page
            (dst,) = self.allocate(1)
            copy(page, dst)
            self._refs[page] -= 1
            return dst

    def _check_id(self, page: int) -> None:
        if not isinstance(page, int) or not 0 <= page < len(self._refs):
            raise PageError(f"page {page!r} was never allocated by this pool")


class PageList:
    """A sequence's K/V as pages: ``pages[i]`` holds positions ``[i * page_size,
    (i + 1) * page_size)``; ``length`` positions are filled. It holds one reference to
    each of its pages until :meth:`release` (or, with ``finalize``, until it is garbage:
    how a :class:`~polyengine.protocol.Prefix`, valid for as long as anyone keeps it,
    gives its pages back)."""

    def __init__(self, pool: PagePool, pages: list[int], length: int, *, finalize: bool = False):
        if len(pages) < pages_for(length, pool.page_size):
            raise PageError(f"{len(pages)} pages cannot hold {length} positions of {pool.page_size}")
        self.pool, self.pages, self.length = pool, list(pages), int(length)
        self._finalizer = weakref.finalize(self, _release_quietly, pool, self.pages) if finalize else None

    @classmethod
    def new(cls, pool: PagePool, length: int = 0, *, finalize: bool = False) -> "PageList":
        """Fresh pages for ``length`` positions."""
        return cls(pool, pool.allocate(pages_for(length, pool.page_size)), length, finalize=finalize)

    @classmethod
    def continuing(cls, pool: PagePool, head: "PageList | None") -> "PageList":
        """The page list a prefill writes its new prefix into: a holder of ``head``'s pages
        (the prefix it continues; shared, a partly filled last one copied on its first
        write), or an empty one from position 0; released when it is garbage."""
        return head.fork(finalize=True) if head is not None else cls(pool, [], 0, finalize=True)

    def fork(self, length: int | None = None, *, finalize: bool = False) -> "PageList":
        """A new holder of this list's first ``length`` positions (all by default): it
        shares their pages (the partly filled last one too, copied on its first write)."""
        length = self.length if length is None else int(length)
        if not 0 <= length <= self.length:
            raise PageError(f"cannot fork {length} positions of a page list holding {self.length}")
        pages = self.pages[: pages_for(length, self.pool.page_size)]
        self.pool.share(pages)
        return PageList(self.pool, pages, length, finalize=finalize)

    def prepare_write(self, start: int, end: int, copy: Callable[[int, int], None]) -> None:
        """Make positions ``[start, end)`` writable by this holder alone: pages are added
        to reach ``end`` and each page the range touches that another holder shares is
        copied first. ``length`` becomes at least ``end``."""
        ps = self.pool.page_size
        need = pages_for(end, ps) - len(self.pages)
        if need > 0:
            self.pages.extend(self.pool.allocate(need))
        for i in range(start // ps, pages_for(end, ps)):
            self.pages[i] = self.pool.writable(self.pages[i], copy)
        self.length = max(self.length, int(end))

    def pages_to_write(self, start: int, end: int) -> int:
        """Pages :meth:`prepare_write` of ``[start, end)`` would take from the pool now: new
        ones past the last, and a copy of each touched page another holder shares."""
        ps = self.pool.page_size
        last = pages_for(end, ps)
        copies = sum(1 for i in range(start // ps, min(last, len(self.pages))) if self.pool.refcount(self.pages[i]) > 1)
        return max(0, last - len(self.pages)) + copies

    def release(self) -> None:
        """Give every page back (once; the list is empty afterwards)."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        pages, self.pages, self.length = self.pages, [], 0
        self.pool.release(pages)


def _release_quietly(pool: PagePool, pages: list[int]) -> None:
    """A finalizer's release: ``pages`` is the list object the holder kept (copy on write
    replaces its entries in place), released as it stands when the holder is collected."""
    pool.release(pages)


def check_owner(pages: PagePool | None, seq: PageList | None, backend: str) -> None:
    """A prefix's pages (``seq``; None for contiguous K/V) belong to the pool of the engine
    that made it (``pages``; None for an engine without pages): another engine of the same
    weights must not read them."""
    if (seq is not None) != (pages is not None) or (seq is not None and seq.pool is not pages):
        raise InvalidRequest(f"prefix's K/V live in another {backend} engine's pages (or this engine's hold "
                             f"none); move it with export_prefix/import_prefix")
