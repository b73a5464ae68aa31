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

import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import numpy as np

from polyengine.engine import Capabilities, EngineBase, EngineConfig, Prefix, ResultTokens, SlotTable
from polyengine.errors import InvalidRequest
from polyengine.hostinfo import has_bf16_units
from polyengine.models import Model
from polyengine.prefix import PortablePrefix
from polyengine.sampling import SamplingParams
from polyengine.sampling.params import ENGINE_FIELDS, MAX_TOP_LOGPROBS
from polyengine.sampling.rows import row_bytes

from polyengine.backends.tpu_jax import sampling as smp
from polyengine.backends.tpu_jax import steps
from polyengine.backends.tpu_jax.observe import CompileLog, Profiler, format_report, logger, memory_report
from polyengine.backends.tpu_jax.options import OPTIONS
from polyengine.backends.tpu_jax.quantize import KV_SCALE_BYTES, quantize_weights
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

    def is_occupied(self, slot: int) -> bool:
        return self.slots.is_occupied(slot)


class TpuJaxEngine(EngineBase):
    name = "tpu_jax"
    OPTIONS = OPTIONS

    def __init__(self, model: Model, config: EngineConfig):
        super().__init__(model, config)
        o, devices = self.options, self.devices
        plan = plan_mesh(
            model.config, config.max_slots, devices, tensor_parallel=o["tensor_parallel"],
            data_parallel=o["data_parallel"], rules=ShardingRules.with_overrides(o["sharding_rules"]))
        self.plan = plan
        self.cfg = steps.StepConfig(
            model=model.config, dtype=self.dtype, slots=config.max_slots, cache_length=config.max_cache_length,
            plan=plan, attention=o["attention"], quantize=o["quantize"], kv_int8=o["kv_quantize"] == "int8",
            num_top=MAX_TOP_LOGPROBS, candidates=o["candidates"])
        platform = devices[0].platform if devices else "cpu"
        kind = devices[0].device_kind if devices else platform
        self.device = (f"{platform} ({kind}; JAX {jax.__version__}; {plan.describe()} on {plan.mesh.devices.size} of "
                       f"{len(devices)} devices, {jax.process_count()} process(es))")
        self._check_memory()
        self.profiler = Profiler(port=o["profiler_port"], trace_dir=o["trace_dir"], trace_steps=o["trace_steps"])
        self.memory_reports: dict[str, dict[str, Any]] = {}
        self.compiles = CompileLog(per_bucket=("prefill_step", "insert_step"))
        self.warmup_seconds: float | None = None
        self._params: dict[str, jax.Array] | None = None
        self._spare: TpuDecodeState | None = None
        self._eos_mask = np.zeros(self.vocab_size, bool)
        self._eos_mask[list(self.eos_token_ids)] = True

    # -- construction ----------------------------------------------------------------------

    def capabilities_for(self, model: Model, config: EngineConfig) -> Capabilities:
        self.devices = self._devices(self.options["platform"])
        self.device = platform = self.devices[0].platform if self.devices else "cpu"
        return Capabilities(
            dtypes=_dtypes(platform), sampling_params=ENGINE_FIELDS, max_top_logprobs=MAX_TOP_LOGPROBS,
            bulk_insert=True, portable_prefix=True, prefix_reuse=False, async_results=True,
        )

    @staticmethod
    def _devices(platform: str) -> list[Any]:
        try:
            return jax.devices(platform) if platform else jax.devices()
        except RuntimeError as exc:
            raise InvalidRequest(f"option platform={platform!r}: JAX has no such devices here ({exc})") from None

    def _needs(self) -> dict[str, int]:
        """Bytes per device of what the engine allocates (weights, caches, sampler tables)."""
        c, cfg, plan = self.model.config, self.config, self.plan
        item = np.dtype(steps.JAX_DTYPES[self.dtype]).itemsize
        weights = 0
        for name, shape in c.weight_shapes().items():
            quantized = self.cfg.quantize and (name.endswith("_proj.weight") or name == "lm_head.weight")
            weights += math.prod(shape) * (1 if quantized else item) // plan.shards(param_axes(name, len(shape)), shape)
        if self.cfg.quantize and c.tie_word_embeddings:
            weights += c.vocab_size * c.hidden_size  # the int8 copy of the tied head
        kv_item, width = (1, c.head_dim + KV_SCALE_BYTES) if self.cfg.kv_int8 else (item, c.head_dim)
        cache_shape = (c.num_hidden_layers, cfg.max_slots, c.num_key_value_heads, cfg.max_cache_length, width)
        cache = 2 * math.prod(cache_shape) * kv_item // plan.shards(steps._CACHE_AXES, cache_shape)
        return {
            f"{self.dtype} weights{' (int8 projections)' if self.cfg.quantize else ''}": weights,
            f"the KV cache of {cfg.max_slots} slots x {cfg.max_cache_length} positions": cache,
            "the sampler's per-slot tables and a prefill's activations": (
                cfg.max_slots * row_bytes(c.vocab_size) // plan.dp
                + cfg.max_prefill_length * (c.vocab_size + 4 * c.intermediate_size) * 4),
        }

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
            w = TorchWeights.from_model(self.model, dtype=torch.float32, max_positions=self.max_cache_length)
            host = {name: t.numpy() for name, t in w.tensors.items()}
            # RoPE tables from float64 in one rounding (as the shared model builds them).
            angles = np.arange(self.max_cache_length, dtype=np.float64)[:, None] * c.rope_inv_freq()[None, :]
            host["rope.cos"], host["rope.sin"] = np.cos(angles), np.sin(angles)
            if self.cfg.quantize:
                host = quantize_weights(host, self.cfg.quantize)
            dtype = steps.JAX_DTYPES[self.dtype]
            params = {}
            for name, arr in host.items():
                if arr.dtype.kind == "f" and not name.endswith(".scale"):
                    arr = np.asarray(arr, dtype=dtype)
                params[name] = self.plan.put(arr, param_axes(name, arr.ndim))
            self._params = params
            self._report("after weights load")
            if self.options["warmup"]:
                self.warmup()
        return self._params

    def _report(self, when: str) -> None:
        report = memory_report(list(self.plan.mesh.devices.flat))
        self.memory_reports[when] = report
        logger.info("tpu_jax memory %s: %s", when, format_report(report))

    def init_decode_state(self) -> TpuDecodeState:
        if self._spare is not None:  # warm-up's state: every slot freed, so as good as new
            state, self._spare = self._spare, None
            return state
        self.load_params()
        with self.compiles.track():
            arrays = steps.init_state(self.plan.put(self._eos_mask, ("vocab",)), cfg=self.cfg)
        return TpuDecodeState(self.max_concurrent_decodes, arrays, SlotTable(self.max_concurrent_decodes))

    def warmup(self) -> None:
        """Compile every program this engine can run: prefill and insert per bucket,
        bulk insert, generate (with and without overrides), free, and the first token
        of an imported prefix. Afterwards no request mix compiles anything.
        ``bench_report()`` tells what each program cost."""
        params = self.load_params()
        start = time.perf_counter()
        state = self.init_decode_state()
        sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=0, logprobs=True, top_logprobs=1)
        reachable = sorted({self.config.bucket_for(n) for n in range(1, self.max_prefill_length + 1)})
        prefix = None
        for bucket in reachable:
            prefix, _ = self.prefill(params=params, tokens=[0] * min(bucket, self.max_prefill_length), sampling=sampling)
            state = self.insert(prefix, state, 0)
            state = self.free_resource(state, 0)
        imported = self.import_prefix(self.export_prefix(prefix))
        state, _ = self.bulk_insert(imported, state, [0])
        state, _ = self.generate(params, state, overrides={0: 0})
        state, out = self.generate(params, state)
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

    def _first(self, logits: jax.Array, sampling: SamplingParams, prompt: np.ndarray, sample_index: int = 0) -> jax.Array:
        """Sample ``sample_index``'s first token from a prefix's logits: packed (1, width)."""
        return steps.first_token_step(logits, self._row(sampling, prompt, sample_index), cfg=self.cfg.sampler)

    def prefill(self, *, params, tokens, sampling: SamplingParams, existing_prefix: Prefix | None = None):
        toks, sampling, _ = self.check_prefill(tokens, sampling, existing_prefix)
        n = toks.size
        padded = np.zeros(self.config.bucket_for(n), np.int32)
        padded[:n] = toks
        tokens_in, length = self.plan.put_tree((padded, np.int32(n)))
        row = self._row(sampling, toks)
        with self.compiles.track(padded.size):
            k, v, logits = steps.prefill_step(params, tokens_in, length, cfg=self.cfg)
            result = self._results(steps.first_token_step(logits, row, cfg=self.cfg.sampler))
        prefix = Prefix(
            kv=PrefixArrays(k, v, row), logits=logits, prompt_tokens=toks, sampling=sampling, backend=self.name,
            first_token=int(result.tokens[0, 0]), to_host=self._host, model_id=self.model_id,
        )
        return prefix, result

    # -- insert, bulk_insert, free_resource: the kit's flow over these hooks ----------------

    def _install(self, prefix: Prefix, state: TpuDecodeState, slots: list[int], *, draw: bool) -> ResultTokens | None:
        result = None
        if draw:
            # Sample i's first token, each from its own stream (sample 0's is prefill's: the
            # same program on the same logits and seed).
            with self.compiles.track():
                rows = [steps.first_token_step(prefix.logits, prefix.kv.row, cfg=self.cfg.sampler)] + [
                    self._first(prefix.logits, prefix.sampling, prefix.prompt_tokens, i) for i in range(1, len(slots))]
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
        length, order, count, mask, index, tokens = self.plan.put_tree(
            (np.int32(prefix.true_length), order, np.int32(len(slots)), mask, index, tokens))
        with self.compiles.track(kv.k.shape[2]):  # the prefix's bucket
            state.arrays = steps.insert_step(
                state.arrays, kv.k, kv.v, length, kv.row, order, count, mask, index, tokens, cfg=self.cfg)
        return result

    def _release(self, state: TpuDecodeState, slot: int) -> None:
        with self.compiles.track():
            state.arrays = steps.free_step(state.arrays, self.plan.put(np.int32(slot)), cfg=self.cfg)

    # -- generate --------------------------------------------------------------------------

    def generate(self, params, decode_state: TpuDecodeState, *, overrides: Mapping[int, Any] | None = None):
        state = decode_state
        forced = self.check_overrides(overrides, state.slots.last_result)
        r = self.max_concurrent_decodes
        tokens, mask = np.zeros(r, np.int32), np.zeros(r, bool)
        for slot, (token, _) in forced.items():  # one token per step: the position is the latest
            tokens[slot], mask[slot] = token, True
        # What the host knows without a sync: who advances, by one.
        state.slots.advance(state.slots.live(self.max_cache_length))
        self.profiler.before_step()
        tokens, mask = self.plan.put_tree((tokens, mask))
        with self.compiles.track():
            state.arrays, packed = steps.generate_step(params, state.arrays, tokens, mask, cfg=self.cfg)
        self.profiler.after_step(packed)
        return state, self._results(packed)

    # -- portable prefixes ---------------------------------------------------------------

    def _gathered(self, x: jax.Array) -> np.ndarray:
        if self.plan.multi_process:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    def export_prefix(self, prefix: Prefix) -> PortablePrefix:
        self.check_prefix(prefix)
        n = prefix.true_length
        k, v = (self._gathered(x)[:, :, :n].astype(np.float32) for x in (prefix.kv.k, prefix.kv.v))
        return PortablePrefix(
            k=k, v=v, prompt_tokens=prefix.prompt_tokens, last_logits=self._host(prefix.logits),
            sampling=prefix.sampling, model_fingerprint=self.model.fingerprint,
        )

    def import_prefix(self, portable: PortablePrefix) -> Prefix:
        prompt, sampling = self.check_portable(portable)
        self.load_params()
        n = prompt.size
        dtype = steps.JAX_DTYPES[self.dtype]
        axes = ("layers", "kv_heads", "positions", "head_dim")

        def put(a):  # pad to the bucket, as prefill's prefixes are
            padded = np.zeros(a.shape[:2] + (self.config.bucket_for(n),) + a.shape[3:], dtype)
            padded[:, :, :n] = a
            return self.plan.put(padded, axes)

        logits = self.plan.put(portable.last_logits)
        row = self._row(sampling, prompt)
        with self.compiles.track():
            first = self._results(steps.first_token_step(logits, row, cfg=self.cfg.sampler))
        return Prefix(
            kv=PrefixArrays(put(portable.k), put(portable.v), row), logits=logits, prompt_tokens=prompt, sampling=sampling,
            backend=self.name, first_token=int(first.tokens[0, 0]), to_host=self._host,
            model_id=self.model_id,
        )

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


def create_engine(*, model: Model, config: EngineConfig) -> TpuJaxEngine:
    return TpuJaxEngine(model, config)
