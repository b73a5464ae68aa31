"""Paged K/V for the tpu_jax engine (option ``page_size``): the page pools on the mesh,
the programs that move K/V between them and contiguous arrays, and the paged decode step.

The pools are one K and one V array ``[layers, kv_heads, pages, page_size, head_dim]``
(:data:`~.footprint.POOL_AXES`, the shared forward's ``page_layout="heads"``: one KV
head's pages are one block, as JAX's Pallas paged-attention kernel reads them,
:mod:`.pallas`; the KV heads split over ``tp`` as the contiguous cache's are; every
device group of ``dp`` holds the whole pool, since any page may hold any slot's K/V),
indexed by the page ids of a :class:`~polyengine.pages.PagePool` (the core
keeps the counts and the rules of docs/design.md, "Pages"). A slot reads and writes
through its row of the decode state's page table (``DecodeArrays.table``, int32 on the
devices); a :class:`~polyengine.protocol.Prefix` holds a :class:`PagedPrefix`.

Decode attention is the shared forward's gather (``forward(..., page_table=)``: each
row's pages gathered through its table row, K/V written at ``(table[p // page_size],
p % page_size)``), traced into the step, or JAX's Pallas kernel reading the pages in
place (option ``paged_attention``, :mod:`.pallas`). The step reads the table's first ``width``
columns, ``width`` a bucket (:func:`width_buckets`) of the longest live row's pages: one
program per bucket, compiled by warm-up, so serving compiles nothing and a short batch
reads only the pages it needs. A prefill still runs over a contiguous cache of its own
(the contiguous engine's programs), and its new positions are scattered into pages
(:func:`write_pages_step`); a continuation gathers its prefix's pages into a contiguous
array of the prefix's bucket first (:func:`gather_pages_step`).

Host and device: the page ids are the host's (pure Python). What a step changes in the
pages (a page added to a slot, a shared page copied before its first write) is prepared
on the host (:meth:`PagedKV.prepare`) as a few small arrays (:class:`PageOps`) and
applied first inside the step's program; so is the copy a prefill's write needs.
Unbounded pools (``kv_pages`` 0) start at every slot's full context and grow by half
when more pages are held (a new pool shape: its programs compile once more); a bounded
pool has one shape and never compiles again.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from polyengine.kit import on_lane
from polyengine.pages import PageError, PageList, PagePool, pages_for

from polyengine.backends.tpu_jax import sampling as smp
from polyengine.backends.tpu_jax.footprint import POOL_AXES
from polyengine.backends.tpu_jax.steps import (
    DecodeArrays, SlotRows, StepConfig, _live, run_model, sample_step,
)

__all__ = ["PagedPrefix", "PageOps", "PagedKV", "width_buckets", "init_pool", "grow_pool", "init_table",
           "write_pages_step", "gather_pages_step", "page_ops_step", "insert_pages_step", "paged_forward_step",
           "paged_generate_step"]

# An index past any pool or table: a scatter with mode="drop" writes nothing there.
_DROP = np.iinfo(np.int32).max

_KV_AXES = ("layers", "kv_heads", "positions", "head_dim")


@dataclass
class PagedPrefix:
    """``Prefix.kv`` of a paged engine: the prefix's pages, the bucket a contiguous
    engine would store it in (it picks the continuation's program, as the contiguous
    prefix's array width does), and the request's sampling row on the devices."""

    seq: PageList
    bucket: int
    row: smp.SamplerState


@jax.tree_util.register_dataclass
@dataclass
class PageOps:
    """A step's page work, padded to the slots ``R`` (unused entries point past the pool
    or table and are dropped): copies on write ``copy_src -> copy_dst`` (R,), and
    table entries ``table[set_slot, set_index] = set_page`` (R,)."""

    copy_src: jax.Array
    copy_dst: jax.Array
    set_slot: jax.Array
    set_index: jax.Array
    set_page: jax.Array


def width_buckets(max_pages: int) -> tuple[int, ...]:
    """The page-table widths a decode step is compiled for: powers of two below
    ``max_pages`` (a context's pages), and ``max_pages``."""
    out, w = [], 1
    while w < max_pages:
        out.append(w)
        w *= 2
    return (*out, max_pages)


def _constrain_pool(cfg: StepConfig, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    return cfg.plan.constrain(k, POOL_AXES), cfg.plan.constrain(v, POOL_AXES)


def _pool_shape(cfg: StepConfig, pages: int, page_size: int) -> tuple[int, ...]:
    c = cfg.model
    return (c.num_hidden_layers, c.num_key_value_heads, pages, page_size, c.head_dim)


@functools.partial(jax.jit, static_argnames=("cfg", "pages", "page_size"))
def init_pool(*, cfg: StepConfig, pages: int, page_size: int) -> tuple[jax.Array, jax.Array]:
    shape = _pool_shape(cfg, pages, page_size)
    return _constrain_pool(cfg, jnp.zeros(shape, cfg.cache_dtype), jnp.zeros(shape, cfg.cache_dtype))


@functools.partial(jax.jit, static_argnames=("cfg", "pages"))
def grow_pool(k, v, *, cfg: StepConfig, pages: int) -> tuple[jax.Array, jax.Array]:
    """The pools with ``pages`` pages, the first ones as they were (new buffers: a larger
    shape cannot reuse the old ones, so nothing is donated)."""
    pad = [(0, 0), (0, 0), (0, pages - k.shape[2]), (0, 0), (0, 0)]
    return _constrain_pool(cfg, jnp.pad(k, pad), jnp.pad(v, pad))


@functools.partial(jax.jit, static_argnames=("cfg", "width"))
def init_table(*, cfg: StepConfig, width: int) -> jax.Array:
    return cfg.plan.constrain(jnp.zeros((cfg.slots, width), jnp.int32), ("slots", None))


def _apply(cfg: StepConfig, k, v, table, ops: PageOps):
    """Copies on write first (a page's K/V into a fresh page), then the table entries."""
    k = k.at[:, :, ops.copy_dst].set(k[:, :, ops.copy_src], mode="drop")
    v = v.at[:, :, ops.copy_dst].set(v[:, :, ops.copy_src], mode="drop")
    if table is not None:
        table = cfg.plan.constrain(table.at[ops.set_slot, ops.set_index].set(ops.set_page, mode="drop"), ("slots", None))
    return (*_constrain_pool(cfg, k, v), table)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("k", "v", "table"))
def page_ops_step(k, v, table, ops: PageOps, *, cfg: StepConfig):
    """Apply a step's page work alone (a step refused for want of pages keeps the work
    of the slots prepared before it: their page lists changed on the host)."""
    return _apply(cfg, k, v, table, ops)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("k", "v"))
