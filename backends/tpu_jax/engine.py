"""The tpu_jax engine: the protocol over the jitted steps, on any JAX platform.

TPU in production, the CPU here, GPU JAX where present. The engine is the host half:
it checks every call with the kit's refusals, turns requests into small arrays
(padded tokens, one sampling row, slot masks) and calls the pure step functions of
:mod:`.steps`, which hold the model (the shared torch forward through torchax), the
sampler and the KV cache updates. The decode state is a host mirror of the slots
(what can be known without a sync: occupancy, completion lengths) plus
:class:`~.steps.DecodeArrays` on the devices; results are packed device buffers whose
host copy starts at once (``async_results``), so the driver dispatches step n+1 while
step n is copied.

The same engine runs single-process and as one process of a multi-host JAX program
(``ray_engine.py`` hosts one per Ray worker): nothing here depends on which, except
that host inputs become global arrays (``ShardingPlan.put``) and results are read from
this process's replica.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from polyengine.engine import Capabilities, EngineBase, EngineConfig, Prefix, PrefillRequest, ResultTokens, SlotTable
from polyengine.errors import InvalidRequest
from polyengine.hostinfo import has_bf16_units
from polyengine.logs import compiling
from polyengine.models import Model
from polyengine.models.quantize import quantize_model, replaced_weights
from polyengine.models.config import ARCHITECTURES
from polyengine.models.int_blocks import FOUR_BIT_FORMATS, block_matrices
from polyengine.pages import PageList, PagePool, check_owner, pages_for
from polyengine.prefix import PortablePrefix
from polyengine.sampling import SamplingParams
from polyengine.sampling.masks import full_mask
from polyengine.sampling.params import ENGINE_FIELDS, MAX_TOP_LOGPROBS

from polyengine.backends.tpu_jax import paged
from polyengine.backends.tpu_jax import sampling as smp
from polyengine.backends.tpu_jax import steps
from polyengine.backends.tpu_jax.compile_cache import use_compile_cache
from polyengine.backends.tpu_jax.observe import CompileLog, Profiler, format_report, logger, memory_report
from polyengine.backends.tpu_jax.options import BATCHED_PREFILL_PLATFORMS, OPTIONS, WEIGHT_FORMATS, check_pages
from polyengine.backends.tpu_jax.footprint import device_needs
from polyengine.backends.tpu_jax.quantize import block_arrays
from polyengine.backends.tpu_jax.sharding import ShardingRules, param_axes, plan_mesh

__all__ = ["TpuJaxEngine", "TpuDecodeState", "PrefixArrays", "create_engine"]

def _dtypes(platform: str) -> tuple[str, ...]:
    """What this platform computes well: bfloat16 first on a TPU; on the CPU float32,
    plus bfloat16 only where the CPU has bf16 arithmetic (AMX or AVX512-BF16: elsewhere
    XLA widens every bf16 product to float32, slower than float32 itself)."""
    if platform == "tpu":
        return ("bfloat16", "float32")
    if platform == "gpu":
        return ("bfloat16", "float32", "float16")
    return ("float32", "bfloat16") if has_bf16_units() else ("float32",)


@dataclass
class PrefixArrays:
    """``Prefix.kv`` of this engine: K/V on the devices, padded to the prompt's bucket,
    and the request's sampling row, put on the devices once for prefill and insert."""

    k: jax.Array  # (layers, kv_heads, bucket, head_dim), compute dtype
    v: jax.Array
    row: smp.SamplerState


@dataclass
class TpuDecodeState:
    """The protocol's decode state: device arrays plus the host's mirror of the slots."""

    num_slots: int
    arrays: steps.DecodeArrays
    slots: SlotTable  # occupancy and counts, what the host knows without a sync
    seqs: list[PageList | None] | None = None  # paged (option page_size): per slot, its pages

    def is_occupied(self, slot: int) -> bool:
        return self.slots.is_occupied(slot)


# What steps.XLA_CPU_SCHEDULER says, for speed_paths (backends/tpu_jax/xla_flags.py).
_SCHEDULER_WORDS = {
    "set": "XLA:CPU's memory-minimizing scheduler (set in XLA_FLAGS by this backend): one dequantized matrix at a time",
    "user": "XLA:CPU's scheduler as XLA_FLAGS chose it (xla_cpu_enable_concurrency_optimized_scheduler)",
    "late": "XLA:CPU's default scheduler (JAX had started before this backend was imported; block weights may "
            "then be dequantized all at once)",
    "unknown": "XLA:CPU's default scheduler (this jaxlib has no concurrency-optimized one to turn off)",
}


