"""Hostile backends, class "an engine that cannot go on": a backend whose call raises
the typed ``EngineDead`` (a lost worker), at admission or at a step. The AsyncLLM must
fail every pending request (running, queued, and one being submitted) with
``EngineDead`` naming the cause, refuse later ones at once, and report itself dead;
nothing may hang. The synchronous LLM passes the typed error to its caller. (A backend
raising ``SystemExit``, ``KeyboardInterrupt`` or another ``BaseException`` does not end
the engine: tests/test_hostile_round3_engine.py.)
"""

from __future__ import annotations

import asyncio
import time

import pytest

from polyengine import LLM, AsyncLLM, EngineConfig, SamplingParams
from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.errors import EngineDead
from polyengine.models import load_model

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


class _Doom(BaseException):
    """Not an Exception: what a careless backend (or a library under it) may raise."""


KINDS = {
    "SystemExit": lambda: SystemExit(3),
    "KeyboardInterrupt": lambda: KeyboardInterrupt(),
    "BaseException": lambda: _Doom("the device vanished"),
    "EngineDead": lambda: EngineDead("worker 1 of 2 died"),
}
DEAD = ["EngineDead"]  # the others fail the requests of the call only (tests/test_hostile_round3_engine.py)


class DyingEngine(ReferenceEngine):
    """Raises ``kind`` in ``where``: the second prefill (the first request is running), or
    the first step."""

    def __init__(self, model, config, kind: str, where: str):
        super().__init__(model, config)
        self.kind, self.where, self.prefills = kind, where, 0

    def prefill(self, **kwargs):
        self.prefills += 1
        if self.where == "prefill" and self.prefills == 2:
            raise KINDS[self.kind]()
        return super().prefill(**kwargs)

    def generate(self, params, decode_state, *, overrides=None):
        time.sleep(0.005)  # 40 tokens take 0.2 s: the first request is still running when the others arrive
        if self.where == "generate" and self.prefills >= 1:
            raise KINDS[self.kind]()
        return super().generate(params, decode_state, overrides=overrides)


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny")


@pytest.mark.parametrize("where", ["prefill", "generate"])
@pytest.mark.parametrize("kind", DEAD)
def test_a_dying_engine_fails_every_request_with_a_typed_error(model, kind, where):
    engine = DyingEngine(model, EngineConfig(max_slots=2, max_cache_length=64), kind, where)
    llm = AsyncLLM.from_llm(LLM.from_engine(engine, model.tokenizer, tools=False, max_queue=4))

    async def main():
        results = await asyncio.wait_for(
            asyncio.gather(*(llm.generate([1, 5, 9 + i], LONG) for i in range(3)), return_exceptions=True), 20)
        start = asyncio.get_running_loop().time()
        with pytest.raises(EngineDead):
            await asyncio.wait_for(llm.submit([1, 2], LONG), 5)
        refused_in = asyncio.get_running_loop().time() - start
        await asyncio.wait_for(llm.shutdown(timeout=0), 10)
        return results, refused_in

    results, refused_in = asyncio.run(main())
    assert all(isinstance(r, EngineDead) for r in results), results
    expected = "worker 1 of 2 died" if kind == "EngineDead" else kind if kind != "BaseException" else "_Doom"
    assert all(expected in str(r) for r in results), results
    assert llm.dead is not None and expected in str(llm.dead)
    assert refused_in < 1.0
    assert llm.num_running == 0 and llm.num_waiting == 0


def test_the_synchronous_llm_passes_engine_dead_to_its_caller(model):
    engine = DyingEngine(model, EngineConfig(max_slots=1, max_cache_length=64), "EngineDead", "prefill")
    llm = LLM.from_engine(engine, model.tokenizer, tools=False)
    with pytest.raises(EngineDead, match="worker 1 of 2 died"):
        llm.generate([[1, 5, 9], [1, 5, 10]], LONG)
