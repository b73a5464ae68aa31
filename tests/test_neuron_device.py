"""The neuron backend's Neuron path (``compiler="neuronx"``), on a recording stand-in.

No Neuron device or installable torch-neuronx is at hand, so ``tests/neuron_standin``
stands in for torch-neuronx and neuronx-distributed: it parses the compiler flags as
neuronx-cc does (and applies its default auto-cast when ``--auto-cast=none`` is
missing), keeps state only through aliases, keeps weights and states in per-core
"device memory" and counts every byte a call moves, runs each core in a thread with
real collectives, and follows NxD's runtime rules (routing by input shapes, one
packer, initialize before calls, no weights in a saved artifact unless asked). These
tests check what the engine asks of it, that its tokens are the reference's, and, by
planting each mistake, that the stand-in would catch a wrong flag, a missing alias or a
cache that crosses to the host.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.backends.neuron.engine import NeuronEngine  # noqa: E402
from polyengine.backends.reference.engine import ReferenceEngine  # noqa: E402
from polyengine.conformance.models import build_model  # noqa: E402
from polyengine.driver import LLM  # noqa: E402
from polyengine.errors import InvalidRequest, UnsupportedFeature  # noqa: E402

STANDIN = Path(__file__).resolve().parent / "neuron_standin"
LIMITS = dict(max_slots=4, max_prefill_length=24, max_cache_length=64)
PROMPTS = [[1, 5, 9, 4, 2], [1, 7, 3], [1, 2, 8, 8, 2, 6, 6, 11, 30, 4, 4, 9], [40, 41]]
GREEDY = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=0.7),
          SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),  # up to the cache limit
          SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2)]


@pytest.fixture
def standin(monkeypatch):
    """torch_neuronx and neuronx_distributed importable from the stand-in; torch.jit's
    save and load of a stand-in program routed to it. Removed afterwards."""
    monkeypatch.syspath_prepend(str(STANDIN))
    import neuronx_distributed.trace.model_builder as mb
    from neuronx_distributed._device import RECORD

    save, load = torch.jit.save, torch.jit.load

    def jit_save(obj, f, *args, **kwargs):
        return mb.save(obj, f) if isinstance(obj, mb.Executor) else save(obj, f, *args, **kwargs)

    def jit_load(f, *args, **kwargs):
        return mb.load(f) or load(f, *args, **kwargs)

    monkeypatch.setattr(torch.jit, "save", jit_save)
    monkeypatch.setattr(torch.jit, "load", jit_load)
    RECORD.clear()
    yield RECORD
    for name in [m for m in sys.modules if m.split(".")[0] in ("torch_neuronx", "neuronx_distributed")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def model():
    return build_model("mha_tied")


def _engine(model, tmp_path, dtype="float32", **options):
    return NeuronEngine(model, EngineConfig(**LIMITS, dtype=dtype, options={
        "compiler": "neuronx", "cache_dir": str(tmp_path), **options}))


def _tokens(engine, sampling=GREEDY, prompts=PROMPTS):
    return [[o.token_ids for o in c.outputs] for c in LLM.from_engine(engine, tools=False).generate(prompts, sampling)]


def _cache_bytes(engine) -> int:
    c = engine.model.config
    return 2 * c.num_hidden_layers * engine.max_concurrent_decodes * c.num_key_value_heads * engine.buckets.cache * \
        c.head_dim * torch.tensor([], dtype=engine.torch_dtype).element_size()


def assert_cache_stays_on_the_device(calls: list[dict], cache_bytes: int) -> None:
    """No call moves as much as a quarter of the KV cache either way (the sampler's
    tables and a prefix do cross; the cache never does)."""
    worst = max(calls, key=lambda c: max(c["to_device"], c["to_host"]))
    assert max(worst["to_device"], worst["to_host"]) < cache_bytes / 4, (worst, cache_bytes)


# -- what the engine asks of the compiler and the runtime ----------------------------------


def test_compiler_arguments_aliases_and_a_weightless_artifact(standin, model, tmp_path):
    from neuronx_distributed._device import parse_flags

    eng = _engine(model, tmp_path, speculation=2)  # every kind of model: the draft's too
    (trace,) = standin.traces
    assert trace["tp_degree"] == 1
    assert set(trace["models"]) == {"context_24", "insert_24", "decode_4_65", "draft_4_65"}
    for key, m in trace["models"].items():
        assert m["flags"] == {"--model-type": "transformer", "-O": "-O2", "--auto-cast": "none"}, key
        if key.startswith("context"):
            assert m["aliases"] == {} and m["states"] == [], key
        else:  # the KV cache is state, aliased to the outputs holding its new value
            assert m["aliases"] == {"k_cache": 4, "v_cache": 5} and m["states"] == ["k_cache", "v_cache"], key
        assert not any("cache" in w for w in m["weights"]), key  # the cache is never a weight or an input
    names = {f"weights.{n.replace('.', '__')}" for n in eng._names}
    assert set(trace["models"]["decode_4_65"]["weights"]) == names  # every weight a parameter, none an input
    assert [s["weights_in_artifact"] for s in standin.saves] == [False]  # one artifact for every checkpoint
    (init,) = standin.initializations
    assert init["bytes"] == sum(t.numel() * t.element_size() for t in eng._weights.tensors.values()) + 8  # + tp_rank
    assert parse_flags(eng.on_device.description()["compiler_args"])["--auto-cast"] == "none"
    # bfloat16 as declared: no auto-cast, float32 accumulation.
    _engine(model, tmp_path, dtype="bfloat16", speculation=2)
    flags = standin.traces[-1]["models"]["decode_4_65"]["flags"]
    assert flags == {"--model-type": "transformer", "-O": "-O2", "--auto-cast": "none",
                     "--enable-mixed-precision-accumulation": True}


def test_greedy_equals_the_reference_and_the_cache_never_leaves_the_device(standin, model, tmp_path):
    eng = _engine(model, tmp_path, speculation=2)
    got = _tokens(eng)
    want = _tokens(ReferenceEngine(model, EngineConfig(**LIMITS)))
    assert got == want
    assert len(got[2][0]) == LIMITS["max_cache_length"] - len(PROMPTS[2])
    kinds = {c["model"].split("_")[0] for c in standin.calls}
    assert kinds == {"context", "insert", "decode", "draft"}
    assert_cache_stays_on_the_device(standin.calls, _cache_bytes(eng))


def test_a_second_checkpoint_loads_the_artifact_and_moves_only_its_weights(standin, model, tmp_path):
    _engine(model, tmp_path, speculation=1)
    other = build_model("mha_tied", seed=99)
    eng = _engine(other, tmp_path, speculation=1)
    assert len(standin.traces) == 1 and len(standin.initializations) == 2  # loaded from disk, weights moved once
    assert eng.compile_report[0]["source"] == "disk"
    assert _tokens(eng, GREEDY[:2], PROMPTS[:2]) == _tokens(ReferenceEngine(other, EngineConfig(**LIMITS)), GREEDY[:2],
                                                             PROMPTS[:2])


def test_sampled_streams_and_speculation_agree_on_the_device(standin, model, tmp_path):
    sampled = [SamplingParams(seed=3, max_tokens=14, frequency_penalty=0.6, repetition_penalty=1.2),
               SamplingParams(seed=4, temperature=0.7, top_p=0.9, top_k=20, max_tokens=14, n=2)]
    spec = _tokens(_engine(model, tmp_path, speculation=2), sampled, PROMPTS[:2])
    plain = _tokens(_engine(model, tmp_path, speculation=1), sampled, PROMPTS[:2])
    assert spec == plain


def test_tensor_parallel_over_two_cores_equals_one_core(standin, model, tmp_path):
    one = _engine(model, tmp_path, speculation=1)
    two = _engine(model, tmp_path, speculation=1, tp_degree=2)
    trace = standin.traces[-1]
    assert trace["tp_degree"] == 2
    init = standin.initializations[-1]
    assert init["cores"] == 2 and init["states"]["k_cache"] == (2, 4, 2, 64, 16)  # each core: 2 of the 4 KV heads
    # each core holds half of each split projection (and the whole embeddings, norms, head)
    assert init["bytes"] < 2 * standin.initializations[0]["bytes"]
    params, tokens = one.load_params(), [1, 5, 9, 4, 2, 3, 3]
    a = one.prefill(params=params, tokens=tokens, sampling=SamplingParams(seed=0))[0]
    b = two.prefill(params=two.load_params(), tokens=tokens, sampling=SamplingParams(seed=0))[0]
    np.testing.assert_allclose(b.host_logits(), a.host_logits(), atol=1e-5)  # one all-reduce: float32 rounding
    np.testing.assert_allclose(b.kv[0].numpy(), a.kv[0].numpy(), atol=1e-5)  # every head gathered back
    assert _tokens(two) == _tokens(ReferenceEngine(model, EngineConfig(**LIMITS)))
    assert_cache_stays_on_the_device([c for c in standin.calls], _cache_bytes(two))
    with pytest.raises(InvalidRequest, match="tp_degree=3 does not divide the model's 4 attention heads"):
        _engine(model, tmp_path, tp_degree=3)


def test_tensor_parallelism_and_the_device_path_are_refused_where_they_cannot_run(model, tmp_path, monkeypatch):
    with pytest.raises(UnsupportedFeature, match="tp_degree=2 on the CPU compile path"):
        NeuronEngine(model, EngineConfig(**LIMITS, options={"compiler": "inductor", "tp_degree": 2}))
    from polyengine.backends.neuron import plugin

    monkeypatch.setattr(plugin, "neuronx_installed", lambda: False)
    with pytest.raises(InvalidRequest, match="needs torch-neuronx and neuronx-distributed"):
        NeuronEngine(model, EngineConfig(**LIMITS, options={"compiler": "neuronx"}))


def test_a_newer_decode_state_takes_the_device_cache_over(standin, model, tmp_path):
    eng = _engine(model, tmp_path, speculation=1, async_steps=False)
    params = eng.load_params()
    old = eng.init_decode_state()
    prefix, _ = eng.prefill(params=params, tokens=[1, 2, 3], sampling=SamplingParams(temperature=0))
    old = eng.insert(prefix, old, 0)
    new = eng.init_decode_state()
    with pytest.raises(InvalidRequest, match="replaced by a newer one"):
        eng.generate(params, old)
    with pytest.raises(InvalidRequest, match="replaced by a newer one"):
        eng.insert(prefix, old, 1)
    new = eng.insert(prefix, new, 0)
    new, res = eng.generate(params, new)
    assert int(res.valid[0, 0]) == 1


# -- the stand-in catches each mistake it must ------------------------------------------


def test_the_standin_catches_a_wrong_or_missing_compiler_argument(standin, model, tmp_path, monkeypatch):
    from neuronx_distributed._device import CompilerError

    from polyengine.backends.neuron import nxd

    ref = ReferenceEngine(model, EngineConfig(**LIMITS))
    want = ref.prefill(params=ref.load_params(), tokens=[1, 5, 9, 4, 2], sampling=SamplingParams(seed=0))[0].host_logits()
    good = _engine(model, tmp_path / "good", speculation=1)
    logits = good.prefill(params=good.load_params(), tokens=[1, 5, 9, 4, 2], sampling=SamplingParams(seed=0))[0]
    np.testing.assert_allclose(logits.host_logits(), want, atol=1e-4)
    # Without --auto-cast=none the compiler casts float32 matmuls to bfloat16: the logits move.
    monkeypatch.setitem(nxd.COMPILER_ARGS, "float32", "--model-type=transformer -O2")
    cast = _engine(model, tmp_path / "cast", speculation=1)
    moved = cast.prefill(params=cast.load_params(), tokens=[1, 5, 9, 4, 2], sampling=SamplingParams(seed=0))[0]
    assert np.abs(moved.host_logits() - want).max() > 1e-3
    monkeypatch.setitem(nxd.COMPILER_ARGS, "float32", "--model-type=transformer -O2 --auto-cast=off")
    with pytest.raises(CompilerError, match="invalid choice: 'off'"):
        _engine(model, tmp_path / "bad", speculation=1)


def test_the_standin_catches_a_missing_alias(standin, model, tmp_path, monkeypatch):
    """Drop the aliases (and the cache outputs they name): the cache parameters are then
    weights, which no checkpoint holds, so loading fails; handed zeros as weights, every
    call's cache write is a value nobody keeps, as in a traced graph, and the tokens are
    no longer the reference's."""
    from polyengine.backends.neuron import nxd

    decode, checkpoints = nxd.OnDevice._decode, nxd.DeviceGraphs.checkpoints
    monkeypatch.setattr(nxd.OnDevice, "aliases", lambda self: {})
    monkeypatch.setattr(nxd.OnDevice, "_insert", lambda self, k, v, slot: (slot.to(torch.int32), *[nxd._pad(slot)] * 3))
    monkeypatch.setattr(nxd.OnDevice, "_decode", lambda self, *inputs: decode(self, *inputs)[:4])
    with pytest.raises(KeyError, match="no weight 'k_cache'"):
        _engine(model, tmp_path, speculation=1)

    def with_caches(self):
        return [{**c, "k_cache": torch.zeros(self._cache[0]), "v_cache": torch.zeros(self._cache[0])}
                for c in checkpoints(self)]

    monkeypatch.setattr(nxd.DeviceGraphs, "checkpoints", with_caches)
    got = _tokens(_engine(model, tmp_path, speculation=1), GREEDY[:1], PROMPTS[:1])
    want = _tokens(ReferenceEngine(model, EngineConfig(**LIMITS)), GREEDY[:1], PROMPTS[:1])
    assert got != want
    # An alias that is not one of the module's parameters is refused when tracing.
    monkeypatch.setattr(nxd.OnDevice, "aliases", lambda self: {} if self.kind == "context" else {
        self.k_cache.clone(): nxd.OUTPUTS, self.v_cache: nxd.OUTPUTS + 1})
    monkeypatch.setattr(nxd.OnDevice, "_decode", decode)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        _engine(model, tmp_path / "other", speculation=1)


