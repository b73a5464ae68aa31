"""Plugin discovery, selection and every PluginError path, in-process."""

from __future__ import annotations

import pytest

import polyengine
from polyengine import PROTOCOL_VERSION, BackendSpec, Probe, hookimpl
from polyengine.errors import BackendUnavailable, PluginError, UnknownBackend
from polyengine.plugins import get_registry, list_backends, register_plugin, reset_registry, select_backend

from mock_engine import MockEngine, MockPlugin, tiny_model


@pytest.fixture(autouse=True)
def fresh_registry():
    reset_registry()
    yield
    reset_registry()


def _names():
    return [b.name for b in list_backends()]


def test_reference_backend_is_discovered_through_its_entry_point():
    ref = {b.name: b for b in list_backends()}["reference"]
    assert ref.distribution == "polyengine"
    assert not ref.broken and ref.probe().available and not ref.probe().accelerator
    d = ref.to_dict()
    for key in ("name", "available", "accelerator", "reason", "install_hint", "distribution", "priority", "broken"):
        assert key in d


def test_mock_backend_registers_and_runs_through_the_protocol():
    register_plugin(MockPlugin(), "mock-plugin")
    assert "mock" in _names()
    engine = polyengine.create_engine("mock", model=tiny_model(), max_slots=2, max_prefill_length=8, max_cache_length=16)
    assert isinstance(engine, MockEngine) and isinstance(engine, polyengine.Engine)
    params = engine.load_params()
    state = engine.init_decode_state()
    prefix, first = engine.prefill(params=params, tokens=[3, 4], sampling=polyengine.SamplingParams())
    assert first.tokens[0, 0] == 7  # 3 + 4
    state = engine.insert(prefix, state, 1)
    state, res = engine.generate(params, state)
    assert res.row_tokens(1) == [8] and res.row_tokens(0) == []
    state, res = engine.generate(params, state, overrides={1: 20})
    assert res.row_tokens(1) == [21]
    state = engine.free_resource(state, 1)
    state, res = engine.generate(params, state)
    assert not res.valid.any()


def test_mock_engine_refuses_sampling_it_does_not_declare():
    register_plugin(MockPlugin(), "mock-plugin")
    engine = polyengine.create_engine("mock", model=tiny_model(), max_slots=1, max_prefill_length=8, max_cache_length=16)
    with pytest.raises(polyengine.UnsupportedFeature, match="top_p"):
        engine.prefill(params=None, tokens=[1], sampling=polyengine.SamplingParams(top_p=0.5))


def test_unknown_backend_lists_installed_ones():
    with pytest.raises(UnknownBackend) as exc:
        select_backend("nope")
    assert "reference" in str(exc.value) and "nope" in str(exc.value)


def test_unavailable_backend_says_why_and_how_to_fix():
    register_plugin(MockPlugin("gpuish", available=False, extra="cuda"), "gpuish-plugin")
    info = {b.name: b for b in list_backends()}["gpuish"]
    assert info.to_dict()["available"] is False
    with pytest.raises(BackendUnavailable) as exc:
        polyengine.create_engine("gpuish", model=tiny_model())
    assert "mock hardware missing" in str(exc.value)
    assert exc.value.install_hint == "pip install 'polyengine[cuda]'"


def test_auto_prefers_present_accelerators_by_their_priority_then_cpu_priority():
    """The order is data the specs carry (accelerator_priority, priority), not a list in core."""
    register_plugin(MockPlugin("cpu_fast", priority=70), "p1")  # above the cpu backend (60)
    assert select_backend("auto").name == "cpu_fast"
    register_plugin(MockPlugin("cudaish", accelerator=True, kind="cuda", accelerator_priority=100, priority=10), "p2")
    assert select_backend("auto").name == "cudaish"
    register_plugin(MockPlugin("tpuish", accelerator=True, kind="tpu", accelerator_priority=300), "p3")
    register_plugin(MockPlugin("neuronish", accelerator=True, kind="neuron", accelerator_priority=200), "p4")
    assert select_backend("auto").name == "tpuish"
    register_plugin(MockPlugin("absent_tpu", available=False, kind="tpu", accelerator_priority=900), "p5")
    assert select_backend("auto").name == "tpuish"
    # an accelerator backend whose hardware is absent ranks among CPU paths by priority
    register_plugin(MockPlugin("tpu_on_cpu", accelerator=False, kind="tpu", accelerator_priority=900, priority=60), "p6")
    assert select_backend("auto").name == "tpuish"


