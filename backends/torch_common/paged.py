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

Threads: the page ids are the host's (pure Python, changed by the caller's thread in
``generate`` and on the engine thread elsewhere, never both at once); the pools are
touched on the engine thread only, so a decode step's copies and table rows are
prepared on the host (:meth:`PagedKV.prepare`) and applied first in the step
(:meth:`PagedKV.apply`).
"""

from __future__ import annotations

from typing import Any, Callable

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

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V pools, grown to every page id handed out so far."""
        self.grow()
        return self._tensors

    def grow(self) -> None:
        """Make the pools hold every page id the PagePool has handed out. Bounded
        (kv_pages): all of them at once. Unbounded: ``first_size`` pages first (every
        slot's full context, what the contiguous cache holds), then half as many again
        whenever the prefixes the driver keeps need more (a new buffer: the old pages
        copied into it)."""
        have = 0 if self._tensors is None else self._tensors[0].shape[1]
        size = self.pool.storage_size(None if self._tensors is None else have, self._first_size)
        if size is None:
            return
        k, v = self._new_pools(size)
        if self._tensors is not None:
            k[:, :have], v[:, :have] = self._tensors
        self._tensors = k, v

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """Copy on write: each (src, dst) page's K/V into dst, in every layer."""
        if not copies:
            return
        src = self._ids([s for s, _ in copies])
        dst = self._ids([d for _, d in copies])
        for pool in self.tensors:
            pool[:, dst] = pool[:, src]

    def gather(self, seq: PageList, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` positions of ``seq`` as contiguous K and V
        ``(layers, kv_heads, length, head_dim)`` in the pools' dtype."""
        idx = self._ids(seq.pages[: pages_for(length, self.page_size)])

        def one(pool: torch.Tensor) -> torch.Tensor:
            layers, _, kvh, ps, hd = pool.shape
            return pool[:, idx].transpose(1, 2).reshape(layers, kvh, -1, hd)[:, :, :length]

        k, v = self.tensors
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
        pk, pv = self.tensors
        lo, hi = start - offset, end - offset
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
        """Device half (engine thread, before the step's forward): the pools grown, the
        copies made, the changed rows of ``table`` written. Returns the pools."""
        copies, rows = ops
        self.copy(copies)
        for slot, pages in rows:
            table[slot, : len(pages)] = self._ids(pages)
        return self.tensors

    def new_table(self, slots: int, length: int) -> torch.Tensor:
        """A page table ``(slots, pages for length)``: row i holds slot i's page ids."""
        return torch.zeros((slots, pages_for(length, self.page_size)), dtype=torch.int64, device=self.device)

    def _ids(self, pages: Any) -> torch.Tensor:
        return to_device(np.asarray(pages, np.int64), self.device)
