"""The engine protocol over the shared torch model and sampler, for every torch engine.

One flow for the ``cpu`` and ``cuda_torch`` backends; each chooses its device, its
dtypes and how a decode step computes its rows, and this module runs the protocol on
top. The decode state owns a preallocated KV cache for all its slots (``[layers,
slots, kv_heads, max_cache_length, head_dim]``), a batched device sampler whose
per-slot parameters are installed at insert, and a device copy of the host's slot
counts. A prompt is prefilled alone, padded to a bucket, into a cache of its own that
becomes the prefix; insert copies it into the slot's row. Every generate step samples on
the device and packs the step's results into one int32 buffer: one host transfer per
step (:meth:`TorchEngine._results`).

The host keeps only what it can know without a sync (which slots are live, their
lengths); the tokens stay on the device until the driver reads them. The device path
(:meth:`TorchEngine._decode`) takes no host data: its live mask, positions and lengths
come from the device's copy of the slot counts, which insert, free and overrides update
with fill kernels or non-blocking copies from pinned memory (``transfer.py``), so step
n+1 is queued while step n runs (tested with a dispatch mode that flags any host data or
sync inside a step: ``tests/test_cuda_torch_sync.py``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from polyengine.engine import EngineBase, EngineConfig, Prefix, ResultLayout, ResultTokens, SlotTable
from polyengine.errors import InsufficientMemory, InvalidRequest, UnsupportedFeature
from polyengine.kit import on_lane
from polyengine.models import Model
from polyengine.pages import PageList, PagePool, pages_for
from polyengine.prefix import PortablePrefix
from polyengine.protocol import DEFAULT_STEP_TOKENS
from polyengine.sampling import SamplingParams
from polyengine.sampling.rows import row_bytes

from polyengine.backends.torch_common.hostmem import grows_with_use, release_row
from polyengine.backends.torch_common.model import (
    CastKVCodec, StepSpec, TorchWeights, final_norm, forward, residual_stream,
)
from polyengine.backends.torch_common.options import SHARED_OPTIONS
from polyengine.backends.torch_common.paged import PagedKV
from polyengine.backends.torch_common.sampling import TorchSampler
from polyengine.backends.torch_common.state import SlotsInFlight, TorchSlotsEngine, host_array
from polyengine.backends.torch_common.transfer import fill_row, pack_results, to_device

__all__ = ["TorchEngine", "TorchDecodeState", "StepInputs", "TORCH_DTYPES", "on_engine_thread"]

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

@dataclass
class TorchDecodeState(SlotsInFlight):
    num_slots: int
    k: torch.Tensor  # (layers, slots, kv_heads, max_cache_length, head_dim)
    v: torch.Tensor
    sampler: TorchSampler
    next_tokens: torch.Tensor  # (slots,) int64 on the device: what each slot feeds next
    slots: SlotTable  # the host's count: prompt and completion per slot, what a step can know without a sync
    # The same count on the device, so a step derives its live mask, positions and lengths
    # there instead of copying the host's lists in (a copy that would wait for the step before).
    total: torch.Tensor  # (slots,) int64: prompt + completion tokens, 0 when free
    prompt_len: torch.Tensor  # (slots,) int64
    occupied: torch.Tensor  # (slots,) bool
    pending: Future | None = None  # the step running on the worker thread (CPU async mode)
    graphs: dict = field(default_factory=dict)  # CUDA: kv_len -> (graph, static logits), over this state's buffers
    positions: torch.Tensor | None = None  # CUDA graphs: static (slots, 1) input buffers
    live: torch.Tensor | None = None
    # Paged K/V (option page_size): k/v above are then the engine's page pools
    # (layers, pages, kv_heads, page_size, head_dim), refreshed before each step, and each
    # slot reads and writes through its row of the page table.
    page_table: torch.Tensor | None = None  # (slots, pages per context) int64 page ids
    seqs: list[PageList | None] | None = None  # per slot: its pages (the host's record)

    def write_prefix(self, slot: int, prefix: Prefix) -> None:
        """Paged: the slot shares the prefix's pages (its first write copies a partly filled
        last page); contiguous: the prefix's K/V copied into the slot's cache row."""
        if self.seqs is None:
            return super().write_prefix(slot, prefix)
        seq = self.seqs[slot] = prefix.kv.fork(finalize=True)
        self.page_table[slot, : len(seq.pages)] = to_device(np.asarray(seq.pages, np.int64), self.page_table.device)


@dataclass(eq=False)
class _KVRun:
    """A prefill's contiguous K/V buffer ``(layers, 1, kv_heads, capacity, head_dim)``
    and how far it is written: positions below ``filled`` belong to prefixes and are never
    written again; a prefill continuing a prefix of exactly ``filled`` positions may write
    after them (TorchEngine._kv_run)."""

    k: torch.Tensor
    v: torch.Tensor
    filled: int

    @property
    def capacity(self) -> int:
        return int(self.k.shape[3])


class _RunViews(tuple):
    """A contiguous prefix's ``(k, v)`` views, with the run they view (``.run``)."""

    def __new__(cls, kv: tuple[torch.Tensor, torch.Tensor], run: _KVRun) -> "_RunViews":
        self = super().__new__(cls, kv)
        self.run = run
        return self


@dataclass(frozen=True)
class StepInputs:
    """What the host decides for one decode step before it runs: the live slots, each
    slot's position (0 for the others), the attended length, the top-log-prob count
    and the step's allowed-token masks (packed bits per slot, on the device)."""

    live: list[int]
    positions: list[int]
    kv_len: int
    num_top: int
    words: torch.Tensor | None
    mixed: "MixedRows | None" = None


@dataclass
class MixedRows:
    """A mixed step's prompt rows (generate_with_prefill): the entries' tokens, the cache
    row of each (the decode state's slots, then one page-table row per entry), their
    positions, the entries' page-table rows and new page lists, and the index of each
    entry's last token. The step fills ``logits`` (an entry's last token's, one row each)."""

    seqs: list[PageList]
    tokens: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor
    table: torch.Tensor
    last: list[int]
    logits: torch.Tensor | None = None

    def release(self) -> None:
        for seq in self.seqs:
            seq.release()


@dataclass(frozen=True)
class _StepPlan:
    """What the host decided and took for one step (TorchEngine._take_step)."""

    forced: dict
    live: list[int]
    positions: list[int]
    kv_len: int
    num_top: int
    words: np.ndarray | None
    page_ops: Any

    @property
    def layout(self) -> ResultLayout:
        return ResultLayout(k=1, top_n=self.num_top, logprobs=True)


