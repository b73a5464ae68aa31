"""The neuron backend without compiling anything: discovery and the probe, imports,
buckets, artifact keys, and the sampler rollback it relies on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from polyengine import EngineConfig
from polyengine.errors import BackendUnavailable, InvalidRequest
from polyengine.plugins import reset_registry, select_backend

from imports import assert_imports_light

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fresh_registry():
    reset_registry()
    yield
    reset_registry()


def _run(code: str, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_listing_backends_imports_neither_torch_nor_torch_neuronx():
    assert_imports_light("from polyengine.plugins import list_backends; [b.to_dict() for b in list_backends()]",
                         heavy=("torch", "torch_neuronx"))
    from polyengine.plugins import list_backends

    row = {b.name: b.to_dict() for b in list_backends()}["neuron"]
    assert row["available"] and not row["accelerator"] and row["by_name_only"]
    assert "CPU compile path" in row["reason"] and "/dev/neuron" in row["reason"]


def test_the_backend_modules_never_import_torch_neuronx_without_neuron():
    """Importing every module of the backend (and building the CPU path's pieces) with
    torch_neuronx made unimportable: nothing reaches for it."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch_neuronx', 'neuronx_cc', 'libneuronxla', 'neuronx_distributed'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import polyengine.backends.neuron.engine, polyengine.backends.neuron.compile, polyengine.backends.neuron.cache\n"
        "import polyengine.backends.neuron.graphs, polyengine.backends.neuron.speculation, polyengine.backends.neuron.state\n"
        "import polyengine.backends.neuron.nxd\n"
        "from polyengine.backends.neuron.compile import compiler_version\n"
        "print(compiler_version('inductor'))\n"
        "print('torch_neuronx' in sys.modules or 'neuronx_distributed' in sys.modules)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False"


def test_probe_reasons_name_the_active_path(monkeypatch):
    from polyengine.backends.neuron import plugin

    monkeypatch.setattr(plugin, "neuron_devices", lambda: [])
    p = plugin.probe()
    assert p.available and not p.accelerator and p.by_name_only and "no Neuron device" in p.reason
    monkeypatch.setattr(plugin, "neuron_devices", lambda: ["/dev/neuron0", "/dev/neuron1"])
    monkeypatch.setattr(plugin, "neuronx_installed", lambda: False)
    p = plugin.probe()
    assert p.by_name_only and "torch-neuronx or neuronx-distributed is not installed" in p.reason
    assert "pip.repos.neuron.amazonaws.com" in p.reason and "neuronx-distributed" in p.reason
    monkeypatch.setattr(plugin, "neuronx_installed", lambda: True)
    p = plugin.probe()
    assert p.accelerator and not p.by_name_only and "2 device(s)" in p.reason and "one NxD model" in p.reason


def test_auto_never_picks_the_cpu_path_even_when_it_is_the_only_backend(monkeypatch):
    monkeypatch.setenv("POLYENGINE_BACKENDS", "neuron")
    assert select_backend("neuron").name == "neuron"  # by name: yes
    with pytest.raises(BackendUnavailable, match="no backend can run here"):
        select_backend("auto")


def test_auto_picks_neuron_where_its_devices_are(monkeypatch):
    from polyengine.backends.neuron import plugin

    monkeypatch.setattr(plugin, "neuron_devices", lambda: ["/dev/neuron0"])
    monkeypatch.setattr(plugin, "neuronx_installed", lambda: True)
    assert select_backend("auto").name == "neuron"


# -- buckets ------------------------------------------------------------------------------


def test_buckets_cover_the_limits_and_a_prompt_beyond_them_names_them():
    from polyengine.backends.neuron.buckets import Buckets

    b = Buckets.plan(EngineConfig(max_slots=8, max_prefill_length=300, max_cache_length=1024), tokens_per_step=3)
    assert b.prefill == (64, 128, 256, 300) and b.batch == (8,) and b.cache == 1026
    assert b.seq == (256, 512, 1024, 1026) and b.seq_for(257) == 512 and b.prompt(65) == 128
    with pytest.raises(InvalidRequest, match=r"fits no context-encoding bucket \(buckets: 64, 128, 256, 300\)"):
        b.prompt(301)
    small = Buckets.plan(EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=64, prefill_buckets=(8, 24)),
                         tokens_per_step=1, batch=(1, 2, 4))
    assert small.prefill == (8, 24) and small.seq == (64,) and small.batch_for(3) == 4
    for batch, seq, phrase in [((1, 2), (), "must end with 4"), ((2, 1, 4), (), "ascending"), ((), (32,), "must end with 64")]:
        with pytest.raises(InvalidRequest, match=phrase):
            Buckets.plan(EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=64), tokens_per_step=1,
                         batch=batch, seq=seq)


# -- artifact keys ------------------------------------------------------------------------


def test_artifact_keys_follow_config_bucket_dtype_and_compiler_never_weights():
    from polyengine.backends.neuron.cache import GraphKey
    from polyengine.conformance.models import build_model

    a, b = build_model("mha_tied"), build_model("mha_tied", seed=99)
    assert a.fingerprint != b.fingerprint  # two checkpoints ...
    key = lambda m, **kw: GraphKey.of("context", config=m.config, **{  # noqa: E731
        "bucket": {"prompt": 24}, "dtype": "float32", "compiler": "inductor", **kw}).digest
    assert key(a) == key(b)  # ... one artifact
    other = build_model("gqa_llama3")
    assert len({key(a), key(other), key(a, bucket={"prompt": 16}), key(a, dtype="bfloat16")}) == 4
    # Token ids and RoPE settings reach the graphs as inputs (the EOS mask, the RoPE tables).
    eos = a.config.model_copy(update={"eos_token_ids": (5,), "rope_theta": 1.0})
    assert GraphKey.of("context", config=eos, bucket={"prompt": 24}, dtype="float32", compiler="inductor").digest == key(a)


