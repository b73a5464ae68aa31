"""The CPU decode step, compiled for the host at first use.

``csrc/linear.cpp`` holds skinny products ``y = x @ W.T`` for a few rows of ``x``
(the live slots of a decode step), float32 or int8 weights with per-row or per-group
scales; ``csrc/q8.cpp`` int8 weights against activations quantized to int8 per 32
values (integer dot products: AVX-512 VNNI, AVX-VNNI or AVX2, as the host has);
``csrc/parallel.h`` the threads; ``csrc/decode.cpp`` a whole fused decode step
(every layer for the live rows, in one call) built on them. They are compiled once per host
and ISA path with the system's C++ compiler into a cache folder, then called through
ctypes on the tensors' memory: no Python extension build, no torch headers, a few
seconds of compiling. The ISA path (engine option ``isa``, :data:`ISA_FLAGS`) is
``-march=native`` by default ("auto"), or a lower instruction set forced so that every
path is tested and measured on any host that executes it: "avx512", "avx2", "scalar". The cache is private to the user and its library is loaded only
when its signed record matches it (``polyengine.cache``): a damaged, empty, planted or
foreign file is compiled again, never ``dlopen``'ed. Where the kernels cannot be built
or loaded, :func:`load` raises :class:`KernelsUnavailable` naming the fix and the engine
stays on the shared torch forward (with a warning that says so).

Only the CPU path uses them: :class:`CpuKernels.linear` for at most :data:`MAX_ROWS`
rows in the shared forward (beyond that a GEMM library is compute-bound and faster)
and for a fused step's LM head, :class:`FusedDecoder` for decode steps. Each is a
switch of the engine (options ``cpu_kernels``, ``fused_decode`` and
``int8_compute``), kept only because the benchmark shows it helps.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from polyengine.cache import cache_root, check, private_dir, store
from polyengine.errors import UnsafeCache, UnsupportedFeature
from polyengine.hostinfo import ISA_PATHS, cpu_flags, missing_for, runnable_isas

__all__ = ["CpuKernels", "FusedDecoder", "KernelsUnavailable", "load", "q8_fits", "isa_flags", "check_isa",
           "ISA_CHOICES", "MAX_ROWS", "Q8_BLOCK"]

MAX_ROWS = 16
Q8_BLOCK = 32  # int8 activations: values per scale (csrc/q8.cpp)
Q8_ISAS = {3: "avx512-vnni", 2: "avx-vnni", 1: "avx2", 0: "scalar"}
ISA_CHOICES = ("auto", *ISA_PATHS)
_COMPILED_ISAS = {2: "avx512", 1: "avx2", 0: "scalar"}  # pe_isa(): what the library was compiled with
_KERNELS = Path(__file__).with_name("csrc")
_SOURCE = _KERNELS / "decode.cpp"  # includes linear.cpp, q8.cpp, prefill_attn.cpp and parallel.h
_COMPILE_SECONDS = 300
_lock = threading.Lock()
_loaded: dict[int, "CpuKernels"] = {}


def _cache_dir() -> Path:
    """The kernel cache: private to this user (``polyengine.cache``: created 0700, refused
    when someone else could write it), under ``$POLYENGINE_CACHE`` or ``~/.cache/polyengine``."""
    return private_dir(cache_root() / "kernels", what="CPU kernel cache")


class KernelsUnavailable(RuntimeError):
    """The kernels cannot be built or loaded here; the message says why and names the fix."""


def _isa_tag() -> str:
    flags = " ".join(sorted(cpu_flags()))
    return hashlib.blake2b((platform.machine() + flags).encode(), digest_size=6).hexdigest()


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def check_isa(isa: str) -> None:
    """Refuse an ISA path this CPU cannot execute (its library would die with SIGILL),
    naming what the CPU lacks and the paths it does run."""
    if isa == "auto":
        return
    if isa not in ISA_PATHS:
        raise ValueError(f"unknown ISA path {isa!r}; choose from {', '.join(ISA_CHOICES)}")
    missing = missing_for(isa)
    if missing:
        raise UnsupportedFeature(
            f"isa={isa!r}", "cuda_torch",
            f"this CPU lacks {', '.join(missing)}; it runs isa {', '.join(repr(i) for i in runnable_isas())} "
            f"(or 'auto', the best of them)")


def isa_flags(isa: str) -> list[str]:
    """The compiler flags of an ISA path (docs/decisions.md, "forced ISA paths").

    "auto" is ``-march=native``: everything this CPU has. A forced path names a fixed
    target so that its instructions are those of the hosts it stands for, whatever the
    host it runs on: "avx2" is ``-march=haswell`` (AVX2, FMA: the AVX2-only hosts; no
    AVX-VNNI even where the host has it), "scalar" ``-march=x86-64`` (SSE2, the vector
    extensions' 8-float fallback), "avx512" ``-march=skylake-avx512`` plus VNNI and BF16
    where this CPU has them (never AMX). Each keeps ``-mtune=native``, so a forced path
    differs from "auto" in its instructions, not in its scheduling."""
    if isa == "auto":
        return ["-march=native"]
    if not _x86():
        return []  # off x86 only "scalar" exists: the compiler's default target
    march = {"avx512": "skylake-avx512", "avx2": "haswell", "scalar": "x86-64"}[isa]
    flags = [f"-march={march}", "-mtune=native"]
    if isa == "avx512":
        flags += [f for flag, f in (("avx512_vnni", "-mavx512vnni"), ("avx512_bf16", "-mavx512bf16"))
                  if flag in cpu_flags()]
    return flags


@dataclass
class CpuKernels:
    lib: ctypes.CDLL
    threads: int
    path: Path
    requested: str = "auto"  # the ISA path asked for (option isa)

    @property
    def isa(self) -> str:
        """The instruction set the library was compiled for ("avx512", "avx2", "scalar"):
        read from the library, so it says what runs, not what was asked."""
        return _COMPILED_ISAS[int(self.lib.pe_isa())]

    @property
    def flags(self) -> list[str]:
        return isa_flags(self.requested)

    @property
    def vector_width(self) -> int:
        return int(self.lib.pe_vector_width())

    @property
    def bf16_dot(self) -> str:
        """The instructions of bfloat16-activation products (option bf16_compute "bf16")."""
        return "avx512-bf16 vdpbf16ps" if self.lib.pe_bf16_dot() else "float32 fma"

    @property
    def q8_isa(self) -> str:
        """The instructions of the int8-activation products on this host."""
        return Q8_ISAS[int(self.lib.pe_q8_isa())]

    @property
    def attention_bf16(self) -> bool:
        """Whether :meth:`prefill_attention` has its bfloat16 path (vdpbf16ps) here."""
        return bool(self.lib.pe_pa_bf16())

    @property
    def attention_by_default(self) -> bool:
        """Whether option prefill_attention's auto picks :meth:`prefill_attention` on these
        kernels: the 16-float (AVX-512) paths, where it measured faster than torch's SDPA;
        the 8-float ones measured slower than torch's AVX-512 SDPA on that host."""
        return self.vector_width == 16

    def prefill_attention_fits(self, head_dim: int, bf16: bool) -> str | None:
        """None where :meth:`prefill_attention` runs heads of ``head_dim``, else why not."""
        if bf16 and not self.attention_bf16:
            return f"the {self.isa} kernels have no bfloat16 dot products (AVX512-BF16)"
        unit = 16 if bf16 else self.vector_width
        if head_dim % unit:
            return f"head_dim {head_dim} is not a multiple of {unit} (the kernel's vector width)"
        return None

    def prefill_attention(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float,
                          bf16: bool = False) -> torch.Tensor:
        """Causal attention of a prefill from position 0 (``csrc/prefill_attn.cpp``):
        ``q`` (T, heads, head_dim) float32 with contiguous heads, ``keys``/``vals``
        (kv_heads, T, head_dim) float32 with contiguous head_dim; returns (T, heads *
        head_dim). ``bf16``: q, k, v and the softmax weights rounded to bfloat16, products
        summed in float32 by vdpbf16ps; else float32 throughout."""
        t, nh, hd = q.shape
        nkv = keys.shape[0]
        why = self.prefill_attention_fits(hd, bf16)
        if why is not None:
            raise ValueError(f"prefill attention kernel: {why}")
        if keys.shape != vals.shape or keys.shape[1] != t or keys.shape[2] != hd or nh % nkv:
            raise ValueError(f"prefill attention kernel: q {tuple(q.shape)} does not fit keys {tuple(keys.shape)} "
                             f"/ values {tuple(vals.shape)}")
        if q.dtype != torch.float32 or keys.dtype != torch.float32 or vals.dtype != torch.float32:
            raise ValueError("prefill attention kernel: q, keys and values must be float32")
        if q.stride(2) != 1 or q.stride(1) != hd:
            q = q.contiguous()
        if keys.stride() != vals.stride() or keys.stride(2) != 1:
            keys, vals = keys.contiguous(), vals.contiguous()
        out = torch.empty((t, nh * hd), dtype=torch.float32)
        rc = self.lib.pe_prefill_attention(q.data_ptr(), q.stride(0), keys.data_ptr(), vals.data_ptr(), keys.stride(0),
                                           keys.stride(1), out.data_ptr(), t, nh, nkv, hd, scale, int(bf16),
                                           self.threads)
        if rc != 0:
            raise ValueError(f"prefill attention kernel refused q {tuple(q.shape)}, keys {tuple(keys.shape)}")
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
               int8_activations: int = 0, bf16_activations: bool = False) -> torch.Tensor:
        """``x @ weight.T (* scale) + bias`` for float32 ``x`` (..., K); ``weight`` (N, K)
        float32, bfloat16 (widened exactly in the kernels, float32 products), or int8 with
        ``scale`` (N,) or (N, K / group) float32. ``out``: a
        contiguous float32 buffer of at least M * N elements to write into (a decode
        step's logits, reused instead of a fresh ~6 MB allocation that faults in its
        pages each step). ``int8_activations``: with int8 weights, quantize ``x`` to int8
        per 32 values and use integer dot products (``csrc/q8.cpp``): 1 one int8 row
        per row of ``x``, 2 a second one carrying the first's rounding error; 0 float32.
        ``bf16_activations``: with bfloat16 weights, round ``x`` to bfloat16 and multiply
        pairs with vdpbf16ps where the ISA path has it (``pe_bf16_dot``)."""
        if not weight.is_contiguous():
            raise ValueError("the CPU kernels need contiguous weights")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        m, k = x2.shape
        n = weight.shape[0]
        if out is not None and out.is_contiguous() and out.dtype == torch.float32 and out.numel() >= m * n:
            y = out.view(-1)[: m * n].view(m, n)
        else:
            y = torch.empty((m, n), dtype=torch.float32)
        b = ctypes.c_void_p(bias.data_ptr()) if bias is not None else None
        if weight.dtype == torch.int8 and int8_activations:
            group = 0 if scale.dim() == 1 else k // scale.shape[1]
            if k % Q8_BLOCK or group % Q8_BLOCK:
                raise ValueError(f"int8 activations need K ({k}) and the int8 group ({group}) to be multiples of {Q8_BLOCK}")
            pairs = 2 if int8_activations == 2 else 1
            xq = torch.empty(pairs * m * k, dtype=torch.int8)
            xs = torch.empty(pairs * m * k // Q8_BLOCK + k, dtype=torch.float32)  # scales, then k residuals
            self.lib.pe_linear_q8(x2.data_ptr(), k, weight.data_ptr(), scale.data_ptr(), b, y.data_ptr(), n, m, n, k,
                                  group, self.threads, xq.data_ptr(), xs.data_ptr(), pairs,
                                  xs[pairs * m * k // Q8_BLOCK:].data_ptr())
        elif weight.dtype == torch.int8 and scale.dim() == 2:  # blockwise: (N, K / group) scales
            group = k // scale.shape[1]
            self.lib.pe_linear_i8_grouped(x2.data_ptr(), k, weight.data_ptr(), scale.data_ptr(), b, y.data_ptr(), n,
                                          m, n, k, group, self.threads)
        elif weight.dtype == torch.bfloat16 and bf16_activations:
            xb = torch.empty(m * k, dtype=torch.bfloat16)
            self.lib.pe_linear_bf16dot(x2.data_ptr(), k, weight.data_ptr(), b, y.data_ptr(), n, m, n, k, self.threads,
                                       xb.data_ptr())
        elif weight.dtype == torch.bfloat16:
            self.lib.pe_linear_bf16(x2.data_ptr(), k, weight.data_ptr(), b, y.data_ptr(), n, m, n, k, self.threads)
        elif weight.dtype == torch.int8:
            self.lib.pe_linear_i8(x2.data_ptr(), k, weight.data_ptr(), scale.data_ptr(), b, y.data_ptr(), n,
                                  m, n, k, self.threads)
        else:
            self.lib.pe_linear_f32(x2.data_ptr(), k, weight.data_ptr(), b, y.data_ptr(), n, m, n, k, self.threads)
        return y.reshape(*shape[:-1], n)


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise KernelsUnavailable("no C++ compiler found (g++, c++ or clang++); fix: install one (Debian/Ubuntu: "
                                 "apt-get install g++; Fedora: dnf install gcc-c++) or set CXX to one")
    return cxx


def _compile(cxx: str, target: Path, isa: str = "auto") -> None:
    cmd = [cxx, "-O3", *isa_flags(isa), "-fopenmp", "-shared", "-fPIC", "-I", str(_KERNELS), "-o", str(target), str(_SOURCE)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_SECONDS)
    except subprocess.TimeoutExpired:
        raise KernelsUnavailable(f"compiling {_SOURCE.name} took over {_COMPILE_SECONDS} s: {' '.join(cmd)}; fix: "
                                 f"retry on a less busy machine (the result is cached)") from None
    except OSError as exc:
        raise KernelsUnavailable(f"running the C++ compiler {cxx} failed ({exc.strerror or exc}); fix: install g++ "
                                 f"or set CXX to a working compiler") from None
    if proc.returncode != 0 or not target.exists() or target.stat().st_size == 0:
        raise KernelsUnavailable(f"compiling {_SOURCE.name} failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}\nfix: "
                                 f"set CXX to another compiler (g++ >= 9 or clang >= 10), or option "
                                 f"cpu_kernels=False to use torch's matmul without this warning")


def cache_entry(isa: str = "auto") -> tuple[Path, list[str]]:
    """Where this host's library for ISA path ``isa`` lives in the cache (named by a
    digest of every kernel source, the CPU's ISA flags and the path's compiler flags)
    and the sources it is built from."""
    sources = [p for p in sorted(_KERNELS.iterdir()) if p.suffix in (".cpp", ".h")]
    digest = hashlib.blake2b(b"".join(p.read_bytes() for p in sources) + " ".join(isa_flags(isa)).encode(),
                             digest_size=8).hexdigest()
    try:
        return _cache_dir() / f"cpu-step-{isa}-{digest}-{_isa_tag()}.so", [p.name for p in sources]
    except UnsafeCache as exc:
        raise KernelsUnavailable(str(exc)) from None


def load(threads: int | None = None, isa: str = "auto") -> CpuKernels:
    """The kernels for this host and ISA path ``isa`` (:data:`ISA_CHOICES`; compiled on
    first use, cached by source, CPU and path in a private, signed cache:
    ``polyengine.cache``). Raises :class:`UnsupportedFeature` for a path this CPU cannot
    execute, and :class:`KernelsUnavailable`, whose message names the fix, where they
    cannot be built or loaded."""
    check_isa(isa)
    threads = threads or torch.get_num_threads()
    with _lock:
        if (threads, isa) in _loaded:
            return _loaded[threads, isa]
        path, sources = cache_entry(isa)
        record, reason = check(path)
        if record is None:
            cxx = _compiler()
            if reason != "missing":  # damaged, planted or foreign: never dlopen'ed, built again
                warnings.warn(f"cuda_torch: not loading the cached CPU kernels ({reason}); compiling them again",
                              stacklevel=3)
            store(path, lambda tmp: _compile(cxx, tmp, isa), {"sources": sources, "compiler": cxx, "isa": isa,
                                                             "flags": isa_flags(isa)})
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise KernelsUnavailable(f"loading the compiled kernels {path} failed ({exc}); fix: delete that file "
                                     f"(it is compiled again)") from None
        lib.pe_vector_width.restype = lib.pe_isa.restype = ctypes.c_int
        ptr, long_, int_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
        lib.pe_linear_f32.argtypes = [ptr, long_, ptr, ptr, ptr, long_, int_, long_, long_, int_]
        lib.pe_linear_i8.argtypes = [ptr, long_, ptr, ptr, ptr, ptr, long_, int_, long_, long_, int_]
        lib.pe_linear_i8_grouped.argtypes = [ptr, long_, ptr, ptr, ptr, ptr, long_, int_, long_, long_, long_, int_]
        lib.pe_linear_bf16.argtypes = lib.pe_linear_f32.argtypes
        lib.pe_linear_f32.restype = lib.pe_linear_i8.restype = lib.pe_linear_i8_grouped.restype = None
        lib.pe_linear_bf16.restype = None
        lib.pe_linear_bf16dot.argtypes = [*lib.pe_linear_f32.argtypes, ptr]
        lib.pe_linear_bf16dot.restype = None
        lib.pe_bf16_dot.restype = ctypes.c_int
        lib.pe_linear_q8.argtypes = [ptr, long_, ptr, ptr, ptr, ptr, long_, int_, long_, long_, long_, int_, ptr, ptr,
                                     int_, ptr]
        lib.pe_linear_q8.restype = None
        lib.pe_q8_isa.restype = ctypes.c_int
        lib.pe_decode.argtypes = [ptr, ptr, ptr, int_, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
        lib.pe_decode.restype = None
        lib.pe_prefill_attention.argtypes = [ptr, long_, ptr, ptr, long_, long_, ptr, int_, int_, int_, int_,
                                             ctypes.c_float, int_, int_]
        lib.pe_prefill_attention.restype = lib.pe_pa_bf16.restype = ctypes.c_int
        kernels = CpuKernels(lib, threads, path, isa)
        _loaded[threads, isa] = kernels
        return kernels


def q8_fits(config, group: int) -> bool:
    """Whether int8 activations apply: every projection's input size (hidden,
    intermediate, heads x head_dim) and the int8 weight group are multiples of 32."""
    return all(k % Q8_BLOCK == 0 for k in (config.hidden_size, config.intermediate_size, config.q_size)) and (
        group % Q8_BLOCK == 0)


_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
          "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


class _Layer(ctypes.Structure):
    _fields_ = ([("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)]
                + [(p, ctypes.c_void_p) for p in _PROJECTIONS]
                + [(p + "_scale", ctypes.c_void_p) for p in _PROJECTIONS]
                + [(p + "_bias", ctypes.c_void_p) for p in _PROJECTIONS])


class _Dims(ctypes.Structure):
    _fields_ = [(n, ctypes.c_long) for n in ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "layers",
                                             "cache_rows", "cache_len")] + [
        ("eps", ctypes.c_float), ("int8", ctypes.c_int), ("group", ctypes.c_long), ("threads", ctypes.c_int),
        ("q8", ctypes.c_int), ("kv_type", ctypes.c_int), ("bf16", ctypes.c_int)]


# The KV cache element types the fused step reads and writes (decode.cpp's PE_KV_*).
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class FusedDecoder:
    """A whole decode step on the CPU in one call (``csrc/decode.cpp``).

    Built once per engine over the weights dict of :class:`TorchWeights` (float32, or
    with the engine's int8 ``.qweight``/``.scale`` entries, or its bfloat16 ``.qweight``
    entries without scales: option ``weight_dtype``) and the decode state's cache
    shape; :meth:`step` advances M rows by one token each, writing their K/V into the
    cache tensors, and returns the hidden states after the last layer (before the final
    norm). Holds references to every tensor it points at.
    """

    def __init__(self, kernels: CpuKernels, tensors: dict[str, torch.Tensor], config, *, cache_rows: int,
                 cache_len: int, quantized: bool, int8_activations: int = 0, kv_dtype: torch.dtype = torch.float32,
                 bf16_activations: bool = False):
        c = config
        self.kv_dtype = kv_dtype
        self.kernels, self.config = kernels, c
        self._keep: list[torch.Tensor] = []

        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            if not t.is_contiguous() or t.dtype not in (torch.float32, torch.int8, torch.bfloat16):
                raise ValueError(f"the fused decoder needs contiguous float32/int8/bfloat16 tensors, got {t.dtype}")
            self._keep.append(t)
            return t.data_ptr()

        group = 0
        # quantized: int8 weights with scales, or bfloat16 ones (no scales)
        narrow = tensors[f"model.layers.0.{_NAMES['q']}.qweight"].dtype if quantized else torch.float32
        self.layers = (_Layer * c.num_hidden_layers)()
        for i in range(c.num_hidden_layers):
            pre = f"model.layers.{i}."
            entry = self.layers[i]
            entry.input_norm = ptr(tensors[pre + "input_layernorm.weight"])
            entry.post_norm = ptr(tensors[pre + "post_attention_layernorm.weight"])
            for p in _PROJECTIONS:
                name = pre + _NAMES[p]
                if narrow == torch.bfloat16:
                    setattr(entry, p, ptr(tensors[name + ".qweight"]))
                elif quantized:
                    scale = tensors[name + ".scale"]
                    g = 0 if scale.dim() == 1 else tensors[name + ".qweight"].shape[1] // scale.shape[1]
                    if i == 0 and p == "q":
                        group = g
                    elif g != group:
                        raise ValueError("the fused decoder needs one int8 grouping for every projection")
                    setattr(entry, p, ptr(tensors[name + ".qweight"]))
                    setattr(entry, p + "_scale", ptr(scale))
                else:
                    setattr(entry, p, ptr(tensors[name + ".weight"]))
                setattr(entry, p + "_bias", ptr(tensors.get(name + ".bias")))
        self.dims = _Dims(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                          c.head_dim, c.num_hidden_layers, cache_rows, cache_len, c.rms_norm_eps,
                          int(narrow == torch.int8), group, kernels.threads,
                          int(int8_activations) if narrow == torch.int8 else 0, KV_TYPES[kv_dtype],
                          (2 if bf16_activations else 1) if narrow == torch.bfloat16 else 0)
        if self.dims.q8 and not q8_fits(config, group):
            raise ValueError(f"int8 activations need every projection's input size and int8 group to be multiples "
                             f"of {Q8_BLOCK}")
        self.cos, self.sin = ptr(tensors["rope.cos"]), ptr(tensors["rope.sin"])
        self._scratch: torch.Tensor | None = None

    def _scratch_for(self, m: int) -> torch.Tensor:
        c, d = self.config, self.dims
        kmax = max(c.hidden_size, c.intermediate_size, c.q_size)
        need = m * (2 * c.q_size + 2 * c.kv_size + 2 * c.intermediate_size + 2 * c.hidden_size) + m * d.heads * d.cache_len
        need += d.threads * kmax + 2 * m * kmax // Q8_BLOCK + (2 * m * kmax + 3) // 4  # int8 activations
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.float32)
        return self._scratch

    def step(self, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor) -> torch.Tensor:
        """``x`` (M, hidden) float32 embeddings of the tokens fed, in place -> the last
        layer's hidden states; ``rows``/``positions`` (M,) int32; caches of the
        decoder's ``kv_dtype`` (float32, bfloat16 or float16)."""
        m = x.shape[0]
        if not (x.is_contiguous() and x.dtype == torch.float32 and k_cache.is_contiguous() and v_cache.is_contiguous()
                and k_cache.dtype == v_cache.dtype == self.kv_dtype):
            raise ValueError(f"the fused decoder needs contiguous float32 activations and {self.kv_dtype} caches")
        rows = rows.to(torch.int32).contiguous()
        positions = positions.to(torch.int32).contiguous()
        scratch = self._scratch_for(m)
        self.kernels.lib.pe_decode(ctypes.byref(self.dims), self.layers, x.data_ptr(), m, rows.data_ptr(),
                                   positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), self.cos, self.sin,
                                   scratch.data_ptr())
        return x
