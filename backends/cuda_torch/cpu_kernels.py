"""The CPU decode step's matrix products, compiled for the host at first use.

``kernels/linear.cpp`` holds skinny products ``y = x @ W.T`` for a few rows of ``x``
(the live slots of a decode step), float32 or int8 weights with per-row scales. It
is compiled once per host ISA with the system's C++ compiler and ``-march=native``
into a cache folder, then called through ctypes on the tensors' memory: no Python
extension build, no torch headers, about a second of compiling. Where no compiler
works, :func:`load` says why and the engine stays on ``torch.nn.functional.linear``.

Only the CPU path uses it, for float32 activations and at most :data:`MAX_ROWS` rows
(beyond that a GEMM library is compute-bound and faster); it is a switch of the
engine (option ``cpu_kernels``), kept because the benchmark shows it helps.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CpuKernels", "load", "quantize_int8", "dequantize_int8", "MAX_ROWS"]

MAX_ROWS = 16
_SOURCE = Path(__file__).with_name("kernels") / "linear.cpp"
_lock = threading.Lock()
_loaded: dict[int, "CpuKernels"] = {}


def _cache_dir() -> Path:
    base = os.environ.get("POLYENGINE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "polyengine")
    return Path(base) / "kernels"


def _isa_tag() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.blake2b((platform.machine() + flags).encode(), digest_size=6).hexdigest()


@dataclass
class CpuKernels:
    lib: ctypes.CDLL
    threads: int
    path: Path

    @property
    def vector_width(self) -> int:
        return int(self.lib.pe_vector_width())

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               scale: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (* scale) + bias`` for float32 ``x`` (..., K); ``weight`` (N, K)
        float32, or int8 with ``scale`` (N,) float32."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        m, k = x2.shape
        n = weight.shape[0]
        y = torch.empty((m, n), dtype=torch.float32)
        b = ctypes.c_void_p(bias.data_ptr()) if bias is not None else None
        if weight.dtype == torch.int8 and scale.dim() == 2:  # blockwise: (N, K / group) scales
            group = k // scale.shape[1]
            self.lib.pe_linear_i8_grouped(x2.data_ptr(), k, weight.data_ptr(), scale.data_ptr(), b, y.data_ptr(), n,
                                          m, n, k, group, self.threads)
        elif weight.dtype == torch.int8:
            self.lib.pe_linear_i8(x2.data_ptr(), k, weight.data_ptr(), scale.data_ptr(), b, y.data_ptr(), n,
                                  m, n, k, self.threads)
        else:
            self.lib.pe_linear_f32(x2.data_ptr(), k, weight.data_ptr(), b, y.data_ptr(), n, m, n, k, self.threads)
        return y.reshape(*shape[:-1], n)


def _compile(target: Path) -> None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (g++, c++ or clang++; or set CXX)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(tmp), str(_SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {_SOURCE.name} failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    os.replace(tmp, target)  # atomic: concurrent first uses never load a half-written file


def load(threads: int | None = None) -> CpuKernels:
    """The kernels for this host (compiled on first use, cached by source and ISA)."""
    threads = threads or torch.get_num_threads()
    with _lock:
        if threads in _loaded:
            return _loaded[threads]
        digest = hashlib.blake2b(_SOURCE.read_bytes(), digest_size=8).hexdigest()
        path = _cache_dir() / f"linear-{digest}-{_isa_tag()}.so"
        if not path.exists():
            _compile(path)
        lib = ctypes.CDLL(str(path))
        lib.pe_vector_width.restype = ctypes.c_int
        ptr, long_, int_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
        lib.pe_linear_f32.argtypes = [ptr, long_, ptr, ptr, ptr, long_, int_, long_, long_, int_]
        lib.pe_linear_i8.argtypes = [ptr, long_, ptr, ptr, ptr, ptr, long_, int_, long_, long_, int_]
        lib.pe_linear_i8_grouped.argtypes = [ptr, long_, ptr, ptr, ptr, ptr, long_, int_, long_, long_, long_, int_]
        lib.pe_linear_f32.restype = lib.pe_linear_i8.restype = lib.pe_linear_i8_grouped.restype = None
        kernels = CpuKernels(lib, threads, path)
        _loaded[threads] = kernels
        return kernels


def quantize_int8(weight: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: per output channel (``group=0``: ``weight ~ q * scale[:, None]``,
    scale ``(N,)``) or per block of ``group`` weights along a row (scale ``(N, K/group)``;
    ``K`` must be a multiple of ``group``)."""
    w = weight.to(torch.float32)
    n, k = w.shape
    blocks = w.reshape(n, k // group, group) if group else w.reshape(n, 1, k)
    scale = blocks.abs().amax(dim=2).clamp(min=1e-12) / 127.0  # (N, blocks)
    q = torch.round(blocks / scale[:, :, None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return q.contiguous(), (scale if group else scale[:, 0]).contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    if scale.dim() == 1:
        return q.to(torch.float32) * scale[:, None]
    return (q.to(torch.float32).reshape(n, scale.shape[1], -1) * scale[:, :, None]).reshape(n, k)
