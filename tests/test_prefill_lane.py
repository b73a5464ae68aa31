"""The prefill lane (capability ``prefill_lane``, ``start_prefill``; docs/design.md, "The
prefill lane"): a long prompt prefills on threads of the engine's own while the driver
goes on stepping the streams. The driver's side on a reference engine given a lane (no
torch), the cpu engine's lane bit for bit against the same calls one after another, its
option and its refusals. The conformance suite's rule is ``test_prefill_lane``
(conformance/layer_prefixes.py), run on every backend."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

from polyengine import EngineConfig, SamplingParams
from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.driver import LLM
from polyengine.errors import InvalidRequest, UnsupportedFeature
from polyengine.kit import on_lane
from polyengine.models import load_model

# A step prefills at most 8 prompt tokens while streams decode: a 30-token prompt is "long".
CFG = EngineConfig(max_slots=4, max_prefill_length=40, max_cache_length=96, max_num_batched_tokens=8,
                   prefill_chunk=8)


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny-gqa")


class LaneEngine(ReferenceEngine):
    """The reference engine with a lane: ``prefill`` on a thread of its own (NumPy; the
    reference keeps no scratch between calls). ``fail`` makes the lane's prefills raise;
    ``gate`` (an Event) holds them until it is set."""

    fail: Exception | None = None
    gate: threading.Event | None = None

    def __init__(self, model, config):
        super().__init__(model, config)
        self.capabilities = self.capabilities.model_copy(update={"prefill_lane": True})
        self.lane = ThreadPoolExecutor(1)
        self.on_lane: list[int] = []  # the token counts of the pieces the lane ran

    def start_prefill(self, *, params, tokens, **kw) -> Future:
        def run():
            if self.gate is not None:
                self.gate.wait(30)
            if self.fail is not None:
                raise self.fail
            self.on_lane.append(len(tokens))
            return self.prefill(params=params, tokens=tokens, **kw)

        return self.lane.submit(run)


def _streams_and_a_long_prompt(llm: LLM, rng: np.random.Generator, long: int = 30, long_tokens: int = 6):
    """Three short streams, then (once they decode) a prompt of ``long`` tokens: the requests."""
    sp = SamplingParams(seed=5, max_tokens=24, ignore_eos=True)
    reqs = [llm.submit(rng.integers(3, 250, 5).tolist(), sp) for _ in range(3)]
    while not all(r.samples[0].out.token_ids for r in reqs):
        llm.step()
    reqs.append(llm.submit(rng.integers(3, 250, long).tolist(),
                           SamplingParams(seed=6, max_tokens=long_tokens, ignore_eos=True)))
    return reqs


def _run_all(llm: LLM) -> None:
    while llm.scheduler.busy:
        llm.step()


def test_the_driver_runs_a_long_prompt_on_the_lane_and_changes_no_output(model):
    """A prompt longer than the step budget goes to the lane while streams decode (one
    piece, up to its end: no chunks), short ones stay within the steps; every output
    equals the run on the same engine without a lane."""
    outs = []
    for lane in (True, False):
        eng = LaneEngine(model, CFG) if lane else ReferenceEngine(model, CFG)
        llm = LLM.from_engine(eng, tools=False)
        reqs = _streams_and_a_long_prompt(llm, np.random.default_rng(3))
        _run_all(llm)
        outs.append([r.samples[0].out.token_ids for r in reqs])
        if lane:
            assert eng.on_lane == [30] and llm.scheduler.lane_prefills == 1
    assert outs[0] == outs[1]
    assert all(len(o) == n for o, n in zip(outs[0], (24, 24, 24, 6)))


def test_the_metrics_count_the_lanes_pieces(model):
    """/metrics' polyengine_prefill_lane_pieces_total follows the scheduler's count."""
    import asyncio

    pytest.importorskip("prometheus_client")
    from polyengine.driver import AsyncLLM
    from serving.metrics import Metrics

    eng = LaneEngine(model, CFG)
    llm = LLM.from_engine(eng, tools=False)
    _streams_and_a_long_prompt(llm, np.random.default_rng(7))
    _run_all(llm)

    async def main():
        async with AsyncLLM.from_llm(llm) as served:
            metrics = Metrics()
            metrics.watch(served)
            return metrics.render().decode(), served.lane_prefills

    text, count = asyncio.run(main())
    assert count == 1 and "polyengine_prefill_lane_pieces_total 1.0" in text, text


def test_nothing_decoding_prefills_within_the_step_not_on_the_lane(model):
    """With no stream to keep at pace there is no budget and no lane: the prompt is
    prefilled at once, on all the engine's threads."""
    eng = LaneEngine(model, CFG)
    llm = LLM.from_engine(eng, tools=False)
    llm.generate([list(range(3, 33))], SamplingParams(seed=1, max_tokens=3))
    assert eng.on_lane == [] and llm.scheduler.lane_prefills == 0


