"""The cpu backend's choices, resolved once: :class:`CpuPlan`.

Every choice the engine runs (the compute and KV dtypes, the ISA path and whether the
host-compiled kernels load, the fused decode step, the weight format, the activations of
narrowed products, prefill's GEMM operands and attention, how the KV cache's memory is
held) is made here, from the checked options, the model and the host, and kept in one
frozen record. The engine runs the record; :meth:`CpuPlan.describe` puts it into words
(the engine's startup line, ``polyengine generate``'s stderr, ``polyengine backends
--verbose``). Nothing else derives a choice: a reader that needs one reads the plan.
This is ggml's rule for its CPU backend: variants picked by what the host runs, a plan
resolved once and only described afterwards.

Every refusal (an option that cannot apply with the others, or on this host) is an
:class:`~polyengine.errors.UnsupportedFeature` raised here, naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from polyengine.errors import InvalidRequest, UnsupportedFeature
from polyengine.hostinfo import cpu_flags, cpu_model, has_bf16_units, runnable_isas
from polyengine.models.quantize import WEIGHT_MODES, group_of, quantized_names

from polyengine.backends.cpu.blocks import KERNEL_FORMATS
from polyengine.backends.cpu.kernels import (_NAMES, MAX_ROWS, TILED_FUSED_PREFILL_ROWS, CpuKernels, KernelsUnavailable,
                                             check_isa, load, q8_fits)
from polyengine.backends.torch_common.hostmem import THP_SETTING, huge_pages_available, transparent_huge_pages

__all__ = ["CpuHost", "CpuPlan", "diagnose", "INT8_COMPUTE"]

BACKEND = "cpu"
INT8_COMPUTE = {"auto": 2, "int8x2": 2, "int8": 1, "float": 0}  # option -> int8 rows per activation row
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CpuHost:
    """What the plan needs to know of the host: the CPU's name and ISA flags, whether it
    has bfloat16 units (AMX or AVX512-BF16), the kernel ISA paths it executes."""

    model: str
    flags: frozenset[str]
    bf16_units: bool
    runnable: tuple[str, ...]

    @classmethod
    def detect(cls) -> "CpuHost":
        return cls(cpu_model(), cpu_flags(), has_bf16_units(), runnable_isas())

    def describe(self) -> str:
        flags = [f for f in _ISA_FLAGS if f in self.flags]
        return f"{self.model}; {' '.join(flags) or 'no AVX2'}; torch capability {torch.backends.cpu.get_cpu_capability()}"


@dataclass(frozen=True)
class CpuPlan:
    """One engine's resolved choices (or, with ``model`` None at resolve, the defaults'
    on this host: ``polyengine backends --verbose``)."""

    host: CpuHost
    dtype: torch.dtype  # compute
    kv_dtype: torch.dtype
    threads: int  # intra-op threads (0: torch's default)
    async_steps: bool  # steps on a worker thread
    kv_memory: str  # "grow" | "reserve"
    isa: str  # the requested ISA path ("auto" or forced)
    kernels: CpuKernels | None  # the host-compiled library, None where not used
    kernels_fallback: str | None  # why not, with the fix (None: used, or not applicable to this dtype)
    fused_decode: bool  # the whole decode step in one kernel call
    fused_prefill: bool  # prefills of up to 16 tokens as one fused call (with fused_decode)
    dynamic_split: bool  # the fused step's products shared by chunks that threads done early take on
    barrier_yield: int  # in fused steps of at most this many rows a thread waiting at a barrier yields first
    unfused_why: str | None  # why not, where the kernels are used (None: fused, or no kernels)
    live_rows: bool  # a decode step computes the live slots' rows only
    weights: str  # "" (the compute dtype), "int8", "int8-block32" or "bfloat16"
    block_weights: tuple[str, ...]  # weights kept in the file's GGUF blocks (csrc/gguf.h)
    block_formats: str  # their formats in words ("Q4_K x 7, Q6_K x 2"), "" without any
    block_activations: int  # int8 rows per activation row of block products (0: float32 bands)
    repack: bool  # decode products on the block weights repacked sixteen rows interleaved (csrc/packed.h)
    repack_kept: tuple[str, ...]  # with repack: formats left in the file's layout (repack_weights "auto")
    huge_pages: bool  # with repack: the repacked copy in transparent huge pages (option huge_pages)
    # repacked matrices against one int8 row (int8_compute=int8) multiply on the packed
    # groups at every row count, prefill's too: faster than int16 tiles there (docs/cpu.md,
    # "Batch-1 decode on interleaved rows"); with int8x2 tiles are, from TILE_ROWS rows
    packed_rows: bool
    fuse_projections: bool  # bfloat16 weights: q/k/v and gate/up as one matrix each
    int8_activations: int  # int8 rows per activation row of int8 products (0: float32)
    bf16_activations: bool  # bfloat16 weights' decode products on bfloat16 activations
    prefill_compute: torch.dtype  # the operands of prefill's GEMMs on narrowed weights
    block_tiles: bool  # prefill's products on block weights on int16 tiles (csrc/tile.h), not bands into the GEMM
    prefill_attention: str | None  # "float32"/"bfloat16" on the host kernel, None for torch's SDPA
    for_model: bool = True  # False: resolved without a model (the defaults' description)
    page_size: int = 0  # K/V in pages of this many positions (0: a contiguous row per slot)
    repack_declined: str = ""  # why repack_weights "auto" kept the file's layout after all (CpuEngine._check_memory)

    def packs(self, fmt: str) -> bool:
        """Whether block matrices of format ``fmt`` are repacked (where the kernels take their shape)."""
        return self.repack and fmt not in self.repack_kept

    # -- resolution --------------------------------------------------------------------

    @classmethod
    def resolve(cls, options: Mapping[str, Any], model: Any, host: CpuHost, *, dtype: torch.dtype) -> "CpuPlan":
        """The plan for checked ``options`` on ``model`` (a Model or None) and ``host``,
        computing in ``dtype``. Loads (compiling on first use) the kernels it picks."""
        o, config = options, None if model is None else model.config
        weights = _weights(o, config, dtype)
        kv_dtype = _kv_dtype(o, dtype)
        kernels, fallback = _kernels(o, dtype)
        if o["bf16_compute"] == "bf16" and kernels is None:
            raise UnsupportedFeature("bf16_compute='bf16'", BACKEND, "it runs in the host-compiled CPU kernels, "
                                     f"which are not used here ({fallback or 'the kernels compute float32'})")
        blocks = _block_weights(model, dtype, weights)
        int8_activations = _int8_activations(o, config, kernels, bool(blocks))
        block_activations = _block_activations(o, kernels, blocks)
        bf16_activations = o["bf16_compute"] == "bf16"
        # Block weights on int16 tiles: prefill's activations are int16 whatever decode's are
        # (tiles are as precise as int8x2, so one int8 row in decode asks for no bfloat16 GEMM)
        tiles = kernels is not None and kernels.gguf_tiles and bool(blocks)
        prefill_compute = _prefill_compute(o, host, dtype, weights or ("blocks" if blocks else ""), bf16_activations,
                                           int8_activations or (0 if tiles else block_activations))
        block_tiles = _block_tiles(o, kernels, blocks, prefill_compute, dtype, block_activations)
        repack, kept = _repack(o, kernels, model, blocks, block_activations)
        huge_pages = _huge_pages(o, repack)
        formats = _formats(model, blocks)
        packed_rows = repack and not kept and block_activations == 1 and o["prefill_compute"] == "auto"
        unfused_why = None if kernels is None else _unfused_why(o, config, weights, blocks, block_activations)
        return cls(
            host=host, dtype=dtype, kv_dtype=kv_dtype, threads=o["threads"], async_steps=o["async_steps"],
            kv_memory=o["kv_memory"], isa=o["isa"], kernels=kernels, kernels_fallback=fallback,
            fused_decode=kernels is not None and unfused_why is None, unfused_why=unfused_why,
            fused_prefill=kernels is not None and unfused_why is None and o["fused_prefill"],
            dynamic_split=o["dynamic_split"], barrier_yield=o["barrier_yield"],
            live_rows=o["live_rows"], weights=weights, block_weights=blocks, block_formats=formats,
            block_activations=block_activations, repack=repack, repack_kept=kept, huge_pages=huge_pages,
            packed_rows=packed_rows,
            fuse_projections=o["fuse_projections"],
            int8_activations=int8_activations, bf16_activations=bf16_activations, prefill_compute=prefill_compute,
            block_tiles=block_tiles, prefill_attention=_prefill_attention(o, config, kernels, fallback, prefill_compute),
            for_model=model is not None, page_size=o.get("page_size", 0),
        )

    @property
    def narrow(self) -> bool:
        """The projections' weights are int8 or bfloat16 copies (``.qweight`` tensors)."""
        return bool(self.weights)

    # -- description -------------------------------------------------------------------

    def describe(self) -> dict[str, str]:
        """The plan in words a user can act on; every fallback names its reason and fix."""
        k = self.kernels
        out = {"device": f"cpu ({torch.get_num_threads()} threads)", "cpu": self.host.describe()}
        if self.dtype != torch.float32:
            out["decode"] = f"the shared torch forward in {_name(self.dtype)} (the CPU kernels are float32)"
        elif k is not None:
            out["decode"] = ("fused step: every layer of the live rows in one host-compiled call (csrc/decode.h); "
                             + ("its products shared by chunks, a thread done early taking the other's (option "
                                "dynamic_split)" if self.dynamic_split else "fixed shares of its products (option "
                                "dynamic_split=False)")
                             + (f"; in steps of up to {self.barrier_yield} rows a thread waiting at a phase's barrier "
                                "yields its core first (option barrier_yield)" if self.barrier_yield else
                                "; its barriers spin (option barrier_yield=0)")
                             if self.fused_decode else "the shared torch forward, products on the host-compiled "
                             f"kernels ({self.unfused_why})")
            how = ("auto: the best this CPU runs, -march=native" if k.requested == "auto" else
                   f"forced by option isa, {' '.join(k.flags) or 'the compiler default'}")
            out["isa"] = (f"{k.isa} ({how}; int8 products on {k.q8_isa}; others here: option "
                          f"isa={'/'.join(self.host.runnable)})")
            out["kernels"] = f"compiled for this CPU ({k.vector_width}-float vectors): {k.path}"
        else:
            out["decode"] = "the shared torch forward on torch's matmul (FALLBACK)"
            out["kernels"] = f"not used: {self.kernels_fallback}"
        out["int8"] = self._int8()
        out["weights"] = self._weights()
        out["prefill"] = self._prefill() + "; causal attention " + self._attention()
        if self.fused_prefill:
            more = (f" (up to {TILED_FUSED_PREFILL_ROWS} on int16 tiles while their attention is short)"
                    if self.block_tiles else "")
            out["prefill"] += (f"; up to {MAX_ROWS} tokens{more} as one call of the fused step instead "
                               "(option fused_prefill)")
        out["kv cache"] = self._kv()
        return out

    def _int8(self) -> str:
        k = self.kernels
        if self.block_weights:
            if not self.block_activations:
                return ("GGUF block weights x float32 activations: bands dequantized into float32 products "
                        + ("(int8_compute=float)" if k is not None else "(no kernels)"))
            rows = "two int8 rows (int8x2, int8_compute auto)" if self.block_activations == 2 else "one int8 row (int8_compute=int8)"
            return (f"GGUF block weights x int8 activations per 32 values, {rows} per row, integer dot products on "
                    f"{k.q8_isa} (csrc/gguf.h, as llama.cpp's vec_dot)")
        if not self.for_model:
            return (f"off by default; with option quantize: integer dot products on {k.q8_isa} where the model's "
                    f"sizes are multiples of 32 (int8_compute auto), else float activations" if k is not None else
                    "off by default; with option quantize: torch's matmul on int8 weights widened band by band "
                    "(no kernels)")
        if self.weights not in WEIGHT_MODES:
            return "off (option quantize: int8 or int8-block32)"
        if k is None:
            return f"{self.weights} weights; products on torch's matmul, the weights widened band by band (no kernels)"
        if self.int8_activations:
            rows = "two int8 rows (int8x2)" if self.int8_activations == 2 else "one int8 row"
            return (f"{self.weights} weights x int8 activations ({rows} per row), integer dot products on "
                    f"{k.q8_isa}")
        return f"{self.weights} weights x float32 activations (weights widened in the kernels)"

    def _weights(self) -> str:
        if self.block_weights:
            where = "the block kernels" if self.kernels is not None else "bands dequantized by the core (no kernels)"
            if self.repack:
                use = ("every product, prefill's too (one int8 row: int8_compute=int8)" if self.packed_rows else
                       "decode's products and prefill's tiles")
                kept = (f"; {', '.join(self.repack_kept)} kept as mapped (repack_weights=true packs them too)"
                        if self.repack_kept else "")
                huge = " in 2 MiB transparent huge pages (option huge_pages)" if self.huge_pages else ""
                return (f"the file's GGUF blocks ({self.block_formats}), copied at load with sixteen rows "
                        f"interleaved{huge} (option repack_weights, csrc/packed.h) for {use}, their file pages "
                        f"released{kept}")
            declined = f"; not repacked: {self.repack_declined}" if self.repack_declined else ""
            return (f"the file's GGUF blocks as mapped, never widened whole ({self.block_formats}): decode "
                    f"products on {where}, prefill by dequantized bands into torch's GEMM{declined}")
        if self.weights in WEIGHT_MODES:
            return f"int8 ({self.weights}) projections and LM head"
        if self.weights == "bfloat16":
            if self.kernels is None:
                how = "float32 products, widened band by band for torch's matmul"
            elif self.bf16_activations:
                how = f"decode products on activations rounded to bfloat16 (bf16_compute=bf16): {self.kernels.bf16_dot}"
            else:
                how = "float32 products, widened in the kernels (bf16_compute=float)"
            return f"bfloat16 projections and LM head (option weight_dtype), {how}"
        return _name(self.dtype) + ("; weight_dtype=bfloat16 halves the bytes a step streams"
                                    if self.dtype == torch.float32 else "")

    def _bf16_units(self) -> bool:
        return _bf16_units(self.host, self.isa)

    def _prefill(self) -> str:
        """Prefill's products: torch's GEMM, on bfloat16 operands or float32 for narrowed weights."""
        units = self._bf16_units()
        if not self.for_model:  # what option prefill_compute's auto picks here
            if self.kernels is not None and self.kernels.gguf_tiles:
                return ("GGUF block weights on int16 tiles (csrc/tile.h, AVX-512 VNNI); torch's GEMM for other "
                        "weights, int8 or bfloat16 ones widened to float32, or on bfloat16 operands with "
                        "bf16_compute=bf16 or int8_compute=int8 (prefill_compute auto)")
            if units:
                return ("torch's GEMM; int8 or bfloat16 weights widened to float32, or on bfloat16 operands with "
                        "bf16_compute=bf16 or int8_compute=int8 (prefill_compute auto; this CPU has bfloat16 units)")
            stands = f", as on the hosts isa {self.isa!r} stands for" if self.host.bf16_units else ""
            return ("torch's GEMM; int8 or bfloat16 weights widened to float32, float32 here whatever the options "
                    f"(prefill_compute auto; no bfloat16 units here{stands})")
        if self.packed_rows:
            return ("block weights on their repacked sixteen-row groups against one int8 row per 32 activations, "
                    "as decode's products (int8_compute=int8 with repack_weights: faster than int16 tiles at every "
                    "row count), where every block matrix was repacked; else on int16 tiles (csrc/tile.h)")
        if self.block_tiles:
            return ("block weights unpacked sixteen rows at a time into int16 tiles against int16 activations "
                    "(csrc/tile.h, AVX-512 VNNI; prefill_compute=float: bands dequantized into torch's GEMM)")
        if self.block_weights:
            operands = "bfloat16" if self.prefill_compute == torch.bfloat16 else "float32"
            return f"torch's GEMM on {operands} operands, block weights dequantized a band of rows at a time"
        if not self.narrow:
            return "torch's GEMM"
        if self.prefill_compute == torch.bfloat16:
            why = "bfloat16 units here" if units else (
                "forced; this CPU has no bfloat16 units, so it is slow here" if not self.host.bf16_units else
                f"forced; the hosts isa {self.isa!r} stands for have no bfloat16 units")
            return f"torch's GEMM on bfloat16 operands ({self.weights} weights; prefill_compute=bf16: {why})"
        return f"torch's GEMM ({self.weights} weights widened band by band to float32; prefill_compute=float)"

    def _attention(self) -> str:
        """Where a prefill's causal attention runs (option prefill_attention)."""
        if self.prefill_attention is None:
            return "on torch's SDPA"
        how = "bfloat16 operands on vdpbf16ps, float32 sums" if self.prefill_attention == "bfloat16" else "float32"
        return f"on the host kernel (csrc/prefill_attn.h, {how}; option prefill_attention)"

    def _kv(self) -> str:
        """The KV cache: its element type and how its memory is held."""
        kind = _name(self.kv_dtype) + ("" if self.kv_dtype == self.dtype else
                                       f" (option kv_dtype; compute {_name(self.dtype)})")
        held = ("pages held as the slots write them, handed back on free (kv_memory=grow)" if self.kv_memory == "grow"
                else "every slot's full context held from the start (kv_memory=reserve)")
        if self.page_size:
            held = (f"a pool of pages of {self.page_size} positions shared by slots and prefixes (option page_size), "
                    + ("its memory held as pages are first written, freed pages kept for reuse" if self.kv_memory == "grow"
                       else "held from the start"))
        hint = "; kv_dtype=bfloat16/float16 halves it" if self.kv_dtype == torch.float32 else ""
        return f"{kind}, {held}{hint}"


