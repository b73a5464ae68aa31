"""The cuda_torch engine: the protocol over the shared torch model and sampler.

One PyTorch program for a GPU and the CPU. The decode state owns a preallocated KV
cache for all its slots (``[layers, slots, kv_heads, max_cache_length, head_dim]``)
and a batched device sampler whose per-slot parameters are installed at insert. A
prompt is prefilled alone, padded to a bucket, into a scratch cache that becomes the
prefix; insert copies it into the slot's row. Every generate step runs all slots in
one forward (rows of empty slots write nothing and are ignored), samples on the
device, and packs the step's results into one int32 buffer: one host transfer per
step, started at once (pinned memory and a non-blocking copy on CUDA; on the CPU the
whole step runs on a worker thread, so the driver reads step n while step n+1 runs).

The host keeps only what it can know without a sync (which slots are live, their
lengths); the tokens stay on the device until the driver reads them.
"""

from __future__ import annotations

import functools
import math
import subprocess
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch

from polyengine.engine import Capabilities, EngineBase, EngineConfig, Option, Prefix, ResultLayout, ResultTokens, SlotTable
from polyengine.errors import InsufficientMemory, InvalidRequest, UnsupportedFeature
from polyengine.hostinfo import has_bf16_units
from polyengine.models import Model
from polyengine.prefix import PortablePrefix
from polyengine.sampling import SamplingParams
from polyengine.sampling.params import ENGINE_FIELDS, MAX_TOP_LOGPROBS
from polyengine.sampling.rows import row_bytes

from polyengine.backends.torch_common.model import ATTENTION_IMPLS, StepSpec, TorchWeights, forward, rms_norm
from polyengine.backends.torch_common.sampling import TorchSampler
from polyengine.backends.torch_common.state import SlotsInFlight, TorchSlotsEngine, host_array

