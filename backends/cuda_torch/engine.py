"""The cuda_torch engine: the protocol over the shared torch model and sampler.

One PyTorch program for a GPU and the CPU. The decode state owns a preallocated KV
cache for all its slots (``[layers, slots, kv_heads, max_cache_length, head_dim]``),
a batched device sampler whose per-slot parameters are installed at insert, and a
device copy of the host's slot counts. A
prompt is prefilled alone, padded to a bucket, into a scratch cache that becomes the
prefix; insert copies it into the slot's row. Every generate step runs all slots in
one forward (rows of empty slots write nothing and are ignored), samples on the
device, and packs the step's results into one int32 buffer: one host transfer per
step, started at once (pinned memory and a non-blocking copy on CUDA; on the CPU the
whole step runs on a worker thread, so the driver reads step n while step n+1 runs).

The host keeps only what it can know without a sync (which slots are live, their
lengths); the tokens stay on the device until the driver reads them. A step takes no
host data: its live mask, positions and lengths come from the device's copy of the
slot counts, which insert, free and overrides update with fill kernels or non-blocking
copies from pinned memory (``torch_common/transfer.py``), so step n+1 is queued while
step n runs (tested on the CPU with a dispatch mode that flags any host data or sync
inside a step: ``tests/test_cuda_torch_sync.py``).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch

from polyengine.engine import Capabilities, EngineBase, EngineConfig, Option, Prefix, ResultLayout, ResultTokens, SlotTable
from polyengine.errors import FallbackWarning, InsufficientMemory, InvalidRequest, UnsupportedFeature
from polyengine.hostinfo import has_bf16_units
from polyengine.models import Model
from polyengine.models.quantize import WEIGHT_MODES, has_int8_copies, int8_bytes, quantized_names, replaced_weights
from polyengine.models.config import ARCHITECTURES
from polyengine.prefix import PortablePrefix
from polyengine.sampling import SamplingParams
from polyengine.sampling.params import ENGINE_FIELDS, MAX_TOP_LOGPROBS
from polyengine.sampling.rows import row_bytes

from polyengine.backends.torch_common.model import (ATTENTION_IMPLS, CastKVCodec, StepSpec, TorchWeights, forward,
                                                   rms_norm)
from polyengine.backends.cpu.int8 import has_bf16_copies
from polyengine.backends.cpu.plan import bf16_units
from polyengine.backends.torch_common.sampling import TorchSampler
from polyengine.backends.torch_common.hostmem import release_row
from polyengine.backends.torch_common.state import SlotsInFlight, TorchSlotsEngine, host_array
from polyengine.backends.torch_common.transfer import fill_row, to_device

__all__ = ["TorchEngine", "TorchDecodeState", "create_engine"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INT8_COMPUTE = {"auto": 2, "int8x2": 2, "int8": 1, "float": 0}  # option -> int8 rows per activation row


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
        # the instruction set of the host-compiled kernels: "auto" the best this CPU runs
        # (-march=native); a lower one forced tests and measures that path on a bigger host
        # (cpu_kernels.isa_flags, docs/cuda_torch.md); one this CPU cannot execute is refused
        "isa": Option("auto", "CPU: ISA path of the host-compiled kernels", choices=("auto", "avx512", "avx2", "scalar")),
        "fused_decode": Option(True, "CPU: the whole decode step in one host-compiled call (needs cpu_kernels; Llama "
                                     "family only, other architectures use the torch forward)"),
        # CPU: a step computes the live slots' rows only (its cost follows the requests);
        # off, it runs every slot from device data as CUDA does (what tests/test_cuda_torch_sync.py probes)
        # CPU: the KV cache is an anonymous memory map, pages made as slots write them and
        # handed back when a slot is freed (torch_common/hostmem.py); "reserve" holds
        # every slot's full context from the start (torch.zeros), as on CUDA
        "kv_memory": Option("grow", "CPU: KV cache pages held as used ('grow') or all from the start ('reserve')",
                            choices=("grow", "reserve")),
        # K/V stored narrower than float32 compute (half the cache's memory and reads):
        # rounded to nearest even on write, widened on read (fused step and torch forward alike)
        "kv_dtype": Option("auto", "KV cache element type: 'auto' (the compute dtype), 'bfloat16' or 'float16'",
                           choices=("auto", "bfloat16", "float16")),
        "live_rows": Option(True, "CPU: decode only the live slots' rows (False: every slot, as on CUDA)"),
        # "int8": weight-only int8 with per-output-channel scales; "int8-block32": a scale per
        # 32 weights of a row (closer to float32); float32 accumulation either way
        "quantize": Option("", "int8 weights: 'int8' (per channel) or 'int8-block32'", choices=("", *WEIGHT_MODES)),
        # with int8 weights on the CPU: "int8" quantizes each decode product's activations to
        # int8 per 32 values and multiplies with integer dot products (VNNI / AVX2, as
        # llama.cpp's Q8_0 does); "int8x2" adds a second int8 row carrying the first's
        # rounding error (twice the integer work, float-like accuracy); "float" keeps them
        # float32 (weight-only int8, exact up to rounding); "auto" is "int8x2" where every
        # input size is a multiple of 32, else "float" (docs/cuda_torch.md)
        "int8_compute": Option("auto", "activations of int8 products on the CPU", choices=tuple(_INT8_COMPUTE)),
        # CPU, float32 compute: the projections and the LM head stored as bfloat16 (rounded
        # to nearest even once, at load; the float32 matrices are not kept), widened exactly
        # in the products: half the bytes a decode step streams, float32 arithmetic
        "weight_dtype": Option("auto", "CPU, float32 compute: projection weights stored as 'bfloat16' ('auto': the "
                                       "compute dtype)", choices=("auto", "bfloat16")),
        # with bfloat16 weights: "bf16" rounds each decode product's input rows to bfloat16
        # and multiplies pairs with AVX512-BF16's vdpbf16ps (twice float32's products per
        # instruction; the same products in float32 on paths without it); "float" keeps
        # float32 activations (exact products of the rounded weights)
        "bf16_compute": Option("float", "with weight_dtype bfloat16: decode products' activations, 'float' or "
                                        "'bf16'", choices=("float", "bf16")),
        # CPU prefill products on int8 or bfloat16 weights (more rows than the kernels take):
        # "bf16" multiplies bfloat16 operands on torch's bfloat16 GEMM (AVX512-BF16 or AMX
        # units: ~4x its float32 GEMM on this project's host), rounding activations, weights
        # (int8 ones after their scales) and products to bfloat16; "float" widens the weights
        # for the float32 GEMM; "auto" is "bf16" where decode's activations are already that
        # coarse (bf16_compute "bf16", int8_compute "int8") and the CPU has bfloat16 units
        # (paths.bf16_units: none where isa forces avx2 or scalar), else "float". Decode
        # steps are not affected.
        "prefill_compute": Option("auto", "CPU prefill products on int8/bfloat16 weights: 'float', 'bf16', or 'auto' "
                                          "(bf16 with bf16_compute=bf16 or int8_compute=int8 on a CPU with bfloat16 "
                                          "units)", choices=("auto", "float", "bf16")),
        # CPU: a prefill's causal attention (a prompt from position 0) on the host-compiled
        # kernel (csrc/prefill_attn.cpp: float32 FMAs, or bfloat16 operands on vdpbf16ps
        # where prefill's GEMMs take bfloat16 operands) instead of torch's SDPA; "auto" uses
        # it on the AVX-512 kernels, where it measured faster than SDPA, and where the
        # engine's attention is "sdpa"
        "prefill_attention": Option("auto", "CPU prefill's causal attention: 'kernel' (host-compiled), 'sdpa' "
                                            "(torch), or 'auto' (kernel on AVX-512 kernels)",
                                    choices=("auto", "kernel", "sdpa")),
        # bfloat16 weights: each layer's q/k/v (gate/up) stored as slices of one matrix, so
        # the torch forward (prefill) multiplies them in one GEMM; no memory added
        "fuse_projections": Option(True, "bfloat16 weights: q/k/v and gate/up as one matrix each for the torch "
                                         "forward's GEMMs (prefill)"),
        # CUDA: replay the decode forward as a CUDA graph per kv_len bucket (not verified on a GPU
        # in this project's CI, hence off by default; see docs/cuda_torch.md)
        "cuda_graphs": Option(False, "CUDA: replay decode steps as CUDA graphs (never run on a GPU here)"),
    }

    def __init__(self, model: Model, config: EngineConfig):
        super().__init__(model, config)
        o, device = self.options, self.torch_device
        if o["quantize"] and device.type != "cpu":
            raise UnsupportedFeature("quantize='int8' on CUDA", self.name, "int8 weights run on the CPU path only")
        if o["quantize"] and model.config.num_experts:
            raise UnsupportedFeature("quantize with a mixture-of-experts model", self.name,
                                     "int8 weights cover dense projections only")
        if o["weight_dtype"] != "auto":
            why = None
            if o["quantize"]:
                why = "int8 weights already replace the float ones; choose one of quantize and weight_dtype"
            elif device.type != "cpu":
                why = "bfloat16 weights under float32 compute run on the CPU path; on CUDA use dtype bfloat16"
            elif model.config.num_experts:
                why = "it stores dense projections only, not a mixture of experts'"
            elif self.dtype != "float32":
                why = f"it narrows float32 weights, and this engine computes in {self.dtype}; use dtype float32"
            if why:
                raise UnsupportedFeature(f"weight_dtype={o['weight_dtype']!r} here", self.name, why)
        elif o["bf16_compute"] != "float":
            raise UnsupportedFeature(f"bf16_compute={o['bf16_compute']!r} without bfloat16 weights", self.name,
                                     "it chooses the activations of bfloat16 weights' products; add "
                                     "weight_dtype='bfloat16'")
        if o["cuda_graphs"] and device.type != "cuda":
            raise UnsupportedFeature("cuda_graphs on the CPU", self.name, "CUDA graphs need a CUDA device")
        self.torch_dtype = _DTYPES[self.dtype]
        if o["isa"] != "auto":  # a forced path must run, or the row measuring it measures something else
            if device.type != "cpu" or self.torch_dtype != torch.float32 or not o["cpu_kernels"]:
                raise UnsupportedFeature(
                    f"isa={o['isa']!r} here", self.name, "the ISA path chooses the host-compiled CPU kernels, which "
                    "run on the CPU in float32 with cpu_kernels=True; drop the option or use device='cpu', "
                    "dtype float32")
            from polyengine.backends.cpu.kernels import check_isa

            check_isa(o["isa"])
        self.kv_dtype = self.torch_dtype if o["kv_dtype"] == "auto" else _DTYPES[o["kv_dtype"]]
        if self.kv_dtype != self.torch_dtype and self.torch_dtype != torch.float32:
            raise UnsupportedFeature(
                f"kv_dtype={o['kv_dtype']!r} with dtype {self.dtype}", self.name,
                "a narrower KV cache is kept for float32 compute only; use kv_dtype='auto' (the compute dtype)")
        # The forward's codec when K/V are narrower than compute: every cache, the decode
        # state's and a prefill's own (so its Prefix), stores them narrow; attention reads
        # them widened to the compute dtype.
        self._kv_codec = None if self.kv_dtype == self.torch_dtype else CastKVCodec(
            self.kv_dtype, self.kv_dtype, self.torch_dtype)
        self.sampler_dtype = torch.float64 if o["sampler_dtype"] == "float64" else torch.float32
        # the projections' weights are int8 (quantize) or bfloat16 (weight_dtype) copies, ".qweight"
        self._narrow = bool(o["quantize"]) or o["weight_dtype"] != "auto"
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
        # Why the host-compiled CPU kernels are not used, with the fix (None: they are, or
        # they do not apply: CUDA, or a dtype they do not compute).
        self.kernels_fallback: str | None = None
        if device.type == "cpu" and self.torch_dtype == torch.float32:
            if not o["cpu_kernels"]:
                self.kernels_fallback = ("option cpu_kernels=False; set cpu_kernels=True for the host-compiled "
                                         "decode kernels")
            else:
                from polyengine.backends.cpu.kernels import KernelsUnavailable, load

                try:
                    self._kernels = load(o["threads"] or None, o["isa"])
                except KernelsUnavailable as exc:
                    if o["isa"] != "auto":
                        raise UnsupportedFeature(f"isa={o['isa']!r}", self.name, str(exc)) from None
                    self.kernels_fallback = str(exc)
            if self.kernels_fallback is not None:
                message = (f"cuda_torch: decoding on torch's matmul, not the compiled CPU kernels: "
                           f"{self.kernels_fallback}")
                warnings.warn(message, FallbackWarning, stacklevel=2)
                logging.getLogger(__name__).warning(message)
        self._linear = self._cpu_linear if (self._kernels is not None or self._narrow) else None
        self._tiled = None  # the narrow product without the kernels (int8.TiledInt8Linear), made with the weights
        self.int8_activations = self._pick_int8_compute(model.config)
        # decode products of bfloat16 weights on bfloat16 activations (option bf16_compute)
        self.bf16_activations = o["bf16_compute"] == "bf16"
        if self.bf16_activations and self._kernels is None:
            raise UnsupportedFeature("bf16_compute='bf16'", self.name, "it runs in the host-compiled CPU kernels, "
                                     f"which are not used here ({self.kernels_fallback})")
        self.prefill_compute = self._pick_prefill_compute()
        # prefill's products: decode's, with the GEMM operands of option prefill_compute
        self._prefill_linear = self._linear if self._linear is None or self.prefill_compute == self.torch_dtype else (
            functools.partial(self._cpu_linear, compute=self.prefill_compute))
        # prefill's causal attention on the kernel (option prefill_attention): None (SDPA),
        # "float32" or "bfloat16" (operands, as prefill_compute's)
        self.prefill_attention = self._pick_prefill_attention(model.config)
        self._fused = None  # the FusedDecoder, built with the weights when fused_decode applies
        self._specs: dict[tuple, StepSpec] = {}  # the forward's static choices per bucket
        self._logits_buffer: torch.Tensor | None = None  # a fused step's logits, reused

    # -- construction ----------------------------------------------------------------------

    def kv_grows_with_use(self) -> bool:
        """kv_memory "grow" on a host whose cache pages come with use (hostmem.py)."""
        from polyengine.backends.torch_common.hostmem import grows_with_use

        return self.options["kv_memory"] == "grow" and grows_with_use(self.torch_device)

    @property
    def kv_itemsize(self) -> int:
        """Option kv_dtype's element size (a prefix and the decode cache keep K/V in it)."""
        kv = self.options["kv_dtype"]
        return super().kv_itemsize if kv == "auto" else _DTYPES[kv].itemsize

    def capabilities_for(self, model: Model, config: EngineConfig) -> Capabilities:
        device = self.torch_device = self._pick_device(self.options["device"])
        self.device = self._describe(device)
        dtypes = ("bfloat16", "float16", "float32") if device.type == "cuda" else ("float32",)
        if device.type == "cpu" and has_bf16_units():
            dtypes = ("float32", "bfloat16")  # bf16 matmul is fast only with AMX / AVX512-BF16
        return Capabilities(
            dtypes=dtypes, sampling_params=ENGINE_FIELDS, max_top_logprobs=MAX_TOP_LOGPROBS,
            bulk_insert=True, portable_prefix=True, prefix_reuse=True, async_results=True,
            architectures=ARCHITECTURES, token_masks=True,
        )

    def speed_paths(self) -> dict[str, str]:
        """What this engine runs on, each fallback with its reason and fix (paths.py): its
        startup log line, ``polyengine generate``'s stderr."""
        from polyengine.backends.cpu.plan import describe

        return describe(device=self.torch_device, dtype=self.torch_dtype, options=self.options,
                        kernels=self._kernels, fallback=self.kernels_fallback, int8_activations=self.int8_activations,
                        prefill_compute=self.prefill_compute, prefill_attention=self.prefill_attention)

    def _pick_int8_compute(self, config) -> int:
        """int8 rows per activation row for int8 weights (option ``int8_compute``): 0 for
        float32 activations, 1 or 2 (csrc/q8.cpp)."""
        from polyengine.backends.cpu.kernels import q8_fits

        o = self.options
        if not o["quantize"] and o["int8_compute"] != "auto":
            raise UnsupportedFeature(f"int8_compute={o['int8_compute']!r} without int8 weights", self.name,
                                     "it chooses the activations of int8 weights' products; add quantize='int8' or "
                                     "'int8-block32'")
        if not o["quantize"] or o["int8_compute"] == "float":
            return 0
        fits = self._kernels is not None and q8_fits(config, WEIGHT_MODES[o["quantize"]])
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
        """What this engine allocates, counted as it will be: on the CPU in float32 the
        Model's arrays are used as they are (nothing new); elsewhere a copy in the compute
        dtype of every weight the engine keeps float; int8 copies unless the Model already
        holds them (they are computed once per Model and mode)."""
        c, cfg = self.model.config, self.config
        item = torch.tensor([], dtype=self.torch_dtype).element_size()
        shares_host = self.torch_device.type == "cpu" and self.torch_dtype == torch.float32
        mode = self.options["quantize"]
        shapes = c.weight_shapes()
        kept = set(shapes) - (replaced_weights(c) if self._narrow else set())
        needs = {}
        if not shares_host:
            needs[f"{self.dtype} weights on {self.torch_device}"] = sum(math.prod(shapes[n]) for n in kept) * item
        if mode and not has_int8_copies(self.model, mode):
            needs[f"int8 copies of the projections and the LM head ({mode})"] = int8_bytes(c, mode)
        if self.options["weight_dtype"] == "bfloat16" and not has_bf16_copies(self.model):
            needs["bfloat16 copies of the projections and the LM head"] = sum(
                math.prod(shapes[source]) for _, source in quantized_names(c)) * 2
        needs[f"the KV cache of {cfg.max_slots} slots x {cfg.max_cache_length} positions"] = (
            cfg.max_slots * cfg.max_cache_length * c.kv_bytes_per_token(self.kv_dtype.itemsize))
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
            spec = self._specs[key] = StepSpec(attention=self.options["attention"], inplace=True, moe="sparse", **choices)
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
            mode = self.options["quantize"]
            # int8 or bfloat16 copies: the float matrices they replace are not kept (nor
            # converted); an exclusive Model releases them too (polyengine.models.quantize).
            skip = replaced_weights(self.model.config) if self._narrow else frozenset()
            weights = self._allocating("the weights", lambda: TorchWeights.from_model(
                self.model, device=self.torch_device, dtype=self.torch_dtype, max_positions=self.max_cache_length,
                skip=skip))
            if mode:
                from polyengine.backends.cpu.int8 import TiledInt8Linear, int8_tensors

                weights.tensors.update(self._allocating("int8 weights", lambda: int8_tensors(self.model, mode)))
            elif self._narrow:
                from polyengine.backends.cpu.int8 import bf16_tensors

                weights.tensors.update(self._allocating("bfloat16 weights", lambda: bf16_tensors(
                    self.model, fused=self.options["fuse_projections"])))
            if self._narrow:
                from polyengine.backends.cpu.int8 import TiledInt8Linear

                self._tiled = TiledInt8Linear()
            self._weights = weights
            # The fused step is written for the Llama family; other architectures decode
            # through the shared torch forward (its projections still on the host kernels).
            if self._kernels is not None and self.options["fused_decode"] and self.model.config.is_llama_family:
                from polyengine.backends.cpu.kernels import FusedDecoder

                self._fused = FusedDecoder(self._kernels, self._weights.tensors, self.model.config,
                                           cache_rows=self.max_concurrent_decodes, cache_len=self.max_cache_length,
                                           quantized=self._narrow,
                                           int8_activations=self.int8_activations, kv_dtype=self.kv_dtype,
                                           bf16_activations=self.bf16_activations)
            self._prefill_sampler = TorchSampler(
                self.vocab_size, 1, self.eos_token_ids, device=self.torch_device, dtype=self.sampler_dtype)
        return self._weights

    def _pick_prefill_compute(self) -> torch.dtype:
        """The operand dtype of prefill's GEMMs on narrowed weights (option prefill_compute)."""
        choice = self.options["prefill_compute"]
        if choice == "bf16" and not self._narrow:
            raise UnsupportedFeature("prefill_compute='bf16' without int8 or bfloat16 weights", self.name,
                                     "it chooses the GEMM operands of narrowed weights; add weight_dtype='bfloat16' "
                                     "or quantize, or drop the option")
        # auto: prefill's activations as precise as the decode products' (bfloat16 rows,
        # or one int8 row per 32 values: both 8 significant bits), on bfloat16 units only
        coarse = self.bf16_activations or self.int8_activations == 1
        if choice == "bf16" or (choice == "auto" and coarse and bf16_units(self.options["isa"])):
            return torch.bfloat16
        return self.torch_dtype

    def _pick_prefill_attention(self, config) -> str | None:
        """The operands of a prefill's causal attention on the host kernel (option
        prefill_attention): "bfloat16" where prefill's GEMMs take bfloat16 operands and the
        kernels have vdpbf16ps, else "float32"; None for torch's SDPA."""
        choice = self.options["prefill_attention"]
        if choice == "sdpa":
            return None
        if self._kernels is None:
            if choice == "kernel":
                why = (f"it runs in the host-compiled CPU kernels, which are not used here ({self.kernels_fallback})"
                       if self.kernels_fallback else "it runs in the host-compiled CPU kernels (CPU, float32 compute)")
                raise UnsupportedFeature("prefill_attention='kernel'", self.name, why)
            return None
        bf16 = self.prefill_compute == torch.bfloat16 and self._kernels.attention_bf16
        why = self._kernels.prefill_attention_fits(config.head_dim, bf16)
        if why is not None:
            if choice == "kernel":
                raise UnsupportedFeature("prefill_attention='kernel'", self.name, why)
            return None
        if choice == "auto" and (not self._kernels.attention_by_default or self.options["attention"] != "sdpa"):
            return None
        return "bfloat16" if bf16 else "float32"

    def _kernel_attention(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float) -> torch.Tensor:
        """StepSpec.causal_attention on the host kernel, one batch row at a time."""
        bf16 = self.prefill_attention == "bfloat16"
        b, t, nh, hd = q.shape
        rows = [self._kernels.prefill_attention(q[i], keys[i], vals[i], scale, bf16=bf16) for i in range(b)]
        return (rows[0] if b == 1 else torch.stack(rows)).reshape(b, t, nh * hd)

    def _cpu_linear(self, t: dict[str, torch.Tensor], x: torch.Tensor, name: str, *, any_rows: bool = False,
                    out: torch.Tensor | None = None, compute: torch.dtype | None = None) -> torch.Tensor:
        """A projection on the CPU: the host kernels for the few rows of a decode step (or
        for any number with ``any_rows``, writing into ``out``), torch's GEMM for prefill;
        int8 or bfloat16 weights when narrowed (widened band by band for torch's GEMM: int8.py,
        on ``compute`` operands: option prefill_compute)."""
        from polyengine.backends.cpu.kernels import MAX_ROWS

        bias = t.get(name + ".bias")
        on_kernels = self._kernels is not None and (any_rows or x.numel() // x.shape[-1] <= MAX_ROWS)
        q = t.get(name + ".qweight")
        if q is not None:
            scale = t.get(name + ".scale")  # None: bfloat16 weights
            if on_kernels:
                return self._kernels.linear(x, q, bias, scale=scale, out=out, int8_activations=self.int8_activations,
                                            bf16_activations=self.bf16_activations)
            return self._tiled(x, q, scale, bias, compute=compute)
        w = t[name + ".weight"] if name != "lm_head" else t.get("lm_head.weight", t["model.embed_tokens.weight"])
        if on_kernels and x.dtype == torch.float32:
            return self._kernels.linear(x, w, bias, out=out)
        return torch.nn.functional.linear(x, w, bias)

    @_on_engine_thread
    def init_decode_state(self) -> TorchDecodeState:
        weights = self.load_params()
        n = self.max_concurrent_decodes

        def allocate():
            k, v = weights.new_cache(n, self.max_cache_length, lazy=self.options["kv_memory"] == "grow",
                                     dtype=self.kv_dtype)
            sampler = TorchSampler(self.vocab_size, n, self.eos_token_ids, device=self.torch_device, dtype=self.sampler_dtype)
            return k, v, sampler

        k, v, sampler = self._allocating("a decode state's KV cache", allocate)
        dev = self.torch_device

        def counts(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=dev)

        return TorchDecodeState(n, k, v, sampler, counts(torch.int64), SlotTable(n), counts(torch.int64),
                                counts(torch.int64), counts(torch.bool))

    # -- prefill ---------------------------------------------------------------------------

    def _to_host(self, t: torch.Tensor) -> np.ndarray:
        return t.detach().to("cpu", torch.float32).numpy()

    def _first_token(self, logits: torch.Tensor, prompt: np.ndarray, sampling: SamplingParams,
                     token_mask: np.ndarray | None = None):
        """Sample 0's first token (step 0) from a prefix's logits, on the prefill sampler."""
        sampler = self._prefill_sampler
        sampler.install(0, sampling, prompt)
        try:
            return sampler.sample(logits[None], num_top=sampling.top_logprobs,
                                  token_mask=None if token_mask is None else token_mask[None])
        finally:
            sampler.clear(0)

    @_on_engine_thread
    @torch.no_grad()
    def prefill(self, *, params: TorchWeights, tokens, sampling: SamplingParams, existing_prefix: Prefix | None = None,
                token_mask: np.ndarray | None = None):
        toks, sampling, start = self.check_prefill(tokens, sampling, existing_prefix)
        mask = self.check_token_mask(token_mask, sampling)
        n = toks.size
        padded = self.config.bucket_for(n)
        dev = self.torch_device
        # The prefix's own cache, in the KV dtype (what the decode cache will hold, bit for
        # bit); on a Linux host a memory map of its own, so a prefix dropped (the driver's
        # prefix cache evicts them in any order) gives its pages back at once instead of
        # leaving holes in the heap that the process keeps (hostmem.py).
        k, v = params.new_cache(1, start + padded, lazy=True, dtype=self.kv_dtype)
        if existing_prefix is not None:
            k[:, 0, :, :start], v[:, 0, :, :start] = existing_prefix.kv
        batch = np.zeros((1, padded), np.int64)
        batch[0, :n] = toks
        positions = (start + torch.arange(padded, dtype=torch.int64, device=dev))[None]
        write = (torch.arange(padded, device=dev) < n)[None]
        logits, k, v = forward(
            params, self._spec(causal=start == 0, linear=self._prefill_linear, kv_codec=self._kv_codec,
                               causal_attention=self._kernel_attention if start == 0 and self.prefill_attention else None),
            to_device(batch, dev), positions, k, v,
            rows=None, write_mask=write, logits_at=torch.full((1,), n - 1, dtype=torch.int64, device=dev),
        )
        prompt = toks if existing_prefix is None else np.concatenate([existing_prefix.prompt_tokens, toks]).astype(np.int32)
        first = self._first_token(logits[0], prompt, sampling, mask)
        token = int(first.tokens[0])  # the protocol's Prefix carries it on the host
        prefix = Prefix(
            kv=(k[:, 0, :, : start + n], v[:, 0, :, : start + n]), logits=logits[0].float(), prompt_tokens=prompt,
            sampling=sampling, backend=self.name, first_token=token, to_host=self._to_host, model_id=self.model_id,
            token_mask=mask,
            nbytes=self.kv_bytes(start + padded),  # the view keeps its whole buffer alive
        )
        return prefix, ResultTokens.first_tokens(first.tokens, first.logprobs, first.top_ids, first.top_logprobs,
                                                 to_host=host_array)

    # -- insert, bulk_insert, free_resource: the kit's flow over torch_common's hooks --------

    insert = _on_engine_thread(torch.no_grad()(EngineBase.insert))
    bulk_insert = _on_engine_thread(torch.no_grad()(EngineBase.bulk_insert))
    free_resource = _on_engine_thread(EngineBase.free_resource)

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
        release_row(state.k, slot)  # kv_memory "grow": the slot's pages go back (0 bytes otherwise)
        release_row(state.v, slot)

    # -- generate --------------------------------------------------------------------------

    def generate(self, params: TorchWeights, decode_state: TorchDecodeState, *, overrides: Mapping[int, Any] | None = None,
                 token_masks: Mapping[int, np.ndarray] | None = None):
        state = decode_state
        state.wait()
        forced = self.check_overrides(overrides, state.slots.last_result)
        masks = self.check_token_masks(token_masks, state.slots.last_result, forced=forced,
                                       sampling_of=state.slots.sampling)
        words = None if masks is None else masks.words
        for slot, (_, position) in forced.items():
            state.slots.force(slot, position)
        # slot -> (token, its new prompt + completion count) for the device's copy
        forced = {slot: (token, state.slots[slot].total) for slot, (token, _) in forced.items()}
        live = state.slots.live(self.max_cache_length)
        positions = [state.slots[i].length if i in live else 0 for i in range(state.num_slots)]
        # The attended length is a host number (a static choice of the step), not a copy.
        kv_len = min(self.max_cache_length, self.options["kv_block"] * math.ceil((max(positions, default=0) + 1) / self.options["kv_block"]))
        num_top = state.sampler.max_top_logprobs
        state.slots.advance(live)  # what the host can know before the step runs: who advances, by one
        layout = ResultLayout(k=1, top_n=num_top, logprobs=True)

        def step() -> torch.Tensor:
            return self._step(params, state, forced, live, positions, kv_len, num_top, words)

        if self._worker is not None:
            state.pending = self._worker.submit(step)
            return state, ResultTokens.from_packed(state.pending, layout, to_host=lambda f: f.result().numpy())
        buf = step()
        if self.torch_device.type == "cuda":
            return state, ResultTokens.from_packed(buf, layout, start_copy=_copy_to_host_async, to_host=_finish_copy)
        return state, ResultTokens.from_packed(buf, layout, to_host=lambda t: t.numpy())

    @torch.no_grad()
    def _step(self, params, state: TorchDecodeState, forced, live, positions, kv_len, num_top,
              words: np.ndarray | None) -> torch.Tensor:
        """One decode step from device data only: the host's ``live``/``positions`` lists
        decide Python-level choices (and feed the CPU's fused kernels, where the host is
        the device), never a tensor the step reads. ``words``: the step's allowed-token
        masks (packed bits per slot), copied in like every other host input."""
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
        if live and dev.type == "cpu" and (self.options["live_rows"] or self._fused is not None):
            # The host is the device: only the live rows are computed (the fused kernel,
            # else the shared forward on those rows), so the cost follows the requests.
            tokens, logprobs, top_ids, top_lp = self._live_step(params, state, live, positions, kv_len, num_top, words)
        elif live:  # CUDA: every slot runs from device data, empty ones write nothing (no host copy, no sync)
            pos = torch.where(live_mask, state.total - 1, 0)[:, None]
            if self.options["cuda_graphs"]:
                logits = self._graph_forward(params, state, pos, live_mask[:, None], kv_len)
            else:
                logits, state.k, state.v = forward(
                    params, self._spec(kv_len=kv_len, linear=self._linear, kv_codec=self._kv_codec),
                    state.next_tokens[:, None], pos, state.k, state.v, rows=None, write_mask=live_mask[:, None],
                )
            res = state.sampler.sample(logits[:, 0], num_top=num_top, token_mask=words)
            state.sampler.record(res.tokens, mask=live_mask)
            state.next_tokens.copy_(torch.where(live_mask, res.tokens, state.next_tokens))
            tokens, logprobs, top_ids, top_lp = res.tokens, res.logprobs, res.top_ids, res.top_logprobs
        else:
            tokens = torch.zeros(n, dtype=torch.int64, device=dev)
            logprobs = torch.zeros(n, device=dev)
            top_ids = torch.zeros((n, num_top), dtype=torch.int64, device=dev)
            top_lp = torch.zeros((n, num_top), device=dev)
        state.total += live_mask  # the host's advance(live), on the device
        lengths = torch.where(state.occupied, state.total - state.prompt_len, 0)  # completion tokens
        return torch.cat([
            tokens.to(torch.int32)[:, None], live_mask.to(torch.int32)[:, None],
            lengths.to(torch.int32)[:, None],
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
            return forward(params, self._spec(kv_len=kv_len, kv_codec=self._kv_codec), state.next_tokens[:, None],
                           state.positions, state.k, state.v, rows=None, write_mask=state.live)[0]

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

    def _live_step(self, params: TorchWeights, state: TorchDecodeState, live: list[int], positions: list[int],
                   kv_len: int, num_top: int, words: torch.Tensor | None):
        """A decode step over the live rows only, so that its cost follows the live
        requests, not the slot count: the fused CPU kernel where it is built, else the
        shared forward on those rows (their cache rows gathered, unless every slot is
        live); then the sampler on those rows, the results scattered back to slot order."""
        t, n, dev = params.tensors, state.num_slots, self.torch_device
        rows = torch.tensor(live, dtype=torch.int64, device=dev)
        pos = torch.tensor([positions[i] for i in live], dtype=torch.int64, device=dev)
        if self._fused is not None:
            x = t["model.embed_tokens.weight"][state.next_tokens[rows]].contiguous()  # (M, hidden)
            self._fused.step(x, rows, pos, state.k, state.v)
            x = rms_norm(x, t["model.norm.weight"], self.model.config.rms_norm_eps)
            logits = self._head(t, x)  # (M, vocab)
        else:
            logits, state.k, state.v = forward(
                params, self._spec(kv_len=kv_len, linear=self._linear, kv_codec=self._kv_codec),
                state.next_tokens[rows][:, None], pos[:, None], state.k, state.v, rows=None if len(live) == n else rows,
            )
            logits = logits[:, 0]  # (M, vocab)
        res = state.sampler.sample(logits, rows, num_top=num_top, token_mask=None if words is None else words[rows])
        state.sampler.record(res.tokens, rows=rows)
        state.next_tokens[rows] = res.tokens

        def scatter(values: torch.Tensor) -> torch.Tensor:
            return torch.zeros((n, *values.shape[1:]), dtype=values.dtype, device=dev).index_put_((rows,), values)

        return scatter(res.tokens), scatter(res.logprobs), scatter(res.top_ids), scatter(res.top_logprobs)

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
        put = lambda a: to_device(np.ascontiguousarray(a), self.torch_device, self.kv_dtype)  # noqa: E731
        logits = to_device(np.ascontiguousarray(portable.last_logits, np.float32), self.torch_device)
        first = self._first_token(logits, prompt, sampling)
        return Prefix(
            kv=(put(portable.k), put(portable.v)), logits=logits, prompt_tokens=prompt, sampling=sampling,
            backend=self.name, first_token=int(first.tokens[0]), to_host=self._to_host, model_id=self.model_id,
            nbytes=self.kv_bytes(prompt.size),
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