# -- the rules, one function per choice ---------------------------------------------------


def _name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _bf16_units(host: CpuHost, isa: str) -> bool:
    """Whether auto choices count on bfloat16 units: the host's, except where option
    ``isa`` forces a path below avx512: "avx2" and "scalar" run as a host of that kind
    would, which has none (docs/cpu.md, forced ISA paths)."""
    return host.bf16_units and isa in ("auto", "avx512")


def _kv_dtype(o: Mapping[str, Any], dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type (option kv_dtype): narrower than compute for float32
    compute only."""
    kv = dtype if o["kv_dtype"] == "auto" else {"bfloat16": torch.bfloat16, "float16": torch.float16}[o["kv_dtype"]]
    if kv != dtype and dtype != torch.float32:
        raise UnsupportedFeature(
            f"kv_dtype={o['kv_dtype']!r} with dtype {_name(dtype)}", BACKEND,
            "a narrower KV cache is kept for float32 compute only; use kv_dtype='auto' (the compute dtype)")
    return kv


def _weights(o: Mapping[str, Any], config: Any, dtype: torch.dtype) -> str:
    """The projections' weight format: option quantize or weight_dtype, where they apply."""
    experts = config is not None and config.num_experts
    if o["quantize"] and experts:
        raise UnsupportedFeature("quantize with a mixture-of-experts model", BACKEND,
                                 "int8 weights cover dense projections only")
    if o["weight_dtype"] != "auto":
        why = None
        if o["quantize"]:
            why = "int8 weights already replace the float ones; choose one of quantize and weight_dtype"
        elif experts:
            why = "it stores dense projections only, not a mixture of experts'"
        elif dtype != torch.float32:
            why = f"it narrows float32 weights, and this engine computes in {_name(dtype)}; use dtype float32"
        if why:
            raise UnsupportedFeature(f"weight_dtype={o['weight_dtype']!r} here", BACKEND, why)
        return o["weight_dtype"]
    if o["bf16_compute"] != "float":
        raise UnsupportedFeature(f"bf16_compute={o['bf16_compute']!r} without bfloat16 weights", BACKEND,
                                 "it chooses the activations of bfloat16 weights' products; add weight_dtype='bfloat16'")
    return o["quantize"]


def lane_threads(o: Mapping[str, Any]) -> int:
    """The prefill lane's threads (option ``prefill_threads``; docs/cpu.md, "The prefill
    lane"): ``-1`` half the engine's threads where it has two or more, else as asked;
    with ``page_size`` too (the lane's prefill writes pages of its own beside the steps',
    paged.py)."""
    total, n = o["threads"] or torch.get_num_threads(), o["prefill_threads"]
    if n == -1:
        return total // 2
    if n and n >= total:
        raise InvalidRequest(f"prefill_threads={n} leaves the decode steps none of the engine's {total} threads; "
                             f"ask for at most {total - 1}, or 0 for no lane", field="options.prefill_threads")
    return n


def _kernels(o: Mapping[str, Any], dtype: torch.dtype) -> tuple[CpuKernels | None, str | None]:
    """The host-compiled kernels (they compute float32) and, where they are not used,
    why, with the fix. A forced ISA path must run or be refused, never fall back: the
    row measuring it would measure something else."""
    if o["isa"] != "auto":
        if dtype != torch.float32 or not o["cpu_kernels"]:
            raise UnsupportedFeature(
                f"isa={o['isa']!r} here", BACKEND, "the ISA path chooses the host-compiled kernels, which compute "
                "float32 with cpu_kernels=True; drop the option or use dtype float32")
        check_isa(o["isa"])
    if dtype != torch.float32:
        return None, None
    if not o["cpu_kernels"]:
        return None, "option cpu_kernels=False; set cpu_kernels=True for the host-compiled decode kernels"
    try:
        return load(o["threads"] or None, o["isa"]), None
    except KernelsUnavailable as exc:
        if o["isa"] != "auto":
            raise UnsupportedFeature(f"isa={o['isa']!r}", BACKEND, str(exc)) from None
        return None, str(exc)


def _block_weights(model: Any, dtype: torch.dtype, weights: str) -> tuple[str, ...]:
    """The projections, LM head and embedding table the engine reads in the file's GGUF
    blocks: every one stored in a format of csrc/gguf.h, under float32 compute, unless
    option quantize or weight_dtype replaces the weights (they requantize tensor by
    tensor) or the model is a mixture of experts (its experts run stacked, in float32)."""
    if model is None or weights or dtype != torch.float32 or model.config.num_experts:
        return ()
    names = {source for _, source in quantized_names(model.config)} | {"model.embed_tokens.weight"}
    records = model.records
    return tuple(sorted(n for n in names if n in records and records[n].format in KERNEL_FORMATS
                        and len(records[n].shape) == 2))


def _formats(model: Any, blocks: tuple[str, ...]) -> str:
    counts: dict[str, int] = {}
    for name in blocks:
        fmt = model.records[name].format
        counts[fmt] = counts.get(fmt, 0) + 1
    return ", ".join(f"{f} x {c}" for f, c in sorted(counts.items()))


def _block_activations(o: Mapping[str, Any], kernels: CpuKernels | None, blocks: tuple[str, ...]) -> int:
    """int8 rows per activation row of block products (option int8_compute): auto is two
    (int8x2: the second row carries the first's rounding error, so the products are those
    of the float activations to ~1/250 of one row's error, and a file decodes greedily as
    the oracle on its blocks); "int8" one, as llama.cpp pairs its blocks with Q8
    activations (faster; its bound is in docs/cpu.md); 0 multiplies float32 activations
    by dequantized bands."""
    if not blocks or o["int8_compute"] == "float":
        return 0
    if kernels is None:
        if o["int8_compute"] != "auto":
            raise UnsupportedFeature(f"int8_compute={o['int8_compute']!r}", BACKEND,
                                     "the CPU kernels are off or unavailable")
        return 0
    return INT8_COMPUTE[o["int8_compute"]]


def _unfused_why(o: Mapping[str, Any], config: Any, weights: str, blocks: tuple[str, ...] = (),
                 block_activations: int = 0) -> str | None:
    """Why a decode step cannot be the fused kernel call (None: it can): the option, an
    architecture it is not written for, or int8 weights whose projections quantize in
    different groupings (a scale per 32 where the input size divides, per row elsewhere)."""
    if not o["fused_decode"]:
        return "fused_decode=False"
    if config is None:
        return None
    if not config.is_llama_family:
        return f"the fused step is written for the Llama family, not {config.model_type}"
    if blocks:
        needed = {f"model.layers.{i}.{_NAMES[p]}.weight" for i in range(config.num_hidden_layers) for p in _NAMES}
        if not needed <= set(blocks):
            return "some projections are not in the file's GGUF blocks; the fused step takes all or none"
        if not block_activations:
            return "int8_compute=float: the fused step takes GGUF blocks against int8 activations only"
    if weights in WEIGHT_MODES:
        sizes = (config.hidden_size, config.q_size, config.intermediate_size)
        if len({group_of(weights, k) for k in sizes}) > 1:
            return (f"{weights} groups these projections' inputs ({', '.join(map(str, sizes))}) differently; the "
                    f"fused step takes one grouping")
    return None


def _int8_activations(o: Mapping[str, Any], config: Any, kernels: CpuKernels | None, blocks: bool = False) -> int:
    """int8 rows per activation row for int8 weights (option ``int8_compute``): 0 for
    float32 activations, 1 or 2 (csrc/q8.h)."""
    if not o["quantize"] and not blocks and o["int8_compute"] != "auto":
        raise UnsupportedFeature(f"int8_compute={o['int8_compute']!r} without int8 or block weights", BACKEND,
                                 "it chooses the activations of int8 weights' (or a GGUF file's blocks') products; "
                                 "add quantize='int8' or 'int8-block32'")
    if not o["quantize"] or o["int8_compute"] == "float" or config is None:
        return 0
    fits = kernels is not None and q8_fits(config, WEIGHT_MODES[o["quantize"]])
    if o["int8_compute"] != "auto" and not fits:
        why = ("the CPU kernels are off or unavailable" if kernels is None else
               "it needs hidden, intermediate and heads x head_dim sizes that are multiples of 32")
        raise UnsupportedFeature(f"int8_compute={o['int8_compute']!r}", BACKEND, why)
    return INT8_COMPUTE[o["int8_compute"]] if fits else 0


def _prefill_compute(o: Mapping[str, Any], host: CpuHost, dtype: torch.dtype, weights: str, bf16_activations: bool,
                     int8_activations: int) -> torch.dtype:
    """The operand dtype of prefill's GEMMs on narrowed weights (option prefill_compute):
    auto makes prefill's activations as precise as the decode products' (bfloat16 rows,
    or one int8 row per 32 values: both 8 significant bits), on bfloat16 units only."""
    choice = o["prefill_compute"]
    if choice == "bf16" and not weights:
        raise UnsupportedFeature("prefill_compute='bf16' without int8 or bfloat16 weights", BACKEND,
                                 "it chooses the GEMM operands of narrowed weights; add weight_dtype='bfloat16' "
                                 "or quantize, or drop the option")
    coarse = bf16_activations or int8_activations == 1
    if choice == "bf16" or (choice == "auto" and coarse and _bf16_units(host, o["isa"])):
        return torch.bfloat16
    return dtype


def _block_tiles(o: Mapping[str, Any], kernels: CpuKernels | None, blocks: tuple[str, ...],
                 prefill_compute: torch.dtype, dtype: torch.dtype, block_activations: int) -> bool:
    """Whether prefill's products on block weights run on int16 tiles (option
    prefill_compute "int16"; auto: wherever the kernels have them, prefill's operands are
    float32 and decode's products quantize their activations too (not int8_compute
    float), since they are faster than bands dequantized into torch's GEMM from 8 rows up
    and as precise as the decode products' int8x2: docs/cpu.md, "Prefill on block
    weights")."""
    choice = o["prefill_compute"]
    have = kernels is not None and kernels.gguf_tiles
    if choice == "int16":
        if not blocks:
            raise UnsupportedFeature("prefill_compute='int16'", BACKEND,
                                     "it runs the products on a GGUF file's block weights, and none are kept in "
                                     "blocks here (float32 compute on a GGUF file keeps them); drop the option")
        if not have:
            why = "the host-compiled kernels are not used here" if kernels is None else (
                f"this library's int8 path is {kernels.q8_isa}")
            raise UnsupportedFeature("prefill_compute='int16'", BACKEND,
                                     f"its tiles need AVX-512 VNNI (csrc/tile.h) and {why}; use "
                                     "prefill_compute='float' (or 'auto')")
        return True
    return (choice == "auto" and bool(blocks) and have and block_activations > 0
            and prefill_compute == dtype == torch.float32)


# The formats repack_weights="auto" leaves in the file's layout under int8x2 activations:
# on a 1B Q8_0 file the groups decoded no faster at batch 1 and slower at batch 8 and in
# prefill (docs/cpu.md, "Batch-1 decode on interleaved rows"); against one int8 row
# (int8_compute=int8) they are the faster product at every row count, and it packs them.
AUTO_REPACK_KEEPS = ("Q8_0",)


def _repack(o: Mapping[str, Any], kernels: CpuKernels | None, model: Any, blocks: tuple[str, ...],
            block_activations: int) -> tuple[bool, tuple[str, ...]]:
    """Whether decode's products read the block weights repacked sixteen rows interleaved
    (option repack_weights; csrc/packed.h), and the formats left in the file's layout.
    ``"auto"``: wherever the rows run, but for AUTO_REPACK_KEEPS under int8x2; ``True``
    packs every format and refuses a setting where the rows cannot run."""
    choice = o["repack_weights"]
    if choice is False:
        return False, ()
    why = None
    if not blocks:
        why = ("it repacks a GGUF file's block weights, and none are kept in blocks here (float32 compute on a GGUF "
               "file keeps them)")
    elif kernels is None or not kernels.gguf_packed:
        why = ("its products need AVX2 or AVX-512 VNNI (csrc/packed.h) and " +
               ("the host-compiled kernels are not used here" if kernels is None else
                f"this library's int8 path is {kernels.q8_isa}"))
    elif not block_activations:
        why = "its products take int8 activations, and int8_compute='float' asks for float32 ones"
    if why and choice == "auto":
        return False, ()
    if why:
        raise UnsupportedFeature("repack_weights=True", BACKEND, why + "; drop the option")
    if choice is True or block_activations == 1:
        return True, ()
    present = {model.records[name].format for name in blocks}
    kept = tuple(f for f in AUTO_REPACK_KEEPS if f in present)
    return (True, kept) if present - set(kept) else (False, ())


def _huge_pages(o: Mapping[str, Any], repack: bool) -> bool:
    """Whether the repacked copy lives in transparent huge pages (option huge_pages):
    ``"auto"`` where the host gives them to a map that asks (THP ``madvise`` or ``always``);
    ``True`` refuses a host that would not."""
    choice = o["huge_pages"]
    if choice is False or (choice == "auto" and not repack):
        return False
    if choice is True and not repack:
        raise UnsupportedFeature("huge_pages=True", BACKEND, "it holds the repacked block weights, and nothing is "
                                 "repacked here (option repack_weights); drop the option")
    if huge_pages_available():
        return True
    if choice is True:
        mode = transparent_huge_pages() or "not readable"
        raise UnsupportedFeature("huge_pages=True", BACKEND, f"this host gives no transparent huge pages to a map "
                                 f"that asks (THP mode {mode!r}, {THP_SETTING}); drop the option")
    return False


def _prefill_attention(o: Mapping[str, Any], config: Any, kernels: CpuKernels | None, fallback: str | None,
                       prefill_compute: torch.dtype) -> str | None:
    """The operands of a prefill's causal attention on the host kernel (option
    prefill_attention): "bfloat16" where prefill's GEMMs take bfloat16 operands and the
    kernels have vdpbf16ps, else "float32"; None for torch's SDPA. auto: the kernel on
    the AVX-512 kernels (measured faster than SDPA there) with attention "sdpa"."""
    choice = o["prefill_attention"]
    if choice == "sdpa":
        return None
    if kernels is None:
        if choice == "kernel":
            why = (f"it runs in the host-compiled CPU kernels, which are not used here ({fallback})" if fallback
                   else "it runs in the host-compiled CPU kernels (float32 compute)")
            raise UnsupportedFeature("prefill_attention='kernel'", BACKEND, why)
        return None
    bf16 = prefill_compute == torch.bfloat16 and kernels.attention_bf16
    if config is not None:
        why = kernels.prefill_attention_fits(config.head_dim, bf16)
        if why is not None:
            if choice == "kernel":
                raise UnsupportedFeature("prefill_attention='kernel'", BACKEND, why)
            return None
    if choice == "auto" and (not kernels.attention_by_default or o["attention"] != "sdpa"):
        return None
    return "bfloat16" if bf16 else "float32"


def diagnose() -> dict[str, str]:
    """What an engine with the default options would run here (``polyengine backends
    --verbose``): builds the kernels if they are not cached yet, since whether they
    compile is the question."""
    from polyengine.options import option_defaults

    from polyengine.backends.cpu.options import OPTIONS

    from polyengine.backends.torch_common.paged import TAIL_IMPORT

    plan = CpuPlan.resolve(option_defaults(OPTIONS), None, CpuHost.detect(), dtype=torch.float32)
    return {**plan.describe(), "prefix tails": TAIL_IMPORT}
