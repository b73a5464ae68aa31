"""cuda_torch, the GPU device path: its probe (NVIDIA and AMD ROCm device files), its
refusals on a host without a GPU (naming the ``cpu`` backend), and the whole
conformance suite on its device path run on the CPU with option ``device='cpu'``: a
stand-in, named as one, for the GPU this CI never has (every slot from device data,
the packed results, the shared forward and sampler). The GPU itself: marker ``gpu``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.backends.cuda_torch import plugin  # noqa: E402
from polyengine.backends.cuda_torch.engine import CudaEngine  # noqa: E402
from polyengine.conformance import BackendConformance  # noqa: E402
from polyengine.driver import LLM  # noqa: E402
from polyengine.errors import BackendUnavailable, InvalidRequest, UnsupportedFeature  # noqa: E402
from polyengine.models import load_model  # noqa: E402

CFG = EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=64)
STAND_IN = {"device": "cpu"}
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny-gqa")


def _stand_in(model=None, config=None):
    return CudaEngine(model, config.model_copy(update={"options": {**STAND_IN, **config.options}}))


class TestCudaTorchDevicePathStandIn(BackendConformance):
    """The suite on cuda_torch's device path, run on the CPU (option device='cpu')."""

    @pytest.fixture
    def engine_factory(self):
        return _stand_in

    @pytest.fixture
    def conformance_tolerances(self):
        return "polyengine.backends.cuda_torch:conformance.toml"


@no_gpu
def test_without_a_gpu_it_is_by_name_only_and_says_to_use_cpu(model, monkeypatch):
    monkeypatch.setattr(plugin, "rocm_devices", lambda: [])
    monkeypatch.setattr(plugin, "cuda_devices", lambda: [])
    probe = plugin.probe()
    assert probe.available and probe.by_name_only and not probe.accelerator and "'cpu'" in probe.reason
    with pytest.raises(BackendUnavailable, match=r"use backend 'cpu' \(--backend cpu\)"):
        CudaEngine(model, CFG)


def test_rocm_device_files_are_a_gpu(monkeypatch):
    monkeypatch.setattr(plugin, "cuda_devices", lambda: [])
    monkeypatch.setattr(plugin.os.path, "exists", lambda p: p == "/dev/kfd")
    monkeypatch.setattr(plugin.glob, "glob", lambda p: ["/dev/dri/renderD128"] if "renderD" in p else [])
    probe = plugin.probe()
    assert probe.available and probe.accelerator and probe.reason.startswith("ROCm")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "")
    assert not plugin.probe().accelerator


@pytest.mark.parametrize("option", ["isa", "quantize", "kv_memory", "threads"])
def test_a_cpu_option_is_refused_naming_the_cpu_backend(model, option):
    with pytest.raises(InvalidRequest, match=f"'{option}' is an option of backend 'cpu'"):
        CudaEngine(model, CFG.model_copy(update={"options": {**STAND_IN, option: 1}}))


@no_gpu
def test_cuda_graphs_and_cuda_devices_are_refused_on_the_cpu(model):
    with pytest.raises(UnsupportedFeature, match="CUDA graphs need a CUDA device"):
        CudaEngine(model, CFG.model_copy(update={"options": {**STAND_IN, "cuda_graphs": True}}))
    with pytest.raises(InvalidRequest, match="use backend 'cpu'"):
        CudaEngine(model, CFG.model_copy(update={"options": {"device": "cuda:0"}}))


def test_the_stand_in_equals_the_cpu_engine(model):
    """Same model, same seed: the device path and the cpu engine (its fused host
    kernels) sample the same tokens."""
    from polyengine.backends.cpu.engine import CpuEngine

    prompts, sp = [[1, 5, 9, 4, 2], [3, 3, 8]], SamplingParams(seed=5, max_tokens=12)
    runs = [[c.token_ids for c in LLM.from_engine(eng, tools=False).generate(prompts, sp)]
            for eng in (_stand_in(model, CFG), CpuEngine(model, CFG))]
    assert runs[0] == runs[1]


@pytest.mark.gpu
def test_cuda_graphs_equal_eager_on_a_gpu(model):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    prompts, sp = [[1, 5, 9, 4, 2], [3, 3, 8]], SamplingParams(seed=5, max_tokens=70)
    cfg = EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=128)
    runs = []
    for graphs in (False, True):
        eng = CudaEngine(model, cfg.model_copy(update={"dtype": "float32", "options": {"cuda_graphs": graphs}}))
        runs.append([c.token_ids for c in LLM.from_engine(eng, tools=False).generate(prompts, sp)])
    assert runs[0] == runs[1]