def test_auto_without_accelerators_ranks_cpu_paths_by_priority():
    register_plugin(MockPlugin("jaxish", kind="tpu", accelerator_priority=300, priority=40), "q1")
    register_plugin(MockPlugin("torchish", kind="cuda", accelerator_priority=100, priority=65), "q2")
    assert select_backend("auto").name == "torchish"


def test_install_hint_comes_from_the_spec():
    register_plugin(MockPlugin("hinted", available=False, install_hint="pip install mysdk (from the vendor's index)"), "h1")
    with pytest.raises(BackendUnavailable) as exc:
        select_backend("hinted")
    assert exc.value.install_hint == "pip install mysdk (from the vendor's index)"


def test_allowlist_excludes_plugins_without_importing_them(monkeypatch, tmp_path):
    """POLYENGINE_BACKENDS excludes an installed plugin: its entry point is not even
    imported (a plugin that breaks at import can be switched off), and it is listed."""
    import polyengine.discovery as discovery

    monkeypatch.setenv("POLYENGINE_BACKENDS", "mock_allowed")
    reg = discovery.PluginRegistry()
    reg.register(MockPlugin("mock_allowed"), "a1")
    reg.register(MockPlugin("mock_denied"), "a2")
    backends = reg.backends()
    assert backends["reference"].excluded and not backends["reference"].usable
    assert backends["mock_denied"].excluded and backends["mock_allowed"].usable
    assert "excluded by POLYENGINE_BACKENDS" in backends["reference"].probe().reason
    with pytest.raises(BackendUnavailable, match="POLYENGINE_BACKENDS"):
        backends["mock_denied"].require_usable()
    assert reg._plugins["reference"].obj is None  # never imported


def test_auto_with_nothing_usable_explains_each_backend(monkeypatch):
    reg = get_registry()
    for info in reg.backends().values():
        monkeypatch.setattr(info, "_probe", Probe(False, False, f"{info.name} disabled for test"))
    with pytest.raises(BackendUnavailable, match="reference disabled for test"):
        select_backend("auto")


class _Malformed:
    @hookimpl
    def polyengine_backends(self):
        return [BackendSpec(name="Bad Name", description="x", protocol_version="99.0", probe=lambda: None, factory="nocolon")]


class _RaisingProbe:
    @hookimpl
    def polyengine_backends(self):
        def probe():
            raise RuntimeError("driver exploded")
        return [BackendSpec(name="flaky", description="d", protocol_version=PROTOCOL_VERSION, probe=probe, factory="m:f")]


class _NotAList:
    @hookimpl
    def polyengine_backends(self):
        return "oops"


class _RaisingHook:
    @hookimpl
    def polyengine_backends(self):
        raise ImportError("no module named secret_sdk")


class _BadFactory:
    @hookimpl
    def polyengine_backends(self):
        return [BackendSpec(name="nofactory", description="d", protocol_version=PROTOCOL_VERSION,
                            probe=lambda: Probe(True), factory="polyengine.engine:does_not_exist")]


class _BadHookSignature:
    @hookimpl
    def polyengine_backends(self, unexpected_argument):
        return []


def test_malformed_spec_is_listed_broken_and_raises_on_use():
    register_plugin(_Malformed(), "malformed-plugin")
    broken = [b for b in list_backends() if b.plugin == "malformed-plugin"]
    assert len(broken) == 1 and broken[0].broken
    msg = str(broken[0].error)
    assert "malformed-plugin" in msg and "protocol" in msg and "name" in msg and "factory" in msg
    with pytest.raises(PluginError, match="malformed-plugin"):
        select_backend(broken[0].name)
    assert "reference" in _names()  # one broken plugin does not break the others


def test_probe_that_raises_marks_the_backend_broken():
    register_plugin(_RaisingProbe(), "flaky-plugin")
    info = {b.name: b for b in list_backends()}["flaky"]
    assert info.to_dict()["broken"] is True
    with pytest.raises(PluginError, match="driver exploded"):
        select_backend("flaky")
    assert select_backend("auto").name != "flaky"  # the broken backend is passed over