def write_pages_step(k, v, new_k, new_v, pages, offsets, ops: PageOps, *, cfg: StepConfig):
    """Scatter a contiguous prefix's K/V ``new_k``/``new_v`` (layers, kv_heads, B, head_dim)
    into the pools: position ``i`` to ``(pages[i], offsets[i])`` (B,) (past the pool:
    not written), after ``ops``' copies. One program per B (a prefill bucket)."""
    k, v, _ = _apply(cfg, k, v, None, ops)
    k = k.at[:, :, pages, offsets].set(new_k.astype(k.dtype), mode="drop")  # (layers, kvh, B, hd) as new_k
    v = v.at[:, :, pages, offsets].set(new_v.astype(v.dtype), mode="drop")
    return _constrain_pool(cfg, k, v)


@functools.partial(jax.jit, static_argnames=("cfg", "length"))
def gather_pages_step(k, v, pages, *, cfg: StepConfig, length: int):
    """The pages ``pages`` (P,) as contiguous K and V (layers, kv_heads, length, head_dim),
    ``length <= P * page_size``: what a continuation and an export read."""

    def one(pool):
        layers, kvh, _, ps, hd = pool.shape
        out = pool[:, :, pages].reshape(layers, kvh, -1, hd)[:, :, :length]
        return cfg.plan.constrain(out, _KV_AXES)

    return one(k), one(v)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("table",))
def insert_pages_step(table, pages, mask, *, cfg: StepConfig):
    """The masked slots' table rows become ``pages`` (W,): the prefix's page ids."""
    return cfg.plan.constrain(jnp.where(mask[:, None], pages[None], table), ("slots", None))


