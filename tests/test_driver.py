"""The driver (continuous batching, stop conditions, tools, cancellation) on tiny models."""

from __future__ import annotations

import numpy as np
import pytest

from polyengine import Capabilities, EngineBase, Prefix, ResultTokens, SamplingParams
from polyengine.driver import LLM
from polyengine.engine import check_request
from polyengine.errors import InvalidRequest, QueueFull
from polyengine.models import load_model
from polyengine.sampling import raw_logprobs


@pytest.fixture(scope="module")
def tiny():
    with pytest.warns(UserWarning):
        return load_model("random:tiny-gqa")


def make_llm(model, **cfg) -> LLM:
    base = dict(max_slots=3, max_prefill_length=24, max_cache_length=48)
    return LLM(model, backend="reference", **{**base, **cfg})


@pytest.fixture(scope="module")
def llm(tiny):
    return make_llm(tiny)


PROMPTS = [[1, 10 + i, 20 + 2 * i, 30 + i % 3] for i in range(8)]


def test_more_requests_than_slots_all_finish_with_their_solo_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [llm.generate([p], greedy)[0].token_ids for p in PROMPTS]
    together = [c.token_ids for c in llm.generate(PROMPTS, greedy)]
    assert together == alone
    assert all(len(t) == 6 for t in together)
    assert not llm.scheduler.busy and len(llm.scheduler.free_slots) == 3


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], sp)[0]
    again = llm.generate([PROMPTS[0]], sp)[0]
    crowd = llm.generate([PROMPTS[3], PROMPTS[5], PROMPTS[0], PROMPTS[1]],
                         [sp.replace(seed=9), sp.replace(seed=10), sp, sp.replace(seed=11)])
    assert alone.token_ids == again.token_ids == crowd[2].token_ids
    assert alone.seed == 1234


def test_unseeded_requests_get_a_reported_seed_that_reproduces_them(llm):
    first = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    replay = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=6, ignore_eos=True, seed=first.seed))[0]
    assert replay.token_ids == first.token_ids


def test_n_samples_are_independent_and_sample_zero_matches_n1(llm):
    sp = SamplingParams(temperature=1.5, max_tokens=6, seed=77, n=3, ignore_eos=True)
    c = llm.generate([PROMPTS[1]], sp)[0]
    assert [o.index for o in c.outputs] == [0, 1, 2]
    seqs = [tuple(o.token_ids) for o in c.outputs]
    assert len(set(seqs)) == 3  # at temperature 1.5 over a 300-token vocab, equal draws are ~impossible
    solo = llm.generate([PROMPTS[1]], sp.replace(n=1))[0]
    assert list(seqs[0]) == solo.token_ids
    assert c.usage.completion_tokens == 18 and c.usage.total_tokens == 18 + 4


def test_n_larger_than_slots_is_refused(llm):
    with pytest.raises(InvalidRequest, match="n=4"):
        llm.generate([PROMPTS[0]], SamplingParams(n=4))


def _eos(llm):
    return llm.engine.eos_token_ids[0]


def test_eos_stops_unless_ignored_and_not_before_min_tokens(llm):
    eos = _eos(llm)
    push = SamplingParams(temperature=0, logit_bias={eos: 100.0}, max_tokens=5)
    c = llm.generate([PROMPTS[0]], push)[0]
    assert c.token_ids == [eos] and c.finish_reason == "stop" and c.outputs[0].stop_reason == eos
    assert c.text == ""
    c = llm.generate([PROMPTS[0]], push.replace(min_tokens=3))[0]
    assert len(c.token_ids) == 4 and eos not in c.token_ids[:3] and c.token_ids[3] == eos
    c = llm.generate([PROMPTS[0]], push.replace(ignore_eos=True))[0]
    assert len(c.token_ids) == 5 and eos not in c.token_ids and c.finish_reason == "length"


def test_template_end_of_turn_token_stops(tiny):
    tok = tiny.tokenizer
    assert set(tok.eos_token_ids) <= set(make_llm(tiny).engine.eos_token_ids)