@pytest.mark.parametrize("plugin,needle", [(_NotAList(), "must return a list"), (_RaisingHook(), "secret_sdk")])
def test_hook_failures_are_broken_entries_named_after_the_plugin(plugin, needle):
    register_plugin(plugin, "odd-plugin")
    info = {b.name: b for b in list_backends()}["odd-plugin"]
    assert info.broken and needle in str(info.error)


def test_missing_factory_raises_plugin_error():
    register_plugin(_BadFactory(), "bf-plugin")
    with pytest.raises(PluginError, match="does_not_exist"):
        polyengine.create_engine("nofactory", model=tiny_model())


def test_invalid_hook_signature_is_a_broken_plugin():
    register_plugin(_BadHookSignature(), "sig-plugin")
    info = {b.name: b for b in list_backends()}["sig-plugin"]
    assert info.broken and "unexpected_argument" in str(info.error)


def test_two_plugins_claiming_one_name_make_that_name_broken_only():
    register_plugin(MockPlugin("twin"), "first-plugin")
    register_plugin(MockPlugin("twin"), "second-plugin")
    info = {b.name: b for b in list_backends()}["twin"]
    assert info.broken
    assert "first-plugin" in str(info.error) and "second-plugin" in str(info.error)
    with pytest.raises(PluginError, match="also claimed"):
        select_backend("twin")
    assert select_backend("reference").name == "reference"  # the others keep working


def test_bad_engine_config_is_a_typed_error():
    with pytest.raises(polyengine.InvalidRequest, match="max_prefill_length"):
        polyengine.create_engine("reference", model=tiny_model(), max_prefill_length=64, max_cache_length=32)


class _ExplodingFactory:
    @hookimpl
    def polyengine_backends(self):
        def factory(*, model, config):
            raise RuntimeError("CUDA error: out of memory")

        return [BackendSpec(name="boom", description="d", protocol_version=PROTOCOL_VERSION,
                            probe=lambda: Probe(True), factory=factory)]


def test_an_untyped_factory_error_is_blamed_on_its_plugin():
    register_plugin(_ExplodingFactory(), "boom-plugin")
    with pytest.raises(PluginError, match="boom-plugin.*RuntimeError: CUDA error"):
        polyengine.create_engine("boom", model=tiny_model())


def test_unset_limits_are_fitted_to_the_model():
    from polyengine.limits import DEFAULT_CONTEXT_LENGTH

    model = tiny_model()  # max_position_embeddings 2048 (the config default)
    big = type(model)(model.config.model_copy(update={"max_position_embeddings": 8192}), model.weights, source="big")
    # One default, decided once: the context length, and the whole context but one for the prompt.
    assert DEFAULT_CONTEXT_LENGTH == 2048
    assert (polyengine.EngineConfig().max_cache_length, polyengine.EngineConfig().max_prefill_length) == (2048, 2047)
    assert polyengine.EngineConfig(max_cache_length=100).max_prefill_length == 99
    for m in (model, big):
        engine = polyengine.create_engine("reference", model=m, max_slots=1)
        assert (engine.max_cache_length, engine.max_prefill_length) == (2048, 2047)
        engine = polyengine.create_engine("reference", model=m, max_slots=1, max_cache_length=None)  # None: unset
        assert (engine.max_cache_length, engine.max_prefill_length) == (2048, 2047)
    engine = polyengine.create_engine("reference", model=model, max_cache_length=100)
    assert (engine.max_cache_length, engine.max_prefill_length) == (100, 99)
    engine = polyengine.create_engine("reference", model=model, config=polyengine.EngineConfig(max_slots=1))
    assert (engine.max_cache_length, engine.max_prefill_length) == (2048, 2047)
    small = type(model)(model.config.model_copy(update={"max_position_embeddings": 64}), model.weights, source="small")
    engine = polyengine.create_engine("reference", model=small)
    assert (engine.max_cache_length, engine.max_prefill_length) == (64, 63)
    engine = polyengine.create_engine("reference", model=small, config=polyengine.EngineConfig())
    assert (engine.max_cache_length, engine.max_prefill_length) == (64, 63)
