"""The block KV layout's host half (option ``page_size``): what the host computes for the
graphs' block inputs, as NxD's block KV layout has them.

The pools are one K and one V tensor ``[layers, blocks, kv_heads, block_size, head_dim]``
(torch_common's :class:`~polyengine.backends.torch_common.paged.PagedKV` holds them,
grows an unbounded pool, copies blocks on write, and gathers or scatters a prefix's
K/V for export and import), indexed by the block ids of a
:class:`~polyengine.pages.PagePool` (the core keeps the counts and the rules of
docs/design.md, "Pages"). Block ids are the host's: they change on the caller's thread
(prefill, insert, free, the step's preparation here), and the pools only on the step
worker, so nothing here touches a pool.

Two inputs per graph call come from here: a **slot mapping** (context encoding and
continuation: each padded prompt position's flat slot ``block * block_size + offset``,
pad positions repeating the last prompt position's, which the graph writes with the
same value: ``graphs.write_slots``), and a **block table** (token generation: one row
per slot, ``ceil(kv_len / block_size)`` columns, the static width of the step's
sequence bucket; a continuation's prefix reads one row of ``ceil(Q / block_size)``).
"""

from __future__ import annotations

import numpy as np
import torch

from polyengine.pages import PageList, pages_for

__all__ = ["slot_mapping", "block_row", "prepare_step"]

# A step's block work: copies on write (src, dst), and the block table (slots, width).
BlockOps = tuple[list[tuple[int, int]], torch.Tensor]


def slot_mapping(seq: PageList, start: int, n: int, bucket: int) -> torch.Tensor:
    """``(bucket,)`` int64: the slot of each of a prompt's ``bucket`` padded positions
    ``start ..`` in ``seq`` (which holds them); pads repeat position ``start + n - 1``'s."""
    ps = seq.pool.page_size
    pos = start + np.minimum(np.arange(bucket), n - 1)
    return torch.from_numpy(np.asarray(seq.pages, np.int64)[pos // ps] * ps + pos % ps)


def block_row(pages: list[int], width: int) -> torch.Tensor:
    """``(width,)`` int64: ``pages`` first, block 0 after them (read only at positions no
    query sees, where attention weighs them exactly 0)."""
    out = np.zeros(width, np.int64)
    out[: min(len(pages), width)] = pages[:width]
    return torch.from_numpy(out)


def prepare_step(seqs: list[PageList | None], writes: dict[int, tuple[int, int]], kv_len: int,
                 block_size: int) -> BlockOps:
    """Host half of a decode step: each slot's positions ``writes[slot] = (start, end)``
    made its own (blocks added, a shared block's copy recorded), and the block table at
    the width of ``kv_len`` (one row per slot). A bounded pool that runs out raises InsufficientMemory with
    the copies of the slots prepared before it in ``.page_ops`` (their block lists
    changed: the copies must still be made)."""
    copies: list[tuple[int, int]] = []
    try:
        for slot, (start, end) in writes.items():
            seqs[slot].prepare_write(start, end, lambda src, dst: copies.append((src, dst)))
    except Exception as exc:
        exc.page_ops = copies
        raise
    width = pages_for(kv_len, block_size)  # even when no slot writes (all at their limit): the bucket's width
    table = np.zeros((len(seqs), width), np.int64)
    for slot, seq in enumerate(seqs):
        if seq is not None:
            pages = seq.pages[:width]
            table[slot, : len(pages)] = pages
    return copies, torch.from_numpy(table)
