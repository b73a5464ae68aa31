"""What machine the numbers come from: CPU model, ISA flags, cores, load, versions.

Every table prints this, because the same code is 100x apart on two CPUs (bf16 on a
host with AMX versus one without) and ratios mean something only within one host.
torch's view of the CPU (``torch.backends.cpu.get_cpu_capability()``) is asked in a
short subprocess, so this process never imports torch.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from typing import Any

from polyengine.hostinfo import cpu_flags, cpu_model

__all__ = ["ISA_FLAGS", "EMULATIONS", "cpu_info", "emulated_cpu_info", "load_average", "package_versions", "has_fast_bf16",
           "torch_cpu", "llamacpp_install_command", "llamacpp_lib_command", "SOURCE_ROOTS", "compile_bytecode"]

# The flags that decide which fast paths exist (matmul widths, bf16/int8 units).
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vbmi", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


def cpu_info() -> dict[str, Any]:
    model, flags = cpu_model(), cpu_flags()
    mem = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return {
        "model": model,
        "isa": [f for f in ISA_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": None if mem is None else round(mem / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def has_fast_bf16(info: dict[str, Any]) -> bool:
    """Whether bf16 matmuls have hardware support here (without it they crawl)."""
    return bool({"amx_bf16", "avx512_bf16"} & set(info.get("isa", ())))


# CPU flag -> the ggml build options it allows. llama.cpp's GGML_NATIVE=ON (its default)
# compiles for the build host's CPU as the compiler sees it, which gave "Illegal
# instruction" at run time on some virtual machines; naming the detected ISA works.
_GGML_OPTIONS = (
    ("avx2", ("GGML_AVX", "GGML_AVX2")), ("fma", ("GGML_FMA",)), ("f16c", ("GGML_F16C",)),
    ("avx_vnni", ("GGML_AVX_VNNI",)), ("avx512f", ("GGML_AVX512",)), ("avx512vbmi", ("GGML_AVX512_VBMI",)),
    ("avx512_vnni", ("GGML_AVX512_VNNI",)), ("avx512_bf16", ("GGML_AVX512_BF16",)),
    ("amx_tile", ("GGML_AMX_TILE",)), ("amx_int8", ("GGML_AMX_INT8",)), ("amx_bf16", ("GGML_AMX_BF16",)),
)


def llamacpp_install_command(info: dict[str, Any]) -> str:
    """The pip command that builds llama-cpp-python for this CPU (x86; elsewhere the default build)."""
    isa = set(info.get("isa", ()))
    flags = ["-DGGML_NATIVE=OFF"] + [f"-D{o}=ON" for flag, opts in _GGML_OPTIONS if flag in isa for o in opts]
    flags.append("-DLLAVA_BUILD=OFF")  # the multimodal library is not needed and doubles the build
    if not {"avx2", "avx512f"} & isa:
        return "pip install llama-cpp-python"
    return f'CMAKE_ARGS="{" ".join(flags)}" pip install llama-cpp-python'


# Host kinds a run can emulate (``polyengine bench --emulate KIND``; docs/benchmarks.md,
# "An AVX2-only host, emulated"): every system of the run restricted to the instructions
# such a host has, on this one. ``flags``: the ISA_FLAGS such a host has (at most);
# ``env``: what restricts torch in each worker and probe (ATen's vectorized kernels,
# MKL's GEMM, oneDNN's bf16 GEMM: their documented switches); ``llamacpp_forbid``: CPU
# features llama.cpp's system info must not report (its library is built for the kind);
# ``isa``: the cpu backend's option ``isa`` for the kind.
EMULATIONS: dict[str, dict[str, Any]] = {
    "avx2": {
        "flags": ("avx2", "fma", "f16c"),
        "env": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
        "llamacpp_forbid": ("AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI", "AMX_INT8"),
        "isa": "avx2",
    },
}


def emulated_cpu_info(info: dict[str, Any], kind: str | None) -> dict[str, Any]:
    """``info`` as the host kind ``kind`` (EMULATIONS) would report it: its ISA flags only
    (those this CPU has); ``info`` itself for None."""
    if kind is None:
        return info
    return {**info, "isa": [f for f in info.get("isa", ()) if f in EMULATIONS[kind]["flags"]]}


def llamacpp_lib_command(info: dict[str, Any], version: str | None) -> str:
    """Shell commands that build llama.cpp's libraries for the ISA flags of ``info``, from
    llama-cpp-python's own source (the library its bindings were written against), into
    a folder for ``--llamacpp-lib`` (llama-cpp-python loads it through
    LLAMA_CPP_LIB_PATH)."""
    isa = set(info.get("isa", ()))
    flags = ["-DGGML_NATIVE=OFF"] + [f"-D{o}=ON" for flag, opts in _GGML_OPTIONS if flag in isa for o in opts]
    pin = f"=={version}" if version else ""
    src = f"llama_cpp_python-{version}" if version else "llama_cpp_python-*"
    return (f"pip download --no-deps --no-binary :all: llama-cpp-python{pin} -d lcp && tar xzf lcp/*.tar.gz -C lcp && "
            f"cmake -S lcp/{src} -B lcp/build -DCMAKE_BUILD_TYPE=Release {' '.join(flags)} -DLLAVA_BUILD=OFF && "
            f"cmake --build lcp/build -j --target llama   # then: --llamacpp-lib lcp/build/bin")


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def package_versions(names: tuple[str, ...] = ("polyengine", "numpy", "torch", "transformers", "llama_cpp_python", "gguf")) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


# The packages whose folders hold polyengine's modules: pyproject.toml's package-dir roots
# (an editable install maps each to its own folder; a wheel puts all under polyengine/).
SOURCE_ROOTS = ("polyengine", "polyengine.backends.reference", "polyengine.backends.torch_common",
                "polyengine.backends.cpu", "polyengine.backends.cuda_torch", "polyengine.backends.tpu_jax",
                "polyengine.backends.neuron", "polyengine.conformance", "polyengine.serving", "polyengine.benchmarks")


def compile_bytecode() -> dict[str, Any]:
    """Compile polyengine's modules to bytecode where none is stored, as pip does when it
    installs a wheel (and as llama-cpp-python's and torch's installed modules are), so a
    worker's load time is an installed copy's: a source checkout run with
    ``PYTHONDONTWRITEBYTECODE=1`` (this project's hosts set it) or from a read-only tree
    would compile ~200 modules in every worker, 0.1 s of a 1B file's load here. Files that
    cannot be written stay as they are (the load then includes compiling them, and the
    report says how many). Returns ``{"folders", "compiled", "missing"}``."""
    import py_compile

    folders = []
    for name in SOURCE_ROOTS:
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:
            continue
        folders += [] if spec is None else list(spec.submodule_search_locations or [])
    folders = [f for f in dict.fromkeys(folders) if not any(f.startswith(o + os.sep) for o in folders)]
    stale = _without_bytecode(folders)
    missing = 0
    for source in stale:  # py_compile writes whatever PYTHONDONTWRITEBYTECODE says
        try:
            py_compile.compile(source, doraise=True)
        except (OSError, py_compile.PyCompileError):
            missing += 1
    return {"folders": folders, "compiled": len(stale) - missing, "missing": missing}


def _without_bytecode(folders: list[str]) -> list[str]:
    """The ``.py`` files under ``folders`` with no current bytecode beside them."""
    from importlib.util import cache_from_source

    out = []
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.endswith(".py"):
                    source = os.path.join(root, name)
                    compiled = cache_from_source(source)
                    if not os.path.exists(compiled) or os.path.getmtime(compiled) < os.path.getmtime(source):
                        out.append(source)
    return out


_TORCH_SNIPPET = (
    "import json, torch; print(json.dumps({'capability': torch.backends.cpu.get_cpu_capability(), "
    "'threads': torch.get_num_threads(), 'version': torch.__version__}))"
)


def torch_cpu(env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """torch's CPU capability, thread count and version, or None without torch; with
    ``env`` (an emulation's) set in its process.

    Run before any job, never beside one: on a small host it would skew the timings.
    """
    if importlib.util.find_spec("torch") is None:
        return None
    import json

    try:
        out = subprocess.run([sys.executable, "-c", _TORCH_SNIPPET], capture_output=True, text=True,
                             timeout=120, check=True, env={**os.environ, **(env or {})}).stdout
        return json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"capability": f"unknown (the torch probe failed: {type(exc).__name__})"}
