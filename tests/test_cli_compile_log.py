"""A compile of the CPU kernels says so, and how long it took, on the command line's
progress logger (a stand-in compiler that copies the real library: test_kernel_cache)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from polyengine.logs import cli_logging  # noqa: E402

from test_kernel_cache import cache, real_library  # noqa: E402,F401 - the stand-in compiler's fixtures


def test_a_cpu_kernel_compile_says_so_and_how_long_it_took(cache, capsys):
    from polyengine.backends.cpu import kernels as cpu_kernels

    with cli_logging(0):
        cpu_kernels.load(1)
    err = capsys.readouterr().err
    assert "compiling CPU kernels for ISA path auto (first run, cached after)...\n" in err, err
    assert "compiled CPU kernels for ISA path auto in " in err and cache.compiles == 1
    cpu_kernels._loaded.clear()
    with cli_logging(0):
        cpu_kernels.load(1)
    assert "compil" not in capsys.readouterr().err  # cached: nothing compiles, nothing said
