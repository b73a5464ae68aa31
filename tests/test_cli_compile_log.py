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


def test_a_neuron_graph_compile_says_so_and_how_long_it_took(tmp_path, monkeypatch, capsys):
    """The cache's compile step is a stand-in here (the real one is Inductor or neuronx-cc,
    tens of seconds); what is checked is that the cache announces it and times it."""
    from types import SimpleNamespace

    from polyengine.backends.neuron import cache as neuron_cache

    def fake_compile(module, args, compiler, *, workdir=None):
        return SimpleNamespace(seconds=0.0, source="compiled", path=None), lambda p: p.write_bytes(b"graph")

    monkeypatch.setattr(neuron_cache, "compile_graph", fake_compile)
    artifacts = neuron_cache.ArtifactCache(tmp_path / "cache", "inductor")
    key = neuron_cache.GraphKey("decode", (("bucket", {"kv_len": 128}),))
    with cli_logging(0):
        artifacts.get(key, (), lambda: (None, ()))
    err = capsys.readouterr().err
    assert "compiling the decode graph for {'kv_len': 128} with inductor (first run, cached after)...\n" in err, err
    assert "compiled the decode graph for {'kv_len': 128} with inductor in " in err


def test_a_jax_program_compile_says_how_long_it_took(capsys):
    pytest.importorskip("jax")
    from polyengine.backends.tpu_jax.observe import CompileLog

    log = CompileLog(per_bucket=("prefill",))
    with cli_logging(0):
        log.record("jit(prefill)", "128", 2.5, "compiled")
        log.record("jit(generate)", "-", 0.1, "cache")  # read from JAX's cache: nothing compiled, nothing said
    assert capsys.readouterr().err == "compiled the prefill program for bucket 128 in 2.5 s (first use in this process)\n"