def test_the_cache_check_catches_a_cache_that_crosses():
    calls = [{"model": "decode_4_64", "to_device": 300_000, "to_host": 2_000}]
    with pytest.raises(AssertionError):
        assert_cache_stays_on_the_device(calls, cache_bytes=266_240)


# -- prompts continuing a prefix (option prefix_reuse) --------------------------------------


SYSTEM = [1, 5, 9, 4, 2, 3, 3, 7, 8, 12, 14, 6, 2, 9, 10, 11, 13]  # one cache block and one more token
TURNS = [SYSTEM + [20, 21], SYSTEM + [22, 23, 24], SYSTEM + [25]]


def _generated(engine, prompts, sampling):
    """Each prompt in turn through the driver (so the later ones find the first one's
    prefix cached): the tokens and how many prompt tokens came from the cache."""
    llm = LLM.from_engine(engine, tools=False)
    done = [llm.generate([p], sampling)[0] for p in prompts]
    return [c.outputs[0].token_ids for c in done], [c.usage.cached_tokens for c in done]


def test_prefix_reuse_on_the_device_is_off_by_default_and_on_by_construction(standin, model, tmp_path):
    """On Neuron devices "auto" builds no continuation model (the engine refuses
    existing_prefix, as before); "on" adds one per (prefix, prompt) bucket pair to the NxD
    program, a continued prefill equals the whole prompt's, and the driver's prefix cache
    serves later prompts (their tokens the reference's), on one core and on two."""
    auto = _engine(model, tmp_path / "a")
    assert not auto.capabilities.prefix_reuse and not auto.capabilities.prefix_truncate
    assert not any(k.startswith("continuation") for k in standin.traces[-1]["models"])
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want, _ = _generated(ReferenceEngine(model, EngineConfig(**LIMITS)), TURNS, greedy)
    for tp in (1, 2):
        eng = _engine(model, tmp_path / f"on{tp}", prefix_reuse="on", tp_degree=tp)
        assert eng.capabilities.prefix_reuse and eng.capabilities.prefix_truncate
        assert eng.on_device.description()["continuations"] == [[24, 24]]
        assert {k for k in standin.traces[-1]["models"] if k.startswith("continuation")} == {"continuation_24_24"}
        params = eng.load_params()
        head, _ = eng.prefill(params=params, tokens=SYSTEM, sampling=SamplingParams(seed=0))
        whole, _ = eng.prefill(params=params, tokens=TURNS[1], sampling=SamplingParams(seed=0))
        standin.calls.clear()
        cont, _ = eng.prefill(params=params, tokens=TURNS[1][len(SYSTEM):], sampling=SamplingParams(seed=0),
                              existing_prefix=head)
        assert [c["model"] for c in standin.calls] == ["continuation_24_24"]
        np.testing.assert_allclose(cont.host_logits(), whole.host_logits(), rtol=1e-5, atol=1e-5)
        for got, full in zip(cont.kv, whole.kv):
            np.testing.assert_allclose(got.numpy(), full.numpy(), rtol=1e-5, atol=1e-5)
        got, cached = _generated(eng, TURNS, greedy)
        assert got == want, tp
        assert cached[0] == 0 and min(cached[1:]) >= 16, cached
        assert_cache_stays_on_the_device(standin.calls, _cache_bytes(eng))


