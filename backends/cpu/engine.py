"""The cpu engine: the shared torch engine run by a resolved :class:`CpuPlan`.

The host is the device, so a decode step computes only the live slots' rows (its cost
follows the requests, not the slot count): on the host-compiled fused step where the
plan has it, else the shared torch forward on those rows with its projections on the
host kernels. Weights stay the Model's float32 arrays (no copy) or become the plan's
int8/bfloat16 copies; prefill runs torch's GEMM (on the plan's operands) and, where the
plan says so, its causal attention on the host kernel. The KV cache is an anonymous
memory map whose pages come as slots write them (``kv_memory`` grow). Steps run on a
worker thread, so the driver reads step n while n+1 runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import sys
import warnings
from typing import Sequence

import numpy as np
import torch

from polyengine.engine import Capabilities, EngineConfig
from polyengine.errors import FallbackWarning, InsufficientMemory
from polyengine.models import Model
from polyengine.models.config import ARCHITECTURES
from polyengine.models.quantize import has_int8_copies, int8_bytes, quantized_names, replaced_weights
from polyengine.pages import PageList
from polyengine.sampling.params import ENGINE_FIELDS, MAX_TOP_LOGPROBS

from polyengine.backends.cpu.blocks import (BlockMatrix, TiledBlockLinear, embed_rows, packing_arena, repacked,
                                            repacked_for)
from polyengine.backends.cpu.int8 import TiledInt8Linear, bf16_tensors, has_bf16_copies, int8_tensors
from polyengine.backends.cpu.kernels import (BLOCK_KERNEL_ROWS, FUSED_PREFILL_SCORES, MAX_ROWS, SPLIT_PIECES,
                                             TILE_ROWS, TILED_FUSED_PREFILL_ROWS, FusedDecoder)
from polyengine.backends.cpu.options import OPTIONS, WEIGHT_FORMATS
from polyengine.backends.cpu.plan import CpuHost, CpuPlan, lane_threads
from polyengine.backends.torch_common.engine import MixedRows, StepInputs, TorchDecodeState, TorchEngine
from polyengine.backends.torch_common.model import TorchWeights, forward, rms_norm

__all__ = ["CpuEngine", "create_engine"]


class CpuEngine(TorchEngine):
    name = "cpu"
    OPTIONS = OPTIONS
    # A prefill forward's rows (a batch's prompts together, or a long prompt's pieces): at
    # least 512, more while their float32 activations stay under PREFILL_FORWARD_BYTES.
    # On a 1B file eight 128-token prompts as one forward of 1,024 rows held ~230 MiB more
    # at its peak than the engine's steady state, two of 512 half that, at the same rate per
    # token; a 2,048-token prompt in pieces of 512 peaked at half the memory over its start
    # and ran faster, while on the 135M default model (small activations, K/V copied into
    # each piece) pieces only cost time (docs/cpu.md, "Prefill rows")
    PREFILL_FORWARD_BYTES = 64 << 20
    PREFILL_FORWARD_MIN_TOKENS = 512

    def capabilities_for(self, model: Model, config: EngineConfig) -> Capabilities:
        self.torch_device = torch.device("cpu")
        self.device = f"cpu ({torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()})"
        self.host = CpuHost.detect()
        # bfloat16 compute only where the CPU has bfloat16 units (AMX, AVX512-BF16): elsewhere
        # torch widens it element by element and it is slower than float32
        dtypes = ("float32", "bfloat16") if self.host.bf16_units else ("float32",)
        return Capabilities(
            dtypes=dtypes, sampling_params=ENGINE_FIELDS, max_top_logprobs=MAX_TOP_LOGPROBS,
            bulk_insert=True, portable_prefix=True, prefix_reuse=True, prefix_truncate=True, async_results=True,
            portable_prefix_tail=True,  # paged: the head's pages shared; contiguous: the kit's copy
            architectures=ARCHITECTURES, token_masks=True, embeddings=True,
            batched_prefill=self.batches_prefill(),
            # the GGUF block formats are computed on as mapped (blocks.py); others, and every
            # weight where the plan does not keep blocks, are converted one tensor at a time
            weight_formats=WEIGHT_FORMATS, page_size=self.options["page_size"],
            prefill_lane=self.lane_threads() > 0,
        )

    def lane_threads(self) -> int:
        """The prefill lane's threads (option prefill_threads, resolved once: plan.lane_threads)."""
        if not hasattr(self, "_lane_threads"):
            self._lane_threads = lane_threads(self.options)
        return self._lane_threads

    @contextlib.contextmanager
    def _lane_split(self):
        """TorchEngine._lane_split: the lane's calls to the compiled kernels (its products,
        its attention, a fused prefill) on its threads, the steps' on the rest
        (CpuKernels.lend: they take their thread count per call). torch's own ops (norms,
        RoPE, the sampler) keep torch's count, one for the whole process: switching it while
        the lane ran stalled the steps by ~150 ms at a time (measured: docs/cpu.md, "The
        prefill lane")."""
        if self._kernels is None:
            yield
            return
        with self._kernels.lend(self.lane_threads()):
            yield

    def _sampler_kernels(self):
        """TorchEngine._sampler_kernels: the compiled kernels' stream and draw (option
        sampler_kernel)."""
        if self._kernels is None or not self.options["sampler_kernel"]:
            return None
        return self._kernels

    def _prefill_rows(self, n: int) -> int:
        """No padding on the host: nothing here is compiled per shape, and a pad row costs
        a real row in every product (a 20-token prompt padded to 32 is 1.6x the work).
        With ``prefill_buckets`` set, the buckets as asked (docs/cpu.md, "Prefill rows")."""
        return n if self.config.prefill_buckets is None else self.config.bucket_for(n)

    def _resolve(self) -> None:
        self.plan = plan = CpuPlan.resolve(self.options, self.model, self.host, dtype=self.torch_dtype)
        if plan.threads:
            torch.set_num_threads(plan.threads)
        if plan.kernels_fallback is not None:
            message = f"cpu: decoding on torch's matmul, not the compiled CPU kernels: {plan.kernels_fallback}"
            warnings.warn(message, FallbackWarning, stacklevel=4)
            logging.getLogger(__name__).warning(message)
        self._kernels = plan.kernels
        self._blocks: dict[str, BlockMatrix] = {}  # made with the weights (plan.block_weights)
        self._tiled_blocks = TiledBlockLinear() if plan.block_weights else None
        # Rows of x up to which a product on GGUF blocks runs on the int8 kernels, past it
        # on bands dequantized into torch's GEMM.
        # With int16 tiles (plan.block_tiles) those run from TILE_ROWS rows on.
        self.block_kernel_rows = TILE_ROWS - 1 if plan.block_tiles else BLOCK_KERNEL_ROWS
        if plan.kernels is not None or plan.narrow or plan.block_weights:
            self._linear = self._cpu_linear
            self._prefill_linear = (self._cpu_linear if plan.prefill_compute == self.torch_dtype else
                                    functools.partial(self._cpu_linear, compute=plan.prefill_compute))
        if plan.prefill_attention is not None:
            self._causal_attention = self._kernel_attention
        self._tiled = TiledInt8Linear() if plan.narrow else None  # narrow products without the kernels
        self._fused: FusedDecoder | None = None  # built with the weights where the plan has it
        # Tokens up to which a prefill (all entries of a batch together) is one fused call:
        # more where its products run on int16 tiles, past MAX_ROWS only while its attention
        # stays short (_fused_prefill_fits; docs/cpu.md, "Short prefills in the fused step")
        self.fused_prefill_rows = (TILED_FUSED_PREFILL_ROWS if plan.block_tiles else MAX_ROWS) if plan.fused_prefill else 0
        self._logits_buffer: torch.Tensor | None = None  # a fused step's logits, reused
        self.prefill_forward_tokens = max(self.PREFILL_FORWARD_MIN_TOKENS,
                                          self.PREFILL_FORWARD_BYTES // prefill_row_bytes(self.model.config))
        # generate_with_prefill inside the fused step (option mixed_step): on pages, up to as
        # many prompt tokens as a fused prefill takes; the capability says how many
        mixes = self.options["mixed_step"] and plan.fused_decode and self.options["page_size"] > 0
        self.capabilities = self.capabilities.model_copy(update={"mixed_step": self.fused_prefill_rows if mixes else 0})

    # A fused step's consecutive rows of one sequence (a prefill's tokens) attend as one run,
    # their query heads side by side in vector lanes (csrc/decode.h, attn_tile); False: row
    # by row, as a decode step's rows. A class attribute so a bench can compare the two.
    attention_runs = True
    # Keys a fused prefill of more than MAX_ROWS tokens may attend in all (_fused_prefill_fits);
    # None: no bound where attention_runs apply (the head size a multiple of the vector
    # width), else FUSED_PREFILL_SCORES (row by row, the torch forward's kernel wins past it).
    fused_prefill_scores: int | None = None

    def _fused_prefill_fits(self, lengths: Sequence[int], starts: Sequence[int]) -> bool:
        """Up to MAX_ROWS tokens always (where the fused step runs); past it, up to
        ``fused_prefill_rows`` tokens, where the step takes a prefill's rows as runs
        (attention_runs) at any length of prefix (measured faster than the torch forward
        at 1,000 and 1,900 positions), else only while their queries attend at most
        FUSED_PREFILL_SCORES keys in all (each token its prefix and the tokens before it):
        row by row, the torch forward's attention kernel wins on long prefixes."""
        if not super()._fused_prefill_fits(lengths, starts):
            return False
        if int(sum(lengths)) <= MAX_ROWS:
            return True
        bound = self.fused_prefill_scores
        if bound is None:  # none where the step's attention takes a prefill's rows as runs
            bound = sys.maxsize if self._fused is not None and self._fused.takes_runs else FUSED_PREFILL_SCORES
        return sum(int(n) * (int(s) + int(n)) for n, s in zip(lengths, starts)) <= bound

    def _mixes(self, checked, state) -> bool:
        """TorchEngine._mixes: on the fused step (option mixed_step), while slots decode,
        entries of up to ``mixed_step`` tokens in all that a fused prefill would take."""
        lengths = [toks.size for toks, _, _, _ in checked]
        return (self._fused is not None and 0 < sum(lengths) <= self.capabilities.mixed_step
                and bool(state.slots.live(self.max_cache_length)) and self._prefill_rows(max(lengths)) == max(lengths)
                and self._fused_prefill_fits(lengths, [start for _, _, start, _ in checked]))

    def _resolve_kv_dtype(self) -> torch.dtype:
        return self.plan.kv_dtype

    def _async_steps(self) -> bool:
        return self.plan.async_steps

    def _lazy_kv(self) -> bool:
        return self.plan.kv_memory == "grow"

    def kv_grows_with_use(self) -> bool:
        """kv_memory "grow" on a host whose cache pages come with use (hostmem.py)."""
        from polyengine.backends.torch_common.hostmem import grows_with_use

        return self.options["kv_memory"] == "grow" and grows_with_use(torch.device("cpu"))

    def speed_paths(self) -> dict[str, str]:
        """What this engine runs on, each fallback with its reason and fix: its startup
        log line, ``polyengine generate``'s stderr."""
        return self.plan.describe()

    def _check_memory(self) -> None:
        """TorchEngine's check; with repack_weights "auto" a repacked copy that would not fit
        leaves the file's layout as mapped instead (it needs no memory of its own): the
        refusal stays for what does not fit without the copy, and for ``true``."""
        try:
            super()._check_memory()
        except InsufficientMemory:
            if not self.plan.repack or self.options["repack_weights"] != "auto" or repacked_for(self.model):
                raise
            self.plan = dataclasses.replace(
                self.plan, repack=False, repack_kept=(), huge_pages=False, packed_rows=False,
                repack_declined="the interleaved copy would not fit in the memory available")
            logging.getLogger(__name__).warning("cpu: repack_weights auto: %s; the file's blocks as mapped",
                                                self.plan.repack_declined)
            super()._check_memory()

    def _weight_needs(self) -> dict[str, int]:
        """In float32 the Model's float32 arrays are used as they are and weights stored
        in other formats (a file's blocks, f16) are converted; in bfloat16 a copy of every
        weight kept float; int8 or bfloat16 projection copies unless the Model already
        holds them (they are computed once per Model and mode)."""
        c, plan = self.model.config, self.plan
        shapes = c.weight_shapes()
        needs = {}
        kept = set(shapes) - (replaced_weights(c) if plan.narrow else set()) - set(plan.block_weights)
        if self.torch_dtype != torch.float32:
            needs[f"{self.dtype} weights"] = sum(math.prod(shapes[n]) for n in kept) * self.torch_dtype.itemsize
        elif converted := self.model.conversion_bytes(sorted(kept)):
            needs["float32 copies of the weights stored in other formats"] = converted
        if plan.weights in ("int8", "int8-block32") and not has_int8_copies(self.model, plan.weights):
            needs[f"int8 copies of the projections and the LM head ({plan.weights})"] = int8_bytes(c, plan.weights)
        if plan.repack and not repacked_for(self.model):
            needs["the block weights repacked (option repack_weights)"] = sum(
                plan.kernels.gguf_packed_bytes(self.model.records[n].format, *shapes[n]) for n in plan.block_weights
                if plan.packs(self.model.records[n].format))
        if plan.weights == "bfloat16" and not has_bf16_copies(self.model):
            needs["bfloat16 copies of the projections and the LM head"] = sum(
                math.prod(shapes[source]) for _, source in quantized_names(c)) * 2
        return needs

    # -- weights -------------------------------------------------------------------------

    def _load_weights(self) -> TorchWeights:
        plan = self.plan
        # int8 or bfloat16 copies: the float matrices they replace are not kept (nor
        # converted); an exclusive Model releases them too (polyengine.models.quantize).
        skip = (replaced_weights(self.model.config) if plan.narrow else frozenset()) | set(plan.block_weights)
        # the file's blocks as mapped: nothing allocated, nothing converted
        self._blocks = {name: BlockMatrix.of(self.model.weights.record(name)) for name in plan.block_weights}
        if plan.repack:  # one tensor at a time; its file pages then leave this process's memory
            packing = {name: b for name, b in self._blocks.items() if plan.packs(b.format) and plan.kernels.gguf_packs(b)}
            # one map for them all, in huge pages with option huge_pages (docs/cpu.md, "Weights in huge pages")
            arena = self._allocating("repacked block weights", lambda: packing_arena(
                self.model, packing, plan.kernels, huge=plan.huge_pages))
            for name, blocks in packing.items():
                blocks.packed = self._allocating("repacked block weights", lambda n=name, b=blocks: repacked(
                    self.model, n, b, plan.kernels, arena))
        if "model.embed_tokens.weight" in self._blocks:
            self._embed = self._block_embed
        weights = self._allocating("the weights", lambda: TorchWeights.from_model(
            self.model, device=self.torch_device, dtype=self.torch_dtype, max_positions=self.max_cache_length,
            skip=skip))
        if plan.weights == "bfloat16":
            weights.tensors.update(self._allocating("bfloat16 weights", lambda: bf16_tensors(
                self.model, fused=plan.fuse_projections)))
        elif plan.narrow:
            weights.tensors.update(self._allocating("int8 weights", lambda: int8_tensors(self.model, plan.weights)))
        # Repacked against one int8 row, every product reads the packed groups, at any row
        # count, where every block matrix was packed (plan.packed_rows; else tiles from TILE_ROWS)
        self._packed_rows = plan.packed_rows and all(b.packed is not None for b in self._blocks.values())
        if self._packed_rows:
            self.block_kernel_rows = sys.maxsize
        if plan.fused_decode:
            self._fused = FusedDecoder(plan.kernels, weights.tensors, self.model.config,
                                       cache_rows=self.max_concurrent_decodes, cache_len=self.max_cache_length,
                                       quantized=plan.narrow, kv_dtype=self.kv_dtype,
                                       int8_activations=plan.block_activations if self._blocks else plan.int8_activations,
                                       bf16_activations=plan.bf16_activations, blocks=self._blocks,
                                       page_size=self.options["page_size"],
                                       tile_rows=TILE_ROWS if plan.block_tiles and not self._packed_rows else 0,
                                       attention_runs=self.attention_runs,
                                       split_pieces=SPLIT_PIECES if plan.dynamic_split else 0,
                                       barrier_yield=plan.barrier_yield)
        return weights

    # -- products and attention on the host kernels ---------------------------------------

    def _cpu_linear(self, t: dict[str, torch.Tensor], x: torch.Tensor, name: str, *, any_rows: bool = False,
                    out: torch.Tensor | None = None, compute: torch.dtype | None = None) -> torch.Tensor:
        """A projection: the host kernels for the few rows of a decode step (or for any
        number with ``any_rows``, writing into ``out``), torch's GEMM for prefill; int8
        or bfloat16 weights when narrowed (widened band by band for torch's GEMM: int8.py,
        on ``compute`` operands: the plan's prefill_compute)."""
        plan, kernels = self.plan, self._kernels
        bias = t.get(name + ".bias")
        blocks = self._blocks.get(self.model.config.head_weight if name == "lm_head" else name + ".weight")
        limit = MAX_ROWS if blocks is None else self.block_kernel_rows
        on_kernels = kernels is not None and (any_rows or x.numel() // x.shape[-1] <= limit)
        if blocks is not None:
            if on_kernels and plan.block_activations:
                if blocks.packed is not None:
                    return kernels.gguf_packed_linear(x, blocks, blocks.packed, bias, out=out,
                                                      pairs=plan.block_activations)
                return kernels.gguf_linear(x, blocks, bias, out=out, pairs=plan.block_activations)
            if plan.block_tiles:
                return kernels.gguf_tile_linear(x, blocks, bias, out=out)
            return self._tiled_blocks(x, blocks, bias, kernels=kernels, compute=compute)
        q = t.get(name + ".qweight")
        if q is not None:
            scale = t.get(name + ".scale")  # None: bfloat16 weights
            if on_kernels:
                return kernels.linear(x, q, bias, scale=scale, out=out, int8_activations=plan.int8_activations,
                                      bf16_activations=plan.bf16_activations)
            return self._tiled(x, q, scale, bias, compute=compute)
        w = t[name + ".weight"] if name != "lm_head" else t[self.model.config.head_weight]
        if on_kernels and x.dtype == torch.float32:
            return kernels.linear(x, w, bias, out=out)
        return torch.nn.functional.linear(x, w, bias)

    def _block_embed(self, t: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        """StepSpec.embed for a table kept in blocks: only the looked-up rows dequantized."""
        return embed_rows(self._blocks["model.embed_tokens.weight"], tokens, self._kernels)

    def _kernel_attention(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float,
                          start: int = 0) -> torch.Tensor:
        """StepSpec.causal_attention on the host kernel, one batch row at a time: queries
        at positions start.., from 0 or continuing a prefix."""
        bf16 = self.plan.prefill_attention == "bfloat16"
        b, t, nh, hd = q.shape
        rows = [self._kernels.prefill_attention(q[i], keys[i], vals[i], scale, bf16=bf16, start=start)
                for i in range(b)]
        return (rows[0] if b == 1 else torch.stack(rows)).reshape(b, t, nh * hd)

    def _fused_prefill(self, params: TorchWeights, tokens, rows: list[int], positions: list[int], k: torch.Tensor,
                       v: torch.Tensor, last: list[int]) -> torch.Tensor:
        """TorchEngine._fused_prefill on the fused step (option fused_prefill): the same
        kernel as a decode step, over the prefill's own K/V buffer. A chunked prompt's piece
        or a prefix hit's tail then costs what a decode step of as many rows costs, not the
        torch forward's ~50 ops a layer and its copies (docs/cpu.md, "Short prefills in the
        fused step")."""
        t = params.tensors
        x = self._embedded(t, tokens)
        self._fused.prefill(x, torch.tensor(rows, dtype=torch.int32), torch.tensor(positions, dtype=torch.int32), k, v)
        return self._last_logits(t, x, last)

    def _fused_paged_prefill(self, params: TorchWeights, tokens, start: int, prefix):
        """TorchEngine._fused_paged_prefill on the fused step: the tokens written straight
        into the new prefix's pages through a one-row page table, the continued prefix's
        positions read where they lie (no contiguous copy of them, no scatter after)."""
        n = len(tokens)
        seq = PageList.continuing(self.pages, None if prefix is None else prefix.kv)
        self._paged.writable(seq, start, start + n)
        t = params.tensors
        x = self._embedded(t, tokens)
        with self._paged.using() as (k, v):  # beside a step on the prefill lane: its own pages
            self._fused.step(x, torch.zeros(n, dtype=torch.int32), torch.arange(start, start + n, dtype=torch.int32),
                             k, v, page_table=self._paged.table_for(seq, self.max_cache_length))
        return seq, self._last_logits(t, x, [n - 1])

    def _embedded(self, t: dict[str, torch.Tensor], tokens) -> torch.Tensor:
        """The tokens' embeddings (a tensor of ids, or a host array) as the fused step takes
        them: contiguous float32 rows."""
        ids = tokens if isinstance(tokens, torch.Tensor) else torch.as_tensor(np.asarray(tokens, np.int64))
        return (t["model.embed_tokens.weight"][ids] if self._embed is None else self._embed(t, ids)).contiguous()

    def _last_logits(self, t: dict[str, torch.Tensor], x: torch.Tensor, last: list[int]) -> torch.Tensor:
        """The logits of the rows ``last`` of a fused prefill's hidden states ``x``, in a
        tensor of their own (the prefixes keep them; a decode step's head reuses a buffer)."""
        return self._cpu_linear(t, self._final_norm(t, x[torch.as_tensor(last, dtype=torch.int64)]), "lm_head")

    def _final_norm(self, t: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The model's last norm on a fused step's hidden states (the kernels' RMS norm, as
        the step's own layers normalize; torch's where the weight is not float32)."""
        w, eps = t["model.norm.weight"], self.model.config.rms_norm_eps
        return self._fused.kernels.rms_norm(x, w, eps) if w.dtype == torch.float32 else rms_norm(x, w, eps)

    # -- decode ---------------------------------------------------------------------------

    def _decode(self, params: TorchWeights, state: TorchDecodeState, live_mask: torch.Tensor, step: StepInputs):
        """The live rows only (the fused kernel where it is built, else the shared forward
        on those rows, their cache rows gathered unless every slot is live); then the
        sampler on those rows, the results scattered back to slot order. With
        ``live_rows=False`` and no fused step, every slot runs as on a device."""
        if step.mixed is not None and self._fused is None:
            raise RuntimeError("cpu: a mixed step needs the fused step (TorchEngine._mixes)")
        if self._fused is None and not self.plan.live_rows:
            return super()._decode(params, state, live_mask, step)
        t, n, dev, live = params.tensors, state.num_slots, self.torch_device, step.live
        rows = torch.tensor(live, dtype=torch.int64, device=dev)
        pos = torch.tensor([step.positions[i] for i in live], dtype=torch.int64, device=dev)
        if self._fused is not None:
            x = self._embedded(t, state.next_tokens[rows])
            if step.mixed is None:
                self._fused.step(x, rows, pos, state.k, state.v, page_table=state.page_table)
                logits = self._head(t, self._final_norm(t, x))  # (M, vocab)
            else:
                logits = self._mixed_pass(t, state, x, rows, pos, step.mixed)
        else:
            every = len(live) == n
            paged = state.page_table is not None  # the live rows' page-table rows say where their K/V are
            logits, state.k, state.v = forward(
                params, self._spec(kv_len=step.kv_len, linear=self._linear, kv_codec=self._kv_codec),
                state.next_tokens[rows][:, None], pos[:, None], state.k, state.v,
                rows=None if every or paged else rows,
                page_table=None if not paged else state.page_table if every else state.page_table[rows],
            )
            logits = logits[:, 0]  # (M, vocab)
        words = None if step.words is None else step.words[rows]
        res = state.sampler.sample(logits, rows, num_top=step.num_top, token_mask=words)
        state.sampler.record(res.tokens, rows=rows)
        state.next_tokens[rows] = res.tokens

        def scatter(values: torch.Tensor) -> torch.Tensor:
            return torch.zeros((n, *values.shape[1:]), dtype=values.dtype, device=dev).index_put_((rows,), values)

        return scatter(res.tokens), scatter(res.logprobs), scatter(res.top_ids), scatter(res.top_logprobs)

    def _mixed_pass(self, t: dict[str, torch.Tensor], state: TorchDecodeState, x: torch.Tensor, rows: torch.Tensor,
                    pos: torch.Tensor, mixed: MixedRows) -> torch.Tensor:
        """A mixed step's one fused pass (generate_with_prefill): the live slots' rows and
        then the entries' prompt rows, which read and write their new prefixes' pages
        through page-table rows after the slots' (each token attends its prefix and the
        tokens before it: the step writes every row's K/V before any attends); one LM head
        over the slots' rows and each entry's last. Sets ``mixed.logits``; returns the
        slots' (M, vocab)."""
        m = x.shape[0]
        x = torch.cat([x, self._embedded(t, mixed.tokens)])
        self._fused.step(x, torch.cat([rows, mixed.rows]), torch.cat([pos, mixed.positions]), state.k, state.v,
                         page_table=torch.cat([state.page_table, mixed.table]))
        last = torch.as_tensor(mixed.last, dtype=torch.int64) + m
        logits = self._head(t, self._final_norm(t, torch.cat([x[:m], x[last]])))
        mixed.logits = logits[m:].clone()  # the prefixes keep theirs; the head's buffer is reused
        return logits[:m]

    def _head(self, t: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The LM head of a fused decode step: the host kernels at any row count (at 32
        rows they measured ~1.5x torch's GEMM on this shape), into a reused buffer."""
        if self._logits_buffer is None or self._logits_buffer.numel() < x.shape[0] * self.vocab_size:
            self._logits_buffer = torch.empty(x.shape[0] * self.vocab_size, dtype=torch.float32)
        return self._cpu_linear(t, x, "lm_head", any_rows=True, out=self._logits_buffer)


def prefill_row_bytes(config) -> int:
    """A prefill forward's float32 activations per token, roughly: the residual stream,
    its norm, the attention output and the down projection's; q, k and v; gate, up and
    their product."""
    return 4 * (4 * config.hidden_size + config.q_size + 2 * config.kv_size + 3 * config.intermediate_size)


def create_engine(*, model: Model, config: EngineConfig) -> CpuEngine:
    return CpuEngine(model, config)
