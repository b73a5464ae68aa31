"""The neuron engine: the protocol over compiled static-shape graphs.

Construction is NxD's compile-then-load: every graph of every bucket is compiled (or
loaded from the artifact cache) before the engine exists, so nothing compiles while
it serves. ``prefill`` pads the prompt to its context-encoding bucket, runs that graph
and draws the first token (a prompt continuing a prefix runs the continuation graph of
its (prefix bucket, prompt bucket) pair); ``insert`` copies the prefix's
K/V into the slot's row of the cache (seq_id = slot) and installs the request in the
slot's sampler row; ``generate`` runs one step for a batch bucket of seq_ids: with
speculation the draft's token-generation graph ``k - 1`` times, then the speculation
graph; without, the token-generation graph. Sampling happens inside those graphs and
the step's results come back as one packed int32 buffer. A prefix's first token
is drawn on the host by the same torch sampler (``TorchSampler``, eager): the
context-encoding graph returns the logits, as a traced Neuron graph returns its
outputs to the host anyway.

The host never reads a token to submit a step (the graphs read each slot's latest
token, position and room from the state), so in async mode (the default) a worker
thread runs the steps in order while the caller reads earlier ones; insert, free and
overrides wait for the queued steps first. Overrides roll a slot back on the device
(:meth:`.state.NeuronDecodeState.rollback`).

Two places for the graphs: the CPU compile path compiles each graph on its own and
keeps the weights and the KV cache in host tensors passed to every call; on Neuron
(:mod:`.nxd`) every graph is one model of one NxD program whose weights and KV cache
live on the NeuronCores (``tp_degree`` of them), moved there once at construction, the
cache updated in place through the compiler's aliasing and reached from the host only
by the prefill's K/V through an insert model. The engine's calls are the same.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from polyengine.engine import Capabilities, EngineBase, EngineConfig, Prefix, PrefillRequest, ResultTokens
from polyengine.errors import InvalidRequest, UnsupportedFeature
from polyengine.models import Model
from polyengine.models.config import ARCHITECTURES
from polyengine.pages import PageList, PagePool, pages_for
from polyengine.prefix import PortablePrefix
from polyengine.sampling import SamplingParams
from polyengine.sampling.masks import full_mask
from polyengine.sampling.params import ENGINE_FIELDS, MAX_TOP_LOGPROBS
from polyengine.sampling.rows import row_bytes

from polyengine.backends.torch_common.model import TorchWeights
from polyengine.backends.torch_common.paged import PagedKV
from polyengine.backends.torch_common.sampling import SamplerState, TorchSampler
from polyengine.backends.torch_common.state import TorchSlotsEngine, host_array
from polyengine.backends.neuron import plugin
from polyengine.backends.neuron.buckets import Buckets
from polyengine.backends.neuron.cache import ArtifactCache, GraphKey, default_cache_dir
from polyengine.backends.neuron.compile import PERSISTED, CompiledGraph
from polyengine.backends.neuron.options import CPU_DEFAULT, OPTIONS
from polyengine.backends.neuron.graphs import (
    ContextContinuation, ContextEncoding, PagedContextContinuation, PagedContextEncoding, PagedTokenGeneration,
    TokenGeneration, result_layout,
)
from polyengine.backends.neuron.nxd import DeviceGraphs
from polyengine.backends.neuron.paged import block_row, prepare_step, slot_mapping
from polyengine.backends.neuron.speculation import Acceptance, draft_config, draft_weights
from polyengine.backends.neuron.state import LastStep, NeuronDecodeState, NeuronSlot, NeuronSlots

__all__ = ["NeuronEngine", "create_engine"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class NeuronEngine(TorchSlotsEngine, EngineBase):
    name = "neuron"
    OPTIONS = OPTIONS
    slot_type = NeuronSlot

    def __init__(self, model: Model, config: EngineConfig):
        super().__init__(model, config)
        o, c, k = self.options, model.config, self.tokens_per_step
        if k > 1 and c.num_hidden_layers < 2:
            raise InvalidRequest(f"option speculation={k} needs a model of 2 layers or more (the draft is the "
                                 f"target's first layers); this one has {c.num_hidden_layers}: use speculation=1",
                                 field="options.speculation")
        if k == 1 and o["draft_layers"]:
            raise InvalidRequest(f"option draft_layers={o['draft_layers']} applies only with speculation >= 2 "
                                 f"(tokens per step); set speculation too, or leave draft_layers out",
                                 field="options.draft_layers")
        if o["cache_dir"] and self.compiler not in PERSISTED:
            raise InvalidRequest(f"option cache_dir applies to the compilers that keep artifacts ({', '.join(PERSISTED)}); "
                                 f"compiler '{self.compiler}' keeps none (its graphs are exported again in each process): "
                                 f"leave cache_dir out, or set compiler='inductor'", field="options.cache_dir")
        self.draft = draft_config(c, o["draft_layers"] or max(1, c.num_hidden_layers // 2)) if k > 1 else None
        self.buckets = Buckets.plan(config, tokens_per_step=k, batch=o["batch_buckets"], seq=o["seq_buckets"])
        if not self.capabilities.prefix_reuse:  # option prefix_reuse: no continuation graphs
            self.buckets = replace(self.buckets, continuations=())
        self.num_top = self.capabilities.max_top_logprobs
        self.layout = result_layout(k, self.num_top)
        self.torch_dtype = _DTYPES[self.dtype]
        # The block KV layout (option page_size): block ids and counts (polyengine.pages) and
        # the pools they index (docs/neuron.md, "Pages").
        ps, kv_pages = o["page_size"], o["kv_pages"]
        per_slot = pages_for(self.buckets.cache, ps or 1)
        if kv_pages and (not ps or kv_pages < per_slot + 1):
            raise InvalidRequest(
                f"kv_pages={kv_pages} needs page_size and at least one context's pages and one more "
                f"({per_slot + 1} with page_size={ps or 1}); raise it or leave it 0", field="options.kv_pages")
        if ps and not kv_pages and self.compiler == "neuronx":  # the program's state has one size: what the rows hold
            kv_pages = max(config.max_slots * per_slot, per_slot + 1)
        self.pages = PagePool(ps, kv_pages or None) if ps else None
        # On Neuron the pools are the program's state (DeviceGraphs); here, host tensors
        self._paged = PagedKV(self.pages, torch.device("cpu"), self._new_pools,
                              first_size=config.max_slots * per_slot) if ps and self.compiler != "neuronx" else None
        self._check_memory()
        if o["threads"]:
            torch.set_num_threads(o["threads"])
        self.cache = ArtifactCache((o["cache_dir"] or default_cache_dir()) if self.compiler in PERSISTED else None,
                                   self.compiler)
        self._weights = TorchWeights.from_model(model, dtype=self.torch_dtype, max_positions=self.buckets.cache)
        self._names = tuple(sorted(self._weights.tensors))
        self._draft_weights = draft_weights(self._weights, self.draft) if self.draft else None
        self._draft_names = tuple(sorted(self._draft_weights.tensors)) if self.draft else ()
        self.on_device: DeviceGraphs | None = None
        if self.compiler == "neuronx":
            self.on_device = DeviceGraphs(
                weights=self._weights, names=self._names, draft=self.draft, draft_names=self._draft_names,
                buckets=self.buckets, max_slots=config.max_slots, max_cache_length=config.max_cache_length,
                tokens_per_step=k, num_top=self.num_top, neutral=self._neutral, no_masks=self._no_masks, dtype=self.dtype,
                tp=o["tp_degree"], prefill_batch=self.prefill_batch_sizes,
                pages=(self.pages.capacity, ps) if ps else None)
        self._live: NeuronDecodeState | None = None  # on Neuron, the decode state that owns the device's cache
        self.graphs: dict[tuple, CompiledGraph] = {}
        self._built: dict[tuple, tuple[str, float]] = {}  # graph name -> (where this engine got it, seconds)
        self._acceptance = Acceptance(k, torch.device("cpu"))  # every step of this engine, for bench_report
        self._warm_up()
        self._first = TorchSampler(self.vocab_size, 1, self.eos_token_ids)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="neuron-step") if o["async_steps"] else None

    # -- construction ----------------------------------------------------------------------

    def capabilities_for(self, model: Model, config: EngineConfig) -> Capabilities:
        o = self.options
        self.compiler = self._pick_compiler(o["compiler"])
        if o["tp_degree"] > 1 and self.compiler != "neuronx":
            raise UnsupportedFeature(f"tp_degree={o['tp_degree']} on the CPU compile path", self.name,
                                     "tensor parallelism splits the model over NeuronCores (compiler='neuronx')")
        self.device = self._describe(self.compiler, o["tp_degree"])
        self.tokens_per_step = o["speculation"]
        # batch sizes of the context-encoding graphs of several prompts (option batched_prefill;
        # "auto" leaves them out of the NxD program, where they are built by construction only)
        batched = o["batched_prefill"] == "on" or (o["batched_prefill"] == "auto" and self.compiler != "neuronx")
        self.prefill_batch_sizes = ((2, 4) if config.max_slots > 2 else (2,)) if batched else ()
        reuse = o["prefix_reuse"] == "on" or (o["prefix_reuse"] == "auto" and self.compiler != "neuronx")
        portable = not (o["page_size"] and self.compiler == "neuronx")
        return Capabilities(
            dtypes=("bfloat16", "float32") if self.compiler == "neuronx" else ("float32",),
            sampling_params=ENGINE_FIELDS, max_top_logprobs=min(MAX_TOP_LOGPROBS, model.config.vocab_size),
            # on Neuron the block pools are the program's state: no model reads a prefix's blocks out or writes them in
            bulk_insert=True, portable_prefix=portable, async_results=o["async_steps"], tokens_per_step=self.tokens_per_step,
            architectures=ARCHITECTURES, token_masks=True, weight_formats=plugin.WEIGHT_FORMATS,
            # the continuation graphs (option prefix_reuse; on Neuron devices models of the
            # NxD program); the kit's cut (a portable prefix's head, continued by its last
            # token) needs them too
            prefix_reuse=reuse, prefix_truncate=reuse,
            portable_prefix_tail=portable,  # paged: the head's blocks shared; contiguous: the kit's copy
            page_size=o["page_size"],
            batched_prefill=bool(self.prefill_batch_sizes),
        )

    @staticmethod
    def _pick_compiler(name: str) -> str:
        if name == "auto":
            return "neuronx" if plugin.neuron_devices() and plugin.neuronx_installed() else CPU_DEFAULT
        if name == "neuronx" and not plugin.neuronx_installed():
            raise InvalidRequest(f"option compiler='neuronx' needs torch-neuronx and neuronx-distributed: {plugin.NEURONX_HINT}")
        return name

    @staticmethod
    def _describe(compiler: str, tp: int = 1) -> str:
        if compiler == "neuronx":
            return f"neuron ({len(plugin.neuron_devices())} device(s); one NxD model on {tp} NeuronCore(s))"
        how = "torch.export, run without inductor" if compiler == "export" else "torch.export + inductor"
        return f"cpu (compile path: {how}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()})"

    def _check_memory(self) -> None:
        """Host memory: on the CPU path the weights (a copy unless float32) and the KV
        cache; on Neuron, where the cache lives on the device, the weights and their
        per-core split while they load. The NeuronCores' own memory is not queried (no
        runtime API is used before the program loads)."""
        c, cfg, b = self.model.config, self.config, self.buckets
        item = torch.tensor([], dtype=self.torch_dtype).element_size()
        needs = {}
        if self.torch_dtype != torch.float32:
            needs[f"{self.dtype} weights"] = c.num_parameters() * item
        elif self.model.conversion_bytes():  # float32 tensors share the Model's F32 arrays; others are converted
            needs["float32 copies of the weights stored in other formats"] = self.model.conversion_bytes()
        if self.compiler == "neuronx":
            needs["the weights split per NeuronCore, while they load"] = c.num_parameters() * item
        elif self.pages is not None and self.pages.capacity:
            needs[f"the K/V block pool of {self.pages.capacity} blocks x {self.pages.page_size} positions"] = (
                self.pages.capacity * self.pages.page_size * c.kv_bytes_per_token(item))
        else:  # an unbounded block pool starts at what the contiguous cache holds
            needs[f"the KV cache of {cfg.max_slots} slots x {b.cache} positions"] = cfg.max_slots * b.cache * c.kv_bytes_per_token(item)
        needs["the sampler's per-slot tables"] = cfg.max_slots * row_bytes(c.vocab_size)
        needs["a context-encoding step"] = b.prefill[-1] * (c.vocab_size + 4 * c.intermediate_size) * 4
        self.check_memory(needs)

    def _key(self, kind: str, config, bucket: dict) -> GraphKey:
        return GraphKey.of(kind, config=config, bucket=bucket, dtype=self.dtype, compiler=self.compiler)

    def _warm_up(self) -> None:
        """Compile (or load) every graph of every bucket, so no call ever compiles. On
        Neuron they are one program; loading it moves the weights to the cores."""
        if self.on_device is not None:
            key = self._key("nxd_model", self.model.config, self.on_device.description())
            self._get(("nxd_model",), key, (), lambda: (self.on_device.spec(), ()))
            self.on_device.attach(self.graphs[("nxd_model",)].fn)
            return
        b, c, k = self.buckets, self.model.config, self.tokens_per_step
        if self.pages is not None:  # the same graphs over the block pools
            decode = ("decode", "draft") if self.draft else ("decode",)
            for base in [*(("context", p) for p in b.prefill), *(("continuation", q, p) for q, p in b.continuations),
                         *(("context_batch", n, p) for n in self.prefill_batch_sizes for p in b.prefill),
                         *((kind, batch, kv) for batch in b.batch for kv in b.seq for kind in decode)]:
                self._paged_graph(base)
            return
        eager = self.compiler == "export"  # runs op by op: K/V written in place (graphs.py)
        for p in b.prefill:
            key = self._key("context", c, {"prompt": p, "positions": b.cache})
            self._get(("context", p), key, ContextEncoding.aliases, lambda p=p: (
                ContextEncoding(c, self._names, p, inplace=eager), self._context_args(p)))
        for n in self.prefill_batch_sizes:
            for p in b.prefill:
                key = self._key("context", c, {"prompt": p, "positions": b.cache, "batch": n})
                self._get(("context_batch", n, p), key, ContextEncoding.aliases, lambda p=p, n=n: (
                    ContextEncoding(c, self._names, p, inplace=eager, batch=n), self._context_args(p, n)))
        for q, p in b.continuations:
            key = self._key("continuation", c, {"prefix": q, "prompt": p, "positions": b.cache})
            self._get(("continuation", q, p), key, ContextContinuation.aliases, lambda q=q, p=p: (
                ContextContinuation(c, self._names, q, p, inplace=eager), self._continuation_args(q, p)))
        for batch in b.batch:
            for kv in b.seq:
                self._decode_graph(("decode", batch, kv), c, self._weights, self._names, batch, k, kv)
                if self.draft:
                    self._decode_graph(("draft", batch, kv), self.draft, self._draft_weights, self._draft_names, batch, 1, kv)

    def _get(self, name: tuple, key: GraphKey, aliases, build) -> None:
        """Graph ``name`` from the artifact cache, timed and recorded for the reports."""
        start = time.perf_counter()
        self.graphs[name], source = self.cache.get(key, aliases, build)
        self._built[name] = (source, time.perf_counter() - start)

    def _decode_graph(self, name: tuple, config, weights: TorchWeights, names, batch: int, tokens: int, kv: int,
                      blocks: int = 0) -> None:
        """The token-generation (or speculation) graph of one batch x sequence bucket;
        ``blocks`` > 0: over block pools of that many blocks (option page_size)."""
        cfg = self.config
        bucket = {"batch": batch, "tokens": tokens, "kv_len": kv, "positions": self.buckets.cache, "slots": cfg.max_slots,
                  "max_cache_length": cfg.max_cache_length, "num_top": self.num_top}
        if blocks:
            bucket.update(blocks=blocks, block_size=self.pages.page_size)

        def build():
            cls = PagedTokenGeneration if blocks else TokenGeneration
            module = cls(config, names, batch=batch, tokens=tokens, kv_len=kv,
                         max_cache_length=cfg.max_cache_length, num_top=self.num_top,
                         inplace=self.compiler == "export")
            r = cfg.max_slots
            if blocks:  # the pools, and the block table at this sequence bucket's static width
                kc, vc = (self._pool_like(config, blocks) for _ in range(2))
                table = (torch.zeros((r, pages_for(kv, self.pages.page_size)), dtype=torch.int64),)
            else:
                (kc, vc), table = weights.new_cache(cfg.max_slots, self.buckets.cache), ()
            args = [tuple(weights.tensors[n] for n in names), kc, vc, *table, torch.arange(batch),
                    torch.zeros(r, dtype=torch.bool), torch.zeros(r, dtype=torch.int64), *self._no_masks(r)]
            if tokens > 1:
                args.append(torch.zeros((batch, tokens - 1), dtype=torch.int64))
            return module, (*args, self._neutral(r))

        kind = ("paged_" if blocks else "") + ("token_generation" if tokens == 1 else "speculation")
        self._get(name, self._key(kind, config, bucket), TokenGeneration.aliases, build)

    # -- the block KV layout (option page_size) ----------------------------------------------

    def _pool_like(self, config, blocks: int) -> torch.Tensor:
        return torch.zeros((config.num_hidden_layers, blocks, config.num_key_value_heads, self.pages.page_size,
                            config.head_dim), dtype=self.torch_dtype)

    def _new_pools(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed K and V block pools (layers, blocks, kv_heads, block_size, head_dim)."""
        return self._weights.new_cache(blocks, self.pages.page_size)

    def _paged_graph(self, base: tuple) -> CompiledGraph:
        """Graph ``base`` (kind and bucket) over the block pools as they are now. A bounded
        pool (kv_pages) has one size, all its graphs compiled at construction; an unbounded
        one that grew gets graphs of its new size, compiled here once per size."""
        blocks = self._paged.tensors[0].shape[1]
        name = (*base, blocks)
        if name in self.graphs:
            return self.graphs[name]
        c, eager, ps = self.model.config, self.compiler == "export", self.pages.page_size
        common = {"positions": self.buckets.cache, "blocks": blocks, "block_size": ps}
        weights = tuple(self._weights.tensors[n] for n in self._names)

        def prompt_args(p: int, n: int = 1) -> tuple:  # the padded prompts, their last positions, their slot mapping
            return (*self._context_args(p, n)[1:], torch.zeros(n * p, dtype=torch.int64))

        if base[0] in ("context", "context_batch"):
            n, p = (1, base[1]) if base[0] == "context" else base[1:]
            bucket = {"prompt": p, **common, **({"batch": n} if n > 1 else {})}
            self._get(name, self._key("paged_context", c, bucket), PagedContextEncoding.aliases,
                      lambda: (PagedContextEncoding(c, self._names, p, inplace=eager, batch=n),
                               (weights, self._pool_like(c, blocks), self._pool_like(c, blocks), *prompt_args(p, n))))
        elif base[0] == "continuation":
            q, p = base[1:]
            self._get(name, self._key("paged_continuation", c, {"prefix": q, "prompt": p, **common}),
                      PagedContextContinuation.aliases,
                      lambda: (PagedContextContinuation(c, self._names, q, p, inplace=eager),
                               (weights, self._pool_like(c, blocks), self._pool_like(c, blocks),
                                torch.zeros(pages_for(q, ps), dtype=torch.int64), torch.tensor([0]), *prompt_args(p))))
        elif base[0] == "decode":
            self._decode_graph(name, c, self._weights, self._names, base[1], self.tokens_per_step, base[2], blocks)
        else:
            self._decode_graph(name, self.draft, self._draft_weights, self._draft_names, base[1], 1, base[2], blocks)
        return self.graphs[name]

    def _on_worker(self, fn):
        """Run ``fn`` (work on the block pools) on the step worker, after the queued steps:
        the steps write the same pools, and an unbounded pool may grow (a new tensor)."""
        return fn() if self._worker is None else self._worker.submit(fn).result()

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copies on write (src, dst) in the block pools: the program's copy model on Neuron."""
        if self.on_device is not None:
            self.on_device.copy(copies)
        else:
            self._paged.copy(copies)

    def _on_pools(self, base: tuple, weights: tuple, *inputs: torch.Tensor) -> torch.Tensor:
        """A prefill graph ``base`` over the block pools, its logits: on Neuron the
        program's model (the pools are its state), else the graph with the pools as inputs."""
        if self.on_device is not None:
            return self.on_device.on_pools(base, *inputs)
        k_pool, v_pool = self._paged.tensors
        (logits,) = self._paged_graph(base)(weights, k_pool, v_pool, *inputs)
        return logits

    @property
    def shares_prefix_heads(self) -> bool:
        """Paged, a head holds the prefix's blocks (_prefix_head); else the kit's copy."""
        return self.pages is not None

    def _prefix_head(self, prefix: Prefix, length: int) -> Prefix:
        """Paged: the prefix's first ``length`` positions as a new holder of its blocks (the
        continuation copies a partly filled last one before it writes); else the kit's copy."""
        if self.pages is None:
            return super()._prefix_head(prefix, length)
        seq = prefix.kv.fork(length, finalize=True)
        return replace(prefix, kv=seq, prompt_tokens=prefix.prompt_tokens[:length],
                       nbytes=self.kv_bytes(len(seq.pages) * self.pages.page_size))

    def _context_args(self, p: int, batch: int = 1) -> tuple:
        return (tuple(self._weights.tensors[n] for n in self._names), torch.zeros((batch, p), dtype=torch.int64),
                torch.full((batch,), p - 1))

    def _no_masks(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The mask inputs of a step without masks: every token allowed, no slot masked."""
        return (torch.from_numpy(full_mask(self.vocab_size, rows)), torch.zeros(rows, dtype=torch.bool))

    def _continuation_args(self, q: int, p: int) -> tuple:
        c = self.model.config
        kv = torch.zeros((c.num_hidden_layers, 1, c.num_key_value_heads, q, c.head_dim), dtype=self.torch_dtype)
        return (tuple(self._weights.tensors[n] for n in self._names), kv, kv.clone(), torch.tensor([0]),
                torch.zeros((1, p), dtype=torch.int64), torch.tensor([p - 1]))

    def _neutral(self, rows: int) -> dict[str, torch.Tensor]:
        return SamplerState.neutral(rows, self.vocab_size, self.eos_token_ids).as_dict()

    @property
    def compile_report(self) -> list[dict[str, Any]]:
        """Per graph: its name, where this engine got it (``compiled``, ``disk``, or
        ``memory``: loaded earlier in this process), the seconds that took, its file."""
        return [{"graph": "/".join(map(str, name)), "source": self._built[name][0],
                 "seconds": round(self._built[name][1], 3), "path": str(g.path)} for name, g in self.graphs.items()]

    def _program(self, name: tuple) -> tuple[str, str]:
        """A graph's program and bucket, in words."""
        if name[0] == "context":
            return "context_encoding", f"prompt {name[1]}"
        if name[0] == "context_batch":
            return "context_encoding", f"batch {name[1]}, prompt {name[2]}"
        if name[0] == "nxd_model":
            b = self.buckets
            return "nxd_model", f"every graph: prompts {list(b.prefill)}, batch {list(b.batch)}, kv {list(b.seq)}"
        if name[0] == "continuation":
            return "context_continuation", f"prefix {name[1]}, prompt {name[2]}"
        program = {"draft": "draft_token_generation", "decode": "speculation" if self.tokens_per_step > 1 else "token_generation"}
        return program[name[0]], f"batch {name[1]}, kv {name[2]}"

    def bench_report(self) -> dict[str, Any]:
        """What ``polyengine bench`` prints beside its timings: ``"compile"``, one row per
        graph built or loaded at construction (``program``, ``bucket``, ``seconds``,
        ``source``: ``"compiled"`` or ``"cache"``, disk or this process's memo), and
        scalar statistics, the speculation ones over every step this engine ran."""
        rows = []
        for name, (src, seconds) in self._built.items():
            program, bucket = self._program(name)
            rows.append({"program": program, "bucket": bucket, "seconds": seconds,
                         "source": "compiled" if src == "compiled" else "cache"})
        out: dict[str, Any] = {
            "compile": rows,
            "graphs_compiled": sum(r["source"] == "compiled" for r in rows),
            "graphs_from_cache": sum(r["source"] == "cache" for r in rows),
            "compile_seconds": sum((r["seconds"] for r in rows if r["source"] == "compiled"), 0.0),
            "tokens_per_step": self.tokens_per_step,
        }
        if self.draft is not None:
            if self._worker is not None:
                self._worker.submit(lambda: None).result()  # the queued steps have added their counts
            acc = self._acceptance.report()
            out.update(speculation_acceptance=acc["acceptance_rate"], speculation_proposed=acc["proposed"],
                       speculation_accepted=acc["accepted"], speculation_tokens_per_step=acc["tokens_per_step"])
        return out

    # -- lifecycle -------------------------------------------------------------------------

    def load_params(self) -> TorchWeights:
        return self._weights

    def init_decode_state(self) -> NeuronDecodeState:
        """A new decode state. On Neuron the KV cache is the program's (one per engine, on
        the device), so a new state takes it over and the previous one is retired (using
        it raises): the cache needs no clearing, since an insert rewrites a slot's row
        and positions past a slot's length are rewritten before they are read."""
        r = self.max_concurrent_decodes
        if self.on_device is not None:
            k = v = None
            if self._live is not None:
                self._live.wait()
                self._live.retired = True
                for seq in self._live.seqs or ():  # with pages: its slots' blocks go back to the pool
                    if seq is not None:
                        seq.release()
        elif self.pages is not None:  # the engine's block pools; each slot a block list
            k = v = None
        else:
            k, v = self._weights.new_cache(r, self.buckets.cache)
        state = NeuronDecodeState(
            r, k, v, TorchSampler(self.vocab_size, r, self.eos_token_ids), torch.zeros(r, dtype=torch.int64),
            torch.zeros(r, dtype=torch.bool), Acceptance(self.tokens_per_step, torch.device("cpu")), NeuronSlots(r),
            device=self.on_device, seqs=[None] * r if self.pages is not None else None)
        if self.on_device is not None:
            self._live = state
        return state

    # -- prefill ---------------------------------------------------------------------------

    def _first_tokens(self, logits: torch.Tensor, prompt: np.ndarray, sampling: SamplingParams,
                      token_mask: np.ndarray | None = None) -> ResultTokens:
        """Sample 0's first token (step 0) from a prefix's logits, on the host sampler."""
        self._first.install(0, sampling, prompt)
        try:
            res = self._first.sample(logits[None], num_top=sampling.top_logprobs,
                                     token_mask=None if token_mask is None else token_mask[None])
        finally:
            self._first.clear(0)
        return ResultTokens.first_tokens(res.tokens, res.logprobs, res.top_ids, res.top_logprobs, to_host=host_array)

    @torch.no_grad()
    def prefill(self, *, params: TorchWeights, tokens, sampling: SamplingParams, existing_prefix: Prefix | None = None,
                token_mask: np.ndarray | None = None):
        if hasattr(tokens, "__len__") and len(tokens) > self.buckets.prefill[-1]:
            self.buckets.prompt(len(tokens))  # raises, naming the buckets
        toks, sampling, start = self.check_prefill(tokens, sampling, existing_prefix)
        mask = self.check_token_mask(token_mask, sampling)
        n = toks.size
        p = self.buckets.prompt(n)
        padded = torch.zeros((1, p), dtype=torch.int64)
        padded[0, :n] = torch.from_numpy(toks.astype(np.int64))
        weights = tuple(params.tensors[name] for name in self._names)
        if self.pages is not None:
            return self._paged_prefill(weights, toks, sampling, existing_prefix, start, mask, padded)
        if existing_prefix is None:
            prompt = toks
            if self.on_device is not None:
                logits, k, v = self.on_device.context(padded, torch.tensor([n - 1]))
            else:
                logits, k, v = self.graphs[("context", p)](weights, padded, torch.tensor([n - 1]))
        else:  # the continuation graph of the pair (option prefix_reuse declares it)
            prompt = np.concatenate([existing_prefix.prompt_tokens, toks]).astype(np.int32)
            q = self.buckets.prompt(start)
            head_k, head_v = (self._padded(x, q) for x in existing_prefix.kv)
            args = (head_k, head_v, torch.tensor([start]), padded, torch.tensor([n - 1]))
            if self.on_device is not None:  # the NxD program's model of the pair: its inputs' shapes pick it
                logits, k, v = self.on_device.continuation(*args)
            else:
                logits, k, v = self.graphs[("continuation", q, p)](weights, *args)
        total = prompt.size
        return self._prefilled((k[:, 0, :, :total].clone(), v[:, 0, :, :total].clone()), logits[0], prompt, sampling,
                               mask)

    def _paged_prefill(self, weights: tuple, toks: np.ndarray, sampling: SamplingParams, existing_prefix: Prefix | None,
                       start: int, mask, padded: torch.Tensor):
        """Prefill into blocks: the new prefix holds the continued prefix's blocks (shared)
        and fresh ones; the context graph writes the prompt's K/V through a slot mapping.
        The block ids change here, on the caller's thread; the pools only on the worker."""
        n, p = toks.size, padded.shape[1]
        seq = PageList.continuing(self.pages, None if existing_prefix is None else existing_prefix.kv)
        copies: list[tuple[int, int]] = []
        try:
            seq.prepare_write(start, start + n, lambda src, dst: copies.append((src, dst)))
        except BaseException:  # a bounded pool ran out: nothing was written
            seq.release()
            raise
        slots, last = slot_mapping(seq, start, n, p), torch.tensor([n - 1])
        if existing_prefix is None:
            prompt, base, head = toks, ("context", p), ()
        else:
            prompt = np.concatenate([existing_prefix.prompt_tokens, toks]).astype(np.int32)
            q = self.buckets.prompt(start)
            base, head = ("continuation", q, p), (block_row(seq.pages, pages_for(q, self.pages.page_size)),
                                                  torch.tensor([start]))

        def run() -> torch.Tensor:
            self._copy_blocks(copies)
            return self._on_pools(base, weights, *head, padded, last, slots)

        return self._prefilled(seq, self._on_worker(run)[0], prompt, sampling, mask)

    def _prefilled(self, kv, logits: torch.Tensor, prompt: np.ndarray, sampling: SamplingParams,
                   mask: np.ndarray | None) -> tuple[Prefix, ResultTokens]:
        """A prefill's prefix (``kv``: its K/V, or its blocks with pages) and its first
        token, drawn from ``logits`` (V,) on the host sampler."""
        first = self._first_tokens(logits, prompt, sampling, mask)
        held = len(kv.pages) * self.pages.page_size if isinstance(kv, PageList) else prompt.size
        return Prefix(kv=kv, logits=logits, prompt_tokens=prompt, sampling=sampling, backend=self.name,
                      first_token=int(first.tokens[0, 0]), to_host=host_array, model_id=self.model_id, token_mask=mask,
                      nbytes=self.kv_bytes(held)), first

    # -- batched prefill (option batched_prefill) ---------------------------------------------

    @torch.no_grad()
    def prefill_batch(self, *, params: TorchWeights,
                      requests: Sequence[PrefillRequest]) -> list[tuple[Prefix, ResultTokens]]:
        """Fresh prompts (no ``existing_prefix``) of one prefill bucket run together in the
        context-encoding graph of 4 or 2 rows (as many fours as fit, then a two; no pad
        rows, so a paged graph writes only the entries' own blocks); an entry left alone
        and every continuation run as their own ``prefill``. Every entry is checked before
        any work; if a later part fails (a bounded pool that runs out), the prefixes made
        before it are released. Without capability ``batched_prefill``: the kit's loop."""
        if not self.capabilities.batched_prefill:
            return EngineBase.prefill_batch(self, params=params, requests=requests)
        checked = self.check_prefill_batch(requests)
        groups: dict[int, list[int]] = {}
        for i, (req, (toks, _, _, _)) in enumerate(zip(requests, checked)):
            if req.existing_prefix is None:
                groups.setdefault(self.buckets.prompt(toks.size), []).append(i)
        parts = [(p, members[at: at + n]) for p, members in groups.items()
                 for at, n in _split(len(members), self.prefill_batch_sizes)]
        done: dict[int, tuple[Prefix, ResultTokens]] = {}
        try:
            for p, part in parts:
                done.update(zip(part, self._prefill_rows(params, p, [checked[i] for i in part])))
            for i, (req, (toks, sampling, _, mask)) in enumerate(zip(requests, checked)):
                if i not in done:
                    done[i] = self.prefill(params=params, tokens=toks, sampling=sampling,
                                           existing_prefix=req.existing_prefix, token_mask=mask)
        except BaseException:
            for prefix, _ in done.values():
                if isinstance(prefix.kv, PageList):
                    prefix.kv.release()
            raise
        return [done[i] for i in range(len(requests))]

    def _prefill_rows(self, params: TorchWeights, p: int, rows: list) -> list[tuple[Prefix, ResultTokens]]:
        """Fresh prompts ``rows`` (checked entries) of bucket ``p`` in one context-encoding
        graph of ``len(rows)`` rows: each row's prefix and first token, as its own prefill
        gives them."""
        n = len(rows)
        padded, last = torch.zeros((n, p), dtype=torch.int64), torch.tensor([toks.size - 1 for toks, _, _, _ in rows])
        for r, (toks, _, _, _) in enumerate(rows):
            padded[r, : toks.size] = torch.from_numpy(toks.astype(np.int64))
        weights = tuple(params.tensors[name] for name in self._names)
        if self.pages is None:
            if self.on_device is not None:  # the NxD program's model of n rows: its inputs' shapes pick it
                logits, k, v = self.on_device.context(padded, last)
            else:
                logits, k, v = self.graphs[("context_batch", n, p)](weights, padded, last)
            kvs = [(k[:, r, :, : toks.size].clone(), v[:, r, :, : toks.size].clone())
                   for r, (toks, *_) in enumerate(rows)]
        else:
            kvs = []
            try:
                for toks, *_ in rows:
                    kvs.append(PageList.continuing(self.pages, None))
                    kvs[-1].prepare_write(0, toks.size, lambda src, dst: None)  # fresh blocks: nothing to copy
            except BaseException:  # a bounded pool ran out: nothing was written
                for seq in kvs:
                    seq.release()
                raise
            slots = torch.cat([slot_mapping(seq, 0, toks.size, p) for seq, (toks, *_) in zip(kvs, rows)])

            logits = self._on_worker(lambda: self._on_pools(("context_batch", n, p), weights, padded, last, slots))
        return [self._prefilled(kv, logits[r], toks, sampling, mask)
                for r, ((toks, sampling, _, mask), kv) in enumerate(zip(rows, kvs))]

    @staticmethod
    def _padded(kv: torch.Tensor, bucket: int) -> torch.Tensor:
        """A prefix's K or V (layers, kv_heads, length, head_dim) as the continuation
        graph's input (layers, 1, kv_heads, bucket, head_dim): a new tensor, so the prefix
        itself is never an input the graph could touch."""
        out = kv.new_zeros(kv.shape[:2] + (bucket,) + kv.shape[3:])
        out[:, :, : kv.shape[2]] = kv
        return out[:, None]

    # -- insert, bulk_insert, free_resource: the kit's flow over torch_common's hooks --------

    def _installed(self, state: NeuronDecodeState, slots: list[int], first: torch.Tensor, prefix: Prefix) -> None:
        state.prompt_len[slots], state.occupied[slots] = prefix.true_length, True

    def _release(self, state: NeuronDecodeState, slot: int) -> None:
        super()._release(state, slot)
        state.prompt_len[slot], state.occupied[slot] = 0, False
        if state.seqs is not None and state.seqs[slot] is not None:  # the slot's references only
            state.seqs[slot].release()
            state.seqs[slot] = None

    # -- generate --------------------------------------------------------------------------

    def _settle(self, decode_state: NeuronDecodeState) -> NeuronDecodeState:
        decode_state.check_live()
        return super()._settle(decode_state)

    def generate(self, params: TorchWeights, decode_state: NeuronDecodeState, *, overrides: Mapping[int, Any] | None = None,
                 token_masks: Mapping[int, np.ndarray] | None = None):
        state = decode_state
        state.check_live()
        if overrides or token_masks:
            state.wait()
        forced = self.check_overrides(overrides, state.slots.last_result)
        masks = self.check_token_masks(token_masks, state.slots.last_result, forced=forced,
                                       sampling_of=state.slots.sampling)
        mask_in = self._no_masks(state.num_slots) if masks is None else (
            torch.from_numpy(masks.words), torch.from_numpy(masks.masked))
        busy = state.slots.occupied()
        if not busy:
            empty = self.layout.pack(np.zeros((state.num_slots, self.tokens_per_step)),
                                     np.zeros((state.num_slots, self.tokens_per_step)), np.zeros(state.num_slots),
                                     np.zeros((state.num_slots, self.tokens_per_step)),
                                     np.zeros((state.num_slots, self.tokens_per_step * self.num_top)),
                                     np.zeros((state.num_slots, self.tokens_per_step * self.num_top)))
            state.slots.last = LastStep(empty, self.layout)
            return state, ResultTokens.from_packed(empty, self.layout)
        k, limit = self.tokens_per_step, self.max_cache_length
        batch = self.buckets.batch_for(len(busy))
        seq_ids = busy + state.slots.free_slots()[: batch - len(busy)]
        # Each slot's bound of prompt + completion after the overrides (each makes its
        # position the latest), known before anything changes: a bounded pool that runs out
        # refuses the step with nothing moved, the overrides not applied.
        totals = {i: state.slots[i].total for i in busy}
        for slot, (_, position) in forced.items():
            totals[slot] = state.slots[slot].prompt_len + position + 1
        # Positions total - 1 .. total + k - 2 are written and read: the attended length covers them.
        kv = self.buckets.seq_for(max(min(totals[i], limit) for i in busy) + k - 1)
        blocks = self._prepare_blocks(state, busy, kv, totals) if state.seqs is not None else None
        for slot, (token, position) in forced.items():
            state.rollback(slot, token, position)
        for i in busy:
            s = state.slots[i]
            gain = 1 if masks is not None and masks.masked[i] else k  # a masked slot yields one token
            s.completion, s.fresh = min(s.total + gain, limit) - s.prompt_len, False

        def step() -> torch.Tensor:
            return self._step(params, state, torch.tensor(seq_ids), batch, kv, mask_in, blocks)

        if self._worker is not None:
            state.pending = self._worker.submit(step)
            state.slots.last = LastStep(state.pending, self.layout)
            return state, ResultTokens.from_packed(state.pending, self.layout, to_host=lambda f: f.result().numpy())
        packed = step()
        state.slots.last = LastStep(packed, self.layout)
        return state, ResultTokens.from_packed(packed, self.layout, to_host=host_array)

    def _prepare_blocks(self, state: NeuronDecodeState, busy: list[int], kv: int, totals: dict[int, int]):
        """:func:`.paged.prepare_step` for the busy slots: each may write from its latest
        token to its bound + k - 1 (``totals``: each slot's bound after this step's
        overrides), counted from the prompt's end (the first step after an insert writes
        there, into a partly filled block it may share; later positions lie in the slot's
        own blocks). A slot at its limit (k = 1) writes nothing. A bounded pool that runs
        out makes the copies already recorded, on the worker, and raises."""
        k, limit = self.tokens_per_step, self.max_cache_length
        writes = {i: (state.slots[i].prompt_len, min(totals[i], limit) + k - 1) for i in busy
                  if k > 1 or totals[i] < limit}
        try:
            return prepare_step(state.seqs, writes, kv, self.pages.page_size)
        except Exception as exc:
            ops = getattr(exc, "page_ops", None)
            if ops:
                self._on_worker(lambda: self._copy_blocks(ops))
            raise

    @torch.no_grad()
    def _step(self, params: TorchWeights, state: NeuronDecodeState, seq_ids: torch.Tensor, batch: int, kv: int,
              mask_in: tuple[torch.Tensor, torch.Tensor], blocks=None) -> torch.Tensor:
        """One step on the device: drafts (with speculation), then the decode graph.
        ``blocks``: the block layout's copies on write and block table."""
        s = state.sampler.state
        if blocks is not None:
            copies, table = blocks
            self._copy_blocks(copies)
            graph = lambda kind: self._paged_graph((kind, batch, kv))  # noqa: E731
            k_cache, v_cache = self._paged.tensors if self.on_device is None else (None, None)
            table_in = (table,)
        else:
            graph = lambda kind: self.graphs[(kind, batch, kv)]  # noqa: E731
            k_cache, v_cache, table_in = state.k, state.v, ()
        extra = ()
        if self.draft is not None:
            layers = self.draft.num_hidden_layers
            weights = tuple(params.tensors[n] for n in self._draft_names)
            proposal, drafts = s.as_dict(), []
            for _ in range(self.tokens_per_step - 1):
                if self.on_device is not None:
                    _, counts, step, last = self.on_device.decode(kv, seq_ids, state.occupied, state.prompt_len,
                                                                  self._no_masks(state.num_slots), (), proposal, table_in)
                else:
                    _, counts, step, last = graph("draft")(
                        weights, k_cache[:layers], v_cache[:layers], *table_in, seq_ids, state.occupied, state.prompt_len,
                        *self._no_masks(state.num_slots), proposal)
                proposal = {**proposal, "counts": counts, "step": step, "last_token": last}
                drafts.append(last[seq_ids])
            extra = (torch.stack(drafts, dim=1),)
        if self.on_device is not None:
            packed, counts, step, last = self.on_device.decode(kv, seq_ids, state.occupied, state.prompt_len, mask_in,
                                                               extra, s.as_dict(), table_in)
        else:
            packed, counts, step, last = graph("decode")(
                tuple(params.tensors[n] for n in self._names), k_cache, v_cache, *table_in, seq_ids, state.occupied,
                state.prompt_len, *mask_in, *extra, s.as_dict())
        state.sampler.state = replace(s, counts=counts, step=step, last_token=last)
        if self.draft is not None:
            k = self.tokens_per_step
            valid = packed[seq_ids, k: 2 * k]
            state.acceptance.add(valid)
            self._acceptance.add(valid)
        return packed

    def speculation_stats(self, decode_state: NeuronDecodeState) -> dict[str, float | int]:
        """Speculation so far in this state: row-steps, tokens, tokens per step and the
        share of draft tokens accepted (waits for the queued steps)."""
        decode_state.wait()
        return {"tokens_per_step_max": self.tokens_per_step, **decode_state.acceptance.report()}

    # -- portable prefixes -----------------------------------------------------------------

    def _portable(self, what: str) -> None:
        if not self.capabilities.portable_prefix:
            raise UnsupportedFeature(f"{what} with the block KV layout on Neuron devices", self.name,
                                     "the block pools are the NxD program's state, which no model reads out or writes "
                                     "in; leave page_size 0 for portable prefixes there")

    def export_prefix(self, prefix: Prefix) -> PortablePrefix:
        self._portable("export_prefix")
        self.check_prefix(prefix).require_logits("export_prefix")
        if self.pages is not None:  # read through its blocks
            k, v = self._on_worker(lambda: self._paged.gather(prefix.kv, prefix.true_length))
        else:
            k, v = prefix.kv
        return PortablePrefix(k=host_array(k), v=host_array(v), prompt_tokens=prefix.prompt_tokens, last_logits=host_array(prefix.logits),
                              sampling=prefix.sampling, model_fingerprint=self.model.fingerprint)

    def import_prefix(self, portable: PortablePrefix) -> Prefix:
        self._portable("import_prefix")
        prompt, sampling = self.check_portable(portable)
        return self._imported(portable, prompt, sampling, None)

    def _import_onto_pages(self, portable: PortablePrefix, existing_prefix: Prefix) -> Prefix:
        """EngineBase._import_onto_pages: the tail written into blocks after the held prefix's."""
        return self._imported(portable, portable.prompt_tokens, portable.sampling, existing_prefix)

    @torch.no_grad()
    def _imported(self, portable: PortablePrefix, prompt: np.ndarray, sampling: SamplingParams,
                  existing: Prefix | None) -> Prefix:
        """A checked portable prefix as a Prefix (tensors, or blocks); a tail (from
        ``portable.start``) only onto ``existing`` (paged), whose blocks below the start it shares."""
        put = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.torch_dtype)  # noqa: E731
        logits = torch.from_numpy(np.ascontiguousarray(portable.last_logits, dtype=np.float32))
        first = self._first_tokens(logits, prompt, sampling)
        kv, nbytes = (put(portable.k), put(portable.v)), self.kv_bytes(prompt.size)
        if self.pages is not None:  # written into blocks: fresh ones, or after the held prefix's shared ones
            start, n = portable.start, prompt.size
            seq = (existing.kv.fork(start, finalize=True) if existing is not None
                   else PageList.new(self.pages, n, finalize=True))  # fresh blocks: the write copies nothing
            if start < n:  # an empty tail writes nothing (and copies no shared block)
                self._on_worker(lambda: self._paged.scatter(seq, *kv, start, n, offset=start))
            kv, nbytes = seq, self.kv_bytes(len(seq.pages) * self.pages.page_size)
        return Prefix(kv=kv, logits=logits, prompt_tokens=prompt, sampling=sampling,
                      backend=self.name, first_token=int(first.tokens[0, 0]), to_host=host_array, model_id=self.model_id,
                      nbytes=nbytes)