def test_prefix_reuse_off_builds_no_continuation_graphs(model):
    """On the CPU compile path "off" leaves the continuation graphs out: fewer graphs to
    compile, and a prompt continuing a prefix is refused by name."""
    on = NeuronEngine(model, EngineConfig(**LIMITS, options={"compiler": "export"}))
    off = NeuronEngine(model, EngineConfig(**LIMITS, options={"compiler": "export", "prefix_reuse": "off"}))
    assert on.capabilities.prefix_reuse and ("continuation", 24, 24) in on.graphs
    assert not off.capabilities.prefix_reuse and not off.capabilities.prefix_truncate
    assert not any(name[0] == "continuation" for name in off.graphs) and len(off.graphs) < len(on.graphs)
    params = off.load_params()
    head, _ = off.prefill(params=params, tokens=SYSTEM, sampling=SamplingParams(seed=0))
    with pytest.raises(UnsupportedFeature, match="prefix reuse"):
        off.prefill(params=params, tokens=[20, 21], sampling=SamplingParams(seed=0), existing_prefix=head)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got, cached = _generated(off, TURNS, greedy)
    assert got == _generated(ReferenceEngine(model, EngineConfig(**LIMITS)), TURNS, greedy)[0] and cached == [0, 0, 0]


# -- the block KV layout on the device (option page_size) -----------------------------------


