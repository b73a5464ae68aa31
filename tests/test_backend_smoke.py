"""One smoke test for every built-in backend that runs in this process: built through
its registered factory, driven by ``polyengine.LLM``, greedy and sampled requests
(``n > 1`` where ``bulk_insert`` is declared) give the reference's tokens, and the
reported log-probs agree. The conformance suite checks each rule in depth; this checks
that a backend, as a user gets it from the registry, serves through the driver.
(``tpu_jax_ray`` needs a Ray cluster: its file, tests/test_tpu_jax_ray.py, runs the same
check on one.)
"""

from __future__ import annotations

import numpy as np
import pytest

from polyengine import EngineConfig, SamplingParams
from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.conformance.models import build_model
from polyengine.driver import LLM
from polyengine.plugins import list_backends, select_backend

LIMITS = dict(max_slots=4, max_prefill_length=24, max_cache_length=64)  # the conformance suite's: compiled graphs reuse
PROMPTS = [[1, 5, 9, 4, 2], [1, 7, 3], [1, 2, 8, 8, 2, 6, 6]]
SAMPLING = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), SamplingParams(seed=3, max_tokens=9, n=2),
            SamplingParams(seed=4, temperature=0.7, top_p=0.9, max_tokens=10, logprobs=True, top_logprobs=2)]
IN_PROCESS = ("reference", "cpu", "tpu_jax", "neuron")
BACKENDS = [b.name for b in list_backends() if b.name in IN_PROCESS and not b.broken and b.probe().available]


def _options(backend: str) -> dict:
    # neuron's default compiler on the CPU ("export") keeps nothing on disk: no cache_dir
    return {}


@pytest.fixture
def quiet_jax(request):
    """XLA without its optimizations for tpu_jax: the models are tiny and compiling costs
    more than running."""
    if request.node.callspec.params["backend"] != "tpu_jax":
        yield
        return
    from polyengine.backends.tpu_jax.compat import import_torchax

    import_torchax()
    import jax

    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_registered_backend_serves_the_references_tokens_through_the_driver(backend, quiet_jax):
    model = build_model("gqa_llama3")
    factory = select_backend(backend).load_factory()
    engine = factory(model=model, config=EngineConfig(**LIMITS, options=_options(backend)))
    sampling = [s if s.n == 1 or engine.capabilities.bulk_insert else s.replace(n=1) for s in SAMPLING]
    want = LLM.from_engine(ReferenceEngine(model, EngineConfig(**LIMITS)), tools=False).generate(PROMPTS, sampling)
    got = LLM.from_engine(engine, tools=False).generate(PROMPTS, sampling)
    for a, b in zip(got, want):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs], backend
        assert [o.finish_reason for o in a.outputs] == [o.finish_reason for o in b.outputs], backend
    np.testing.assert_allclose(got[2].outputs[0].logprobs, want[2].outputs[0].logprobs, atol=1e-4)


def test_every_in_process_builtin_backend_is_smoked_here():
    assert {"reference", "cpu", "tpu_jax", "neuron"} <= set(BACKENDS), BACKENDS
