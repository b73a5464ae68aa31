"""The mixed step (capability mixed_step, docs/design.md "The mixed step") on the cpu
engine: generate_with_prefill gives what prefill_batch and then generate give, bit for
bit, with the entries' rows inside the fused step's pass; it falls back to the two calls
where it cannot mix; it refuses before any work and changes nothing; the driver puts a
step's short pieces into the step without changing any output. Tiny model, the fused step
on each ISA path this CPU runs: a few seconds (a kernel build per path on first use)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("torch")

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.backends.cpu.plan import CpuHost  # noqa: E402
from polyengine.driver import LLM  # noqa: E402
from polyengine.engine import PrefillRequest  # noqa: E402
from polyengine.errors import InsufficientMemory, InvalidRequest, UnsupportedFeature  # noqa: E402
from polyengine.hostinfo import ISA_PATHS  # noqa: E402
from polyengine.models import load_model  # noqa: E402
from polyengine.plugins import create_engine  # noqa: E402

GREEDY = SamplingParams(temperature=0)
SEEDED = SamplingParams(temperature=1.1, seed=7, top_p=0.9, logprobs=True, top_logprobs=3)


@pytest.fixture(scope="module")
def tiny():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("random:tiny-gqa")


def _engine(tiny, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return create_engine("cpu", model=tiny, config=EngineConfig(
            max_slots=4, max_prefill_length=60, max_cache_length=96, options={"page_size": 4, **options}))


def _prompts(eng, seed: int, *lengths: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, eng.vocab_size, n).tolist() for n in lengths]


def _run(eng, mixed: bool, entry_lengths=(6, 3)) -> dict:
    """Two slots decode, then one call (mixed or the two calls) prefills a whole prompt and
    continues a prefix while slot 1 is forced a token; the entries are inserted and all four
    decode. Everything the caller sees, for comparison."""
    p, st = eng.load_params(), eng.init_decode_state()
    a, b, whole, cont = _prompts(eng, 0, 7, 13, entry_lengths[0], 5 + entry_lengths[1])
    for slot, (prompt, sampling) in enumerate(((a, SEEDED), (b, GREEDY))):
        prefix, _ = eng.prefill(params=p, tokens=prompt, sampling=sampling)
        st = eng.insert(prefix, st, slot)
    steps = []
    for _ in range(2):
        st, r = eng.generate(p, st)
        steps.append(np.asarray(r.tokens)[:2].copy())
    head, _ = eng.prefill(params=p, tokens=cont[:5], sampling=GREEDY)
    head_logits = head.host_logits().copy()
    requests = [PrefillRequest(whole, SEEDED), PrefillRequest(cont[5:], GREEDY, head)]
    overrides = {1: 11}
    if mixed:
        st, r, out = eng.generate_with_prefill(p, st, requests=requests, overrides=overrides)
        out = out.result()
    else:
        out = eng.prefill_batch(params=p, requests=requests)
        st, r = eng.generate(p, st, overrides=overrides)
    steps.append(np.asarray(r.tokens)[:2].copy())
    firsts = [(int(f.tokens[0, 0]), f.logprobs.copy(), prefix.host_logits().copy(), list(prefix.prompt_tokens))
              for prefix, f in out]
    for slot, (prefix, _) in zip((2, 3), out):
        st = eng.insert(prefix, st, slot)
    for _ in range(4):
        st, r = eng.generate(p, st)
        steps.append(np.asarray(r.tokens)[:4].copy())
    assert np.array_equal(head.host_logits(), head_logits), "the continued prefix changed"
    return {"steps": steps, "firsts": firsts}


def _equal(x: dict, y: dict) -> None:
    assert len(x["steps"]) == len(y["steps"])
    for i, (s, t) in enumerate(zip(x["steps"], y["steps"])):
        assert np.array_equal(s, t), f"step {i}: {s} != {t}"
    for (tok, lp, logits, prompt), (tok2, lp2, logits2, prompt2) in zip(x["firsts"], y["firsts"]):
        assert (tok, prompt) == (tok2, prompt2)
        assert np.array_equal(lp, lp2) and np.array_equal(logits, logits2)


@pytest.mark.parametrize("isa", ISA_PATHS)
def test_the_mixed_step_equals_the_two_calls(tiny, isa):
    """On each ISA path this CPU runs (the fused step's kernels built for it)."""
    if isa not in CpuHost.detect().runnable:
        pytest.skip(f"this CPU cannot run the {isa} path")
    eng = _engine(tiny, isa=isa)
    if eng.plan.kernels is None:
        pytest.skip(f"the CPU kernels do not build here: {eng.plan.kernels_fallback}")
    assert eng.capabilities.mixed_step > 0
    mixed = _run(eng, True)
    assert eng.mixed_steps == 1, "the entries did not run inside the step"
    _equal(mixed, _run(_engine(tiny, isa=isa), False))


def test_entries_past_the_declared_count_take_the_two_calls(tiny):
    eng = _engine(tiny)
    lengths = (eng.capabilities.mixed_step, 3)  # one token more than the step takes
    mixed = _run(eng, True, lengths)
    assert eng.mixed_steps == 0
    _equal(mixed, _run(_engine(tiny), False, lengths))


def test_undeclared_where_it_cannot_mix(tiny):
    for options in ({"mixed_step": False}, {"page_size": 0}, {"fused_decode": False}):
        eng = _engine(tiny, **options)
        assert eng.capabilities.mixed_step == 0, options
        with pytest.raises(UnsupportedFeature):
            eng.generate_with_prefill(eng.load_params(), eng.init_decode_state(),
                                      requests=[PrefillRequest([1, 2, 3], GREEDY)])


def test_a_refused_mixed_step_changes_nothing(tiny):
    """A bad entry or override refuses the call before any work; on a bounded pool that
    runs out, for the entries' pages or then for the step's own, the call is refused with
    InsufficientMemory and the pool's counts are as before; the slot's tokens go on as
    without the refused calls."""
    eng = _engine(tiny, kv_pages=40)  # 24 pages a context
    p, st = eng.load_params(), eng.init_decode_state()
    (a,) = _prompts(eng, 3, 7)
    st = eng.insert(eng.prefill(params=p, tokens=a, sampling=GREEDY)[0], st, 0)
    st, _ = eng.generate(p, st)  # position 7 written: the next step needs a page of its own
    with pytest.raises(InvalidRequest):
        eng.generate_with_prefill(p, st, requests=[PrefillRequest([eng.vocab_size], GREEDY)])
    with pytest.raises(InvalidRequest):
        eng.generate_with_prefill(p, st, requests=[PrefillRequest([1, 2], GREEDY)], overrides={3: 5})
    entries = [PrefillRequest(t, GREEDY) for t in _prompts(eng, 5, 6, 6)]  # two pages each
    hog = []
    for free in (4, 3):  # the step's page runs out after the entries took theirs; then the entries'
        while eng.pages.free > free:
            hog.append(eng.prefill(params=p, tokens=[1, 2, 3], sampling=GREEDY)[0])
        counts = eng.pages.counts()
        with pytest.raises(InsufficientMemory):
            eng.generate_with_prefill(p, st, requests=entries)
        after = eng.pages.counts()  # ids made and given back again count 0
        assert after[: len(counts)] == counts and not any(after[len(counts):]), (
            f"a refused mixed step ({free} pages free) changed the pool")
    assert eng.mixed_steps == 1  # the first call mixed, and was refused at the step's page
    hog.clear()
    st, r = eng.generate(p, st)
    fresh = _engine(tiny)
    fp, fs = fresh.load_params(), fresh.init_decode_state()
    fs = fresh.insert(fresh.prefill(params=fp, tokens=a, sampling=GREEDY)[0], fs, 0)
    for _ in range(2):
        fs, want = fresh.generate(fp, fs)
    assert int(np.asarray(r.tokens)[0, 0]) == int(np.asarray(want.tokens)[0, 0])


def test_the_driver_mixes_short_pieces_without_changing_outputs(tiny):
    """Requests arriving while others decode (4 slots, 10 requests of different lengths):
    outputs equal with the mixed step on and off; none mixed on a bounded page pool."""
    prompts = [np.random.default_rng(i).integers(3, 200, 3 + 5 * i % 37).tolist() for i in range(10)]

    def run(mixed: bool, **options):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llm = LLM(model=tiny, backend="cpu", max_slots=4, max_cache_length=128, max_prefill_length=64,
                      max_num_batched_tokens=16, options={"mixed_step": mixed, **options})
        sched = llm.scheduler
        reqs = [sched.submit(p, SamplingParams(temperature=0.8 if i % 2 else 0, seed=i, max_tokens=6 + 3 * i,
                                               ignore_eos=True)) for i, p in enumerate(prompts)]
        sched.run_until(lambda: all(r.done for r in reqs))
        return [r.completion.outputs[0].token_ids for r in reqs], sched.mixed_prefills

    mixed, count = run(True)
    assert count > 0, "no piece ran inside a step"
    plain, none = run(False)
    assert none == 0 and mixed == plain
    bounded, none = run(True, kv_pages=64)  # a bounded pool: the pieces run before the step, as planned
    assert none == 0 and bounded == plain


def test_the_kit_makes_the_two_calls_for_an_engine_that_declares_it(tiny):
    """EngineBase.generate_with_prefill: undeclared, UnsupportedFeature; declared by an
    engine that does not override it (the reference here), prefill_batch and then generate,
    the prefixes in a finished future; a refused step gives the new prefixes' pages back."""
    def reference(**options):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return create_engine("reference", model=tiny, config=EngineConfig(
                max_slots=2, max_prefill_length=60, max_cache_length=96, options=options))

    plain = reference(page_size=4)
    with pytest.raises(UnsupportedFeature):
        plain.generate_with_prefill(plain.load_params(), plain.init_decode_state(),
                                    requests=[PrefillRequest([1, 2, 3], GREEDY)])
    outs = []
    for mixed in (True, False):
        eng = reference(page_size=4)
        eng.capabilities = eng.capabilities.model_copy(update={"mixed_step": 16})
        p, st = eng.load_params(), eng.init_decode_state()
        st = eng.insert(eng.prefill(params=p, tokens=[5, 6, 7], sampling=GREEDY)[0], st, 0)
        requests = [PrefillRequest([8, 9, 10, 11], SEEDED)]
        if mixed:
            held = eng.pages.counts()
            with pytest.raises(InvalidRequest):  # a bad override: refused after the prefill, its pages given back
                eng.generate_with_prefill(p, st, requests=requests, overrides={1: 3})
            after = eng.pages.counts()
            assert after[: len(held)] == held and not any(after[len(held):])
            st, r, done = eng.generate_with_prefill(p, st, requests=requests)
            out = done.result()
        else:
            out = eng.prefill_batch(params=p, requests=requests)
            st, r = eng.generate(p, st)
        outs.append((np.asarray(r.tokens)[0].tolist(), out[0][0].first_token, out[0][0].host_logits().tolist()))
    assert outs[0] == outs[1]
