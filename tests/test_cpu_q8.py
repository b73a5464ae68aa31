"""The int8 x int8 (Q8_0-style) CPU kernels in ``backends/cpu/csrc/q8.cpp``.

The builds are the engine's own libraries, one per ISA path this CPU executes
(``cpu_kernels.load(isa=...)``, engine option ``isa``: "auto" is ``-march=native``, the
best path this CPU has; "avx512", "avx2" and "scalar" the forced lower ones, shared with
tests/test_cuda_torch.py through the kernel cache), plus one build of this file's own: the
library's one source (``csrc/polyengine_cpu.cpp``) native with the int8 products capped
(``-DPE_Q8_MAX_ISA=2``: 256-bit VNNI), a path no ISA option selects on an AVX-512 host.

Checked: the activation quantization equals a torch reference exactly (scales and
values, round half to even); the products equal a float64 product of the dequantized
operands up to float32 rounding (1e-5 of the sum of the terms' magnitudes); every path
gives the host path's results up to float rounding.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from polyengine.backends.cpu import build  # noqa: E402
from polyengine.hostinfo import cpu_flags, missing_for  # noqa: E402

from isa_paths import ISAS, kernels_for  # noqa: E402

ISA = {"avx512vnni": 3, "avxvnni": 2, "avx2": 1, "scalar": 0}
RTOL = 1e-5

_ptr, _long, _int = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


def _cxx() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _build(folder: Path, name: str, *flags: str) -> Path:
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler found (g++, c++ or clang++; or set CXX): the CPU kernels cannot be built")
    out = folder / f"q8_{name}.so"
    cmd = [cxx, "-O3", *flags, "-fopenmp", "-shared", "-fPIC", "-I", str(build.CSRC), "-o", str(out),
           str(build.SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-3000:]}"
    return out


def _load(path: Path | ctypes.CDLL) -> ctypes.CDLL:
    lib = path if isinstance(path, ctypes.CDLL) else ctypes.CDLL(str(path))
    lib.pe_q8_isa.restype = _int
    lib.pe_q8_isa.argtypes = []
    lib.pe_q8_quantize.restype = None
    lib.pe_q8_quantize.argtypes = [_ptr, _long, _int, _long, _ptr, _ptr]
    lib.pe_q8_linear.restype = None
    lib.pe_q8_linear.argtypes = [_ptr, _ptr, _int, _long, _ptr, _ptr, _long, _ptr, _ptr, _long, _long]
    return lib


def _has(*flags: str) -> bool:
    return set(flags) <= cpu_flags()


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    """name -> library: 'native' (isa auto) always, every forced ISA path this CPU runs,
    and the 256-bit VNNI cap where the CPU has AVX-512 VNNI."""
    libs = {"native": _load(kernels_for("auto").lib)}
    libs.update((isa, _load(kernels_for(isa).lib)) for isa in ISAS[1:] if not missing_for(isa))
    if _has("avx512_vnni", "avx512vl", "avx2"):
        folder = tmp_path_factory.mktemp("q8")
        libs["vnni256"] = _load(_build(folder, "vnni256", *build.isa_flags("auto"), "-DPE_Q8_MAX_ISA=2"))
    return libs


def quantize(lib, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.int8)
    xs = torch.empty(m, k // 32, dtype=torch.float32)
    lib.pe_q8_quantize(x.data_ptr(), x.stride(0), m, k, xq.data_ptr(), xs.data_ptr())
    return xq, xs


def linear(lib, xq, xs, w, ws, wgroup, bias=None) -> torch.Tensor:
    m, k = xq.shape
    n = w.shape[0]
    y = torch.full((m, n + 3), float("nan"))  # ldy > N: the kernel writes only its columns
    lib.pe_q8_linear(xq.data_ptr(), xs.data_ptr(), m, k, w.data_ptr(), ws.data_ptr(), wgroup,
                     bias.data_ptr() if bias is not None else None, y.data_ptr(), y.stride(0), n)
    assert y[:, n:].isnan().all()
    return y[:, :n]


def quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    xs = blocks.abs().amax(dim=2) / 127.0
    q = torch.round(blocks / xs[:, :, None]).clamp(-127, 127)
    q = torch.where(xs[:, :, None] > 0, q, torch.zeros_like(q))
    return q.to(torch.int8).reshape(m, k), xs


def dequantize(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    n, k = q.shape
    if scale.dim() == 1:
        return q.double() * scale.double()[:, None]
    return (q.double().reshape(n, k // group, group) * scale.double()[:, :, None]).reshape(n, k)


def product_ref(xq, xs, w, ws, wgroup, bias):
    """float64 y and the sum of the terms' magnitudes (the scale of float32 rounding)."""
    xd, wd = dequantize(xq, xs, 32), dequantize(w, ws, wgroup)
    y, mag = xd @ wd.T, xd.abs() @ wd.abs().T
    if bias is not None:
        y, mag = y + bias.double(), mag + bias.double().abs()
    return y, mag