def _split(count: int, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """``count`` entries as consecutive (start, size) parts of the batch ``sizes``, largest
    first (7 of (2, 4): 4 + 2 + 1); a part of 1 runs as its own prefill."""
    parts, at = [], 0
    for size in sorted(sizes, reverse=True):
        while count - at >= size:
            parts.append((at, size))
            at += size
    return parts


def create_engine(*, model: Model, config: EngineConfig) -> NeuronEngine:
    return NeuronEngine(model, config)


def diagnose() -> dict[str, str]:
    """What ``polyengine backends --verbose`` says of this backend: the compiler an engine
    with the default options would use here, its artifact cache, and speculation."""
    from polyengine.errors import UnsafeCache

    compiler = NeuronEngine._pick_compiler("auto")
    out = {"device": NeuronEngine._describe(compiler),
           "prefix tails": ("import_prefix_tail (capability portable_prefix_tail): with page_size the held prefix's "
                            "blocks below the tail's start shared and only the tail written into blocks; without, the "
                            "kit's copy through the host")}
    if compiler == "export":
        out["compiler"] = ("export: the CPU compile path (by name only), each graph's torch.export program run as it is, "
                           "re-exported per process, nothing cached on disk; option compiler='inductor' compiles them to "
                           f"C++ (cached); on a Neuron instance: {plugin.NEURONX_HINT}")
    else:
        out["compiler"] = "neuronx: torch_neuronx.trace (neuronx-cc)"
    if compiler not in PERSISTED:
        out["cache"] = f"none with compiler {compiler!r}; compiler='inductor' keeps its artifacts in {default_cache_dir()}"
        out["speculation"] = "off (plain decoding); option speculation=k (2..8) verifies k - 1 drafts per step"
        return out
    try:  # refused: a relative $POLYENGINE_NEURON_CACHE, or a folder someone else could write
        root = default_cache_dir()
        if not root.exists():
            out["cache"] = f"{root} (created private, mode 0700, at the first compile)"
        else:
            from polyengine.cache import private_dir

            private_dir(root, what="neuron artifact cache", env="POLYENGINE_NEURON_CACHE")
            out["cache"] = f"{root} (private; {len(list(root.glob('*.bin')))} artifact(s))"
    except UnsafeCache as exc:
        out["cache"] = f"REFUSED: {exc}"
    out["speculation"] = "off (plain decoding); option speculation=k (2..8) verifies k - 1 drafts per step"
    return out