def on_engine_thread(method):
    """Run an engine method on the step worker thread when there is one.

    torch's CPU ops run on OpenMP, and libgomp keeps a thread team per calling thread:
    once the caller's thread and the step worker both have one, it counts more threads
    than cores and puts idle team threads to sleep, so every parallel op pays futex
    wake-ups (~1 ms a step at batch 1 in the sampler's ops). With every torch call on one
    thread there is one team, which spins between ops as it should."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self._worker is None or threading.current_thread() is self._worker_thread or on_lane():
            return method(self, *args, **kwargs)  # the prefill lane's calls run on its own thread
        return self._worker.submit(method, self, *args, **kwargs).result()

    return run


# The request of a piece of a long prompt (prefill_forward_tokens) whose first token nobody reads.
_PIECE = SamplingParams(seed=0)


def batch_groups(lengths: Sequence[int], cap: int | None) -> list[list[int]]:
    """The entries of a batch (their token counts, in order) in consecutive groups whose
    padded size, entries x the longest, stays within ``cap`` (an entry longer than the cap
    alone); one group without a cap."""
    if not cap:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * max(longest, n) <= cap:
            groups[-1].append(i)
            longest = max(longest, n)
        else:
            groups.append([i])
            longest = n
    return groups


class TorchEngine(TorchSlotsEngine, EngineBase):
    """The protocol for a torch engine. A backend subclass sets ``name`` and
    ``OPTIONS``, picks ``self.torch_device`` in ``capabilities_for``, and may change:
    ``_load_weights`` (what the weights are), ``_decode`` (how a step computes its
    rows), ``self._linear``/``self._prefill_linear`` (the projections, None for
    torch's) and ``self._causal_attention`` (a prefill's causal attention, from position 0
    or continuing a prefix: StepSpec.causal_attention)."""

    OPTIONS = SHARED_OPTIONS
    torch_device: torch.device
    _linear: Callable | None = None  # decode's projections (None: torch's F.linear)
    _prefill_linear: Callable | None = None  # prefill's
    _causal_attention: Callable | None = None  # a prefill's causal attention (None: the forward's)
    _embed: Callable | None = None  # the embedding lookup (None: the table in the weights, StepSpec.embed)
    # Tokens one prefill forward takes at most (None: no bound): prefill_batch groups its
    # entries (padded) under it, and a longer prompt runs as pieces of at most this many,
    # each continuing the one before. A host engine's working set grows with a forward's
    # rows (activations, the batch's K/V and then each entry's copy), and past a few
    # hundred rows a forward costs the same per token
    prefill_forward_tokens: int | None = None

    def __init__(self, model: Model, config: EngineConfig):
        super().__init__(model, config)
        self.torch_dtype = TORCH_DTYPES[self.dtype]
        self._resolve()
        self.kv_dtype = self._resolve_kv_dtype()
        # The forward's codec when K/V are narrower than compute: every cache, the decode
        # state's and a prefill's own (so its Prefix), stores them narrow; attention reads
        # them widened to the compute dtype.
        self._kv_codec = None if self.kv_dtype == self.torch_dtype else CastKVCodec(
            self.kv_dtype, self.kv_dtype, self.torch_dtype)
        self.sampler_dtype = torch.float64 if self.options["sampler_dtype"] == "float64" else torch.float32
        # A worker thread runs the steps, so the caller reads step n while n+1 runs, and
        # every other torch call of the engine too (see on_engine_thread).
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-step") if self._async_steps() else None
        self._worker_thread = self._worker.submit(threading.current_thread).result() if self._worker else None
        # The prefill lane (capability prefill_lane, EngineBase.start_prefill: a thread of its
        # own) has a sampler of its own; _run_lock claims a run's room.
        self._lane_sampler: TorchSampler | None = None
        self._run_lock = threading.Lock()
        self.mixed_steps = 0  # generate_with_prefill calls that took the mixed path, refused ones too (cumulative)
        self._weights: TorchWeights | None = None
        self._prefill_sampler: TorchSampler | None = None
        self._specs: dict[tuple, StepSpec] = {}  # the forward's static choices per bucket
        # Paged K/V (option page_size): the page ids and counts (polyengine.pages) and the
        # pools they index, made with the first decode state or prefix.
        ps, kv_pages = self.capabilities.page_size, self.options["kv_pages"]
        if kv_pages and (not ps or kv_pages < pages_for(config.max_cache_length, ps) + 1):
            raise InvalidRequest(
                f"kv_pages={kv_pages} needs page_size and at least one context's pages and one more "
                f"({pages_for(config.max_cache_length, ps or 1) + 1} with page_size={ps or 1}); raise it or leave it 0",
                field="options.kv_pages")
        self.pages = PagePool(ps, kv_pages or None) if ps else None
        self._paged = PagedKV(self.pages, self.torch_device, self._new_pools, first_size=(
            self.max_concurrent_decodes * pages_for(config.max_cache_length, ps))) if ps else None
        self._check_memory()

    @property
    def kv_itemsize(self) -> int:
        """Option kv_dtype's element size (a prefix and the decode cache keep K/V in it)."""
        kv = self.options["kv_dtype"]
        return super().kv_itemsize if kv == "auto" else TORCH_DTYPES[kv].itemsize

    def _resolve(self) -> None:
        """Hook: a backend's own choices, made once the options, dtype and device are known."""

    def _resolve_kv_dtype(self) -> torch.dtype:
        """The KV cache's element type (option kv_dtype)."""
        kv = self.options["kv_dtype"]
        kv_dtype = self.torch_dtype if kv == "auto" else TORCH_DTYPES[kv]
        if kv_dtype != self.torch_dtype and self.torch_dtype != torch.float32:
            raise UnsupportedFeature(
                f"kv_dtype={kv!r} with dtype {self.dtype}", self.name,
                "a narrower KV cache is kept for float32 compute only; use kv_dtype='auto' (the compute dtype)")
        return kv_dtype

    def _async_steps(self) -> bool:
        """Whether steps run on a worker thread (the caller reads step n while n+1 runs)."""
        return False

    def _lazy_kv(self) -> bool:
        """Whether the decode cache's pages come as slots write them (a CPU choice)."""
        return False

    def _weight_needs(self) -> dict[str, int]:
        """The weights this engine allocates: a copy in the compute dtype of every weight,
        except on the CPU in float32, where the Model's float32 arrays are used as they
        are and only the others (a file's blocks, f16) are converted."""
        shapes = self.model.config.weight_shapes()
        if self.torch_device.type == "cpu" and self.torch_dtype == torch.float32:
            converted = self.model.conversion_bytes(list(shapes))
            return {"float32 copies of the weights stored in other formats": converted} if converted else {}
        return {f"{self.dtype} weights on {self.torch_device}":
                sum(math.prod(s) for s in shapes.values()) * self.torch_dtype.itemsize}

    def _check_memory(self) -> None:
        """What this engine allocates, counted as it will be, against what the device has."""
        c, cfg = self.model.config, self.config
        needs = self._weight_needs()
        if self.pages is not None and self.pages.capacity:
            needs[f"the K/V pool of {self.pages.capacity} pages x {self.pages.page_size} positions"] = (
                self.pages.capacity * self.pages.page_size * c.kv_bytes_per_token(self.kv_dtype.itemsize))
        else:  # unbounded pages: the slots' pages hold at most what a contiguous cache does
            needs[f"the KV cache of {cfg.max_slots} slots x {cfg.max_cache_length} positions"] = (
                cfg.max_slots * cfg.max_cache_length * c.kv_bytes_per_token(self.kv_dtype.itemsize))
        needs["the sampler's per-slot tables and a step's logits"] = (
            cfg.max_slots * row_bytes(c.vocab_size, self.sampler_dtype.itemsize)
            + cfg.max_prefill_length * (c.vocab_size + 4 * c.intermediate_size) * 4)
        if self.capabilities.prefill_lane:  # a step's piece runs beside the lane's prefill
            piece = min(cfg.max_prefill_length, cfg.max_num_batched_tokens or DEFAULT_STEP_TOKENS)
            needs["a prefill piece beside the prefill lane's"] = piece * (c.vocab_size + 4 * c.intermediate_size) * 4
        self.check_memory(needs, **self._memory_available())

    def _memory_available(self) -> dict[str, Any]:
        """check_memory's ``where``/``available`` (host memory by default)."""
        return {}

    def _spec(self, **choices: Any) -> StepSpec:
        """The forward's static choices for one bucket, built once and kept: the
        engine's attention, in-place cache writes, and ``choices`` (kv_len, causal,
        linear)."""
        key = tuple(sorted(choices.items(), key=lambda kv: kv[0]))
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = StepSpec(attention=self.options["attention"], inplace=True, moe="sparse",
                                               embed=self._embed, **choices)
        return spec

    def _allocating(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run an allocation; a device or host out-of-memory becomes InsufficientMemory."""
        try:
            return fn()
        except (torch.OutOfMemoryError, MemoryError) as exc:
            raise InsufficientMemory(
                f"the {self.name} backend ran out of memory allocating {what} on {self.torch_device}: {exc}; "
                f"use fewer slots (max_slots) or a shorter context (max_cache_length)", needed=0, available=0,
                where=str(self.torch_device),
            ) from None

    # -- lifecycle -------------------------------------------------------------------------

    def _load_weights(self) -> TorchWeights:
        """The weights on the device in the compute dtype (a subclass may narrow them)."""
        return self._allocating("the weights", lambda: TorchWeights.from_model(
            self.model, device=self.torch_device, dtype=self.torch_dtype, max_positions=self.max_cache_length))

    def _new_sampler(self, rows: int) -> TorchSampler:
        """A sampler of ``rows`` rows on the engine's device, with :meth:`_sampler_kernels`."""
        return TorchSampler(self.vocab_size, rows, self.eos_token_ids, device=self.torch_device,
                            dtype=self.sampler_dtype, kernels=self._sampler_kernels())

    def _sampler_kernels(self):
        """A backend's own computation of parts of the sampler (``TorchSampler``'s
        ``kernels``: ``sampling.SamplerKernels``), or None: torch ops."""
        return None

    @on_engine_thread
    def load_params(self) -> TorchWeights:
        if self._weights is None:
            self._weights = self._load_weights()
            self._prefill_sampler = self._new_sampler(1)
        return self._weights

    @on_engine_thread
    def init_decode_state(self) -> TorchDecodeState:
        weights = self.load_params()
        n = self.max_concurrent_decodes
        if self.pages is not None:
            return self._paged_decode_state(n)

        def allocate():
            k, v = weights.new_cache(n, self.max_cache_length, lazy=self._lazy_kv(), dtype=self.kv_dtype)
            return k, v, self._new_sampler(n)

        k, v, sampler = self._allocating("a decode state's KV cache", allocate)

        def counts(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=self.torch_device)

        return TorchDecodeState(n, k, v, sampler, counts(torch.int64), SlotTable(n), counts(torch.int64),
                                counts(torch.int64), counts(torch.bool))

    # -- prefill ---------------------------------------------------------------------------

    def _to_host(self, t: torch.Tensor) -> np.ndarray:
        return t.detach().to("cpu", torch.float32).numpy()

    def _first_token(self, logits: torch.Tensor, prompt: np.ndarray, sampling: SamplingParams,
                     token_mask: np.ndarray | None = None):
        """Sample 0's first token (step 0) from a prefix's logits, on the prefill sampler."""
        sampler = self._prefill_sampler
        if on_lane():
            if self._lane_sampler is None:
                self._lane_sampler = self._new_sampler(1)
            sampler = self._lane_sampler
        sampler.install(0, sampling, prompt)
        try:
            return sampler.sample(logits[None], num_top=sampling.top_logprobs,
                                  token_mask=None if token_mask is None else token_mask[None])
        finally:
            sampler.clear(0)

    @on_engine_thread
    @torch.no_grad()
    def prefill(self, *, params: TorchWeights, tokens, sampling: SamplingParams, existing_prefix: Prefix | None = None,
                token_mask: np.ndarray | None = None):
        toks, sampling, start = self.check_prefill(tokens, sampling, existing_prefix)
        mask = self.check_token_mask(token_mask, sampling)
        n = toks.size
        if self.prefill_forward_tokens and n > self.prefill_forward_tokens:
            return self._prefill_pieces(params, toks, sampling, existing_prefix, mask)
        padded = self._prefill_rows(n)
        dev = self.torch_device
        fused = padded == n and self._fused_prefill_fits([n], [start])
        if fused and self.pages is not None:  # the prefix's own pages, written in place
            seq, logits = self._fused_paged_prefill(params, toks, start, existing_prefix)
            return self._prefixed(params, logits[0], None, toks, sampling, existing_prefix, mask, start=start,
                                  nbytes=0, seq=seq)
        run = self._kv_run(params, existing_prefix, start, start + padded)
        k, v = run.k[:, :, :, : start + padded], run.v[:, :, :, : start + padded]
        if fused:
            logits = self._fused_prefill(params, toks, [0] * n, list(range(start, start + n)), run.k, run.v, [n - 1])
        else:
            batch = np.zeros((1, padded), np.int64)
            batch[0, :n] = toks
            positions = (start + torch.arange(padded, dtype=torch.int64, device=dev))[None]
            write = (torch.arange(padded, device=dev) < n)[None]
            tail = start > 0 and self._causal_attention is not None  # the kernel continues the prefix
            logits, k, v = forward(
                params, self._spec(causal=start == 0, causal_tail=tail, linear=self._prefill_linear,
                                   kv_codec=self._kv_codec,
                                   causal_attention=self._causal_attention if start == 0 or tail else None),
                to_device(batch, dev), positions, k, v,
                rows=None, write_mask=write, logits_at=torch.full((1,), n - 1, dtype=torch.int64, device=dev),
            )
        run.filled = start + n
        prefix, first = self._prefixed(params, logits[0], (k[:, 0], v[:, 0]), toks, sampling, existing_prefix, mask,
                                       start=start, nbytes=self.kv_bytes(start + padded))
        if self.pages is None:  # the views keep the whole buffer alive; the run lets a continuation extend it
            prefix = replace(prefix, kv=_RunViews(prefix.kv, run))
        return prefix, first

    def _prefill_pieces(self, params: TorchWeights, toks: np.ndarray, sampling: SamplingParams,
                        existing_prefix: Prefix | None, mask) -> tuple[Prefix, ResultTokens]:
        """A prompt longer than ``prefill_forward_tokens`` as consecutive prefills of as
        even pieces as fit under it, each continuing the one before (its K/V extended in
        place, or its pages shared), the last with the request's sampling and mask; a
        piece's own prefix is dropped once the next continues it."""
        cap = int(self.prefill_forward_tokens)
        pieces = -(-toks.size // cap)
        cuts = [toks.size * i // pieces for i in range(pieces + 1)]
        prefix = existing_prefix
        try:
            for a, b in zip(cuts[:-2], cuts[1:-1]):
                head, _ = self.prefill(params=params, tokens=toks[a:b], sampling=_PIECE, existing_prefix=prefix)
                self._drop_piece(prefix, existing_prefix)
                prefix = head
            return self.prefill(params=params, tokens=toks[cuts[-2]:], sampling=sampling, existing_prefix=prefix,
                                token_mask=mask)
        finally:
            self._drop_piece(prefix, existing_prefix)

    @staticmethod
    def _drop_piece(prefix: Prefix | None, existing_prefix: Prefix | None) -> None:
        """A piece's prefix (not the caller's): its pages' references given back."""
        if prefix is not None and prefix is not existing_prefix and isinstance(prefix.kv, PageList):
            prefix.kv.release()

    # Tokens up to which a prefill (a batch's entries counted together) is one fused call
    # (_fused_prefill, _fused_paged_prefill) instead of the forward; 0: never (CpuEngine sets it).
    fused_prefill_rows = 0

    def _fused_prefill_fits(self, lengths: Sequence[int], starts: Sequence[int]) -> bool:
        """Whether a prefill of entries of ``lengths`` tokens after ``starts`` positions each
        runs as one fused call: up to ``fused_prefill_rows`` tokens in all (0: never, and
        nothing else is computed)."""
        return int(sum(lengths)) <= self.fused_prefill_rows

    def _fused_prefill(self, params: TorchWeights, tokens: np.ndarray, rows: list[int], positions: list[int],
                       k: torch.Tensor, v: torch.Tensor, last: list[int]) -> torch.Tensor:
        """A prefill's forward as one fused call (up to ``fused_prefill_rows`` tokens):
        ``tokens`` (T,) at ``positions`` in cache rows ``rows`` of the contiguous caches
        ``k``/``v`` (layers, rows, kv_heads, length, head_dim), their K/V written there, each
        token attending its row up to its own position; the logits of the tokens at the
        indices ``last`` (len(last), vocab)."""
        raise NotImplementedError

    def _fused_paged_prefill(self, params: TorchWeights, tokens: np.ndarray, start: int,
                             prefix: Prefix | None) -> tuple[PageList, torch.Tensor]:
        """Paged K/V, :meth:`_fused_prefill` over the page pool: ``tokens`` after ``start``
        positions of ``prefix`` (None: from position 0) written into the new prefix's own
        pages (the continued prefix's shared, a partly filled last one copied first).
        Returns those pages and the last token's logits (1, vocab)."""
        raise NotImplementedError

    def _prefill_rows(self, n: int) -> int:
        """The rows a prefill of ``n`` tokens runs (pad tokens after them write nothing):
        the prefill bucket, the shapes a device's kernels and graphs are kept for. A host
        engine without compiled shapes may run the ``n`` alone (CpuEngine)."""
        return self.config.bucket_for(n)

    def _kv_run(self, params: TorchWeights, prefix: Prefix | None, start: int, length: int) -> "_KVRun":
        """The contiguous cache a prefill of positions ``start..length`` runs over.

        Continuing a prefix this engine made, whose buffer has room and whose positions
        after it nobody has written yet (a chunked prompt's next piece), it is that buffer,
        extended in place: the prefix's own positions stay as they are, so the prefix and
        every other view of the buffer read what they read before. Otherwise a new buffer
        (the KV dtype: what the decode cache will hold, bit for bit; on a Linux host a
        memory map of its own, so a prefix dropped gives its pages back at once, hostmem.py)
        with the prefix's K/V copied in. On a host whose cache pages come as they are
        written, a new buffer reserves room for twice the length (up to the engine's
        context), which costs address space only: a prompt prefilled in pieces then copies
        its K/V a logarithmic number of times instead of once a piece. A second
        continuation of the same prefix finds the room taken (``filled`` past its end) and
        copies. docs/prefix-caching.md ("Pieces extend their prefix in place")."""
        run = getattr(prefix.kv, "run", None) if prefix is not None and self.pages is None else None
        with self._run_lock:  # claimed at once: a continuation beside this one (the prefill lane) copies
            if run is not None and run.filled == start and run.capacity >= length:
                run.filled = length
                return run
        capacity = length
        if grows_with_use(self.torch_device):
            capacity = max(length, min(2 * length, self.max_cache_length))
        k, v = params.new_cache(1, capacity, lazy=True, dtype=self.kv_dtype)
        if prefix is not None:
            k[:, 0, :, :start], v[:, 0, :, :start] = self._prefix_kv(prefix)
        return _KVRun(k, v, start)

    def _prefixed(self, params: TorchWeights, logits: torch.Tensor, row: tuple[torch.Tensor, torch.Tensor] | None,
                  toks, sampling: SamplingParams, existing_prefix: Prefix | None, mask, *, start: int, nbytes: int,
                  seq: PageList | None = None):
        """The prefix a prefill made (its K/V from ``row``, the prefill's contiguous cache
        row (layers, kv_heads, positions, head_dim) holding positions ``0..start + n``, or
        already in the pages ``seq``; its last position's logits) and its first token."""
        n = toks.size
        k, v = row if row is not None else (None, None)
        prompt = toks if existing_prefix is None else np.concatenate([existing_prefix.prompt_tokens, toks]).astype(np.int32)
        first = self._first_token(logits, prompt, sampling, mask)
        token = int(first.tokens[0])  # the protocol's Prefix carries it on the host
        if seq is not None:  # written in its pages already
            kv, nbytes = seq, self.kv_bytes(len(seq.pages) * self.pages.page_size)
        elif self.pages is not None:
            # The prefill ran over its own contiguous cache (so a prefill's attention is the
            # contiguous engine's, host kernel included); its new positions go into pages,
            # after the continued prefix's shared ones.
            seq = PageList.continuing(self.pages, None if existing_prefix is None else existing_prefix.kv)
            self._paged.scatter(seq, k, v, start, start + n)
            kv, nbytes = seq, self.kv_bytes(len(seq.pages) * self.pages.page_size)
        else:
            kv = (k[:, :, : start + n], v[:, :, : start + n])
        prefix = Prefix(
            kv=kv, logits=logits.float(), prompt_tokens=prompt,
            sampling=sampling, backend=self.name, first_token=token, to_host=self._to_host, model_id=self.model_id,
            token_mask=mask, nbytes=nbytes,
        )
        return prefix, ResultTokens.first_tokens(first.tokens, first.logprobs, first.top_ids, first.top_logprobs,
                                                 to_host=host_array)

    def batches_prefill(self) -> bool:
        """Capability ``batched_prefill``: one forward for a batch of prefills, unless a
        subclass has a ``prefill`` of its own (then ``prefill_batch`` is the kit's loop over it)."""
        return type(self).prefill is TorchEngine.prefill

    @on_engine_thread
    @torch.no_grad()
    def prefill_batch(self, *, params: TorchWeights, requests) -> list[tuple[Prefix, ResultTokens]]:
        """The entries as one forward: batch row ``i`` holds entry ``i``'s tokens at
        positions ``start_i..``, padded at the end to the longest entry's bucket; each row
        attends to its own cache row (its prefix copied in, then its new K/V), the mask
        keyed by each query's own position, and pad tokens write nothing. Each prefix then
        gets a cache of its own (a copy of its row), so dropping one frees its memory."""
        if type(self).prefill is not TorchEngine.prefill:  # a subclass's own prefill is honoured, entry by entry
            return EngineBase.prefill_batch(self, params=params, requests=requests)
        checked = self.check_prefill_batch(requests)  # every entry, before any work
        out: list[tuple[Prefix, ResultTokens]] = []
        cap = self.prefill_forward_tokens
        for group in batch_groups([toks.size for toks, _, _, _ in checked], cap):
            if cap and len(group) == 1 and checked[group[0]][0].size > cap:  # alone and long: in pieces
                toks, sampling, _, mask = checked[group[0]]
                out.append(self._prefill_pieces(params, toks, sampling, requests[group[0]].existing_prefix, mask))
            else:
                out += self._prefill_checked(params, [requests[i] for i in group], [checked[i] for i in group])
        return out

    def _prefill_checked(self, params: TorchWeights, requests, checked) -> list[tuple[Prefix, ResultTokens]]:
        """prefill_batch's one forward over entries already checked."""
        existing = [r.existing_prefix for r in requests]
        dev = self.torch_device
        b = len(checked)
        width = self._prefill_rows(max(toks.size for toks, _, _, _ in checked))
        starts = [start for _, _, start, _ in checked]
        k, v = params.new_cache(b, max(starts) + width, dtype=self.kv_dtype)
        batch = np.zeros((b, width), np.int64)  # (B, T)
        lengths = np.array([toks.size for toks, _, _, _ in checked])
        for i, ((toks, _, start, _), prior) in enumerate(zip(checked, existing)):
            batch[i, : toks.size] = toks
            if prior is not None:
                k[:, i, :, :start], v[:, i, :, :start] = self._prefix_kv(prior)
        offsets = torch.arange(width, dtype=torch.int64, device=dev)
        positions = to_device(np.asarray(starts, np.int64), dev)[:, None] + offsets[None]  # (B, T)
        write = offsets[None] < to_device(lengths, dev)[:, None]  # (B, T): pad tokens write nothing
        # From position 0 in every row (all of them as long as the widest), the causal
        # kernels apply; from one shared start > 0, the engine's kernel continues the
        # prefixes (causal_tail); otherwise the general mask over each query's own position.
        causal = not any(starts)
        tail = not causal and len(set(starts)) == 1 and self._causal_attention is not None
        # One fused call where the engine has it: every entry's own rows, no pad rows (none with
        # prefill buckets: the rows asked for are run)
        if width == max(lengths) and self._fused_prefill_fits(lengths, starts):
            logits = self._fused_prefill(
                params, np.concatenate([toks for toks, _, _, _ in checked]),
                [i for i, (toks, _, _, _) in enumerate(checked) for _ in range(toks.size)],
                [start + j for toks, _, start, _ in checked for j in range(toks.size)], k, v,
                list(np.cumsum(lengths) - 1))
        else:
            logits, k, v = forward(
                params, self._spec(causal=causal, causal_tail=tail, linear=self._prefill_linear,
                                   kv_codec=self._kv_codec,
                                   causal_attention=self._causal_attention if causal or tail else None),
                to_device(batch, dev), positions, k, v,
                rows=None, write_mask=write, logits_at=to_device(lengths - 1, dev),
            )  # logits (B, vocab)
        out = []
        for i, ((toks, sampling, start, mask), prior) in enumerate(zip(checked, existing)):
            total = start + toks.size
            if self.pages is not None:  # scattered into pages from the batch's row
                row = (k[:, i], v[:, i])
            else:
                own_k, own_v = params.new_cache(1, total, lazy=True, dtype=self.kv_dtype)
                own_k[:, 0], own_v[:, 0] = k[:, i, :, :total], v[:, i, :, :total]
                row = (own_k[:, 0], own_v[:, 0])
            out.append(self._prefixed(params, logits[i], row, toks, sampling, prior, mask, start=start,
                                      nbytes=self.kv_bytes(total)))
        return out

    # -- the prefill lane (capability prefill_lane) -----------------------------------------

    @contextlib.contextmanager
    def _lane_split(self):
        """Hook: the engine's threads split between the lane's prefill (on the calling
        thread) and the steps, for as long as the block runs. A backend declaring
        prefill_lane keeps every scratch of a prefill per thread (CpuEngine)."""
        yield

    def _lane_prefill(self, keywords: dict[str, Any]) -> tuple[Prefix, ResultTokens]:
        with self._lane_split():
            return self.prefill(**keywords)

    # -- insert, bulk_insert, free_resource: the kit's flow over torch_common's hooks --------

    insert = on_engine_thread(torch.no_grad()(EngineBase.insert))
    bulk_insert = on_engine_thread(torch.no_grad()(EngineBase.bulk_insert))
    free_resource = on_engine_thread(EngineBase.free_resource)

    def _installed(self, state: TorchDecodeState, slots: list[int], first: torch.Tensor, prefix: Prefix) -> None:
        state.next_tokens[to_device(np.asarray(slots, np.int64), self.torch_device)] = first
        for slot in slots:  # the first token counts: prompt + 1
            fill_row(state.total, slot, prefix.true_length + 1)
            fill_row(state.prompt_len, slot, prefix.true_length)
            fill_row(state.occupied, slot, True)

    def _release(self, state: TorchDecodeState, slot: int) -> None:
        super()._release(state, slot)
        for counts in (state.total, state.prompt_len, state.occupied):
            fill_row(counts, slot, 0)
        if state.seqs is not None:  # paged: the slot's references only (a prefix keeps its pages)
            if state.seqs[slot] is not None:
                state.seqs[slot].release()
                state.seqs[slot] = None
            return
        release_row(state.k, slot)  # a cache whose pages come with use gives the slot's back (0 bytes otherwise)
        release_row(state.v, slot)

    # -- generate --------------------------------------------------------------------------

    def generate(self, params: TorchWeights, decode_state: TorchDecodeState, *, overrides: Mapping[int, Any] | None = None,
                 token_masks: Mapping[int, np.ndarray] | None = None):
        state = decode_state
        state.wait()
        plan = self._take_step(state, *self._check_step(state, overrides, token_masks))
        return state, self._dispatch(state, lambda: self._run_step(params, state, plan), plan.layout)

    def _check_step(self, state: TorchDecodeState, overrides, token_masks) -> tuple[dict, np.ndarray | None]:
        """What generate refuses, before any work: the overrides and the masks checked,
        ``(forced, words)``."""
        forced = self.check_overrides(overrides, state.slots.last_result)
        masks = self.check_token_masks(token_masks, state.slots.last_result, forced=forced,
                                       sampling_of=state.slots.sampling)
        return forced, None if masks is None else masks.words

    def _take_step(self, state: TorchDecodeState, forced: dict, words: np.ndarray | None) -> "_StepPlan":
        """The host half of a step: the forced tokens marked, each live slot's page taken
        (a pool that runs out refuses here, before the host's counts move), the counts
        advanced."""
        for slot, (_, position) in forced.items():
            state.slots.force(slot, position)
        # slot -> (token, its new prompt + completion count) for the device's copy
        forced = {slot: (token, state.slots[slot].total) for slot, (token, _) in forced.items()}
        live = state.slots.live(self.max_cache_length)
        positions = [state.slots[i].length if i in live else 0 for i in range(state.num_slots)]
        # The attended length is a host number (a static choice of the step), not a copy.
        block = self.options["kv_block"]
        kv_len = min(self.max_cache_length, block * math.ceil((max(positions, default=0) + 1) / block))
        num_top = state.sampler.max_top_logprobs
        # Paged: the copies and table rows go first in the step.
        page_ops = self._prepare_pages(state, live, positions) if self.pages is not None else None
        state.slots.advance(live)  # what the host can know before the step runs: who advances, by one
        return _StepPlan(forced, live, positions, kv_len, num_top, words, page_ops)

    def _run_step(self, params: TorchWeights, state: TorchDecodeState, plan: "_StepPlan",
                  mixed: "MixedRows | None" = None) -> torch.Tensor:
        """The device half of a step (engine thread): the page work applied, the step run."""
        args = (params, state, plan.forced, plan.live, plan.positions, plan.kv_len, plan.num_top, plan.words)
        extra = {} if mixed is None else {"mixed": mixed}  # a plain step calls _step as it always has
        if plan.page_ops is None:
            return self._step(*args, **extra)
        with self._paged.using():  # the pools stay these tensors (a lane's prefill grows none) to its end
            self._apply_pages(state, plan.page_ops)
            return self._step(*args, **extra)

    def _dispatch(self, state: TorchDecodeState, step: Callable[[], torch.Tensor], layout: ResultLayout) -> ResultTokens:
        """The step on the worker thread (its results read later) or here."""
        if self._worker is not None:
            state.pending = self._worker.submit(step)
            return ResultTokens.from_packed(state.pending, layout, to_host=lambda f: f.result().numpy())
        return self._results(step(), layout)

    # -- the mixed step (capability mixed_step) ----------------------------------------------

    def generate_with_prefill(self, params: TorchWeights, decode_state: TorchDecodeState, *, requests,
                              overrides: Mapping[int, Any] | None = None,
                              token_masks: Mapping[int, np.ndarray] | None = None):
        """Protocol ``generate_with_prefill``: where :meth:`_mixes` says so, the entries'
        tokens are rows of the step's own forward (written into their new prefixes' pages,
        each attending its prefix and itself causally: :class:`MixedRows`); else
        ``prefill_batch`` and then ``generate``. Entries, overrides and masks are checked
        first, then the entries' pages taken, then the step's (the two calls' order)."""
        if not self.capabilities.mixed_step:  # the kit's refusal
            return EngineBase.generate_with_prefill(self, params, decode_state, requests=requests)
        checked = self.check_prefill_batch(requests)
        state = decode_state
        state.wait()
        forced, words = self._check_step(state, overrides, token_masks)
        if not self._mixes(checked, state):
            return self._prefill_then_generate(params, state, requests, overrides, token_masks)
        prefixes: Future = Future()
        mixed = self._mixed_rows(requests, checked, state.num_slots)  # the entries' pages (released if refused)
        self.mixed_steps += 1
        try:
            plan = self._take_step(state, forced, words)
        except BaseException:
            mixed.release()
            raise

        def step() -> torch.Tensor:
            try:
                packed = self._run_step(params, state, plan, mixed)
                prefixes.set_result([
                    self._prefixed(params, mixed.logits[j], None, toks, sampling, r.existing_prefix, mask, start=start,
                                   nbytes=0, seq=mixed.seqs[j])
                    for j, (r, (toks, sampling, start, mask)) in enumerate(zip(requests, checked))])
            except BaseException as exc:
                prefixes.set_exception(exc)
                raise
            return packed

        return state, self._dispatch(state, step, plan.layout), prefixes

    def _mixes(self, checked, state: TorchDecodeState) -> bool:
        """Whether generate_with_prefill runs these checked entries inside the step's
        forward (a backend's fused step: CpuEngine); False here."""
        return False

    def _mixed_rows(self, requests, checked, slots: int) -> "MixedRows":
        """The entries' rows for the step: each entry's new prefix's pages (the continued
        prefix's shared, a partly filled last one copied) made writable for its tokens, its
        page table at row ``slots + j``. A pool that runs out releases what was taken and
        raises InsufficientMemory."""
        seqs: list[PageList] = []
        try:
            for r, (toks, _, start, _) in zip(requests, checked):
                seq = PageList.continuing(self.pages, None if r.existing_prefix is None else r.existing_prefix.kv)
                self._paged.writable(seq, start, start + toks.size)  # releases seq if it cannot
                seqs.append(seq)
        except BaseException:
            for seq in seqs:
                seq.release()
            raise
        lengths = [toks.size for toks, _, _, _ in checked]
        dev = self.torch_device
        return MixedRows(
            seqs=seqs,
            tokens=to_device(np.concatenate([toks for toks, _, _, _ in checked]).astype(np.int64), dev),
            rows=to_device(np.repeat(np.arange(slots, slots + len(checked)), lengths).astype(np.int64), dev),
            positions=to_device(np.concatenate([np.arange(start, start + toks.size) for toks, _, start, _ in checked])
                                .astype(np.int64), dev),
            table=torch.cat([self._paged.table_for(seq, self.max_cache_length) for seq in seqs]),
            last=[int(i) for i in np.cumsum(lengths) - 1])

    def _results(self, buf: torch.Tensor, layout: ResultLayout) -> ResultTokens:
        """A step's packed results as the protocol's ResultTokens (a device subclass
        starts the host copy here)."""
        return ResultTokens.from_packed(buf, layout, to_host=lambda t: t.numpy())

    @torch.no_grad()
    def _step(self, params, state: TorchDecodeState, forced, live, positions, kv_len, num_top,
              words: np.ndarray | None, mixed: "MixedRows | None" = None) -> torch.Tensor:
        """One decode step: the forced tokens in, the rows computed (:meth:`_decode`),
        the counts advanced on the device, the results packed. ``words``: the step's
        allowed-token masks (packed bits per slot), copied in like every other host input."""
        dev, n = self.torch_device, state.num_slots
        if words is not None:
            words = to_device(words, dev)
        if forced:
            rows = to_device(np.asarray(list(forced), np.int64), dev)
            tokens = to_device(np.asarray([t for t, _ in forced.values()], np.int64), dev)
            state.sampler.override(tokens, rows=rows)
            state.next_tokens[rows] = tokens
            for slot, (_, total) in forced.items():
                fill_row(state.total, slot, total)
        live_mask = state.occupied & (state.total < self.max_cache_length)
        if live:
            tokens, logprobs, top_ids, top_lp = self._decode(
                params, state, live_mask, StepInputs(live, positions, kv_len, num_top, words, mixed))
        else:
            tokens = torch.zeros(n, dtype=torch.int64, device=dev)
            logprobs = torch.zeros(n, device=dev)
            top_ids = torch.zeros((n, num_top), dtype=torch.int64, device=dev)
            top_lp = torch.zeros((n, num_top), device=dev)
        state.total += live_mask  # the host's advance(live), on the device
        lengths = torch.where(state.occupied, state.total - state.prompt_len, 0)  # completion tokens
        return pack_results(ResultLayout(k=1, top_n=num_top, logprobs=True), tokens=tokens, valid=live_mask,
                            lengths=lengths, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_lp)

    def _decode(self, params: TorchWeights, state: TorchDecodeState, live_mask: torch.Tensor, step: StepInputs):
        """The device path: every slot runs from device data, empty ones write nothing
        (no host copy, no sync). Returns (tokens, logprobs, top_ids, top_logprobs) per slot."""
        pos = torch.where(live_mask, state.total - 1, 0)[:, None]
        logits = self._device_forward(params, state, pos, live_mask, step.kv_len)
        res = state.sampler.sample(logits[:, 0], num_top=step.num_top, token_mask=step.words)
        state.sampler.record(res.tokens, mask=live_mask)
        state.next_tokens.copy_(torch.where(live_mask, res.tokens, state.next_tokens))
        return res.tokens, res.logprobs, res.top_ids, res.top_logprobs

    def _device_forward(self, params: TorchWeights, state: TorchDecodeState, pos: torch.Tensor,
                        live_mask: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Every slot's next logits ``(slots, 1, vocab)`` through the shared forward."""
        logits, state.k, state.v = forward(
            params, self._spec(kv_len=kv_len, linear=self._linear, kv_codec=self._kv_codec),
            state.next_tokens[:, None], pos, state.k, state.v, rows=None, write_mask=live_mask[:, None],
            page_table=state.page_table,
        )
        return logits

    shares_prefix_heads = True  # _prefix_head: views of the K/V or the pages shared

    def _prefix_head(self, prefix: Prefix, length: int) -> Prefix:
        """The first ``length`` positions as views of the prefix's K/V in the KV dtype (the
        kit's way goes through float32), or, paged, its pages shared (the partly filled last
        one copied on its first write); the continuation that reads them copies them."""
        if self.pages is not None:
            seq = prefix.kv.fork(length, finalize=True)
            return replace(prefix, kv=seq, prompt_tokens=prefix.prompt_tokens[:length],
                           nbytes=self.kv_bytes(len(seq.pages) * self.pages.page_size))
        k, v = prefix.kv
        return replace(prefix, kv=(k[:, :, :length], v[:, :, :length]),
                       prompt_tokens=prefix.prompt_tokens[:length])

    # -- embeddings ------------------------------------------------------------------------

    @on_engine_thread
    @torch.no_grad()
    def embed(self, *, params: TorchWeights, tokens) -> np.ndarray:
        """A prefill's forward from position 0 into a scratch cache (no slot, no prefix),
        padded to the prefill bucket as prefill pads, without the LM head."""
        toks = self.check_embed(tokens)
        n, padded, dev = toks.size, self._prefill_rows(toks.size), self.torch_device
        k, v = params.new_cache(1, padded, lazy=True, dtype=self.kv_dtype)
        batch = np.zeros((1, padded), np.int64)
        batch[0, :n] = toks
        x, _, _ = residual_stream(
            params, self._spec(causal=True, linear=self._prefill_linear, kv_codec=self._kv_codec,
                               causal_attention=self._causal_attention),
            to_device(batch, dev), torch.arange(padded, dtype=torch.int64, device=dev)[None], k, v,
            rows=None, write_mask=(torch.arange(padded, device=dev) < n)[None])
        return self._to_host(final_norm(params, x[0, :n]))  # pads sit after the true tokens: causality hides them

    # -- portable prefixes ---------------------------------------------------------------

    @on_engine_thread
    def export_prefix(self, prefix: Prefix) -> PortablePrefix:
        self.check_prefix(prefix).require_logits("export_prefix")
        k, v = self._prefix_kv(prefix)
        return PortablePrefix(
            k=self._to_host(k), v=self._to_host(v), prompt_tokens=prefix.prompt_tokens,
            last_logits=self._to_host(prefix.logits), sampling=prefix.sampling, model_fingerprint=self.model.fingerprint,
        )

    def import_prefix(self, portable: PortablePrefix) -> Prefix:
        prompt, sampling = self.check_portable(portable)
        return self._imported(portable, prompt, sampling, None)

    def _import_onto_pages(self, portable: PortablePrefix, existing_prefix: Prefix) -> Prefix:
        """EngineBase._import_onto_pages: the tail written into pages after the held prefix's."""
        return self._imported(portable, portable.prompt_tokens, portable.sampling, existing_prefix)

    @on_engine_thread
    @torch.no_grad()
    def _imported(self, portable: PortablePrefix, prompt: np.ndarray, sampling, existing: Prefix | None) -> Prefix:
        """A checked portable prefix as a Prefix: its K/V in the KV dtype (contiguous, or
        pages); a tail only onto ``existing`` (paged), whose pages below the start it shares."""
        self.load_params()
        put = lambda a: to_device(np.ascontiguousarray(a), self.torch_device, self.kv_dtype)  # noqa: E731
        logits = to_device(np.ascontiguousarray(portable.last_logits, np.float32), self.torch_device)
        first = self._first_token(logits, prompt, sampling)
        kv, nbytes = (put(portable.k), put(portable.v)), self.kv_bytes(prompt.size)
        if self.pages is not None:
            start = portable.start
            seq = existing.kv.fork(start, finalize=True) if existing is not None else PageList(self.pages, [], 0,
                                                                                                finalize=True)
            if start < prompt.size:  # an empty tail writes nothing (and copies no shared page)
                self._paged.scatter(seq, kv[0], kv[1], start, prompt.size, offset=start)
            kv, nbytes = seq, self.kv_bytes(len(seq.pages) * self.pages.page_size)
        return Prefix(
            kv=kv, logits=logits, prompt_tokens=prompt, sampling=sampling,
            backend=self.name, first_token=int(first.tokens[0]), to_host=self._to_host, model_id=self.model_id,
            nbytes=nbytes,
        )

    # -- pages (option page_size) ----------------------------------------------------------

    def _paged_decode_state(self, n: int) -> TorchDecodeState:
        """A decode state over the engine's page pools: a page-table row per slot."""
        k, v = self._paged.tensors
        sampler = self._allocating("a decode state's sampler", lambda: self._new_sampler(n))
        counts = lambda dtype: torch.zeros(n, dtype=dtype, device=self.torch_device)  # noqa: E731
        return TorchDecodeState(n, k, v, sampler, counts(torch.int64), SlotTable(n), counts(torch.int64),
                                counts(torch.int64), counts(torch.bool),
                                page_table=self._paged.new_table(n, self.max_cache_length), seqs=[None] * n)

    def _new_pools(self, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed K and V page pools (L, pages, kv_heads, page_size, head_dim); on the CPU
        their memory comes as pages are written (kv_memory grow), as the contiguous cache's."""
        weights, ps = self.load_params(), self.pages.page_size
        return self._allocating(f"the K/V page pool ({pages} pages of {ps} positions)", lambda: weights.new_cache(
            pages, ps, lazy=self._lazy_kv(), dtype=self.kv_dtype))

    def _prepare_pages(self, state: TorchDecodeState, live: list[int], positions: list[int]):
        """:meth:`PagedKV.prepare`; a pool that runs out applies what was prepared before
        it (on the engine thread) and raises, the slots' K/V reading the same."""
        try:
            return self._paged.prepare(state.seqs, live, positions)
        except Exception as exc:
            if hasattr(exc, "page_ops"):
                self._apply_pages_now(state, exc.page_ops)
            raise

    def _apply_pages(self, state: TorchDecodeState, ops) -> None:
        state.k, state.v = self._paged.apply(state.page_table, ops)

    _apply_pages_now = on_engine_thread(_apply_pages)

    def _prefix_kv(self, prefix: Prefix) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefix's K/V as (layers, kv_heads, true_length, head_dim) tensors in the KV
        dtype: gathered from its pages, or its own arrays."""
        return prefix.kv if self._paged is None else self._paged.gather(prefix.kv, prefix.true_length)