@functools.partial(jax.jit, static_argnames=("cfg", "width", "kernel"), donate_argnames=("k", "v", "table"))
def paged_forward_step(params, k, v, table, ops: PageOps, rows: SlotRows, override_tokens, override_mask, *,
                       cfg: StepConfig, width: int, kernel: str = "gather"):
    """:func:`~.steps.forward_step` over the page pools: the step's page work applied,
    then every live slot's token at its latest position, attention over the first
    ``width`` pages of each table row (``width`` covers every live row's pages), read by
    ``kernel`` (:func:`.pallas.resolve`: the gather or the Pallas kernel). Returns
    logits (R, V) float32, the live mask, the pools and the table."""
    k, v, table = _apply(cfg, k, v, table, ops)
    feed = jnp.where(override_mask, override_tokens, rows.next_tokens)
    live = _live(rows, cfg.cache_length)
    positions = jnp.maximum(rows.prompt_len + rows.completion - 1, 0)
    logits, k, v = run_model(cfg, params, feed[:, None], positions[:, None], k, v, write_mask=live[:, None],
                             page_table=table[:, :width], paged_kernel=kernel)
    logits = cfg.plan.constrain(logits[:, 0].astype(jnp.float32), ("slots", "vocab"))
    return logits, cfg.plan.constrain(live, ("slots",)), *_constrain_pool(cfg, k, v), table


def paged_generate_step(params, k, v, state: DecodeArrays, ops: PageOps, override_tokens, override_mask, token_mask,
                        *, cfg: StepConfig, width: int, kernel: str = "gather"):
    """:func:`~.steps.generate_step` over the page pools (``k``/``v`` and ``state``
    donated): returns (k, v, state, packed results)."""
    logits, live, k, v, table = paged_forward_step(params, k, v, state.table, ops, state.rows, override_tokens,
                                                   override_mask, cfg=cfg, width=width, kernel=kernel)
    rows, packed = sample_step(state.rows, logits, live, override_tokens, override_mask, token_mask, cfg=cfg.sampler)
    return k, v, DecodeArrays(k=None, v=None, rows=rows, table=table), packed


