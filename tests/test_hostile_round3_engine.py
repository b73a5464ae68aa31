"""Issue 38 (an earlier round's leftover): after a backend raised ``SystemExit`` every
later request got ``EngineDead``, with no way back but a restart.

A backend call that raises something that is not an Exception (``SystemExit``, any
other ``BaseException``; ``KeyboardInterrupt`` off the main thread) now fails the
requests of that call with a ``PluginError`` naming the backend and what it raised, and
the engine goes on: the other requests finish, later ones are served. A real Ctrl-C
(``KeyboardInterrupt`` on the main thread) still reaches the caller of the synchronous
API. ``EngineDead`` still ends the engine (tests/test_hostile_engine.py).
"""

from __future__ import annotations

import asyncio

import pytest

from polyengine import LLM, AsyncLLM, EngineConfig, SamplingParams
from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.errors import PluginError
from polyengine.models import load_model

pytestmark = pytest.mark.filterwarnings("ignore::polyengine.models.RandomWeightsWarning")

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class _Doom(BaseException):
    """Not an Exception: what a careless backend (or a library under it) may raise."""


KINDS = {"SystemExit": lambda: SystemExit(3), "KeyboardInterrupt": KeyboardInterrupt,
         "_Doom": lambda: _Doom("the device hiccuped")}


class OnceEngine(ReferenceEngine):
    """Raises ``kind`` once, in the second prefill or the second generate."""

    def __init__(self, model, config, kind: str, where: str):
        super().__init__(model, config)
        self.kind, self.where, self.calls = kind, where, {"prefill": 0, "generate": 0}

    def _maybe(self, call: str) -> None:
        self.calls[call] += 1
        if call == self.where and self.calls[call] == 2:
            raise KINDS[self.kind]()

    def prefill(self, **kwargs):
        self._maybe("prefill")
        return super().prefill(**kwargs)

    def generate(self, params, decode_state, *, overrides=None):
        self._maybe("generate")
        return super().generate(params, decode_state, overrides=overrides)


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny")


@pytest.mark.parametrize("where", ["prefill", "generate"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_backend_raising_a_base_exception_fails_only_that_call(model, kind, where):
    engine = OnceEngine(model, EngineConfig(max_slots=2, max_cache_length=64), kind, where)
    llm = AsyncLLM.from_llm(LLM.from_engine(engine, model.tokenizer, tools=False))

    async def main():
        first = await asyncio.wait_for(asyncio.gather(*(llm.generate([1, 5, 9 + i], SP) for i in range(2)),
                                                      return_exceptions=True), 30)
        later = await asyncio.wait_for(llm.generate([1, 2, 3], SP), 30)
        await llm.shutdown(timeout=0)
        return first, later

    first, later = asyncio.run(main())
    failed = [r for r in first if isinstance(r, BaseException)]
    assert failed and all(isinstance(r, PluginError) and kind in str(r) for r in failed), first
    if where == "prefill":  # the second request's prefill raised: the first one is not concerned
        assert not isinstance(first[0], BaseException) and len(first[0].outputs[0].token_ids) == 6
    assert llm.dead is None and len(later.outputs[0].token_ids) == 6


def test_the_synchronous_llm_turns_a_backend_sys_exit_into_an_error(model):
    engine = OnceEngine(model, EngineConfig(max_slots=1, max_cache_length=64), "SystemExit", "generate")
    llm = LLM.from_engine(engine, model.tokenizer, tools=False)
    with pytest.raises(PluginError, match="SystemExit"):
        llm.generate([[1, 5, 9]], SP)
    assert len(llm.generate([[1, 5, 9]], SP)[0].outputs[0].token_ids) == 6


def test_a_real_ctrl_c_still_reaches_the_caller(model):
    engine = OnceEngine(model, EngineConfig(max_slots=1, max_cache_length=64), "KeyboardInterrupt", "generate")
    llm = LLM.from_engine(engine, model.tokenizer, tools=False)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 5, 9]], SP)
