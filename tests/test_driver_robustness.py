"""The driver keeps every other request running when one request's backend call, tool
or input goes wrong, and refuses input it cannot honour."""

from __future__ import annotations

import pytest

from polyengine import EngineConfig, SamplingParams
from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.driver import LLM, Scheduler
from polyengine.errors import InvalidRequest
from polyengine.models import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 5, 9], [1, 7, 3], [1, 2, 8]]


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny")


def _engine(model, slots=2):
    return ReferenceEngine(model, EngineConfig(max_slots=slots, max_prefill_length=16, max_cache_length=32))


class FlakyPrefill(ReferenceEngine):
    """Raises an untyped error (think: device out of memory) for one prompt."""

    def prefill(self, *, params, tokens, sampling, existing_prefix=None):
        if list(tokens) == [9]:
            raise RuntimeError("device ran out of memory")
        return super().prefill(params=params, tokens=tokens, sampling=sampling, existing_prefix=existing_prefix)


def test_a_backend_error_at_admission_fails_only_that_request(model):
    llm = LLM.from_engine(FlakyPrefill(model, EngineConfig(max_slots=2, max_prefill_length=16, max_cache_length=32)))
    want = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    good = [llm.submit(p, GREEDY) for p in PROMPTS[:2]]
    bad = llm.submit([9], GREEDY)
    more = llm.submit(PROMPTS[2], GREEDY)
    llm.scheduler.run_until(lambda: all(r.done for r in good + [bad, more]))
    assert bad.status == "failed" and isinstance(bad.error, RuntimeError)
    with pytest.raises(RuntimeError, match="out of memory"):
        bad.completion
    bad.cancel()  # harmless on a failed request
    assert [r.completion.token_ids for r in good + [more]] == want
    assert not llm.scheduler.busy
    with pytest.raises(RuntimeError, match="out of memory"):
        list(llm.stream([9], GREEDY))


class _RaisingToolRow:
    """A tool row with a bug: it raises on one token."""

    def __init__(self, bad_token):
        self.bad_token = bad_token

    def step(self, token):
        if token == self.bad_token:
            raise RuntimeError("tool crashed")
        return token, False


def test_a_tool_error_mid_step_fails_only_its_request(model):
    plain = LLM.from_engine(_engine(model))
    seqs = [c.token_ids for c in plain.generate(PROMPTS[:2], GREEDY)]
    bad_token = next(t for t in seqs[0][1:] if t not in seqs[1])
    sched = Scheduler(_engine(model), tool_factory=lambda: _RaisingToolRow(bad_token))
    a, b = sched.submit(PROMPTS[0], GREEDY), sched.submit(PROMPTS[1], GREEDY)
    sched.run_until(lambda: a.done and b.done)
    assert a.status == "failed" and "tool crashed" in str(a.error)
    assert b.completion.token_ids == seqs[1]
    assert len(sched.free_slots) == 2


def test_generate_feeds_a_batch_larger_than_the_queue(model):
    llm = LLM.from_engine(_engine(model, slots=1), max_queue=2)
    prompts = [[1, i + 3] for i in range(5)]
    outs = llm.generate(prompts, GREEDY)
    assert [c.token_ids for c in outs] == [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_non_integer_token_ids_are_refused(model):
    llm = LLM.from_engine(_engine(model))
    for bad in ([1.5, 2.7], [True, 3], ["7"]):
        with pytest.raises(InvalidRequest, match="must be integers"):
            llm.generate([bad], GREEDY)
    eng = _engine(model)
    params, state = eng.load_params(), eng.init_decode_state()
    prefix, _ = eng.prefill(params=params, tokens=[1, 2], sampling=GREEDY)
    state = eng.insert(prefix, state, 0)
    with pytest.raises(InvalidRequest, match="integer"):
        eng.generate(params, state, overrides={0: 3.7})


def test_stop_strings_without_a_tokenizer_are_refused(model):
    llm = LLM.from_engine(_engine(model))  # no tokenizer given
    with pytest.raises(InvalidRequest, match="stop strings need a tokenizer"):
        llm.generate([[1, 2]], SamplingParams(stop=["a"]))


def test_bad_sampling_values_raise_the_typed_error_from_the_constructor():
    with pytest.raises(InvalidRequest, match=r"top_p.*\(0.0, 1.0\]"):
        SamplingParams(top_p=2)


def test_a_forced_token_ends_a_speculative_step(model):
    """With k tokens per step, a forced token replaces the rest of that step's tokens,
    so every forced token is fed through an override, one per step."""
    from test_driver import ScriptedEngine

    from polyengine import ResultTokens

    class TwoPerStep(ScriptedEngine):
        def generate(self, params, state, *, overrides=None):
            self.overrides.append(dict(overrides or {}))
            if overrides:
                state["last"] = overrides[0]
            toks = [self.script[state["pos"]], self.script[state["pos"] + 1]]
            state.update(pos=state["pos"] + 2, last=toks[-1])
            return state, ResultTokens(tokens=[toks], valid=[[True, True]], lengths=[state["pos"]])

    tok = model.tokenizer
    ps, pe = tok.token_to_id("<|python_start|>"), tok.token_to_id("<|python_end|>")
    os_, oe = tok.token_to_id("<|output_start|>"), tok.token_to_id("<|output_end|>")
    expr, result = tok.encode("2+3"), tok.encode("5")
    script = [ps, *expr, pe] + tok.encode("z") * 40
    engine = TwoPerStep(script, model.config.vocab_size, model.eos_token_ids[0])
    engine.overrides = []
    out = LLM.from_engine(engine, tok).generate([[1]], SamplingParams(max_tokens=12))[0].outputs[0]
    block = [os_, *result, oe]
    n = len(expr) + 2
    assert out.token_ids[: n + len(block)] == [ps, *expr, pe, *block]
    assert out.forced[n : n + len(block)] == [1] * len(block)
    fed = [o[0] for o in engine.overrides if o]
    assert [f.token for f in fed[: len(block)]] == block
    # each names the completion index it replaces: the forced block sits at n, n+1, n+2
    assert [f.position for f in fed[: len(block)]] == [n, n + 1, n + 2]