class PagedKV:
    """The page pools of one engine and the host half of every page operation.

    ``put_tree`` lays host arrays out on the mesh (the engine's ``plan.put_tree``);
    ``first_size`` is how many pages an unbounded pool starts with."""

    def __init__(self, pool: PagePool, cfg: StepConfig, put_tree: Callable[[Any], Any], first_size: int,
                 track: Callable[[Any], Any]):
        self.pool, self.cfg, self._put, self._first_size, self._track = pool, cfg, put_tree, first_size, track
        # Held from reading the pools to storing what a program returns for them: the
        # prefill lane's writes and gathers run on a thread of their own beside the steps,
        # and a pool donated by one must not be handed to the other.
        self.lock = threading.RLock()
        self._k: jax.Array | None = None
        self._v: jax.Array | None = None
        self.width = pages_for(cfg.cache_length, pool.page_size)  # the table's columns: a context's pages
        self.widths = width_buckets(self.width)

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def size(self) -> int:
        """Pages the pools hold now."""
        return 0 if self._k is None else int(self._k.shape[2])

    def grow(self) -> None:
        """Make the pools hold every page id handed out so far. Bounded (kv_pages): all of
        them at once. Unbounded: every slot's full context first, then half as many
        again whenever more are held."""
        have = self.size
        size = self.pool.storage_size(None if self._k is None else have, self._first_size)
        if size is None:
            return
        with self._track("-"):
            if self._k is None:
                self._k, self._v = init_pool(cfg=self.cfg, pages=size, page_size=self.page_size)
            else:
                self._k, self._v = grow_pool(self._k, self._v, cfg=self.cfg, pages=size)

    @contextlib.contextmanager
    def donating(self):
        """The pools, grown, as a list ``[k, v]`` for a program that donates them: what the
        block stores in the list becomes the pools, under :attr:`lock` throughout. The
        donated arrays stay referenced until then: a program that fails leaves them
        usable, or deleted by the donation (a loud error at the next use), never silently
        replaced by a fresh, zeroed pool."""
        with self.lock:
            self.grow()
            pools = [self._k, self._v]
            yield pools
            self._k, self._v = pools

    def peek(self) -> tuple[jax.Array, jax.Array]:
        """The pools, grown, for a program that only reads them (dispatch it under
        :attr:`lock`, before a step can donate them)."""
        with self.lock:
            self.grow()
            return self._k, self._v

    # -- host arrays of the programs' inputs ---------------------------------------------

    def ops(self, copies: list[tuple[int, int]], sets: list[tuple[int, int, int]]) -> PageOps:
        """Copies (src, dst) and table entries (slot, index, page) padded to the slots."""
        r = self.cfg.slots
        if len(copies) > r or len(sets) > r:
            raise PageError(f"a step's page work exceeds one copy and one table entry per slot: {copies}, {sets}")
        src, dst = np.zeros(r, np.int32), np.full(r, _DROP, np.int32)
        slot, index, page = np.full(r, _DROP, np.int32), np.zeros(r, np.int32), np.zeros(r, np.int32)
        for i, (s, d) in enumerate(copies):
            src[i], dst[i] = s, d
        for i, (s, j, p) in enumerate(sets):
            slot[i], index[i], page[i] = s, j, p
        return PageOps(*self._put((src, dst, slot, index, page)))

    def row(self, seq: PageList) -> np.ndarray:
        """A page-table row: ``seq``'s page ids, zeros after them."""
        out = np.zeros(self.width, np.int32)
        out[: len(seq.pages)] = seq.pages
        return out

    # -- prefixes ---------------------------------------------------------------------------

    def write(self, seq: PageList, new_k: jax.Array, new_v: jax.Array, start: int, end: int) -> None:
        """Write positions ``start..end`` of the contiguous ``new_k``/``new_v`` (layers,
        kv_heads, B, head_dim) into ``seq``'s pages: pages added as needed, a shared one
        copied before the write. A pool that runs out releases ``seq`` (a new prefix's,
        never a slot's) and raises InsufficientMemory."""
        copies: list[tuple[int, int]] = []
        try:
            seq.prepare_write(start, end, lambda s, d: copies.append((s, d)))
        except BaseException:
            seq.release()
            raise
        b, ps = new_k.shape[2], self.page_size
        pages, offsets = np.full(b, _DROP, np.int32), np.zeros(b, np.int32)
        pos = np.arange(start, end)
        pages[pos] = np.asarray(seq.pages, np.int32)[pos // ps]
        offsets[pos] = pos % ps
        ops = self.ops(copies, [])
        pages, offsets = self._put((pages, offsets))
        if on_lane():
            # The scatter's output pools are the next step's input: dispatched before the
            # lane's prefill is done, it would hold every step behind the whole prefill.
            jax.block_until_ready((new_k, new_v))
        with self.donating() as pools, self._track(b):
            pools[:] = write_pages_step(*pools, new_k, new_v, pages, offsets, ops, cfg=self.cfg)

    def gather(self, seq: PageList, length: int) -> tuple[jax.Array, jax.Array]:
        """``seq``'s first pages as contiguous K and V (layers, kv_heads, length, head_dim);
        positions past ``seq.length`` hold whatever their page (or page 0) holds: a
        continuation never reads them (its queries see keys below their own position)."""
        ids = np.zeros(pages_for(length, self.page_size), np.int32)
        have = min(len(seq.pages), ids.size)
        ids[:have] = seq.pages[:have]
        ids = self._put(ids)
        with self.lock, self._track(length):
            return gather_pages_step(*self.peek(), ids, cfg=self.cfg, length=length)

    # -- decode steps ---------------------------------------------------------------------------

    def prepare(self, seqs: list[PageList | None], live: list[int], positions: list[int]) -> PageOps:
        """Host half of a decode step: each live slot's write position made its own (a page
        added, a shared page's copy recorded). A pool that runs out raises
        InsufficientMemory with the work of the slots prepared before it in ``.page_ops``
        (their page lists changed; :func:`page_ops_step` must still apply it)."""
        copies: list[tuple[int, int]] = []
        sets: list[tuple[int, int, int]] = []
        try:
            for i in live:
                seq, p = seqs[i], positions[i]
                index = p // self.page_size
                before = seq.pages[index] if index < len(seq.pages) else None
                seq.prepare_write(p, p + 1, lambda s, d: copies.append((s, d)))
                if seq.pages[index] != before:
                    sets.append((i, index, seq.pages[index]))
        except Exception as exc:
            exc.page_ops = (copies, sets)
            raise
        return self.ops(copies, sets)

    def width_for(self, live: list[int], positions: list[int]) -> int:
        """The smallest width bucket holding every live slot's pages after this step's write."""
        need = max((pages_for(positions[i] + 1, self.page_size) for i in live), default=1)
        return next(w for w in self.widths if w >= need)
