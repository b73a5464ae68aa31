"""Which speed paths a cuda_torch engine takes here, in words a user can act on.

One description for two callers: an engine's ``speed_paths()`` (its startup log line,
``polyengine generate``'s stderr) says what that engine runs; :func:`diagnose` (the
backend's ``polyengine backends --verbose`` entry) says what an engine with the default
options would run on this machine, building the CPU kernels if they are not cached yet,
since whether they compile is the question. Every fallback names its reason and its fix.
"""

from __future__ import annotations

from typing import Any

import torch

from polyengine.hostinfo import cpu_flags, cpu_model, has_bf16_units, runnable_isas
from polyengine.options import option_defaults

__all__ = ["describe", "diagnose", "bf16_units"]

_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def _cpu() -> str:
    flags = [f for f in _ISA_FLAGS if f in cpu_flags()]
    return f"{cpu_model()}; {' '.join(flags) or 'no AVX2'}; torch capability {torch.backends.cpu.get_cpu_capability()}"


def describe(*, device: torch.device, dtype: torch.dtype, options: dict[str, Any], kernels: Any,
             fallback: str | None, int8_activations: int | None,
             prefill_compute: torch.dtype | None = None, prefill_attention: str | None = None) -> dict[str, str]:
    """The paths of an engine (or, with ``int8_activations`` None, of one not built yet);
    ``options`` are values (the defaults for one not built)."""
    out: dict[str, str] = {}
    if device.type == "cuda":
        index = device.index or 0
        out["device"] = f"cuda:{index} ({torch.cuda.get_device_name(index)}, CUDA {torch.version.cuda})"
        graphs = "replayed from a CUDA graph per kv_len bucket (option cuda_graphs)" if options.get("cuda_graphs") else (
            "eager (cuda_graphs=False)")
        out["decode"] = f"the shared torch forward on CUDA, {str(dtype).replace('torch.', '')}, {graphs}"
        out["int8"] = "not on CUDA (option quantize runs on the CPU path only)"
        return out
    out["device"] = f"cpu ({torch.get_num_threads()} threads)"
    out["cpu"] = _cpu()
    if dtype != torch.float32:
        out["decode"] = f"the shared torch forward in {str(dtype).replace('torch.', '')} (the CPU kernels are float32)"
    elif kernels is not None:
        fused = options.get("fused_decode", True)
        out["decode"] = ("fused step: every layer of the live rows in one host-compiled call (csrc/decode.cpp)"
                         if fused else "the shared torch forward, products on the host-compiled kernels "
                                       "(fused_decode=False)")
        out["isa"] = _isa(kernels)
        out["kernels"] = f"compiled for this CPU ({kernels.vector_width}-float vectors): {kernels.path}"
    else:
        out["decode"] = "the shared torch forward on torch's matmul (FALLBACK)"
        out["kernels"] = f"not used: {fallback}"
    mode = options.get("quantize", "")
    if int8_activations is None:  # not built: what int8 would use here
        if kernels is not None:
            out["int8"] = (f"off by default; with option quantize: integer dot products on {kernels.q8_isa} where the "
                           f"model's sizes are multiples of 32 (int8_compute auto), else float activations")
        else:
            out["int8"] = ("off by default; with option quantize: torch's matmul on int8 weights widened band by "
                           "band (no kernels)")
    elif not mode:
        out["int8"] = "off (option quantize: int8 or int8-block32)"
    elif kernels is None:
        out["int8"] = f"{mode} weights; products on torch's matmul, the weights widened band by band (no kernels)"
    elif int8_activations:
        rows = "two int8 rows (int8x2)" if int8_activations == 2 else "one int8 row"
        out["int8"] = f"{mode} weights x int8 activations ({rows} per row), integer dot products on {kernels.q8_isa}"
    else:
        out["int8"] = f"{mode} weights x float32 activations (weights widened in the kernels)"
    narrow = options.get("weight_dtype", "auto")
    if mode:
        out["weights"] = f"int8 ({mode}) projections and LM head"
    elif narrow == "bfloat16":
        if kernels is None:
            how = "float32 products, widened band by band for torch's matmul"
        elif options.get("bf16_compute") == "bf16":
            how = f"decode products on activations rounded to bfloat16 (bf16_compute=bf16): {kernels.bf16_dot}"
        else:
            how = "float32 products, widened in the kernels (bf16_compute=float)"
        out["weights"] = f"bfloat16 projections and LM head (option weight_dtype), {how}"
    else:
        out["weights"] = f"{str(dtype).replace('torch.', '')}" + (
            "; weight_dtype=bfloat16 halves the bytes a step streams" if dtype == torch.float32 else "")
    out["prefill"] = _prefill(mode or ("bfloat16" if narrow == "bfloat16" else ""), int8_activations is None,
                              prefill_compute, options.get("isa", "auto"))
    out["prefill"] += "; causal attention " + _prefill_attention(kernels, int8_activations is None, prefill_attention)
    out["kv cache"] = _kv(options, dtype)
    return out


