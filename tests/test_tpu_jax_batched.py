"""tpu_jax's batched prefill (option batched_prefill, docs/tpu_jax.md "Batched prefill"):
prefill_batch runs entries that land in one output bucket as one program, and gives
each entry what its own prefill gives; after warm-up a batched workload compiles nothing."""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
if importlib.util.find_spec("torchax") is None:  # not importorskip: torchax imports only through compat
    pytest.skip("torchax is not installed (pip install 'polyengine[tpu]')", allow_module_level=True)

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.driver import LLM  # noqa: E402
from polyengine.engine import PrefillRequest  # noqa: E402
from polyengine.errors import InvalidRequest, UnsupportedFeature  # noqa: E402
from polyengine.models import load_model  # noqa: E402
from polyengine.backends.tpu_jax.engine import TpuJaxEngine  # noqa: E402

from test_prefix_cache import PrefillLog  # noqa: E402

pytestmark = pytest.mark.usefixtures("jax_compile_less")  # tiny models: compile time over run time

# A cache length no other test module uses: its engines' programs are its own, so the
# compile counts other modules assert in the same process do not depend on the order.
CFG = EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=56, prefill_buckets=(8, 16, 24),
                   dtype="float32", options={"batched_prefill": "on"})
GREEDY = SamplingParams(temperature=0)
SEEDED = SamplingParams(temperature=1.1, seed=7, top_p=0.9, repetition_penalty=1.2, logprobs=True, top_logprobs=3)
# The batch's rows attend over the group's output bucket, a prefill's over its own: the
# masked positions add exact zeros, other reductions may round differently (measured:
# 1.2e-7 on the logits).
ATOL = 2e-5


@pytest.fixture(scope="module")
def model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("random:tiny-gqa")


def _engine(model, **options) -> TpuJaxEngine:
    return TpuJaxEngine(model, CFG.model_copy(update={"options": {**CFG.options, **options}}))


def _batch_rows(eng: TpuJaxEngine) -> list[str]:
    return [r["bucket"] for r in eng.compiles.rows if r["program"] == "prefill_batch_step"]


def _counting(eng: TpuJaxEngine) -> TpuJaxEngine:
    """Records each batch program run as ``eng.batch_runs`` (rows, T, O)."""
    inner, eng.batch_runs = eng._extend_batch, []

    def counted(params, rows, bucket, out):
        eng.batch_runs.append((len(rows), bucket, out))
        return inner(params, rows, bucket, out)

    eng._extend_batch = counted
    return eng


def _requests(eng, params, rng):
    """Plain and continued entries of different lengths, greedy and seeded: two share
    output bucket 24 (continuations), three bucket 16 (one continued, one padded from
    bucket 8 to 16), one is alone in bucket 8."""
    a, b, c, d = (rng.integers(3, 250, n).tolist() for n in (20, 13, 14, 5))
    head_a, _ = eng.prefill(params=params, tokens=a[:9], sampling=GREEDY)  # bucket 16
    head_c, _ = eng.prefill(params=params, tokens=c[:3], sampling=SEEDED)  # bucket 8
    return [
        PrefillRequest(a[9:], SEEDED, head_a),  # 11 new tokens (16) on bucket 16: stored in 24
        PrefillRequest(b, GREEDY),  # plain, 13 tokens: 16
        PrefillRequest(c[3:], GREEDY, head_c),  # 11 (16) on bucket 8: stored in 24
        PrefillRequest(c, SamplingParams(temperature=0.8, seed=8)),  # plain, 14: 16
        PrefillRequest(d, SEEDED),  # plain, 5: alone in bucket 8
        PrefillRequest(d[:2], GREEDY, head_c),  # 2 (8) on bucket 8: stored in 16, beside 16-token rows
    ]