def test_a_request_cancelled_while_on_the_lane_frees_its_slot_and_loses_nothing(model):
    """Cancelled while its piece runs on the lane: the piece's result is dropped when it
    comes, the streams finish as they would, every slot is free after, and the next
    long prompt takes the lane again."""
    eng = LaneEngine(model, CFG)
    eng.gate = threading.Event()
    llm = LLM.from_engine(eng, tools=False)
    reqs = _streams_and_a_long_prompt(llm, np.random.default_rng(4))
    llm.step()
    assert llm.scheduler._lane is not None  # held by the gate
    reqs[3].cancel()
    eng.gate.set()
    _run_all(llm)
    assert reqs[3].samples[0].out.finish_reason == "cancelled" and not reqs[3].samples[0].out.token_ids
    assert all(len(r.samples[0].out.token_ids) == 24 for r in reqs[:3])
    assert llm.scheduler.free_slots == [0, 1, 2, 3] and llm.scheduler._lane is None
    again = _streams_and_a_long_prompt(llm, np.random.default_rng(5))
    _run_all(llm)
    assert len(again[3].samples[0].out.token_ids) == 6 and eng.on_lane == [30, 30]  # the dropped one ran too


def test_a_failure_on_the_lane_fails_that_request_alone(model):
    """The lane's prefill raises: that request fails with the error, its slot is never
    taken, the streams finish."""
    eng = LaneEngine(model, CFG)
    eng.fail = InvalidRequest("the lane refused this prompt", field="prompt")
    llm = LLM.from_engine(eng, tools=False)
    reqs = _streams_and_a_long_prompt(llm, np.random.default_rng(6))
    _run_all(llm)
    assert reqs[3].status == "failed" and "the lane refused this prompt" in str(reqs[3].error)
    assert all(len(r.samples[0].out.token_ids) == 24 for r in reqs[:3])
    assert llm.scheduler.free_slots == [0, 1, 2, 3]


def test_a_bounded_page_pool_holds_the_lanes_pages_back_and_preempts_without_loss(model):
    """On a bounded page pool the lane's piece holds back the pages it may take from its
    start until it is collected: the pool is never over-committed; the streams outgrow
    the pages left while the lane's prefill is held (a gate opened after a second), so
    the request on the lane, the most recently admitted, is preempted (its piece waited
    for and dropped) and later runs again; every completion equals an engine without a
    lane on the same pool."""
    cfg = CFG.model_copy(update={"options": {"page_size": 4, "kv_pages": 26}})
    outs = []
    for lane in (True, False):
        eng = LaneEngine(model, cfg) if lane else ReferenceEngine(model, cfg)
        if lane:
            eng.gate = threading.Event()
            threading.Timer(1.0, eng.gate.set).start()
        llm = LLM.from_engine(eng, tools=False)
        reqs = _streams_and_a_long_prompt(llm, np.random.default_rng(3), long_tokens=24)
        while llm.scheduler.busy:
            llm.step()
            assert eng.pages.held <= 26
        outs.append([r.samples[0].out.token_ids for r in reqs])
        if lane:
            assert reqs[3].preemptions >= 1 and llm.scheduler.lane_prefills >= 1
            assert llm.scheduler._lane_pages == 0 and llm.scheduler.free_slots == [0, 1, 2, 3]
    assert outs[0] == outs[1]
    assert all(len(o) == 24 for o in outs[0])