def test_pages_on_the_device_by_construction(standin, model, tmp_path):
    """With page_size the program's state is the block pools (this core's heads): prompts
    are written through slot mappings, slots share their prefix's blocks (no insert model),
    a write into a shared block copies it on the device first, and the tokens are the
    reference's, with speculation, on two cores, and through the prefix cache."""
    want = _tokens(ReferenceEngine(model, EngineConfig(**LIMITS)))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want_turns, _ = _generated(ReferenceEngine(model, EngineConfig(**LIMITS)), TURNS, greedy)
    for case, options in enumerate([dict(speculation=2), dict(tp_degree=2, prefix_reuse="on")]):
        eng = _engine(model, tmp_path / str(case), page_size=8, **options)
        blocks = LIMITS["max_slots"] * -(-eng.buckets.cache // 8)  # kv_pages 0: what the rows would hold
        assert eng.pages.capacity == blocks and eng.capabilities.page_size == 8
        assert not eng.capabilities.portable_prefix and not eng.capabilities.portable_prefix_tail
        models = standin.traces[-1]["models"]
        assert "copy_block" in models and not any(k.startswith("insert") for k in models)
        heads = model.config.num_key_value_heads // options.get("tp_degree", 1)
        assert standin.initializations[-1]["states"]["k_cache"] == (
            model.config.num_hidden_layers, blocks, heads, 8, model.config.head_dim)
        assert _tokens(eng) == want, case
        pool_bytes = 2 * model.config.num_hidden_layers * blocks * 8 * model.config.num_key_value_heads * \
            model.config.head_dim * 4
        assert_cache_stays_on_the_device(standin.calls, pool_bytes)
        if options.get("prefix_reuse") == "on":
            standin.calls.clear()
            got, cached = _generated(eng, TURNS, greedy)
            assert got == want_turns and min(cached[1:]) >= 16, cached
            # the later prompts continue the system prompt's blocks; its partly filled last one is copied first
            assert {"continuation_24_24", "copy_block"} <= {c["model"] for c in standin.calls}
        prefix, _ = eng.prefill(params=eng.load_params(), tokens=[1, 2, 3], sampling=SamplingParams(seed=0))
        with pytest.raises(UnsupportedFeature, match="export_prefix with the block KV layout on Neuron devices"):
            eng.export_prefix(prefix)
        prefix.kv.release()


def test_a_newer_decode_state_gives_the_older_ones_blocks_back(standin, model, tmp_path):
    eng = _engine(model, tmp_path, page_size=8, async_steps=False)
    params = eng.load_params()
    old = eng.init_decode_state()
    prefix, _ = eng.prefill(params=params, tokens=[1, 2, 3], sampling=SamplingParams(temperature=0))
    old = eng.insert(prefix, old, 0)
    old, _ = eng.generate(params, old)
    prefix.kv.release()
    assert eng.pages.free < eng.pages.capacity  # the slot holds its blocks
    eng.init_decode_state()
    assert eng.pages.free == eng.pages.capacity
    with pytest.raises(InvalidRequest, match="replaced by a newer one"):
        eng.generate(params, old)


@pytest.mark.slow
def test_the_conformance_suite_passes_on_the_device_path_with_pages_and_prefix_reuse(tmp_path):
    """The whole suite on the Neuron path (the recording stand-in, in a process of its own
    through tests/neuron_standin_site), with the options built by construction there:
    pages (a pool large enough for the programs: a bounded pool's refusals are the page
    pressure test's) and continuation models. bfloat16, the path's first dtype."""
    import json
    import os
    import subprocess

    site = Path(__file__).resolve().parent / "neuron_standin_site"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "POLYENGINE_NEURON_CACHE": str(tmp_path / "cache")}
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "polyengine", "conformance", "--backend", "neuron", "--option", "compiler=neuronx",
         "--option", "prefix_reuse=on", "--option", "page_size=16", "--option", "kv_pages=400",
         "--report-json", str(report)], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    doc = json.loads(report.read_text())
    assert doc["capabilities"]["dtypes"][0] == "bfloat16" and doc["capabilities"]["page_size"] == 16
    assert doc["capabilities"]["prefix_reuse"] and "one NxD model" in doc["device"]["backend"]
    assert all(v["failed"] == 0 for v in doc["summary"].values()) and doc["summary"]["differential"]["passed"] > 0