@pytest.mark.parametrize("options", [{}, {"page_size": 4}], ids=["contiguous", "paged"])
def test_prefill_batch_equals_one_prefill_per_entry(model, options):
    """Each entry's prefix equals its own prefill's: prompt, bucket, logits, first token
    and log-probs, the K/V of the whole prefix (exported), the tokens decoded after an
    insert; the entries ran as two batch programs (buckets 24 and 16) and one prefill."""
    eng = _engine(model, **options)
    params = eng.load_params()
    assert eng.capabilities.batched_prefill
    requests = _requests(eng, params, np.random.default_rng(1))
    batch = _counting(eng).prefill_batch(params=params, requests=requests)
    assert sorted(eng.batch_runs) == [(2, 16, 24), (3, 16, 16)]  # (rows, T, O); d alone in 8: its prefill
    for i, (req, (prefix, first)) in enumerate(zip(requests, batch)):
        alone, first_alone = eng.prefill(params=params, tokens=req.tokens, sampling=req.sampling,
                                         existing_prefix=req.existing_prefix)
        assert list(prefix.prompt_tokens) == list(alone.prompt_tokens), i
        assert eng._bucket_of(prefix.kv) == eng._bucket_of(alone.kv), i
        np.testing.assert_allclose(prefix.host_logits(), alone.host_logits(), rtol=0, atol=ATOL, err_msg=f"entry {i}")
        assert prefix.first_token == alone.first_token == int(first.row_tokens(0)[0]), i
        np.testing.assert_allclose(first.logprobs, first_alone.logprobs, atol=ATOL * 10, err_msg=f"entry {i}")
        np.testing.assert_array_equal(first.top_ids, first_alone.top_ids, err_msg=f"entry {i}")
        got, want = eng.export_prefix(prefix), eng.export_prefix(alone)
        np.testing.assert_allclose(got.k, want.k, rtol=0, atol=ATOL, err_msg=f"entry {i}'s K")
        np.testing.assert_allclose(got.v, want.v, rtol=0, atol=ATOL, err_msg=f"entry {i}'s V")
        decoded = []
        for p in (prefix, alone):
            state = eng.insert(p, eng.init_decode_state(), 1)
            tokens = []
            for _ in range(4):
                state, result = eng.generate(params, state)
                tokens.append(int(result.tokens[1, 0]))
            eng.free_resource(state, 1)
            decoded.append(tokens)
        assert decoded[0] == decoded[1], i


def test_a_batch_the_page_pool_cannot_hold_changes_nothing(model):
    """Paged, a bounded pool (17 pages of 4): five 14-token prompts need 20; the call
    raises InsufficientMemory and the pages the first entries took are given back (their
    prefixes are dropped; a page list made with finalize=True releases its pages)."""
    from polyengine.errors import InsufficientMemory

    eng = _engine(model, page_size=4, kv_pages=17)
    params = eng.load_params()
    free = eng.pages.free
    rng = np.random.default_rng(4)
    requests = [PrefillRequest(rng.integers(3, 250, 14).tolist(), GREEDY) for _ in range(5)]
    with pytest.raises(InsufficientMemory):
        eng.prefill_batch(params=params, requests=requests)
    assert eng.pages.free == free
    assert len(eng.prefill_batch(params=params, requests=requests[:4])) == 4


def test_a_batch_outside_the_compiled_set_runs_entry_by_entry(model):
    """After warm-up the engine runs only the batches warm-up compiled; any other goes
    to prefill one entry at a time (here: the set emptied by hand), with the same output."""
    eng = _engine(model)
    params = eng.load_params()
    requests = _requests(eng, params, np.random.default_rng(2))
    batched = eng.prefill_batch(params=params, requests=requests)
    eng.batch_programs = set()
    before = len(_batch_rows(eng))
    looped = _counting(eng).prefill_batch(params=params, requests=requests)
    assert len(_batch_rows(eng)) == before and eng.batch_runs == []
    for (p, _), (q, _) in zip(batched, looped):
        assert p.first_token == q.first_token
        np.testing.assert_allclose(p.host_logits(), q.host_logits(), rtol=0, atol=ATOL)