def test_stop_token_ids(llm):
    solo = llm.generate([PROMPTS[4]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids
    stop_at = solo[2]
    c = llm.generate([PROMPTS[4]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[stop_at]))[0]
    first = solo.index(stop_at)
    assert c.token_ids == solo[: first + 1] and c.finish_reason == "stop" and c.outputs[0].stop_reason == stop_at


def test_stop_strings_are_cut_and_never_streamed(llm):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate(["hello"], sp)[0].text
    assert len(full) >= 4, full
    stop = full[2:4]
    c = llm.generate(["hello"], sp.replace(stop=[stop, "\x00never"]))[0]
    assert c.finish_reason == "stop" and c.outputs[0].stop_reason == stop
    assert c.text == full[: full.index(stop)]
    streamed = "".join(d.text for d in llm.stream("hello", sp.replace(stop=[stop])))
    assert streamed == c.text


def test_max_tokens_and_cache_limit(llm):
    c = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(c.token_ids) == 3 and c.finish_reason == "length"
    c = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, ignore_eos=True))[0]
    assert c.finish_reason == "length" and len(PROMPTS[0]) + len(c.token_ids) == 48


def test_stream_deltas_add_up_to_the_completion(llm):
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)
    deltas = list(llm.stream("hi there", sp))
    c = llm.generate(["hi there"], sp)[0]
    assert "".join(d.text for d in deltas) == c.text
    assert sum((d.token_ids for d in deltas), []) == c.token_ids
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])


def test_logprobs_are_the_raw_model_logprobs(llm):
    sp = SamplingParams(temperature=0.7, seed=3, max_tokens=4, logprobs=True, top_logprobs=3, ignore_eos=True,
                        repetition_penalty=1.3)
    c = llm.generate([PROMPTS[6]], sp)[0]
    out = c.outputs[0]
    assert len(out.logprobs) == len(out.top_logprobs) == 4
    eng = llm.engine
    prefix, _ = eng.prefill(params=eng.load_params(), tokens=PROMPTS[6], sampling=sp)
    raw = raw_logprobs(prefix.host_logits())
    assert out.logprobs[0] == pytest.approx(raw[out.token_ids[0]], abs=1e-5)
    top = np.argsort(-raw, kind="stable")[:3]
    assert list(out.top_logprobs[0]) == top.tolist()


def test_cancel_frees_the_slot_at_once_and_others_continue(llm):
    sched = llm.scheduler
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    keep = llm.submit(PROMPTS[0], sp)
    drop = llm.submit(PROMPTS[1], sp)
    llm.step()
    llm.step()
    assert len(sched.free_slots) == 1
    drop.cancel()
    assert len(sched.free_slots) == 2 and drop.status == "cancelled"
    assert drop.completion.finish_reason == "cancelled"
    sched.run_until(lambda: keep.done)
    assert keep.completion.token_ids == llm.generate([PROMPTS[0]], sp)[0].token_ids


def test_closing_a_stream_cancels_its_request(llm):
    stream = llm.stream(PROMPTS[2], SamplingParams(max_tokens=30, ignore_eos=True))
    next(stream)
    assert len(llm.scheduler.free_slots) == 2
    stream.close()
    assert len(llm.scheduler.free_slots) == 3 and not llm.scheduler.busy


def test_a_too_long_prompt_is_refused_and_the_others_go_on(llm):
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    good = [llm.submit(p, sp) for p in PROMPTS[:4]]
    llm.step()
    with pytest.raises(InvalidRequest) as exc:
        llm.submit(list(range(1, 30)), sp)
    assert "29 tokens" in str(exc.value) and "at most 24" in str(exc.value)
    llm.scheduler.run_until(lambda: all(r.done for r in good))
    assert [r.completion.token_ids for r in good] == [c.token_ids for c in llm.generate(PROMPTS[:4], sp)]
    with pytest.raises(InvalidRequest, match="prompt 1: prompt has 29 tokens"):
        llm.generate([PROMPTS[0], list(range(1, 30))], sp)
    assert not llm.scheduler.busy


def test_a_full_queue_is_refused_with_a_typed_error(tiny):
    llm = make_llm(tiny, max_slots=1)
    llm.scheduler.max_queue = 2
    sp = SamplingParams(temperature=0, max_tokens=2)
    a, b = llm.submit(PROMPTS[0], sp), llm.submit(PROMPTS[1], sp)
    with pytest.raises(QueueFull, match="full"):
        llm.submit(PROMPTS[2], sp)
    llm.scheduler.run_until(lambda: a.done and b.done)
    assert a.completion.finish_reason and b.completion.finish_reason