def _kv(options: dict[str, Any], dtype: torch.dtype) -> str:
    """The CPU KV cache: its element type and how its memory is held."""
    kv, memory = options.get("kv_dtype", "auto"), options.get("kv_memory", "grow")
    kind = str(dtype).replace("torch.", "") if kv == "auto" else f"{kv} (option kv_dtype; compute {str(dtype).replace('torch.', '')})"
    held = ("pages held as the slots write them, handed back on free (kv_memory=grow)" if memory == "grow" else
            "every slot's full context held from the start (kv_memory=reserve)")
    hint = "; kv_dtype=bfloat16/float16 halves it" if kv == "auto" and dtype == torch.float32 else ""
    return f"{kind}, {held}{hint}"


def bf16_units(isa: str) -> bool:
    """Whether the engine's auto choices count on bfloat16 units (AMX or AVX512-BF16):
    the host's, except where option ``isa`` forces a path below avx512: "avx2" and
    "scalar" run as a host of that kind would, which has none (docs/decisions.md,
    "forced ISA paths")."""
    return has_bf16_units() and isa in ("auto", "avx512")


def _prefill(narrow: str, unbuilt: bool, compute: torch.dtype | None, isa: str) -> str:
    """Prefill's products: torch's GEMM, on bfloat16 operands or float32 for narrowed weights."""
    units = bf16_units(isa)
    if unbuilt:  # what option prefill_compute's auto picks here
        return ("torch's GEMM; int8 or bfloat16 weights widened to float32, or " +
                ("on bfloat16 operands with bf16_compute=bf16 or int8_compute=int8 (prefill_compute auto; this CPU "
                 "has bfloat16 units)" if units else "float32 here whatever the options (prefill_compute auto; no "
                                                      "bfloat16 units here" +
                                                      (f", as on the hosts isa {isa!r} stands for)" if
                                                       has_bf16_units() else ")")))
    if not narrow:
        return "torch's GEMM"
    if compute == torch.bfloat16:
        why = "bfloat16 units here" if units else (
            "forced; this CPU has no bfloat16 units, so it is slow here" if not has_bf16_units() else
            f"forced; the hosts isa {isa!r} stands for have no bfloat16 units")
        return f"torch's GEMM on bfloat16 operands ({narrow} weights; prefill_compute=bf16: {why})"
    return f"torch's GEMM ({narrow} weights widened band by band to float32; prefill_compute=float)"


def _prefill_attention(kernels: Any, unbuilt: bool, choice: str | None) -> str:
    """Where a prefill's causal attention runs (option prefill_attention)."""
    if unbuilt:  # what auto picks here
        return ("on the host kernel (prefill_attention auto: AVX-512 kernels)" if kernels is not None
                and kernels.attention_by_default else "on torch's SDPA (prefill_attention auto: no AVX-512 kernels here)")
    if choice is None:
        return "on torch's SDPA"
    how = "bfloat16 operands on vdpbf16ps, float32 sums" if choice == "bfloat16" else "float32"
    return f"on the host kernel (csrc/prefill_attn.cpp, {how}; option prefill_attention)"


def _isa(kernels: Any) -> str:
    """The kernels' ISA path: what the library was compiled for, how it was chosen."""
    how = ("auto: the best this CPU runs, -march=native" if kernels.requested == "auto" else
           f"forced by option isa, {' '.join(kernels.flags) or 'the compiler default'}")
    return f"{kernels.isa} ({how}; int8 products on {kernels.q8_isa}; others here: option isa={'/'.join(runnable_isas())})"


def diagnose() -> dict[str, str]:
    """What an engine with the default options would run here (``polyengine backends --verbose``)."""
    from polyengine.backends.cuda_torch.engine import TorchEngine

    device = TorchEngine._pick_device("")
    kernels, fallback = None, None
    if device.type == "cpu":
        from polyengine.backends.cpu.kernels import KernelsUnavailable, load

        try:
            kernels = load()
        except KernelsUnavailable as exc:
            fallback = str(exc)
    return describe(device=device, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16,
                    options=option_defaults(TorchEngine.OPTIONS), kernels=kernels, fallback=fallback, int8_activations=None)
