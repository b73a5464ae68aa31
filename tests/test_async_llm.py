"""AsyncLLM: the asyncio driver on tiny models (one engine thread, the loop never blocks)."""

from __future__ import annotations

import asyncio
import time

import pytest

from polyengine import AsyncLLM, EngineConfig, SamplingParams
from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.driver import LLM
from polyengine.errors import EngineClosed, InvalidRequest, QueueFull, UnsupportedFeature
from polyengine.models import load_model
from serving_backends import SlowEngine

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 5, 9], [1, 7, 3], [1, 2, 8], [1, 4, 4]]


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny")


def config(slots=2):
    return EngineConfig(max_slots=slots, max_prefill_length=16, max_cache_length=64)


def slow_llm(model, delay, slots=2, max_queue=1024) -> AsyncLLM:
    return AsyncLLM.from_llm(LLM.from_engine(SlowEngine(model, config(slots), delay), model.tokenizer,
                                             max_queue=max_queue))


def run(coro, limit=30.0):
    """Run a test coroutine with a time bound, so a hang fails instead of stalling CI."""
    return asyncio.run(asyncio.wait_for(coro, limit))


def test_concurrent_requests_match_the_synchronous_driver(model):
    want = [c.token_ids for c in LLM(model, "reference", max_slots=2, max_prefill_length=16,
                                     max_cache_length=64).generate(PROMPTS, GREEDY)]

    async def main():
        async with AsyncLLM(model, "reference", max_slots=2, max_prefill_length=16, max_cache_length=64) as llm:
            done = await asyncio.gather(*(llm.generate(p, GREEDY) for p in PROMPTS))
            streamed = [d async for d in llm.stream(PROMPTS[1], GREEDY)]
            return [c.token_ids for c in done], streamed

    got, streamed = run(main())
    assert got == want
    assert [t for d in streamed for t in d.token_ids] == want[1]
    assert streamed[-1].finish_reason == "length"


def test_the_event_loop_keeps_running_while_the_engine_steps(model):
    """Each engine step sleeps 0.5 s; a 10 ms ticker on the loop must never stall that
    long (it would if a step ran on the loop or the loop waited on the scheduler lock)."""
    llm = slow_llm(model, delay=0.5)

    async def main():
        gaps, stop = [], asyncio.Event()

        async def ticker():
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        c = await llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        stop.set()
        await tick
        await llm.shutdown()
        return c, gaps

    c, gaps = run(main())
    assert len(c.token_ids) == 3
    assert len(gaps) > 30 and max(gaps) < 0.25, max(gaps)


def test_closing_a_stream_cancels_and_frees_the_slot_at_the_next_step(model):
    llm = slow_llm(model, delay=0.02)

    async def main():
        handle = await llm.submit(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        got = 0
        async for delta in handle:
            got += len(delta.token_ids)
            if got >= 3:
                break  # closes the iterator: cancels the request
        deadline = time.monotonic() + 5
        while not handle.done and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        c = await handle.result()
        await llm.shutdown()
        return c, got

    c, got = run(main())
    assert c.finish_reason == "cancelled" and got <= len(c.token_ids) < 40
    assert llm.num_running == 0 and len(llm.llm.scheduler.free_slots) == 2


def test_cancelling_the_awaiting_task_cancels_the_request(model):
    llm = slow_llm(model, delay=0.02, slots=1)

    async def main():
        long = asyncio.create_task(llm.generate(PROMPTS[0], SamplingParams(max_tokens=60, ignore_eos=True)))
        await asyncio.sleep(0.2)
        long.cancel()
        t0 = time.monotonic()
        # The only slot is free again: a new request completes promptly.
        c = await llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        waited = time.monotonic() - t0
        await llm.shutdown()
        return c, waited

    c, waited = run(main())
    assert len(c.token_ids) == 3 and waited < 60 * 0.02


def test_bad_requests_fail_at_submit_and_a_full_queue_refuses(model):
    llm = slow_llm(model, delay=0.05, slots=1, max_queue=1)

    async def main():
        with pytest.raises(InvalidRequest) as bad:
            await llm.submit(PROMPTS[0], {"top_p": 1.5})
        with pytest.raises(UnsupportedFeature):
            await llm.submit(PROMPTS[0], {"presence_penalty": 0.5})  # the slow engine declares no penalties
        running = await llm.submit(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
        await asyncio.sleep(0.2)  # admitted: the queue is empty again
        waiting = await llm.submit(PROMPTS[1], SamplingParams(max_tokens=2))
        with pytest.raises(QueueFull):
            await llm.submit(PROMPTS[2], SamplingParams(max_tokens=2))
        running.cancel()
        results = [await running.result(), await waiting.result()]
        await llm.shutdown()
        return bad.value, results

    bad, (first, second) = run(main())
    assert bad.field == "top_p"
    assert first.finish_reason == "cancelled" and second.finish_reason is not None


class FailingGenerate(ReferenceEngine):
    """generate raises once, at the first step after both requests were prefilled (a
    device error mid-run; counted by prefills, not steps, so that it does not depend on
    how quickly the second request arrives, and slow enough that the first is still
    running then)."""

    prefills = 0
    failed = False

    def prefill(self, **kwargs):
        self.prefills += 1
        return super().prefill(**kwargs)

    def generate(self, params, decode_state, *, overrides=None):
        time.sleep(0.01)  # the first request cannot finish before the second one arrives
        if self.prefills >= 2 and not self.failed:
            self.failed = True
            raise RuntimeError("device lost")
        return super().generate(params, decode_state, overrides=overrides)


def test_a_generate_error_fails_the_running_requests_and_the_loop_goes_on(model):
    llm = AsyncLLM.from_llm(LLM.from_engine(FailingGenerate(model, config(2)), model.tokenizer))

    async def main():
        results = await asyncio.gather(*(llm.generate(p, GREEDY) for p in PROMPTS[:2]), return_exceptions=True)
        after = await llm.generate(PROMPTS[2], GREEDY)
        await llm.shutdown()
        return results, after

    results, after = run(main())
    assert all(isinstance(r, RuntimeError) and "device lost" in str(r) for r in results)
    assert len(after.token_ids) == 6 and llm.num_running == 0


def test_shutdown_finishes_what_fits_cancels_the_rest_and_refuses_new_requests(model):
    llm = slow_llm(model, delay=0.02)

    async def main():
        short = await llm.submit(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        long = await llm.submit(PROMPTS[1], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
        t0 = time.monotonic()
        await llm.shutdown(timeout=0.5)
        took = time.monotonic() - t0
        with pytest.raises(EngineClosed):
            await llm.submit(PROMPTS[2], GREEDY)
        return await short.result(), await long.result(), took

    short, long, took = run(main())
    assert short.finish_reason == "length" and len(short.token_ids) == 3
    assert long.finish_reason == "cancelled" and len(long.token_ids) < 60
    assert took < 5.0
    assert not llm._thread.is_alive()


def test_stream_deltas_carry_top_logprobs_like_the_completion(model):
    llm = LLM(model, "reference", max_slots=2, max_prefill_length=16, max_cache_length=64)
    sp = SamplingParams(max_tokens=5, seed=3, logprobs=True, top_logprobs=3, ignore_eos=True)
    deltas = list(llm.stream(PROMPTS[0], sp))
    c = llm.generate([PROMPTS[0]], sp)[0]
    assert [t for d in deltas for t in d.top_logprobs] == c.outputs[0].top_logprobs
    assert [x for d in deltas for x in d.logprobs] == c.outputs[0].logprobs
    plain = list(llm.stream(PROMPTS[0], GREEDY))
    assert all(d.top_logprobs is None for d in plain)