def weights(g, n, k, wgroup):
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    shape = (n, k // wgroup) if wgroup else (n,)
    return w, torch.rand(shape, generator=g) * 0.02 + 1e-3


def assert_near(y, want, mag, rtol=RTOL):
    err = (y.double() - want).abs()
    bound = rtol * mag + 1e-30
    assert (err <= bound).all(), f"max error {(err - bound).max().item():.3g} over the bound"


def test_isa_paths(builds):
    native = builds["native"].pe_q8_isa()
    if _has("avx512_vnni", "avx512bw"):
        assert native == ISA["avx512vnni"]
    elif _has("avx_vnni", "avx2"):
        assert native == ISA["avxvnni"]
    elif _has("avx2"):
        assert native == ISA["avx2"]
    want = {"vnni256": ISA["avxvnni"], "avx2": ISA["avx2"], "scalar": ISA["scalar"],
            "avx512": ISA["avx512vnni"] if _has("avx512_vnni") else ISA["avx2"]}
    for name, lib in builds.items():
        if name in want:
            assert lib.pe_q8_isa() == want[name], name


def test_avxvnni_path_compiles(tmp_path):
    """The VEX-encoded AVX-VNNI path (Alder Lake and later) builds; this host may lack it."""
    cxx = _cxx()
    if cxx is None:
        pytest.skip("no C++ compiler found (g++, c++ or clang++; or set CXX)")
    probe = subprocess.run([cxx, "-mavxvnni", "-x", "c++", "-fsyntax-only", "-"], input="", capture_output=True,
                           text=True)
    if probe.returncode != 0:
        pytest.skip(f"{cxx} knows no -mavxvnni")
    _build(tmp_path, "avxvnni", "-march=haswell", "-mavxvnni")


@pytest.mark.parametrize("k", [32, 96, 576])
def test_quantize_equals_torch(builds, k):
    g = torch.Generator().manual_seed(k)
    m = 5
    x = torch.randn(m, k + 7, generator=g)[:, :k] * torch.logspace(-3, 2, m)[:, None]  # ldx > K
    x[1, :32] = 0  # an all-zero block: scale 0, values 0
    x[2, :32] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5] + [3.49] * 24)  # ties: half to even
    want_q, want_s = quantize_ref(x)
    for name, lib in builds.items():
        xq, xs = quantize(lib, x)
        assert torch.equal(xs, want_s), name
        assert torch.equal(xq, want_q), name
    assert want_s[1, 0] == 0 and want_q[2, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]


@pytest.mark.parametrize(("k", "wgroup"), [(32, 0), (32, 32), (96, 0), (96, 32), (96, 96),
                                           (576, 0), (576, 32), (576, 64), (576, 96),
                                           (1536, 0), (1536, 32), (1536, 64),
                                           (2080, 0), (2080, 32), (2080, 160), (2560, 64)])
def test_product_equals_float64_reference(builds, k, wgroup):
    lib = builds["native"]
    g = torch.Generator().manual_seed(k * 7 + wgroup)
    for m in (1, 3, 5, 17):
        x = torch.randn(m, k, generator=g)
        xq, xs = quantize(lib, x)
        for n in (1, 7, 64):
            w, ws = weights(g, n, k, wgroup)
            for bias in (None, torch.randn(n, generator=g)):
                want, mag = product_ref(xq, xs, w, ws, wgroup, bias)
                assert_near(linear(lib, xq, xs, w, ws, wgroup, bias), want, mag)
    # the float product of the unquantized x is near: x's rounding is half a step a value
    w, ws = weights(g, 64, k, wgroup)
    xd = dequantize(w, ws, wgroup)
    exact = x.double() @ xd.T
    err = (linear(lib, xq, xs, w, ws, wgroup) - exact).abs()
    assert (err <= (xs.double().repeat_interleave(32, 1) / 2) @ xd.abs().T + 1e-6).all()


def test_extremes_do_not_saturate(builds):
    """|x| = |w| = 127 everywhere: maddubs pairs at their largest (32258), int32 sums exact."""
    k, n = 1536, 9
    x = torch.full((2, k), -3.0)
    x[1, ::2] = 3.0
    w = torch.full((n, k), 127, dtype=torch.int8)
    w[::2, 1::2] = -127
    ws = torch.ones(n)
    for name, lib in builds.items():
        xq, xs = quantize(lib, x)
        assert xq.abs().min() == 127
        want, mag = product_ref(xq, xs, w, ws, 0, None)
        assert_near(linear(lib, xq, xs, w, ws, 0), want, mag)


@pytest.mark.parametrize(("m", "n", "k", "wgroup"), [(1, 64, 576, 0), (3, 7, 96, 32), (5, 64, 1536, 64),
                                                     (17, 13, 576, 96), (4, 8, 32, 32), (1, 9, 2080, 160)])
def test_every_path_gives_the_same_results(builds, m, n, k, wgroup):
    g = torch.Generator().manual_seed(m + n + k + wgroup)
    x = torch.randn(m, k, generator=g)
    w, ws = weights(g, n, k, wgroup)
    bias = torch.randn(n, generator=g)
    xq, xs = quantize(builds["native"], x)
    host = linear(builds["native"], xq, xs, w, ws, wgroup, bias)
    _, mag = product_ref(xq, xs, w, ws, wgroup, bias)
    for name, lib in builds.items():
        q2, s2 = quantize(lib, x)
        assert torch.equal(q2, xq) and torch.equal(s2, xs), name
        assert_near(linear(lib, xq, xs, w, ws, wgroup, bias), host.double(), mag, 2 * RTOL)