def test_page_counts_change_under_one_lock_from_many_threads():
    """Four threads allocate, share, copy on write and release at once: every page handed
    out is held by one list at a time, and all come back."""
    from polyengine.pages import PageList, PagePool

    pool = PagePool(4)

    def churn(seed: int) -> int:
        rng = np.random.default_rng(seed)
        for _ in range(400):
            seq = PageList.new(pool, int(rng.integers(1, 20)))
            fork = seq.fork()
            fork.prepare_write(0, fork.length, lambda s, d: None)  # every page copied
            assert not set(seq.pages) & set(fork.pages)
            seq.release()
            fork.release()
        return seed

    with ThreadPoolExecutor(4) as threads:  # a thread's failed assertion is raised here by result()
        assert sorted(f.result() for f in [threads.submit(churn, i) for i in range(4)]) == [0, 1, 2, 3]
    assert pool.held == 0 and len(pool._free) == pool.allocated


def test_an_engine_without_the_lane_refuses_start_prefill(model):
    eng = ReferenceEngine(model, CFG)
    assert not eng.capabilities.prefill_lane
    with pytest.raises(UnsupportedFeature, match="start_prefill"):
        eng.start_prefill(params=eng.load_params(), tokens=[3, 4], sampling=SamplingParams())


# -- the cpu engine's lane ------------------------------------------------------------------

torch = pytest.importorskip("torch")


def _cpu(model, prefill: int = 40, **options):
    from polyengine.backends.cpu.engine import CpuEngine

    return CpuEngine(model, CFG.model_copy(update={"options": {"threads": 2, **options}, "max_prefill_length": prefill,
                                                   "max_cache_length": max(96, prefill + 16)}))


def test_async_llm_serves_streams_and_a_long_prompt_on_the_cpu_lane(model):
    """Through AsyncLLM (what `polyengine serve` runs): streams and a long prompt that
    arrives while they decode, on the cpu engine's lane; every completion equals the
    same requests on an engine without a lane, and the lane ran."""
    import asyncio

    from polyengine.driver import AsyncLLM

    rng = np.random.default_rng(8)
    shorts = [rng.integers(3, 250, 5).tolist() for _ in range(3)]
    long = rng.integers(3, 250, 38).tolist()
    sp = SamplingParams(seed=4, max_tokens=50, ignore_eos=True)

    async def serve(eng):
        async with AsyncLLM.from_llm(LLM.from_engine(eng, tools=False)) as llm:
            streams = [asyncio.ensure_future(llm.generate(p, sp)) for p in shorts]
            for _ in range(2000):  # until the three decode (50 tokens each: they outlast the wait)
                if len(llm._scheduler._slots) == 3:
                    break
                await asyncio.sleep(0.001)
            late = asyncio.ensure_future(llm.generate(long, sp.model_copy(update={"max_tokens": 20})))
            done = await asyncio.gather(*streams, late)
            return [c.token_ids for c in done], llm.lane_prefills

    with_lane, lanes = asyncio.run(serve(_cpu(model)))
    without, none = asyncio.run(serve(_cpu(model, prefill_threads=0)))
    assert with_lane == without and none == 0
    assert lanes == 1


def test_the_cpu_lane_is_half_the_threads_with_pages_too_and_off_with_one_thread(model):
    assert _cpu(model).capabilities.prefill_lane and _cpu(model).lane_threads() == 1
    assert _cpu(model, page_size=16).capabilities.prefill_lane and _cpu(model, page_size=16).lane_threads() == 1
    assert not _cpu(model, threads=1).capabilities.prefill_lane
    assert not _cpu(model, prefill_threads=0).capabilities.prefill_lane
    assert not _cpu(model, prefill_threads=0, page_size=16).capabilities.prefill_lane
    with pytest.raises(InvalidRequest, match="prefill_threads=2 leaves the decode steps none"):
        _cpu(model, prefill_threads=2)