def test_bad_parameters_are_refused_before_queueing(llm):
    with pytest.raises(InvalidRequest, match="temperature"):
        llm.generate(["x"], {"temperature": -1})
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        llm.generate(["x"], SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        llm.generate([[1, 10**6]])
    assert not llm.scheduler.busy


def test_chat_uses_the_template(llm):
    msgs = [{"role": "user", "content": "hi"}]
    ids = llm.apply_chat_template(msgs)
    text = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert llm.tokenizer.decode(ids) == text
    c = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert c.prompt_token_ids == ids and len(c.token_ids) == 3


# -- the tool machine through a scripted token stream ---------------------------------


class ScriptedEngine(EngineBase):
    """Emits a fixed token script (after the prefill's first token) and records overrides."""

    name = "scripted"

    def __init__(self, script, vocab_size, eos):
        self.script = list(script)
        self.capabilities = Capabilities(dtypes=("int",), sampling_params=frozenset())
        self.max_concurrent_decodes, self.max_prefill_length, self.max_cache_length = 1, 16, 64
        self.vocab_size, self.eos_token_ids = vocab_size, (eos,)
        self.fed: list[int] = []

    def load_params(self):
        return None

    def init_decode_state(self):
        return {"num_slots": 1, "pos": None, "last": None}

    def prefill(self, *, params, tokens, sampling, existing_prefix=None):
        toks, sampling = check_request(self, tokens, sampling)
        prefix = Prefix(None, None, toks, sampling, self.name, self.script[0])
        return prefix, ResultTokens(tokens=[[self.script[0]]], valid=[[True]], lengths=[1])

    def insert(self, prefix, state, slot):
        state.update(pos=1, last=prefix.first_token)
        return state

    def generate(self, params, state, *, overrides=None):
        for _, (tok, _) in self.check_overrides(overrides, lambda i: (state["pos"], 1)).items():
            state["last"] = tok
        self.fed.append(state["last"])
        tok = self.script[state["pos"]]
        state.update(pos=state["pos"] + 1, last=tok)
        return state, ResultTokens(tokens=[[tok]], valid=[[True]], lengths=[state["pos"]])

    def free_resource(self, state, slot):
        state.update(pos=None, last=None)
        return state


def test_calculator_tool_forces_its_output_through_overrides(tiny):
    tok = tiny.tokenizer
    ps, pe = tok.token_to_id("<|python_start|>"), tok.token_to_id("<|python_end|>")
    os_, oe = tok.token_to_id("<|output_start|>"), tok.token_to_id("<|output_end|>")
    expr, after = tok.encode("6*7"), tok.encode(" ok")
    junk = tok.encode("zzzzz")
    eos = tiny.eos_token_ids[0]
    result = tok.encode("42")
    # the engine's own tokens while the tool output is forced are junk: they must be replaced
    script = [ps, *expr, pe, *junk[: 2 + len(result)], *after, eos]
    engine = ScriptedEngine(script, tiny.config.vocab_size, eos)
    llm = LLM.from_engine(engine, tok)
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=40))[0].outputs[0]
    forced_block = [os_, *result, oe]
    assert out.token_ids == [ps, *expr, pe, *forced_block, *after, eos]
    assert out.forced == [0] * (len(expr) + 2) + [1] * len(forced_block) + [0] * (len(after) + 1)
    # every forced token was fed into the next step through an override
    n = len(expr) + 2
    assert engine.fed[n : n + len(forced_block)] == forced_block
    assert "42" in out.text and "6*7" in out.text


def test_unsafe_tool_input_becomes_an_error_output_not_execution(tiny):
    tok = tiny.tokenizer
    ps, pe = tok.token_to_id("<|python_start|>"), tok.token_to_id("<|python_end|>")
    eos = tiny.eos_token_ids[0]
    expr = tok.encode("__import__('os').system('true')")
    engine = ScriptedEngine([ps, *expr, pe] + [5] * 40 + [eos], tiny.config.vocab_size, eos)
    out = LLM.from_engine(engine, tok).generate([[1]], SamplingParams(max_tokens=60))[0].outputs[0]
    assert "error" in out.text