# -- the artifact cache: only this user's intact files are loaded ---------------------------


class _Planted:
    """A pickle that, if anything ever unpickled it, would leave a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    """An artifact cache of the test's own whose compiler writes a known artifact and whose
    loader records what it is handed and unpickles it, as Inductor's loader would (so a
    planted pickle that reached it would run). ``(cache module, cache, calls)``."""
    import pickle

    pytest.importorskip("torch")
    from polyengine.backends.neuron import cache as cache_mod
    from polyengine.backends.neuron import compile as compile_mod

    calls = {"compiled": 0, "loaded": []}

    def compile_graph(module, args, compiler, *, workdir=None):
        calls["compiled"] += 1
        graph = compile_mod.CompiledGraph(lambda *a: a, (), returns_aliases=False, path=None, seconds=0.0,
                                          source="compiled")
        return graph, lambda p: p.write_bytes(pickle.dumps({"artifact": "compiled here"}))

    def load_graph(path, aliases, compiler):
        calls["loaded"].append(path)
        pickle.loads(path.read_bytes())
        return compile_mod.CompiledGraph(lambda *a: a, aliases, returns_aliases=False, path=path, seconds=0.0,
                                         source="disk")

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(cache_mod, "compile_graph", compile_graph)
    monkeypatch.setattr(cache_mod, "load_graph", load_graph)
    monkeypatch.setattr(cache_mod, "_MEMO", {})
    return cache_mod, cache_mod.ArtifactCache(tmp_path / "cache", "inductor"), calls


def test_a_planted_pickle_where_an_artifact_is_expected_is_never_unpickled(tmp_path, monkeypatch, fake_cache):
    import hashlib
    import pickle
    import warnings

    cache_mod, cache, calls = fake_cache
    key = cache_mod.GraphKey("context", (("bucket", 24),))
    path = cache.path(key)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Planted(marker))
    path.write_bytes(payload)  # planted, first without a record, then with a forged one
    for forge in (False, True):
        if forge:
            path.write_bytes(payload)
            side = path.with_name(path.name + ".json")
            side.write_text(json.dumps({**json.loads(side.read_text()), "size": len(payload),
                                        "sha256": hashlib.sha256(payload).hexdigest()}))
            monkeypatch.setattr(cache_mod, "_MEMO", {})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graph, source = cache.get(key, (), lambda: (None, ()))
        assert source == "compiled" and not marker.exists() and path not in calls["loaded"]
        assert any("compiling it again" in str(w.message) for w in caught)
    assert calls["compiled"] == 2
    monkeypatch.setattr(cache_mod, "_MEMO", {})
    graph, source = cache.get(key, (), lambda: (None, ()))  # what this user wrote loads
    assert source == "disk" and calls["loaded"] == [path] and not marker.exists()


def test_a_damaged_artifact_is_compiled_again(monkeypatch, fake_cache):
    cache_mod, cache, calls = fake_cache
    key = cache_mod.GraphKey("token_generation", (("bucket", 4),))
    cache.get(key, (), lambda: (None, ()))
    path = cache.path(key)
    path.write_bytes(path.read_bytes()[:7])  # truncated
    monkeypatch.setattr(cache_mod, "_MEMO", {})
    with pytest.warns(UserWarning, match="truncated or replaced.*compiling it again"):
        _, source = cache.get(key, (), lambda: (None, ()))
    assert source == "compiled" and calls["compiled"] == 2 and calls["loaded"] == []


def test_an_artifact_cache_others_can_write_is_refused_before_compiling(tmp_path):
    pytest.importorskip("torch")
    import os

    from polyengine.backends.neuron.engine import NeuronEngine
    from polyengine.conformance.models import build_model
    from polyengine.errors import UnsafeCache

    shared = tmp_path / "shared-cache"
    shared.mkdir()
    os.chmod(shared, 0o777)
    cfg = EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=64,
                       options={"compiler": "inductor", "cache_dir": str(shared)})
    with pytest.raises(UnsafeCache, match=f"refusing the neuron artifact cache directory {shared}.*fix: chmod 700"):
        NeuronEngine(build_model("mha_tied"), cfg)


# -- the rollback primitive -----------------------------------------------------------------


def test_forget_undoes_record_over_several_tokens():
    torch = pytest.importorskip("torch")
    from polyengine.backends.torch_common.sampling import TorchSampler
    from polyengine.sampling import SamplingParams

    s = TorchSampler(16, 2, [1])
    s.install(0, SamplingParams(seed=1, frequency_penalty=0.5), [3, 4])
    before = {k: v.clone() for k, v in s.state.as_dict().items()}
    rows = torch.tensor([0])
    for t in (7, 7, 9):
        s.record(torch.tensor([t]), rows=rows)
    assert s.state.counts[0, 7] == 2 and s.state.step[0] == 3
    for t in (9, 7, 7):
        s.forget(torch.tensor([t]), rows=rows)
    after = s.state.as_dict()
    for name in before:
        if name != "last_token":
            assert torch.equal(before[name], after[name]), name
    np.testing.assert_array_equal(s.state.counts[1].numpy(), 0)