def _lane_against_turns(model, options, lengths=(6, 38), engine=None):
    """Streams decode while the lane prefills a short prompt, a long one and a continuation
    of a prefix that a prefill on the caller's thread continues at the same time; then the
    same calls one after another on a fresh engine (``engine()``, else the cpu engine with
    ``options``). Both runs' prefixes (logits, first token, exported K/V), step log-probs,
    and the lane's (kernel threads, others' threads)."""
    sp = SamplingParams(seed=9, max_tokens=1, logprobs=True)
    rng = np.random.default_rng(12)
    streams = [rng.integers(3, 250, n).tolist() for n in (4, 7)]
    head, tail_a, tail_b = (rng.integers(3, 250, n).tolist() for n in (9, 25, 12))
    short, long = (rng.integers(3, 250, n).tolist() for n in lengths)

    def run(lane: bool):
        eng = engine() if engine is not None else _cpu(model, max(lengths), **options)
        params = eng.load_params()
        seen = []
        if lane and engine is None:
            inner = eng.prefill

            def spy(**kw):
                if on_lane() and eng._kernels is not None:
                    seen.append((eng._kernels.threads, eng._kernels.total_threads - eng._kernels._lent))
                return inner(**kw)

            eng.prefill = spy
        state = eng.init_decode_state()
        for slot, prompt in enumerate(streams):
            state = eng.insert(eng.prefill(params=params, tokens=prompt, sampling=sp)[0], state, slot)
        h = eng.prefill(params=params, tokens=head, sampling=sp)[0]
        calls = [dict(tokens=tail_a, existing_prefix=h), dict(tokens=short), dict(tokens=long)]
        if lane:
            futures = [eng.start_prefill(params=params, sampling=sp, **c) for c in calls]
        else:
            made = [eng.prefill(params=params, sampling=sp, **c) for c in calls]
        beside = eng.prefill(params=params, tokens=tail_b, sampling=sp, existing_prefix=h)
        steps = []
        for _ in range(6):
            state, r = eng.generate(params, state)
            steps.append(np.asarray(r.logprobs).copy())
        if lane:
            made = [f.result(timeout=120) for f in futures]
        prefixes = [(p.host_logits().copy(), int(f.tokens[0, 0])) for p, f in [*made, beside]]
        return prefixes, [eng.export_prefix(p) for p, _ in [*made, beside]], steps, seen

    return run(True), run(False)


def _assert_the_same(got, want) -> None:
    for (la, ta), (lb, tb) in zip(got[0], want[0]):
        assert ta == tb and np.array_equal(la, lb)
    for a, b in zip(got[1], want[1]):
        assert np.array_equal(np.asarray(a.k), np.asarray(b.k)) and np.array_equal(np.asarray(a.v), np.asarray(b.v))
    for a, b in zip(got[2], want[2]):
        assert np.array_equal(a, b)


@pytest.mark.filterwarnings("ignore:cpu. decoding on torch's matmul")
@pytest.mark.parametrize("options", [{}, {"kv_dtype": "bfloat16"}, {"cpu_kernels": False}, {"page_size": 16},
                                     {"page_size": 4, "kv_pages": 120}, {"page_size": 16, "cpu_kernels": False}],
                         ids=["default", "bf16-kv", "no-kernels", "pages", "bounded-pages", "pages-no-kernels"])
def test_the_cpu_lane_computes_bit_for_bit_what_the_calls_compute_in_turn(model, options):
    """The lane's prefills (a short prompt in the fused step, a long one in the torch
    forward, a continuation of a prefix continued beside it at the same time) and the
    steps beside them: every prefix (logits, first token, K/V) and every step's log-probs
    equal those of the same calls made one after another; the lane's kernels ran on one
    thread and everyone else's on the other. With pages the lane's prefixes are written
    into pages of their own while the steps write the slots' (the continued prefix's
    partly filled last page copied by both continuations)."""
    got, want = _lane_against_turns(model, options)
    _assert_the_same(got, want)
    if options.get("cpu_kernels", True):
        assert got[3] and all(seen == (1, 1) for seen in got[3])