def test_the_option_and_refusals(model):
    """'auto' declares the capability on TPU and GPU only (the CPU here: off, the kit's
    loop); 'off' never; a bad value and a refused entry are refused before any work; the
    Ray engine offers the same option (test_tpu_jax_ray.py runs it)."""
    from polyengine.backends.tpu_jax.ray_engine import RayTpuEngine

    assert not TpuJaxEngine(model, CFG.model_copy(update={"options": {}})).capabilities.batched_prefill
    assert not _engine(model, batched_prefill="off").capabilities.batched_prefill
    with pytest.raises(InvalidRequest, match="batched_prefill"):
        _engine(model, batched_prefill="yes")
    assert RayTpuEngine.OPTIONS["batched_prefill"] is TpuJaxEngine.OPTIONS["batched_prefill"]
    with pytest.raises(UnsupportedFeature, match="prefill_workers"):  # refused before any worker starts
        RayTpuEngine(model, CFG.model_copy(update={"options": {"batched_prefill": "on", "prefill_workers": 1}}))
    # the memory check counts a batch's rows of prefill activations (the largest batch size)
    (on,), (off,) = ({k: v for k, v in e._needs().items() if "prefill" in k}.values() for e in (
        _engine(model), _engine(model, batched_prefill="off")))
    assert on > off
    eng = _engine(model)
    params = eng.load_params()
    with pytest.raises(InvalidRequest, match="prefill_batch entry 1"):
        eng.prefill_batch(params=params, requests=[PrefillRequest([5, 6], GREEDY),
                                                   PrefillRequest([eng.vocab_size], GREEDY)])


SAMPLINGS = [
    SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.2, seed=5, max_tokens=5, ignore_eos=True,
                   logprobs=True, top_logprobs=2),
    SamplingParams(temperature=1.3, seed=9, n=2, max_tokens=4, ignore_eos=True),
]


@pytest.mark.parametrize("paged", [{}, {"page_size": 16, "kv_pages": 128}], ids=["contiguous", "paged"])
def test_driver_output_with_batched_prefill_and_no_compile_after_warmup(model, paged):
    """Through the driver (chunks, the prefix cache, a per-step token budget) with
    warm-up: prompts arriving while a stream decodes share prefill_batch calls that ran
    batch programs, nothing compiles after warm-up, and every token and log-prob equals
    the same engine's without batched prefill, each prompt prefilled whole. Paged too,
    its pool bounded (a pool that grows has a new shape: test_tpu_jax.py's no-compile test)."""
    compiles: list[str] = []

    def listener(event, seconds, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kw.get("fun_name", "?"))

    base = dict(max_slots=4, max_prefill_length=24, max_cache_length=56, prefill_buckets=(8, 16, 24),
                dtype="float32")
    off = LLM(model, backend="tpu_jax", tools=False, prefill_chunk=0, prefix_cache_bytes=0,
              options={"batched_prefill": "off", **paged}, **base)
    rng = np.random.default_rng(3)
    system = rng.integers(3, 250, 9).tolist()
    prompts = [(system if i % 2 else []) + rng.integers(3, 250, int(rng.integers(2, 14))).tolist() for i in range(7)]
    sampling = [SAMPLINGS[i % 3] for i in range(len(prompts))]
    want = off.generate(prompts, sampling)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        on = LLM(model, backend="tpu_jax", tools=False, prefill_chunk=8, max_num_batched_tokens=20,
                 prefix_cache_bytes=4 << 20, options={"batched_prefill": "on", "warmup": True, **paged}, **base)
        eng = on.engine
        assert eng.batch_programs and {b for b, _, _ in eng.batch_programs} == {2, 4}
        warm = len(compiles)
        log = PrefillLog(_counting(eng))
        llm = LLM.from_engine(log, tools=False)
        llm.scheduler.prefiller.block = 4
        keeper = llm.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        llm.step()
        reqs = [llm.submit(p, s) for p, s in zip(prompts, sampling)]
        while not all(r.done for r in reqs):
            llm.step()
        keeper.cancel()
        assert compiles[warm:] == [], f"compiled after warm-up: {compiles[warm:]}"
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert any(len(b) > 1 for b in log.batches), log.batches
    assert eng.batch_runs, log.batches  # rows of several requests in one program
    for r, w in zip(reqs, want):
        assert [o.token_ids for o in r.completion.outputs] == [o.token_ids for o in w.outputs]
        if w.outputs[0].logprobs is not None:
            np.testing.assert_allclose(r.completion.outputs[0].logprobs, w.outputs[0].logprobs, atol=1e-5)