class TpuJaxEngine(EngineBase):
    name = "tpu_jax"
    OPTIONS = OPTIONS

    def __init__(self, model: Model, config: EngineConfig):
        super().__init__(model, config)
        o, devices = self.options, self.devices
        # A file's block-format matrices stay integers with group scales on the mesh
        # (quantize.py), unless option quantize requantizes every matrix anyway.
        self._blocks = {} if o["quantize"] else block_matrices(model, WEIGHT_FORMATS)
        plan = plan_mesh(
            model.config, config.max_slots, devices, tensor_parallel=o["tensor_parallel"],
            data_parallel=o["data_parallel"], rules=ShardingRules.with_overrides(o["sharding_rules"]))
        self.plan = plan
        self.cfg = steps.StepConfig(
            model=model.config, dtype=self.dtype, slots=config.max_slots, cache_length=config.max_cache_length,
            plan=plan, attention=o["attention"], quantize=o["quantize"], blocks=bool(self._blocks),
            kv_int8=o["kv_quantize"] == "int8",
            num_top=MAX_TOP_LOGPROBS, candidates=o["candidates"])
        # Paged K/V (option page_size): the page ids and counts (polyengine.pages) and the
        # pools on the mesh they index (paged.py), made with the first prefix or decode state.
        self.paged_kernel = self._paged_attention()  # "gather", "pallas" or "interpret" (pallas.resolve)
        ps, kv_pages = self.capabilities.page_size, o["kv_pages"]
        check_pages(o, config.max_cache_length, self.name)
        self.pages = PagePool(ps, kv_pages or None) if ps else None
        self.compiles = CompileLog(per_bucket=(
            "widen_prefix", "prefill_step", "prefill_batch_step", "insert_kv_step", "write_pages_step",
            "gather_pages_step", "paged_forward_step"))
        self._paged = paged.PagedKV(self.pages, self.cfg, self.plan.put_tree, (
            config.max_slots * pages_for(config.max_cache_length, ps)), self.compiles.track) if ps else None
        # Batched prefill: the batch sizes its programs take (pad rows fill a batch up to
        # one), and after warm-up the (B, T, O) triples it compiled (None: compile on use).
        self.batch_sizes = (2, 4) if config.max_slots > 2 else (2,)
        self.batch_programs: set[tuple[int, int, int]] | None = None
        platform = devices[0].platform if devices else "cpu"
        kind = devices[0].device_kind if devices else platform
        self.device = (f"{platform} ({kind}; JAX {jax.__version__}; {plan.describe()} on {plan.mesh.devices.size} of "
                       f"{len(devices)} devices, {jax.process_count()} process(es))")
        self._check_memory()
        self.compile_cache = use_compile_cache(o["compile_cache"])
        self.profiler = Profiler(port=o["profiler_port"], trace_dir=o["trace_dir"], trace_steps=o["trace_steps"])
        self.memory_reports: dict[str, dict[str, Any]] = {}
        self.warmup_seconds: float | None = None
        self._params: dict[str, jax.Array] | None = None
        self._spare: TpuDecodeState | None = None
        self._empty: PrefixArrays | None = None
        self._eos_mask = np.zeros(self.vocab_size, bool)
        self._eos_mask[list(self.eos_token_ids)] = True

    _ATTENTION_WORDS = {
        "gather": "each row's pages gathered per layer (option paged_attention=pallas: JAX's Pallas kernel)",
        "pallas": "JAX's Pallas paged-attention kernel reads the pages in place (K/V in bfloat16)",
        "interpret": "JAX's Pallas paged-attention kernel under Pallas's TPU interpreter: proves the path, "
                     "far slower than paged_attention=gather",
    }

    def speed_paths(self) -> dict[str, str]:
        """What the engine runs on (``polyengine generate`` and ``backends --verbose`` print it)."""
        kv = (f"pages of {self.pages.page_size} positions; decode attention: "
              f"{self._ATTENTION_WORDS[self.paged_kernel]}" if self.pages else
              "one contiguous cache row per slot (option page_size: pages)")
        paths = {"device": str(self.device), "kv": kv}
        if self._blocks:  # a file's GGUF blocks (quantize.block_arrays)
            four = sum(self.model.records[s].format in FOUR_BIT_FORMATS for s in self._blocks.values())
            paths["weights"] = (f"{four} matrices as 4-bit values two to a byte (Q4_0/Q4_1/Q4_K), "
                                f"{len(self._blocks) - four} as int8 values, with group scales (and offsets), "
                                f"multiplied out in {self.dtype} in the step; the rest converted to {self.dtype} "
                                f"at load, one tensor at a time")
        elif self.cfg.quantize:
            paths["weights"] = f"int8 copies of the matrices (option quantize={self.cfg.quantize})"
        if self.devices and self.devices[0].platform == "cpu":
            paths["scheduler"] = _SCHEDULER_WORDS[steps.XLA_CPU_SCHEDULER]
        return paths

    # -- construction ----------------------------------------------------------------------

    def capabilities_for(self, model: Model, config: EngineConfig) -> Capabilities:
        self.devices = self._devices(self.options["platform"])
        self.device = platform = self.devices[0].platform if self.devices else "cpu"
        return Capabilities(
            dtypes=_dtypes(platform), sampling_params=ENGINE_FIELDS, max_top_logprobs=MAX_TOP_LOGPROBS,
            bulk_insert=True, portable_prefix=True, prefix_reuse=True, prefix_truncate=True, async_results=True,
            architectures=ARCHITECTURES, token_masks=True, weight_formats=WEIGHT_FORMATS,
            portable_prefix_tail=True,  # paged: the head's pages shared; contiguous: the kit's copy
            page_size=self.options["page_size"],
            batched_prefill=self.options["batched_prefill"] == "on" or (
                self.options["batched_prefill"] == "auto" and platform in BATCHED_PREFILL_PLATFORMS),
            prefill_lane=self._prefill_lane(platform),
        )

    def _paged_attention(self) -> str:
        """Option paged_attention, resolved for this platform and dtype (pallas.resolve):
        'pallas' asks for pages, and is refused without them."""
        mode, ps = self.options["paged_attention"], self.options["page_size"]
        if mode == "pallas" and not ps:
            raise InvalidRequest("paged_attention='pallas' reads K/V pages: set page_size (16 is the usual) "
                                 "or leave paged_attention at 'auto'", field="options.paged_attention")
        if not ps:
            return "gather"
        from polyengine.backends.tpu_jax.pallas import resolve

        return resolve(mode, self.devices[0].platform if self.devices else "cpu", self.dtype)

    def _prefill_lane(self, platform: str) -> bool:
        """Option prefill_lane: 'auto' is on for the CPU platform (XLA's host threads serve a
        step and the lane's prefill side by side), off on a TPU or GPU (a device runs one
        program at a time: a step would wait for the whole prefill). With page_size the
        lane's prefill runs over a contiguous cache of its own, as every paged prefill
        does, and only its scatter into the pools (and a continuation's gather from them)
        waits for the pools' lock, which a step holds while it dispatches."""
        lane = self.options["prefill_lane"]
        return lane == "on" or (lane == "auto" and platform == "cpu")

    @staticmethod
    def _devices(platform: str) -> list[Any]:
        try:
            return jax.devices(platform) if platform else jax.devices()
        except RuntimeError as exc:
            raise InvalidRequest(f"option platform={platform!r}: JAX has no such devices here ({exc})") from None

    def _needs(self) -> dict[str, int]:
        """Bytes per device of what the engine allocates (weights, caches, sampler tables)."""
        plan, pool = self.plan, self.pages
        return device_needs(self.model.config, self.config, dtype=self.dtype, dp=plan.dp, tp=plan.tp,
                            quantize=self.cfg.quantize, kv_int8=self.cfg.kv_int8, rules=dict(plan.rules.pairs),
                            blocks={s: self.model.records[s].format for s in self._blocks.values()},
                            page_size=0 if pool is None else pool.page_size,
                            pool_pages=0 if pool is None else pool.capacity or 0,
                            prefill_rows=self.batch_sizes[-1] if self.capabilities.batched_prefill else 1)

    def _check_memory(self) -> None:
        needs = self._needs()
        local = [d for d in self.plan.mesh.devices.flat if d.process_index == jax.process_index()]
        stats = [d.memory_stats() for d in local]
        if local and all(stats):
            free = min(int(s.get("bytes_limit", 0)) - int(s.get("bytes_in_use", 0)) for s in stats)
            self.check_memory(needs, where=f"the memory of each {local[0].platform} device", available=free)
        else:  # the CPU platform: every device's arrays live in this host's memory
            self.check_memory({k: v * len(local) for k, v in needs.items()})

    # -- lifecycle -------------------------------------------------------------------------

    def load_params(self) -> dict[str, jax.Array]:
        """The weights on the mesh (HF names; int8 ``qweight``/``scale`` when quantized)."""
        if self._params is None:
            import torch

            from polyengine.backends.torch_common.model import TorchWeights

            c = self.model.config
            mode = self.cfg.quantize
            skip = replaced_weights(c) if mode else frozenset(self._blocks.values())
            # Each float weight made in the compute dtype as it is read (a bfloat16 file's
            # weights never exist as a float32 model on the host), and each host tensor
            # gone once it is on the mesh (_put_params): nothing else holds it.
            w = TorchWeights.from_model(self.model, dtype=getattr(torch, self.dtype),
                                        max_positions=self.max_cache_length, skip=skip)
            host = {}
            while w.tensors:
                name, t = w.tensors.popitem()
                host[name] = host_array(t)
            # RoPE tables from float64 in one rounding (as the shared model builds them).
            for kind, (cos, sin) in c.rope_tables(self.max_cache_length).items():
                prefix = "rope" if kind == "global" else "rope_local"
                host[prefix + ".cos"], host[prefix + ".sin"] = cos, sin
            if mode:  # the core's quantizer; an exclusive Model releases the floats they replace
                host.update(quantize_model(self.model, mode))
            params: dict[str, jax.Array] = {}
            self._put_params(params, host)
            del w, host
            # a file's blocks, as stored, one tensor at a time: each matrix's arrays go to
            # the mesh and their host copies (and the record's file pages) go before the next
            for name, source in self._blocks.items():
                self._put_params(params, block_arrays(self.model.weight(source, WEIGHT_FORMATS), name))
            self._params = params
            self._report("after weights load")
            if self.options["warmup"]:
                with compiling("every program of this engine (option warmup)", first_run=False):
                    self.warmup()
        return self._params

    def _put_params(self, params: dict, host: dict) -> None:
        """``host``'s arrays onto the mesh into ``params`` (floats in the compute dtype,
        scales and offsets in float32), emptying ``host`` as they go."""
        dtype = steps.JAX_DTYPES[self.dtype]
        while host:
            name, arr = host.popitem()
            if arr.dtype.kind == "f" and not name.endswith((".scale", ".offset")):
                arr = np.asarray(arr, dtype=dtype)
            params[name] = self.plan.put(arr, param_axes(name, arr.ndim))

    def _report(self, when: str) -> None:
        report = memory_report(list(self.plan.mesh.devices.flat))
        self.memory_reports[when] = report
        logger.info("tpu_jax memory %s: %s", when, format_report(report))

    def init_decode_state(self) -> TpuDecodeState:
        if self._spare is not None:  # warm-up's state: every slot freed, so as good as new
            state, self._spare = self._spare, None
            return state
        self.load_params()
        n = self.max_concurrent_decodes
        eos = self.plan.put(self._eos_mask, ("vocab",))
        with self.compiles.track():
            if self._paged is None:
                arrays = steps.init_state(eos, cfg=self.cfg)
            else:  # the K/V live in the engine's pools; the state holds a page-table row per slot
                arrays = steps.DecodeArrays(k=None, v=None, rows=steps.init_rows(eos, cfg=self.cfg.sampler, slots=n),
                                            table=paged.init_table(cfg=self.cfg, width=self._paged.width))
        return TpuDecodeState(n, arrays, SlotTable(n), seqs=None if self._paged is None else [None] * n)

    def warmup(self) -> None:
        """Compile every program this engine can run: prefill and insert per bucket, the
        continuation of a prefix per reachable (prefix bucket, new tokens bucket) pair,
        bulk insert, generate (with and without overrides), free, and the first token
        of an imported prefix. Afterwards no request mix compiles anything.
        ``bench_report()`` tells what each program cost."""
        params = self.load_params()
        start = time.perf_counter()
        state = self.init_decode_state()
        sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=0, logprobs=True, top_logprobs=1)
        reachable = sorted({self.config.bucket_for(n) for n in range(1, self.max_prefill_length + 1)})
        prefix = None
        made = {}
        for bucket in reachable:
            prefix, _ = self.prefill(params=params, tokens=[0] * min(bucket, self.max_prefill_length), sampling=sampling)
            made[bucket] = prefix
            state = self.insert(prefix, state, 0)
            state = self.free_resource(state, 0)
        # The program depends on the buckets, not on the lengths inside them: any prefix
        # of bucket P continued with one token padded to bucket T compiles the pair.
        for p, t in self.continuation_pairs():
            self._extend(params, made[p].kv, 1, np.zeros(1, np.int32), t)
        if self.capabilities.batched_prefill:  # every batch size over every (T, O) a prefill reaches
            one = np.zeros(1, np.int32)
            pairs = {(b, b): (self._empty_prefix(), 0) for b in reachable}
            for p, t in self.continuation_pairs():
                pairs.setdefault((t, self.continued_bucket(p, t)), (made[p].kv, 1))
            for b in self.batch_sizes:
                for (t, o), (held, start) in sorted(pairs.items()):
                    self._extend_batch(params, [(held, start, one)] * b, t, o)
            self.batch_programs = {(b, t, o) for b in self.batch_sizes for t, o in pairs}
        imported = self.import_prefix(self.export_prefix(prefix))
        state, _ = self.bulk_insert(imported, state, [0])
        state, _ = self.generate(params, state, overrides={0: 0})
        state, out = self.generate(params, state)
        if self._paged is not None:  # the decode step of every page-table width, and a refused step's page work
            for width in self._paged.widths:
                state, out = self._generate(params, state, {}, None, width=width)
            with self._paged.donating() as pools, self.compiles.track():
                k, v, state.arrays.table = paged.page_ops_step(*pools, state.arrays.table, self._paged.ops([], []),
                                                               cfg=self.cfg)
                pools[:] = k, v
        state = self.free_resource(state, 0)
        jax.block_until_ready((out.tokens, state.arrays))
        self._spare = state
        self.warmup_seconds = time.perf_counter() - start
        self._report("after warm-up")

    # -- prefill ---------------------------------------------------------------------------

    def _row(self, sampling: SamplingParams, prompt: np.ndarray, sample_index: int = 0) -> smp.SamplerState:
        row = smp.request_row(sampling, prompt, self.vocab_size, self.eos_token_ids)
        row.sample_index[0] = sample_index
        return self.plan.put_tree(row)

    def _host(self, x: jax.Array) -> np.ndarray:
        """A (replicated) device array on the host: this process's copy."""
        return np.asarray(x.addressable_data(0) if self.plan.multi_process else x)

    def _start_copy(self, buf: jax.Array) -> jax.Array:
        """Start the host copy of a step's packed results (this process's replica) at once."""
        (buf.addressable_data(0) if self.plan.multi_process else buf).copy_to_host_async()
        return buf

    def _results(self, packed: Any) -> ResultTokens:
        return ResultTokens.from_packed(packed, self.cfg.layout, to_host=self._host, start_copy=self._start_copy)

    def _mask_in(self, words: np.ndarray | None, rows: int = 1) -> jax.Array:
        """Allowed-token words as a step's input, ``(rows, W)``; None: every token allowed
        (the same executable either way)."""
        return self.plan.put(full_mask(self.vocab_size, rows) if words is None else words.reshape(rows, -1))

    def _first(self, logits: jax.Array, sampling: SamplingParams, prompt: np.ndarray, sample_index: int = 0,
               token_mask: np.ndarray | None = None) -> jax.Array:
        """Sample ``sample_index``'s first token from a prefix's logits: packed (1, width)."""
        return steps.first_token_step(logits, self._row(sampling, prompt, sample_index), self._mask_in(token_mask),
                                      cfg=self.cfg.sampler)

    def prefill(self, *, params, tokens, sampling: SamplingParams, existing_prefix: Prefix | None = None,
                token_mask: np.ndarray | None = None):
        toks, sampling, start = self.check_prefill(tokens, sampling, existing_prefix)
        mask = self.check_token_mask(token_mask, sampling)
        # A plain prefill continues the empty prefix: one program kind for both.
        held = existing_prefix.kv if existing_prefix is not None else self._empty_prefix()
        k, v, logits = self._extend(params, held, start, toks, self.config.bucket_for(toks.size))
        return self._prefixed(k, v, logits, toks, sampling, start, mask, existing_prefix)

    def _prefixed(self, k, v, logits, toks: np.ndarray, sampling: SamplingParams, start: int,
                  mask: np.ndarray | None, existing_prefix: Prefix | None) -> tuple[Prefix, ResultTokens]:
        """A prefill's prefix from its K/V ``(layers, kv_heads, O, head_dim)`` and last
        logits: its first token drawn (:func:`~.steps.first_token_step`), its new positions
        written into pages where the engine keeps them."""
        n = toks.size
        prompt = toks if existing_prefix is None else np.concatenate([existing_prefix.prompt_tokens, toks]).astype(np.int32)
        row = self._row(sampling, prompt)
        with self.compiles.track():
            result = self._results(steps.first_token_step(logits, row, self._mask_in(mask), cfg=self.cfg.sampler))
        if self._paged is None:
            kv, nbytes = PrefixArrays(k, v, row), self.kv_bytes(k.shape[2])
        else:
            # The prefill ran over a contiguous cache of its own (the contiguous engine's
            # programs); its new positions go into pages, after the continued prefix's shared ones.
            seq = PageList.continuing(self.pages, None if existing_prefix is None else existing_prefix.kv.seq)
            self._paged.write(seq, k, v, start, start + n)
            kv, nbytes = paged.PagedPrefix(seq, k.shape[2], row), self.kv_bytes(len(seq.pages) * self.pages.page_size)
        prefix = Prefix(
            kv=kv, logits=logits, prompt_tokens=prompt, sampling=sampling, backend=self.name,
            first_token=int(result.tokens[0, 0]), to_host=self._host, model_id=self.model_id, token_mask=mask,
            nbytes=nbytes,
        )
        return prefix, result

    # -- batched prefill (option batched_prefill) -------------------------------------------

    def prefill_batch(self, *, params, requests: Sequence[PrefillRequest]) -> list[tuple[Prefix, ResultTokens]]:
        """The entries in as few programs as their buckets allow: entries whose own
        prefill stores their prefix in the same output bucket ``O`` run together
        (:func:`~.steps.prefill_batch_step`, up to the largest batch size at a time,
        tokens padded to the largest of their new-tokens buckets ``T``), so each prefix
        comes out in the bucket its own prefill gives and every later program (insert,
        continuation, export) is the one it would be. An entry alone in its bucket, or a
        batch whose (B, T, O) warm-up did not compile, runs as its own prefill: after
        warm-up nothing compiles. Without capability ``batched_prefill``: the kit's loop."""
        if not self.capabilities.batched_prefill:
            return super().prefill_batch(params=params, requests=requests)
        checked = self.check_prefill_batch(requests)
        held = [r.existing_prefix.kv if r.existing_prefix is not None else self._empty_prefix() for r in requests]
        groups: dict[int, list[int]] = {}
        new_bucket = [self.config.bucket_for(toks.size) for toks, _, _, _ in checked]
        for i, kv in enumerate(held):
            p = self._bucket_of(kv)
            out = new_bucket[i] if p == 0 else self.continued_bucket(p, new_bucket[i])
            groups.setdefault(out, []).append(i)
        ran: dict[int, tuple] = {}
        size = self.batch_sizes[-1]
        for out, members in groups.items():
            for at in range(0, len(members), size):
                part = members[at: at + size]
                t = max(new_bucket[i] for i in part)
                b = min(x for x in self.batch_sizes if x >= len(part))
                if len(part) > 1 and (self.batch_programs is None or (b, t, out) in self.batch_programs):
                    rows = [(held[i], checked[i][2], checked[i][0]) for i in part]
                    ran.update(zip(part, self._extend_batch(params, rows, t, out)))
                else:
                    for i in part:
                        toks, _, start, _ = checked[i]
                        ran[i] = self._extend(params, held[i], start, toks, new_bucket[i])
        # A page pool that runs out part way raises; the prefixes made before it are
        # dropped, and their page lists (finalize=True) give their pages back.
        return [self._prefixed(*ran[i], toks, sampling, start, mask, req.existing_prefix)
                for i, (req, (toks, sampling, start, mask)) in enumerate(zip(requests, checked))]

    def _extend_batch(self, params, rows: list[tuple[PrefixArrays | paged.PagedPrefix, int, np.ndarray]], bucket: int,
                      out: int) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
        """:meth:`_extend` for several rows ``(prefix, start, tokens)`` whose prefixes
        all land in bucket ``out``, tokens padded to ``bucket``, in one
        :func:`~.steps.prefill_batch_step`, pad rows filling the batch to a batch size.
        Returns per row (K, V, logits)."""
        b = min(x for x in self.batch_sizes if x >= len(rows))
        tokens, starts, lengths = np.zeros((b, bucket), np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        ks, vs = [], []
        for i, (kv, start, toks) in enumerate(rows):
            tokens[i, : toks.size], starts[i], lengths[i] = toks, start, toks.size
            pk, pv, held = self._prefix_arrays(kv)
            with self.compiles.track(f"{held}->{out}"):
                k, v = steps.widen_prefix(pk, pv, plan=self.plan, bucket=out)
            ks.append(k)
            vs.append(v)
        if len(rows) < b:  # pad rows: an empty prefix's cache, nothing written, results dropped
            empty = self._empty_prefix()
            with self.compiles.track(f"0->{out}"):
                k, v = steps.widen_prefix(empty.k, empty.v, plan=self.plan, bucket=out)
            ks += [k] * (b - len(rows))
            vs += [v] * (b - len(rows))
        tokens, starts, lengths = self.plan.put_tree((tokens, starts, lengths))
        with self.compiles.track(f"{b}x{bucket} in {out}"):
            ks, vs, logits = steps.prefill_batch_step(params, tuple(ks), tuple(vs), starts, tokens, lengths,
                                                      cfg=self.cfg)
        return list(zip(ks, vs, logits))[: len(rows)]

    # -- prefix reuse: one program per (prefix bucket, new tokens bucket) -----------------------

    def continued_bucket(self, prefix_bucket: int, new_bucket: int) -> int:
        """The bucket a continued prefix is stored in: the one that holds both buckets
        (within ``max_prefill_length``). A function of the pair only, so the pair picks one
        program and the insert program of an existing bucket takes the result."""
        return self.config.bucket_for(min(prefix_bucket + new_bucket, self.max_prefill_length))

    def continuation_pairs(self) -> list[tuple[int, int]]:
        """Every (prefix bucket, new tokens bucket) pair a request can reach: a prefix of
        true length ``s`` in bucket ``P`` (prefill stores it in the smallest bucket that
        holds it, a continuation in :meth:`continued_bucket`, which may be larger)
        continued with ``n`` tokens, ``s + n <= max_prefill_length``. Warm-up compiles
        these and no others."""
        buckets, limit = self.config.buckets(), self.max_prefill_length
        smallest = {b: s for s, b in ((1, buckets[0]), *((p + 1, b) for p, b in zip(buckets, buckets[1:])))
                    if s < limit}  # the shortest prompt prefill stores in each bucket
        changed = True
        while changed:  # continuations may store shorter prefixes in larger buckets
            changed = False
            for p, s in list(smallest.items()):
                for t in buckets:
                    n = 1 if t == buckets[0] else buckets[buckets.index(t) - 1] + 1
                    if s + n >= limit:
                        break
                    out = self.continued_bucket(p, t)
                    if s + n < smallest.get(out, limit):
                        smallest[out], changed = s + n, True
        pairs = []
        for p, s in sorted(smallest.items()):
            for t in buckets:
                n = 1 if t == buckets[0] else buckets[buckets.index(t) - 1] + 1
                if s + n <= limit:
                    pairs.append((p, t))
        return pairs

    def _empty_prefix(self) -> PrefixArrays:
        """The prefix a plain prefill continues: no positions (zero bytes), made once; it
        has no sampling row, as it is never inserted or returned."""
        if self._empty is None:
            c = self.model.config
            shape = (c.num_hidden_layers, c.num_key_value_heads, 0, c.head_dim)
            axes = ("layers", "kv_heads", "positions", "head_dim")
            empty = self.plan.put(np.zeros(shape, steps.JAX_DTYPES[self.dtype]), axes)
            self._empty = PrefixArrays(empty, empty, None)
        return self._empty

    def _extend(self, params, kv: PrefixArrays | paged.PagedPrefix, start: int, toks: np.ndarray, bucket: int):
        """``toks`` (padded to ``bucket``) after ``start`` positions of ``kv``: the prefix
        widened to the bucket that holds both (:func:`~.steps.widen_prefix`), then
        :func:`~.steps.prefill_step` on it. Returns (K, V, logits)."""
        padded = np.zeros(bucket, np.int32)
        padded[: toks.size] = toks
        tokens_in, length, start_in = self.plan.put_tree((padded, np.int32(toks.size), np.int32(start)))
        pk, pv, held = self._prefix_arrays(kv)
        out = bucket if held == 0 else self.continued_bucket(held, bucket)
        with self.compiles.track(f"{held}->{out}"):
            k, v = steps.widen_prefix(pk, pv, plan=self.plan, bucket=out)
        with self.compiles.track(str(bucket) if out == bucket else f"{bucket} in {out}"):
            return steps.prefill_step(params, k, v, start_in, tokens_in, length, cfg=self.cfg)

    def _prefix_arrays(self, kv: PrefixArrays | paged.PagedPrefix) -> tuple[jax.Array, jax.Array, int]:
        """A prefix's K/V as contiguous arrays of its bucket (a paged one's gathered from
        its pages), and the bucket."""
        if isinstance(kv, paged.PagedPrefix):
            return (*self._paged.gather(kv.seq, kv.bucket), kv.bucket)
        return kv.k, kv.v, self._bucket_of(kv)

    @staticmethod
    def _bucket_of(kv: PrefixArrays | paged.PagedPrefix) -> int:
        """The bucket a prefix is stored in (0: the empty prefix)."""
        return kv.bucket if isinstance(kv, paged.PagedPrefix) else kv.k.shape[2]

    # -- insert, bulk_insert, free_resource: the kit's flow over these hooks ----------------

    def _install(self, prefix: Prefix, state: TpuDecodeState, slots: list[int], *, draw: bool) -> ResultTokens | None:
        result = None
        if draw:
            # Sample i's first token, each from its own stream (sample 0's is prefill's: the
            # same program on the same logits and seed).
            with self.compiles.track():
                rows = [steps.first_token_step(prefix.logits, prefix.kv.row, self._mask_in(prefix.token_mask),
                                               cfg=self.cfg.sampler)] + [
                    self._first(prefix.logits, prefix.sampling, prefix.prompt_tokens, i, prefix.token_mask)
                    for i in range(1, len(slots))]
            packed = np.concatenate([self._host(x) for x in rows])
            result = ResultTokens.from_packed(packed, self.cfg.layout)
            first = [int(t) for t in result.tokens[:, 0]]
        else:
            first = [prefix.first_token]
        r = self.max_concurrent_decodes
        order = np.zeros(r, np.int32)
        order[: len(slots)] = slots
        mask = np.zeros(r, bool)
        mask[slots] = True
        index, tokens = np.zeros(r, np.int32), np.zeros(r, np.int32)
        index[slots] = np.arange(len(slots))
        tokens[slots] = first
        kv = prefix.kv
        if self._paged is not None:  # each slot shares the prefix's pages: its table row, no K/V copied
            for slot in slots:
                state.seqs[slot] = kv.seq.fork(finalize=True)
            length, pages, mask, index, tokens = self.plan.put_tree(
                (np.int32(prefix.true_length), self._paged.row(kv.seq), mask, index, tokens))
            a = state.arrays
            with self.compiles.track():
                table = paged.insert_pages_step(a.table, pages, mask, cfg=self.cfg)
                rows = steps.insert_rows_step(a.rows, length, kv.row, mask, index, tokens, cfg=self.cfg.sampler)
            state.arrays = steps.DecodeArrays(k=None, v=None, rows=rows, table=table)
            return result
        length, order, count, mask, index, tokens = self.plan.put_tree(
            (np.int32(prefix.true_length), order, np.int32(len(slots)), mask, index, tokens))
        with self.compiles.track(kv.k.shape[2]):  # the prefix's bucket
            state.arrays = steps.insert_step(
                state.arrays, kv.k, kv.v, length, kv.row, order, count, mask, index, tokens, cfg=self.cfg)
        return result

    def _release(self, state: TpuDecodeState, slot: int) -> None:
        with self.compiles.track():
            state.arrays = steps.free_step(state.arrays, self.plan.put(np.int32(slot)), cfg=self.cfg)
        if state.seqs is not None and state.seqs[slot] is not None:  # the slot's references only
            state.seqs[slot].release()
            state.seqs[slot] = None

    # -- generate --------------------------------------------------------------------------

    def generate(self, params, decode_state: TpuDecodeState, *, overrides: Mapping[int, Any] | None = None,
                 token_masks: Mapping[int, np.ndarray] | None = None):
        state = decode_state
        forced = self.check_overrides(overrides, state.slots.last_result)
        masks = self.check_token_masks(token_masks, state.slots.last_result, forced=forced,
                                       sampling_of=state.slots.sampling)
        return self._generate(params, state, forced, None if masks is None else masks.words)

    def _generate(self, params, state: TpuDecodeState, forced, words: np.ndarray | None, *, width: int | None = None):
        """One checked decode step. Paged: ``width`` forces the page-table width bucket
        (warm-up compiles each); None picks the smallest that holds every live slot."""
        r = self.max_concurrent_decodes
        tokens, mask = np.zeros(r, np.int32), np.zeros(r, bool)
        for slot, (token, _) in forced.items():  # one token per step: the position is the latest
            tokens[slot], mask[slot] = token, True
        live = state.slots.live(self.max_cache_length)
        ops = None
        if self._paged is not None:
            # Each live slot's write position made its own (a pool that runs out refuses
            # here, before the host's counts move); the copies and table entries go first
            # in the step.
            positions = {i: state.slots[i].length for i in live}
            ops = self._prepare_pages(state, live, positions)
            width = width or self._paged.width_for(live, positions)
        # What the host knows without a sync: who advances, by one.
        state.slots.advance(live)
        self.profiler.before_step()
        tokens, mask = self.plan.put_tree((tokens, mask))
        words = self._mask_in(words, r)
        if ops is None:
            with self.compiles.track():
                state.arrays, packed = steps.generate_step(params, state.arrays, tokens, mask, words, cfg=self.cfg)
        else:
            with self._paged.donating() as pools, self.compiles.track(width):
                k, v, state.arrays, packed = paged.paged_generate_step(
                    params, *pools, state.arrays, ops, tokens, mask, words, cfg=self.cfg, width=width,
                    kernel=self.paged_kernel)
                pools[:] = k, v
        self.profiler.after_step(packed)
        return state, self._results(packed)

    def _prepare_pages(self, state: TpuDecodeState, live: list[int], positions: dict[int, int]) -> paged.PageOps:
        """:meth:`.paged.PagedKV.prepare`; a pool that runs out applies what was prepared
        before it and raises, the slots' pages on the host and the devices agreeing."""
        try:
            return self._paged.prepare(state.seqs, live, positions)
        except Exception as exc:
            if hasattr(exc, "page_ops"):
                with self._paged.donating() as pools, self.compiles.track():
                    k, v, state.arrays.table = paged.page_ops_step(*pools, state.arrays.table,
                                                                   self._paged.ops(*exc.page_ops), cfg=self.cfg)
                    pools[:] = k, v
            raise

    # -- portable prefixes ---------------------------------------------------------------

    def _gathered(self, x: jax.Array) -> np.ndarray:
        if self.plan.multi_process:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    def export_prefix(self, prefix: Prefix) -> PortablePrefix:
        self.check_prefix(prefix).require_logits("export_prefix")
        n = prefix.true_length
        k, v = (self._gathered(x)[:, :, :n].astype(np.float32) for x in self._prefix_arrays(prefix.kv)[:2])
        return PortablePrefix(
            k=k, v=v, prompt_tokens=prefix.prompt_tokens, last_logits=self._host(prefix.logits),
            sampling=prefix.sampling, model_fingerprint=self.model.fingerprint,
        )

    def import_prefix(self, portable: PortablePrefix) -> Prefix:
        prompt, sampling = self.check_portable(portable)
        return self._imported(portable, prompt, sampling, None)

    def _import_onto_pages(self, portable: PortablePrefix, existing_prefix: Prefix) -> Prefix:
        """EngineBase._import_onto_pages: the tail written into pages after the held prefix's."""
        return self._imported(portable, portable.prompt_tokens, portable.sampling, existing_prefix)

    def _imported(self, portable: PortablePrefix, prompt: np.ndarray, sampling, existing: Prefix | None) -> Prefix:
        """A checked portable prefix as a Prefix (contiguous, or pages); a tail (from
        ``portable.start``) only onto ``existing`` (paged), whose pages below the start it shares."""
        self.load_params()
        n, start = prompt.size, portable.start
        dtype = steps.JAX_DTYPES[self.dtype]
        axes = ("layers", "kv_heads", "positions", "head_dim")

        def put(a):  # pad to the bucket, as prefill's prefixes are (a tail at its own positions)
            padded = np.zeros(a.shape[:2] + (self.config.bucket_for(n),) + a.shape[3:], dtype)
            padded[:, :, start:n] = a
            return self.plan.put(padded, axes)

        logits = self.plan.put(portable.last_logits)
        row = self._row(sampling, prompt)
        with self.compiles.track():
            first = self._results(steps.first_token_step(logits, row, self._mask_in(None), cfg=self.cfg.sampler))
        kv, nbytes = PrefixArrays(put(portable.k), put(portable.v), row), self.kv_bytes(self.config.bucket_for(n))
        if self._paged is not None:
            seq = existing.kv.seq.fork(start, finalize=True) if existing is not None else PageList(
                self.pages, [], 0, finalize=True)
            if start < n:  # an empty tail writes nothing (and copies no shared page)
                self._paged.write(seq, kv.k, kv.v, start, n)
            kv, nbytes = paged.PagedPrefix(seq, kv.k.shape[2], row), self.kv_bytes(len(seq.pages) * self.pages.page_size)
        return Prefix(
            kv=kv, logits=logits, prompt_tokens=prompt, sampling=sampling,
            backend=self.name, first_token=int(first.tokens[0, 0]), to_host=self._host,
            model_id=self.model_id, nbytes=nbytes,
        )

    # -- pages (option page_size) ----------------------------------------------------------

    shares_prefix_heads = True  # _prefix_head: the same device arrays or the pages shared

    def _prefix_head(self, prefix: Prefix, length: int) -> Prefix:
        """truncate_prefix's head: paged, the first ``length`` positions' pages shared (a
        partly filled last one copied at its first write), in the bucket a prefill of
        ``length`` tokens has; contiguous, the same device arrays (JAX arrays are never
        written in place, and every program reads a prefix up to its length only), in the
        prefix's own bucket: no copy through the host (docs/prefix-caching.md, "The serving
        target"). A continuation of it (truncate_prefix's last token, or a turn after a
        prefix_head) runs in that bucket, a (bucket, new tokens bucket) pair the warm-up
        compiles like any continuation's."""
        if self._paged is None:
            return replace(prefix, prompt_tokens=prefix.prompt_tokens[:length])
        seq = prefix.kv.seq.fork(length, finalize=True)
        return replace(prefix, kv=paged.PagedPrefix(seq, self.config.bucket_for(length), prefix.kv.row),
                       prompt_tokens=prefix.prompt_tokens[:length],
                       nbytes=self.kv_bytes(len(seq.pages) * self.pages.page_size))

    def check_prefix(self, prefix: Prefix) -> Prefix:
        """The kit's checks, and K/V this engine holds: a paged prefix's pages belong to the
        pool of the engine that made it, which another engine of the same weights must not read."""
        prefix = super().check_prefix(prefix)
        check_owner(self.pages, prefix.kv.seq if isinstance(prefix.kv, paged.PagedPrefix) else None, self.name)
        return prefix

    def prefix_pages(self, prefix: Prefix) -> PageList:
        if self.pages is None:
            return super().prefix_pages(prefix)
        return self.check_prefix(prefix).kv.seq

    def slot_pages(self, decode_state: TpuDecodeState, slot: int) -> PageList | None:
        if self.pages is None:
            return super().slot_pages(decode_state, slot)
        return decode_state.seqs[self.check_slot(slot)]

    # -- benchmarks ------------------------------------------------------------------------

    def bench_report(self) -> dict[str, Any]:
        """What ``polyengine bench`` prints beside the measurements: under ``"compile"``
        one row per program this engine compiled (``program``, ``bucket``: the prefill
        bucket for per-bucket programs, ``"-"`` for the others; ``seconds``: tracing,
        lowering and XLA's compile, as JAX's monitoring events time them; ``source``: ``"compiled"`` by XLA or read from JAX's
        persistent ``"cache"``), in compile order: with ``warmup=True`` all of them
        during construction, else each on first use. A program another engine of the
        same shapes already compiled in this process is reused, not listed. The other
        keys are scalars: the mesh and devices, warm-up and total compile seconds, and
        the device memory in use after warm-up (or after the weights load)."""
        rows = [dict(r) for r in self.compiles.rows]
        when = "after warm-up" if "after warm-up" in self.memory_reports else "after weights load"
        in_use = self.memory_reports.get(when, {}).get("device_bytes_in_use")
        report = {
            "compile": rows,
            "platform": self.plan.mesh.devices.flat[0].platform,
            "devices": int(self.plan.mesh.devices.size),
            "devices visible": len(self._devices(self.options["platform"])),
            "processes": jax.process_count(),
            "mesh": self.plan.describe(),
            "prefill buckets": ",".join(map(str, self.config.buckets())),
            "programs compiled": sum(r["source"] == "compiled" for r in rows),
            "programs from the persistent cache": sum(r["source"] == "cache" for r in rows),
            "compile seconds": round(sum(r["seconds"] for r in rows), 3),
            "warm-up seconds": None if self.warmup_seconds is None else round(self.warmup_seconds, 3),
            f"device MiB in use {when}": None if in_use is None else round(in_use / 2**20, 1),
        }
        return {k: v for k, v in report.items() if v is not None}

    def close(self) -> None:
        """End a trace still being written; the arrays go with the engine."""
        self.profiler.stop()


def host_array(t) -> np.ndarray:
    """A CPU torch tensor as a NumPy array sharing its memory; bfloat16, which NumPy lacks,
    as JAX's NumPy bfloat16 type, bit for bit."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(jax.numpy.bfloat16)
    return t.numpy()


def create_engine(*, model: Model, config: EngineConfig) -> TpuJaxEngine:
    return TpuJaxEngine(model, config)
