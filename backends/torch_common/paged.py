"""Paged K/V for the torch engines (option ``page_size``): the page pools and what
moves K/V between them, contiguous caches and page tables.

The pools are one K and one V tensor ``[layers, pages, kv_heads, page_size, head_dim]``
indexed by the page ids of a :class:`~polyengine.pages.PagePool` (the core keeps the
counts and the rules of docs/design.md, "Pages"; this module holds the contents). A slot
reads and writes through its row of the decode state's page table (``forward``'s
``page_table``); a :class:`~polyengine.protocol.Prefix` is a
:class:`~polyengine.pages.PageList`. A prefill still runs over a contiguous cache of its
own (so its attention, the cpu backend's host kernel included, is the contiguous
engine's), and its new positions are scattered into pages afterwards.

Threads: the page ids are the host's (a :class:`~polyengine.pages.PagePool` changes its
counts under a lock of its own). A decode step's copies and table rows are prepared on
the host (:meth:`PagedKV.prepare`) and applied first in the step (:meth:`PagedKV.apply`).
With the prefill lane (docs/design.md, "The prefill lane") a prefill writes its prefix's
pages on the lane's thread while a step writes its slots' pages: the pages differ (a
page is written only by its one holder), so both write at once, each inside
:meth:`PagedKV.using`. Growing the pools replaces the tensors (the old pages copied into
new ones), so it waits until no one writes and holds writers off while it runs; no
writer grows from inside :meth:`PagedKV.using` (each grows first).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import numpy as np
import torch

from polyengine.pages import PageList, PagePool, pages_for

from polyengine.backends.torch_common.transfer import to_device

__all__ = ["PagedKV", "PageOps", "TAIL_IMPORT"]

# What ``backends --verbose`` says of import_prefix_tail on the torch engines (cpu, cuda_torch).
TAIL_IMPORT = ("import_prefix_tail (capability portable_prefix_tail): with page_size the held prefix's pages below "
               "the tail's start are shared and only the tail is written; contiguous, a copy through the host")

# A step's page work: copies on write (src, dst) and the page-table rows that changed.
PageOps = tuple[list[tuple[int, int]], list[tuple[int, list[int]]]]


class PagedKV:
    """The page pools of one engine. ``new_pools(pages)`` allocates zeroed K and V pools of
    that many pages (the engine's allocation, with its out-of-memory message);
    ``first_size`` is how many pages an unbounded pool starts with."""

    def __init__(self, pool: PagePool, device: torch.device, new_pools: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 first_size: int):
        self.pool, self.device, self._new_pools, self._first_size = pool, device, new_pools, first_size
        self._tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        self._cond = threading.Condition()
        self._writers = 0  # threads inside using()
        self._growing = False
        self._inside = threading.local()  # this thread's depth in using()

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V pools, grown to every page id handed out so far (a caller that
        writes them while another thread may grow them does so inside :meth:`using`)."""
        self.grow()
        return self._tensors

    @contextlib.contextmanager
    def using(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The pools, grown to every page id handed out so far and kept (not replaced by a
        grow) until the block ends: read or write the pages you hold inside it. Threads
        inside it at once write different pages."""
        depth = getattr(self._inside, "depth", 0)
        if not depth:
            self.grow()
            with self._cond:
                while self._growing:
                    self._cond.wait()
                self._writers += 1
        self._inside.depth = depth + 1
        try:
            yield self._tensors
        finally:
            self._inside.depth = depth
            if not depth:
                with self._cond:
                    self._writers -= 1
                    self._cond.notify_all()

    def grow(self) -> None:
        """Make the pools hold every page id the PagePool has handed out. Bounded
        (kv_pages): all of them at once. Unbounded: ``first_size`` pages first (every
        slot's full context, what the contiguous cache holds), then half as many again
        whenever the prefixes the driver keeps need more (a new buffer: the old pages
        copied into it)."""
        if self._size() is None:
            return
        if getattr(self._inside, "depth", 0):
            raise RuntimeError("the K/V page pools cannot grow inside PagedKV.using (this thread writes them): "
                               "take the pages before entering it")
        with self._cond:
            while self._growing or self._writers:
                self._cond.wait()
            self._growing = True
        try:
            size = self._size()  # another thread may have grown them meanwhile
            if size is not None:
                have = 0 if self._tensors is None else self._tensors[0].shape[1]
                k, v = self._new_pools(size)
                if self._tensors is not None:
                    k[:, :have], v[:, :have] = self._tensors
                self._tensors = k, v
        finally:
            with self._cond:
                self._growing = False
                self._cond.notify_all()

    def _size(self) -> int | None:
        have = None if self._tensors is None else self._tensors[0].shape[1]
        return self.pool.storage_size(have, self._first_size)

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """Copy on write: each (src, dst) page's K/V into dst, in every layer."""
        if not copies:
            return
        src = self._ids([s for s, _ in copies])
        dst = self._ids([d for _, d in copies])
        with self.using() as pools:
            for pool in pools:
                pool[:, dst] = pool[:, src]

    def gather(self, seq: PageList, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` positions of ``seq`` as contiguous K and V
        ``(layers, kv_heads, length, head_dim)`` in the pools' dtype."""
        idx = self._ids(seq.pages[: pages_for(length, self.page_size)])

        def one(pool: torch.Tensor) -> torch.Tensor:
            layers, _, kvh, ps, hd = pool.shape
            return pool[:, idx].transpose(1, 2).reshape(layers, kvh, -1, hd)[:, :, :length]

        with self.using() as (k, v):
            return one(k), one(v)

    def scatter(self, seq: PageList, k: torch.Tensor, v: torch.Tensor, start: int, end: int, *,
                offset: int = 0) -> None:
        """Write positions ``start..end`` of ``k``/``v`` (layers, kv_heads, S, head_dim;
        holding positions from ``offset``) into ``seq``'s pages: pages added as needed, a
        shared one copied before the write. A pool that runs out releases ``seq`` (a new
        prefix's, never a slot's) and raises InsufficientMemory."""
        self.writable(seq, start, end)
        pos = torch.arange(start, end, device=self.device)
        pages, offsets = self._ids(seq.pages)[pos // self.page_size], pos % self.page_size
        lo, hi = start - offset, end - offset
        with self.using() as (pk, pv):
            pk[:, pages, :, offsets] = k[:, :, lo:hi].permute(2, 0, 1, 3).to(pk.dtype)  # (N, layers, kvh, hd)
            pv[:, pages, :, offsets] = v[:, :, lo:hi].permute(2, 0, 1, 3).to(pv.dtype)

    def writable(self, seq: PageList, start: int, end: int) -> None:
        """Positions ``start..end`` of ``seq`` (a new prefix's, never a slot's) made its own
        to write: pages added as needed, a shared one copied first. A pool that runs out
        releases ``seq`` and raises InsufficientMemory."""
        copies: list[tuple[int, int]] = []
        try:
            seq.prepare_write(start, end, lambda s, d: copies.append((s, d)))
        except BaseException:
            seq.release()
            raise
        self.copy(copies)

    def table_for(self, seq: PageList, length: int) -> torch.Tensor:
        """A one-row page table ``(1, pages for length)`` holding ``seq``'s page ids."""
        table = self.new_table(1, length)
        table[0, : len(seq.pages)] = self._ids(seq.pages)
        return table

    def prepare(self, seqs: list[PageList | None], live: list[int], positions: list[int]) -> PageOps:
        """Host half of a decode step: each live slot's write position made its own (a page
        added, a shared page's copy recorded). A pool that runs out raises
        InsufficientMemory with the work of the slots prepared before it in ``.page_ops``
        (their pages changed; :meth:`apply` must still run it)."""
        before = {i: list(seqs[i].pages) for i in live}
        copies: list[tuple[int, int]] = []

        def ops() -> PageOps:
            return copies, [(i, list(seqs[i].pages)) for i, pages in before.items() if seqs[i].pages != pages]

        try:
            for i in live:
                seqs[i].prepare_write(positions[i], positions[i] + 1, lambda s, d: copies.append((s, d)))
        except Exception as exc:
            exc.page_ops = ops()
            raise
        return ops()

    def apply(self, table: torch.Tensor, ops: PageOps) -> tuple[torch.Tensor, torch.Tensor]:
        """Device half (engine thread, before the step's forward, inside :meth:`using`
        through the forward's end): the copies made, the changed rows of ``table``
        written. Returns the pools."""
        copies, rows = ops
        with self.using() as pools:
            self.copy(copies)
            for slot, pages in rows:
                table[slot, : len(pages)] = self._ids(pages)
            return pools

    def new_table(self, slots: int, length: int) -> torch.Tensor:
        """A page table ``(slots, pages for length)``: row i holds slot i's page ids."""
        return torch.zeros((slots, pages_for(length, self.page_size)), dtype=torch.int64, device=self.device)

    def _ids(self, pages: Any) -> torch.Tensor:
        return to_device(np.asarray(pages, np.int64), self.device)
