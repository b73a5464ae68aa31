"""The cuda_torch backend: the conformance suite on this machine's device (the CPU
here, CUDA where a GPU is present), discovery, refusals and the driver."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import polyengine  # noqa: E402
from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.backends.cuda_torch.engine import TorchEngine  # noqa: E402
from polyengine.backends.reference.engine import ReferenceEngine  # noqa: E402
from polyengine.driver import LLM  # noqa: E402
from polyengine.errors import InvalidRequest  # noqa: E402
from polyengine.models import load_model  # noqa: E402

pytest_plugins = ["pytester"]
CFG = EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=64)


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny-gqa")


@pytest.mark.slow
def test_conformance_suite_passes(pytester, tmp_path):
    report = tmp_path / "cuda_torch.json"
    rec = pytester.inline_run("--pyargs", "polyengine.conformance", "--polyengine-backend", "cuda_torch",
                              "-p", "no:cacheprovider", "--polyengine-report-json", str(report))
    failed = [r.nodeid for r in rec.getreports("pytest_runtest_logreport") if r.failed]
    assert not failed, failed
    doc = json.loads(report.read_text())
    assert doc["backend"] == "cuda_torch" and doc["device"]["backend"].startswith(("cpu", "cuda"))
    assert "float32" in doc["capabilities"]["dtypes"]


def test_auto_picks_cuda_torch_over_the_reference():
    info = polyengine.select_backend("auto")
    assert info.name == "cuda_torch"


def test_greedy_equals_the_reference_through_the_driver(model):
    prompts = [[1, 5, 9, 4, 2], [1, 7, 3], [1, 2, 8, 8, 2, 6, 6]]
    sp = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), SamplingParams(seed=3, max_tokens=9),
          SamplingParams(seed=4, temperature=0.7, top_p=0.9, max_tokens=10, logprobs=True, top_logprobs=2)]
    ref = LLM.from_engine(ReferenceEngine(model, CFG), model.tokenizer, tools=False).generate(prompts, sp)
    got = LLM.from_engine(TorchEngine(model, CFG), model.tokenizer, tools=False).generate(prompts, sp)
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids
    lp_got, lp_ref = got[2].outputs[0].logprobs, ref[2].outputs[0].logprobs
    np.testing.assert_allclose(lp_got, lp_ref, atol=1e-4)


@pytest.mark.parametrize(("options", "phrase"), [
    ({"attention": "flash"}, "attention='flash'"),
    ({"sampler_dtype": "float16"}, "sampler_dtype"),
    ({"device": "tpu"}, "device='tpu'"),
    ({"kv_block": 0}, "kv_block=0"),
])
def test_bad_options_are_refused(model, options, phrase):
    with pytest.raises(InvalidRequest) as exc:
        TorchEngine(model, CFG.model_copy(update={"options": options}))
    assert phrase in str(exc.value)


def test_sync_and_async_steps_agree(model):
    prompts = [[1, 4, 4, 2], [3, 9]]
    sp = SamplingParams(seed=11, max_tokens=10)
    runs = []
    for async_steps in (False, True):
        eng = TorchEngine(model, CFG.model_copy(update={"options": {"async_steps": async_steps}}))
        runs.append([c.token_ids for c in LLM.from_engine(eng, tools=False).generate(prompts, sp)])
    assert runs[0] == runs[1]


def test_weights_share_the_models_memory_on_the_cpu(model):
    eng = TorchEngine(model, CFG)
    w = eng.load_params()
    src = model.weights["model.layers.0.mlp.up_proj.weight"]
    assert w.tensors["model.layers.0.mlp.up_proj.weight"].data_ptr() == src.ctypes.data