__all__ = ["TorchEngine", "TorchDecodeState", "create_engine"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_QUANTIZE = {"": None, "int8": 0, "int8-block32": 32}  # option -> weights per scale (0: a whole row)
_INT8_COMPUTE = {"auto": 2, "int8x2": 2, "int8": 1, "float": 0}  # option -> int8 rows per activation row


@dataclass
class TorchDecodeState(SlotsInFlight):
    num_slots: int
    k: torch.Tensor  # (layers, slots, kv_heads, max_cache_length, head_dim)
    v: torch.Tensor
    sampler: TorchSampler
    next_tokens: torch.Tensor  # (slots,) int64 on the device: what each slot feeds next
    slots: SlotTable  # the host's count: prompt and completion per slot, what a step can know without a sync
    pending: Future | None = None  # the step running on the worker thread (CPU async mode)
    graphs: dict = field(default_factory=dict)  # CUDA: kv_len -> (graph, static logits), over this state's buffers
    positions: torch.Tensor | None = None  # CUDA graphs: static (slots, 1) input buffers
    live: torch.Tensor | None = None


def _on_engine_thread(method):
    """Run an engine method on the step worker thread when there is one.

    torch's CPU ops run on OpenMP, and libgomp keeps a thread team per calling thread:
    once the caller's thread and the step worker both have one, it counts more threads
    than cores and puts idle team threads to sleep, so every parallel op pays futex
    wake-ups (~1 ms a step at batch 1 in the sampler's ops). With every torch call on one
    thread there is one team, which spins between ops as it should."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self._worker is None or threading.current_thread() is self._worker_thread:
            return method(self, *args, **kwargs)
        return self._worker.submit(method, self, *args, **kwargs).result()

    return run


class TorchEngine(TorchSlotsEngine, EngineBase):
    name = "cuda_torch"
    OPTIONS = {
        "device": Option("", "'' picks cuda:0 where a GPU is visible, else the CPU; or 'cuda[:N]' / 'cpu'"),
        "attention": Option("sdpa", "attention implementation", choices=ATTENTION_IMPLS),
        "async_steps": Option(True, "CPU: run each step on a worker thread (results read later)"),
        "kv_block": Option(64, "attention reads the cache up to the longest slot, rounded up to this", minimum=1),
        "sampler_dtype": Option("float32", "float64 for bit-for-bit greedy ties with the reference",
                                choices=("float32", "float64")),
        "threads": Option(0, "CPU intra-op threads (0: torch's default)", minimum=0),
        "cpu_kernels": Option(True, "CPU: decode products through the host-compiled kernels (cpu_kernels.py)"),
        "fused_decode": Option(True, "CPU: the whole decode step in one host-compiled call (needs cpu_kernels)"),
        # "int8": weight-only int8 with per-output-channel scales; "int8-block32": a scale per
        # 32 weights of a row (closer to float32); float32 accumulation either way
        "quantize": Option("", "int8 weights: 'int8' (per channel) or 'int8-block32'", choices=tuple(_QUANTIZE)),
        # with int8 weights on the CPU: "int8" quantizes each decode product's activations to
        # int8 per 32 values and multiplies with integer dot products (VNNI / AVX2, as
        # llama.cpp's Q8_0 does); "int8x2" adds a second int8 row carrying the first's
        # rounding error (twice the integer work, float-like accuracy); "float" keeps them
        # float32 (weight-only int8, exact up to rounding); "auto" is "int8x2" where every
        # input size is a multiple of 32, else "float" (docs/cuda_torch.md)
        "int8_compute": Option("auto", "activations of int8 products on the CPU", choices=tuple(_INT8_COMPUTE)),
        # CUDA: replay the decode forward as a CUDA graph per kv_len bucket (not verified on a GPU
        # in this project's CI, hence off by default; see docs/cuda_torch.md)
        "cuda_graphs": Option(False, "CUDA: replay decode steps as CUDA graphs (never run on a GPU here)"),
    }

    def __init__(self, model: Model, config: EngineConfig):
        super().__init__(model, config)
        o, device = self.options, self.torch_device
        if o["quantize"] and device.type != "cpu":
            raise UnsupportedFeature("quantize='int8' on CUDA", self.name, "int8 weights run on the CPU path only")
        if o["cuda_graphs"] and device.type != "cuda":
            raise UnsupportedFeature("cuda_graphs on the CPU", self.name, "CUDA graphs need a CUDA device")
        self.torch_dtype = _DTYPES[self.dtype]
        self.sampler_dtype = torch.float64 if o["sampler_dtype"] == "float64" else torch.float32
        self._check_memory()
        if o["threads"] and device.type == "cpu":
            torch.set_num_threads(o["threads"])
        # CPU: a worker thread runs the steps, so the caller reads step n while n+1 runs, and
        # every other torch call of the engine too (see _on_engine_thread).
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="cuda_torch-step") if (
            device.type == "cpu" and o["async_steps"]) else None
        self._worker_thread = self._worker.submit(threading.current_thread).result() if self._worker else None
        self._weights: TorchWeights | None = None
        self._prefill_sampler: TorchSampler | None = None
        self._kernels = None
        if device.type == "cpu" and o["cpu_kernels"] and self.torch_dtype == torch.float32:
            from polyengine.backends.cuda_torch.cpu_kernels import load

            try:
                self._kernels = load(o["threads"] or None)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                warnings.warn(f"cuda_torch: the CPU kernels are unavailable ({exc}); using torch's matmul", stacklevel=2)
        self._linear = self._cpu_linear if (self._kernels is not None or o["quantize"]) else None
        self.int8_activations = self._pick_int8_compute(model.config)
        self._fused = None  # the FusedDecoder, built with the weights when fused_decode applies
        self._specs: dict[tuple, StepSpec] = {}  # the forward's static choices per bucket
        self._logits_buffer: torch.Tensor | None = None  # a fused step's logits, reused

    # -- construction ----------------------------------------------------------------------

    def capabilities_for(self, model: Model, config: EngineConfig) -> Capabilities:
        device = self.torch_device = self._pick_device(self.options["device"])
        self.device = self._describe(device)
        dtypes = ("bfloat16", "float16", "float32") if device.type == "cuda" else ("float32",)
        if device.type == "cpu" and has_bf16_units():
            dtypes = ("float32", "bfloat16")  # bf16 matmul is fast only with AMX / AVX512-BF16
        return Capabilities(
            dtypes=dtypes, sampling_params=ENGINE_FIELDS, max_top_logprobs=MAX_TOP_LOGPROBS,
            bulk_insert=True, portable_prefix=True, prefix_reuse=True, async_results=True,
        )

    def _pick_int8_compute(self, config) -> int:
        """int8 rows per activation row for int8 weights (option ``int8_compute``): 0 for
        float32 activations, 1 or 2 (kernels/q8.cpp)."""
        from polyengine.backends.cuda_torch.cpu_kernels import q8_fits

        o = self.options
        if not o["quantize"] or o["int8_compute"] == "float":
            return 0
        fits = self._kernels is not None and q8_fits(config, _QUANTIZE[o["quantize"]])
        if o["int8_compute"] != "auto" and not fits:
            why = ("the CPU kernels are off or unavailable" if self._kernels is None else
                   "it needs hidden, intermediate and heads x head_dim sizes that are multiples of 32")
            raise UnsupportedFeature(f"int8_compute={o['int8_compute']!r}", self.name, why)
        return _INT8_COMPUTE[o["int8_compute"]] if fits else 0

    @staticmethod
    def _pick_device(name: str) -> torch.device:
        if name:
            try:
                device = torch.device(name)
            except RuntimeError as exc:
                raise InvalidRequest(f"option device={name!r} is not a torch device ({exc})") from None
            if device.type == "cuda" and not torch.cuda.is_available():
                raise InvalidRequest(f"option device={name!r}: CUDA is not available here")
            if device.type not in ("cuda", "cpu"):
                raise InvalidRequest(f"option device={name!r}: cuda_torch runs on 'cuda[:N]' or 'cpu'")
            return device
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")

    @staticmethod
    def _describe(device: torch.device) -> str:
        if device.type == "cuda":
            index = device.index or 0
            return f"cuda:{index} ({torch.cuda.get_device_name(index)}, CUDA {torch.version.cuda})"
        return f"cpu ({torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()})"

    def _check_memory(self) -> None:
        c, cfg = self.model.config, self.config
        item = torch.tensor([], dtype=self.torch_dtype).element_size()
        shares_host = self.torch_device.type == "cpu" and self.torch_dtype == torch.float32
        needs = {}
        if not shares_host:  # on the CPU in float32 the Model's arrays are used as they are
            needs[f"{self.dtype} weights on {self.torch_device}"] = c.num_parameters() * item
        if self.options["quantize"]:
            needs["int8 copies of the projection weights"] = c.num_parameters()
        needs[f"the KV cache of {cfg.max_slots} slots x {cfg.max_cache_length} positions"] = (
            cfg.max_slots * cfg.max_cache_length * c.kv_bytes_per_token(item))
        needs["the sampler's per-slot tables and a step's logits"] = (
            cfg.max_slots * row_bytes(c.vocab_size, self.sampler_dtype.itemsize) + cfg.max_prefill_length * (c.vocab_size + 4 * c.intermediate_size) * 4)
        if self.torch_device.type == "cuda":
            free = torch.cuda.mem_get_info(self.torch_device)[0]
            self.check_memory(needs, where=f"{self.torch_device} memory", available=free)
        else:
            self.check_memory(needs)

    def _spec(self, **choices: Any) -> StepSpec:
        """The forward's static choices for one bucket, built once and kept: the
        engine's attention, in-place cache writes, and ``choices`` (kv_len, causal,
        linear)."""
        key = tuple(sorted(choices.items(), key=lambda kv: kv[0]))
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = StepSpec(attention=self.options["attention"], inplace=True, **choices)
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

    @_on_engine_thread
    def load_params(self) -> TorchWeights:
        if self._weights is None:
            self._weights = self._allocating("the weights", lambda: TorchWeights.from_model(
                self.model, device=self.torch_device, dtype=self.torch_dtype, max_positions=self.max_cache_length))
            if self.options["quantize"]:
                group = _QUANTIZE[self.options["quantize"]]
                self._allocating("int8 weights", lambda: self._quantize(self._weights.tensors, group))
            if self._kernels is not None and self.options["fused_decode"]:
                from polyengine.backends.cuda_torch.cpu_kernels import FusedDecoder

                self._fused = FusedDecoder(self._kernels, self._weights.tensors, self.model.config,
                                           cache_rows=self.max_concurrent_decodes, cache_len=self.max_cache_length,
                                           quantized=bool(self.options["quantize"]),
                                           int8_activations=self.int8_activations)
            self._prefill_sampler = TorchSampler(
                self.vocab_size, 1, self.eos_token_ids, device=self.torch_device, dtype=self.sampler_dtype)
        return self._weights

    @staticmethod
    def _quantize(tensors: dict[str, torch.Tensor], group: int) -> None:
        """Add ``<name>.qweight`` (int8) and ``<name>.scale`` for every projection and the
        LM head; the float weights stay (on the CPU they are the Model's own arrays).
        A matrix whose rows do not divide into groups gets per-channel scales."""
        from polyengine.backends.cuda_torch.cpu_kernels import quantize_int8

        names = [n[: -len(".weight")] for n in tensors if n.endswith("_proj.weight")]
        head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
        for name, w in [(n, tensors[n + ".weight"]) for n in names] + [("lm_head", head)]:
            g = group if group and w.shape[1] % group == 0 else 0
            tensors[name + ".qweight"], tensors[name + ".scale"] = quantize_int8(w, g)

    def _cpu_linear(self, t: dict[str, torch.Tensor], x: torch.Tensor, name: str, *, any_rows: bool = False,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """A projection on the CPU: the host kernels for the few rows of a decode step (or
        for any number with ``any_rows``, writing into ``out``), torch's GEMM for prefill;
        int8 weights when quantized (dequantized for a GEMM)."""
        from polyengine.backends.cuda_torch.cpu_kernels import MAX_ROWS, dequantize_int8

        bias = t.get(name + ".bias")
        on_kernels = self._kernels is not None and (any_rows or x.numel() // x.shape[-1] <= MAX_ROWS)
        q = t.get(name + ".qweight")
        if q is not None:
            scale = t[name + ".scale"]
            if on_kernels:
                return self._kernels.linear(x, q, bias, scale=scale, out=out, int8_activations=self.int8_activations)
            return torch.nn.functional.linear(x, dequantize_int8(q, scale), bias)
        w = t[name + ".weight"] if name != "lm_head" else t.get("lm_head.weight", t["model.embed_tokens.weight"])
        if on_kernels and x.dtype == torch.float32:
            return self._kernels.linear(x, w, bias, out=out)
        return torch.nn.functional.linear(x, w, bias)

    @_on_engine_thread
    def init_decode_state(self) -> TorchDecodeState:
        weights = self.load_params()
        n = self.max_concurrent_decodes

        def allocate():
            k, v = weights.new_cache(n, self.max_cache_length)
            sampler = TorchSampler(self.vocab_size, n, self.eos_token_ids, device=self.torch_device, dtype=self.sampler_dtype)
            return k, v, sampler

        k, v, sampler = self._allocating("a decode state's KV cache", allocate)
        return TorchDecodeState(n, k, v, sampler, torch.zeros(n, dtype=torch.int64, device=self.torch_device), SlotTable(n))

    # -- prefill ---------------------------------------------------------------------------

    def _to_host(self, t: torch.Tensor) -> np.ndarray:
        return t.detach().to("cpu", torch.float32).numpy()

    def _first_token(self, logits: torch.Tensor, prompt: np.ndarray, sampling: SamplingParams):
        """Sample 0's first token (step 0) from a prefix's logits, on the prefill sampler."""
        sampler = self._prefill_sampler
        sampler.install(0, sampling, prompt)
        try:
            return sampler.sample(logits[None], num_top=sampling.top_logprobs)
        finally:
            sampler.clear(0)

    @_on_engine_thread
    @torch.no_grad()
    def prefill(self, *, params: TorchWeights, tokens, sampling: SamplingParams, existing_prefix: Prefix | None = None):
        toks, sampling, start = self.check_prefill(tokens, sampling, existing_prefix)
        n = toks.size
        padded = self.config.bucket_for(n)
        dev = self.torch_device
        k, v = params.new_cache(1, start + padded)
        if existing_prefix is not None:
            k[:, 0, :, :start], v[:, 0, :, :start] = existing_prefix.kv
        batch = torch.zeros((1, padded), dtype=torch.int64)
        batch[0, :n] = torch.from_numpy(toks.astype(np.int64))
        positions = (start + torch.arange(padded, dtype=torch.int64))[None]
        write = (torch.arange(padded) < n)[None]
        logits, k, v = forward(
            params, self._spec(causal=start == 0, linear=self._linear), batch.to(dev), positions.to(dev), k, v,
            rows=None, write_mask=write.to(dev), logits_at=torch.tensor([n - 1], device=dev),
        )
        prompt = toks if existing_prefix is None else np.concatenate([existing_prefix.prompt_tokens, toks]).astype(np.int32)
        first = self._first_token(logits[0], prompt, sampling)
        token = int(first.tokens[0])  # the protocol's Prefix carries it on the host
        prefix = Prefix(
            kv=(k[:, 0, :, : start + n], v[:, 0, :, : start + n]), logits=logits[0].float(), prompt_tokens=prompt,
            sampling=sampling, backend=self.name, first_token=token, to_host=self._to_host, model_id=self.model_id,
        )
        return prefix, ResultTokens.first_tokens(first.tokens, first.logprobs, first.top_ids, first.top_logprobs,
                                                 to_host=host_array)

    # -- insert, bulk_insert, free_resource: the kit's flow over torch_common's hooks --------

    insert = _on_engine_thread(torch.no_grad()(EngineBase.insert))
    bulk_insert = _on_engine_thread(torch.no_grad()(EngineBase.bulk_insert))
    free_resource = _on_engine_thread(EngineBase.free_resource)

    def _installed(self, state: TorchDecodeState, slots: list[int], first: torch.Tensor, prefix: Prefix) -> None:
        state.next_tokens[torch.tensor(slots, dtype=torch.int64, device=self.torch_device)] = first

    # -- generate --------------------------------------------------------------------------

    def generate(self, params: TorchWeights, decode_state: TorchDecodeState, *, overrides: Mapping[int, Any] | None = None):
        state = decode_state
        state.wait()
        forced = self.check_overrides(overrides, state.slots.last_result)
        for slot, (_, position) in forced.items():
            state.slots.force(slot, position)
        live = state.slots.live(self.max_cache_length)
        positions = [state.slots[i].length if i in live else 0 for i in range(state.num_slots)]
        kv_len = min(self.max_cache_length, self.options["kv_block"] * math.ceil((max(positions, default=0) + 1) / self.options["kv_block"]))
        num_top = state.sampler.max_top_logprobs
        state.slots.advance(live)  # what the host can know before the step runs: who advances, by one
        lengths = state.slots.lengths()
        layout = ResultLayout(k=1, top_n=num_top, logprobs=True)

        def step() -> torch.Tensor:
            return self._step(params, state, forced, live, positions, lengths, kv_len, num_top)

        if self._worker is not None:
            state.pending = self._worker.submit(step)
            return state, ResultTokens.from_packed(state.pending, layout, to_host=lambda f: f.result().numpy())
        buf = step()
        if self.torch_device.type == "cuda":
            return state, ResultTokens.from_packed(buf, layout, start_copy=_copy_to_host_async, to_host=_finish_copy)
        return state, ResultTokens.from_packed(buf, layout, to_host=lambda t: t.numpy())

    @torch.no_grad()
    def _step(self, params, state: TorchDecodeState, forced, live, positions, lengths, kv_len, num_top) -> torch.Tensor:
        dev, n = self.torch_device, state.num_slots
        if forced:
            rows = torch.tensor(list(forced), dtype=torch.int64, device=dev)
            tokens = torch.tensor([t for t, _ in forced.values()], dtype=torch.int64, device=dev)
            state.sampler.override(tokens, rows=rows)
            state.next_tokens[rows] = tokens
        live_mask = torch.zeros(n, dtype=torch.bool)
        live_mask[live] = True
        live_mask = live_mask.to(dev)
        if live and self._fused is not None:
            tokens, logprobs, top_ids, top_lp = self._fused_step(params, state, live, positions, num_top)
        elif live:
            pos = torch.tensor(positions, dtype=torch.int64, device=dev)[:, None]
            if self.options["cuda_graphs"]:
                logits = self._graph_forward(params, state, pos, live_mask[:, None], kv_len)
            else:
                logits, state.k, state.v = forward(
                    params, self._spec(kv_len=kv_len, linear=self._linear), state.next_tokens[:, None], pos, state.k,
                    state.v, rows=None, write_mask=live_mask[:, None],
                )
            res = state.sampler.sample(logits[:, 0], num_top=num_top)
            state.sampler.record(res.tokens, mask=live_mask)
            state.next_tokens.copy_(torch.where(live_mask, res.tokens, state.next_tokens))
            tokens, logprobs, top_ids, top_lp = res.tokens, res.logprobs, res.top_ids, res.top_logprobs
        else:
            tokens = torch.zeros(n, dtype=torch.int64, device=dev)
            logprobs = torch.zeros(n, device=dev)
            top_ids = torch.zeros((n, num_top), dtype=torch.int64, device=dev)
            top_lp = torch.zeros((n, num_top), device=dev)
        return torch.cat([
            tokens.to(torch.int32)[:, None], live_mask.to(torch.int32)[:, None],
            torch.tensor(lengths, dtype=torch.int32, device=dev)[:, None],
            logprobs.to(torch.float32).view(torch.int32)[:, None], top_ids.to(torch.int32),
            top_lp.to(torch.float32).contiguous().view(torch.int32),
        ], dim=1)

    def _graph_forward(self, params: TorchWeights, state: TorchDecodeState, pos: torch.Tensor, live: torch.Tensor,
                       kv_len: int) -> torch.Tensor:
        """The decode forward replayed from a CUDA graph captured per kv_len bucket over
        this state's static buffers (tokens, positions, live mask, caches): one launch
        instead of ~50 kernels a layer. The first use of a bucket runs the step eagerly
        twice (idempotent: same inputs, same cache writes) before capturing it."""
        if state.positions is None:
            state.positions, state.live = torch.zeros_like(pos), torch.zeros_like(live)
        state.positions.copy_(pos)
        state.live.copy_(live)

        def run() -> torch.Tensor:
            return forward(params, self._spec(kv_len=kv_len), state.next_tokens[:, None], state.positions, state.k,
                           state.v, rows=None, write_mask=state.live)[0]

        entry = state.graphs.get(kv_len)
        if entry is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    run()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = run()
            entry = state.graphs[kv_len] = (graph, logits)
        graph, logits = entry
        graph.replay()
        return logits

    def _fused_step(self, params: TorchWeights, state: TorchDecodeState, live: list[int], positions: list[int], num_top: int):
        """The CPU decode step through the fused kernel: only the live rows are computed,
        then the final norm, the LM head and the sampler (rows addressed by slot)."""
        t, n = params.tensors, state.num_slots
        rows = torch.tensor(live, dtype=torch.int64)
        x = t["model.embed_tokens.weight"][state.next_tokens[rows]].contiguous()  # (M, hidden)
        self._fused.step(x, rows, torch.tensor([positions[i] for i in live]), state.k, state.v)
        x = rms_norm(x, t["model.norm.weight"], self.model.config.rms_norm_eps)
        logits = self._head(t, x)  # (M, vocab)
        res = state.sampler.sample(logits, rows, num_top=num_top)
        state.sampler.record(res.tokens, rows=rows)
        state.next_tokens[rows] = res.tokens
        tokens = torch.zeros(n, dtype=torch.int64).index_put_((rows,), res.tokens)
        logprobs = torch.zeros(n, dtype=res.logprobs.dtype).index_put_((rows,), res.logprobs)
        top_ids = torch.zeros((n, res.top_ids.shape[1]), dtype=torch.int64).index_put_((rows,), res.top_ids)
        top_lp = torch.zeros((n, res.top_logprobs.shape[1]), dtype=res.top_logprobs.dtype).index_put_((rows,), res.top_logprobs)
        return tokens, logprobs, top_ids, top_lp

    def _head(self, t: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The LM head of a fused decode step: the host kernels at any row count (at 32
        rows they measured ~1.5x torch's GEMM on this shape), into a reused buffer."""
        if self._logits_buffer is None or self._logits_buffer.numel() < x.shape[0] * self.vocab_size:
            self._logits_buffer = torch.empty(x.shape[0] * self.vocab_size, dtype=torch.float32)
        return self._cpu_linear(t, x, "lm_head", any_rows=True, out=self._logits_buffer)

    # -- portable prefixes ---------------------------------------------------------------

    @_on_engine_thread
    def export_prefix(self, prefix: Prefix) -> PortablePrefix:
        self.check_prefix(prefix)
        k, v = prefix.kv
        return PortablePrefix(
            k=self._to_host(k), v=self._to_host(v), prompt_tokens=prefix.prompt_tokens,
            last_logits=self._to_host(prefix.logits), sampling=prefix.sampling, model_fingerprint=self.model.fingerprint,
        )

    @_on_engine_thread
    @torch.no_grad()
    def import_prefix(self, portable: PortablePrefix) -> Prefix:
        prompt, sampling = self.check_portable(portable)
        self.load_params()
        put = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.torch_device, self.torch_dtype)  # noqa: E731
        logits = torch.from_numpy(portable.last_logits).to(self.torch_device, torch.float32)
        first = self._first_token(logits, prompt, sampling)
        return Prefix(
            kv=(put(portable.k), put(portable.v)), logits=logits, prompt_tokens=prompt, sampling=sampling,
            backend=self.name, first_token=int(first.tokens[0]), to_host=self._to_host, model_id=self.model_id,
        )


def _copy_to_host_async(buf: torch.Tensor):
    """Start the device-to-host copy of a step's packed results (pinned, non-blocking)."""
    host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
    host.copy_(buf, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def _finish_copy(handle) -> np.ndarray:
    host, done = handle
    done.synchronize()
    return host.numpy()


def create_engine(*, model: Model, config: EngineConfig) -> TorchEngine:
    return TorchEngine(model, config)