@pytest.mark.parametrize("options", [{}, {"page_size": 16}], ids=["contiguous", "pages"])
def test_the_cpu_lane_on_the_default_models_blocks_is_bit_for_bit_too(default_gguf, options):
    """The same on the default model as shipped (Q4_1 blocks: int8x2 products, int16 tiles
    and the prefill attention kernel on the lane's one thread), with a 300-token prompt."""
    got, want = _lane_against_turns(load_model(default_gguf), options, lengths=(6, 300))
    _assert_the_same(got, want)
    assert got[3] and all(seen == (1, 1) for seen in got[3])


def _tpu_jax(model, **options):
    pytest.importorskip("jax")
    from polyengine.backends.tpu_jax.engine import TpuJaxEngine

    return TpuJaxEngine(model, CFG.model_copy(update={"options": options}))


def test_tpu_jax_has_the_lane_on_the_cpu_platform_with_pages_too(model):
    """tpu_jax's option prefill_lane: 'auto' is on for the CPU platform, with page_size
    too; 'off' is off."""
    caps = lambda **options: _tpu_jax(model, **options).capabilities  # noqa: E731
    assert caps().prefill_lane and caps(prefill_lane="on").prefill_lane and caps(page_size=16).prefill_lane
    assert not caps(prefill_lane="off").prefill_lane and not caps(prefill_lane="off", page_size=16).prefill_lane


@pytest.mark.usefixtures("jax_compile_less")  # a tiny model: compile time over run time
def test_the_tpu_jax_lane_with_pages_computes_bit_for_bit_what_the_calls_compute_in_turn(model):
    """tpu_jax's lane with page_size: its prefills run over a contiguous cache of their own,
    then scatter into pages, and a continuation gathers its prefix's pages, beside the
    steps, which donate the pools (PagedKV.donating holds them under a lock): every prefix
    and step equals the same calls one after another."""
    got, want = _lane_against_turns(model, {}, engine=lambda: _tpu_jax(model, page_size=4))
    _assert_the_same(got, want)


def test_the_page_pools_grow_only_while_no_one_writes_them():
    """PagedKV.using keeps the pools' tensors while a thread writes them: a grow on
    another thread (a page id past the storage) waits for it to leave, then copies every
    page written; a grow from inside using is refused, not a deadlock."""
    from polyengine.backends.torch_common.paged import PagedKV
    from polyengine.pages import PagePool

    pool = PagePool(2)
    kv = PagedKV(pool, torch.device("cpu"), lambda n: (torch.zeros(1, n, 1, 2, 1), torch.zeros(1, n, 1, 2, 1)),
                 first_size=2)
    pool.allocate(2)
    inside, grown = threading.Event(), threading.Event()
    leave = threading.Event()

    def writer():
        with kv.using() as (k, _):
            inside.set()
            leave.wait(10)
            k[:, 1] = 7.0  # written into the tensors it was given, after the grow asked
            with pytest.raises(RuntimeError, match="cannot grow inside PagedKV.using"):
                pool.allocate(1)
                kv.grow()

    def grower():
        inside.wait(10)
        pool.allocate(1)
        kv.grow()
        grown.set()

    with ThreadPoolExecutor(2) as threads:  # a thread's failure is raised here by result()
        done = [threads.submit(writer), threads.submit(grower)]
        inside.wait(10)
        assert not grown.wait(0.3)  # held off while the writer is inside
        leave.set()
        for f in done:
            f.result(timeout=10)
    assert grown.is_set()
    kv.grow()
    k, _ = kv.tensors
    assert k.shape[1] >= 4 and float(k[0, 1].max()) == 7.0


def test_the_memory_check_counts_a_piece_beside_the_lane(model, monkeypatch):
    """With the lane a step's piece can run beside its prefill: the memory check counts
    that piece's activations (the step budget's tokens), and only then."""
    from polyengine.backends.cpu.engine import CpuEngine

    counted = []
    monkeypatch.setattr(CpuEngine, "check_memory", lambda self, needs, **kw: counted.append(dict(needs)) or 0)
    _cpu(model)
    _cpu(model, prefill_threads=0)
    lane, none = counted
    c = model.config
    assert lane.pop("a prefill piece beside the prefill lane's") == 8 * (c.vocab_size + 4 * c.intermediate_size) * 4
    assert lane == none
