"""A live server's request lifecycle on a slow test backend (tests/serving_backends.py,
25 ms per engine step): refusals of what the backend cannot honour, a full queue,
disconnects that free slots at once, and graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from live_server import LiveServer, wait_until

MODEL = "random:tiny"
ARGS = ["--model", MODEL, "--backend", "test_slow", "--context-length", "512"]
LONG = 300  # tokens: 7.5 s at 25 ms a step, far longer than any wait below


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = LiveServer([*ARGS, "--max-slots", "1", "--max-queue", "1"], tmp_path_factory.mktemp("slow") / "server.log",
                   test_backends=True)
    yield s
    assert s.stop() == 0, s.log()


def body(max_tokens=LONG, stream=True, **extra):
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, **extra}


def gauge(server, name) -> float:
    return server.metrics()[(name,)]


@pytest.mark.parametrize("extra, param", [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"min_p": 0.1}, "min_p"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"logprobs": 5}, "logprobs"),  # the backend gives at most 4 alternatives
])
def test_a_parameter_the_backend_cannot_honour_is_refused_by_name(server, extra, param):
    r = httpx.post(server.api + "/completions", json=body(4, stream=False, **extra), timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, "unsupported_parameter")
    assert "test_slow" in err["message"]


def test_n_above_one_needs_bulk_insert(tmp_path):
    # --max-slots 2 so that n=2 fits the slots and only the missing capability refuses it.
    s = LiveServer([*ARGS, "--max-slots", "2"], tmp_path / "server.log", test_backends=True)
    try:
        r = httpx.post(s.api + "/completions", json=body(4, stream=False, n=2), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    finally:
        assert s.stop() == 0, s.log()


class _Stream:
    """An open SSE response read up to its first event; ``lines`` goes on from there."""

    def __init__(self, response, lines):
        self.response, self.lines = response, lines

    async def aclose(self):
        await self.response.aclose()


async def _first_chunk(http, payload) -> _Stream:
    r = await http.send(http.build_request("POST", "/completions", json=payload), stream=True)
    assert r.status_code == 200
    lines = r.aiter_lines()
    async for line in lines:
        if line.startswith("data: "):
            return _Stream(r, lines)
    raise AssertionError("stream ended before its first event")


def test_a_full_queue_answers_429_and_a_disconnect_frees_the_slot_at_once(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.api, timeout=60) as http:
            running = await _first_chunk(http, body())
            assert await asyncio.to_thread(gauge, server, "polyengine_running_requests") == 1
            waiting = asyncio.ensure_future(http.post("/completions", json=body(3, stream=False)))
            assert await asyncio.to_thread(wait_until, lambda: gauge(server, "polyengine_queue_depth") == 1, 10)
            full = await http.post("/completions", json=body(3, stream=False))
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "rate_limit_exceeded"
            t0 = time.monotonic()
            await running.aclose()  # the client goes away mid-stream
            done = await asyncio.wait_for(waiting, 10)
            return done, time.monotonic() - t0

    cancelled_before = server.metrics().get(("polyengine_requests_cancelled_total",), 0)
    done, waited = asyncio.run(main())
    # The queued request got the slot long before the abandoned one would have ended.
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3
    assert waited < LONG * 0.025 / 3, waited
    after = server.metrics()
    assert after[("polyengine_requests_cancelled_total",)] == cancelled_before + 1
    assert after[("polyengine_running_requests",)] == 0


def test_a_client_that_disconnects_while_queued_leaves_the_queue(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.api, timeout=60) as http:
            running = await _first_chunk(http, body())
            waiting = asyncio.ensure_future(http.post("/completions", json=body(3, stream=False)))
            assert await asyncio.to_thread(wait_until, lambda: gauge(server, "polyengine_queue_depth") == 1, 10)
            waiting.cancel()  # closes the connection
            left = await asyncio.to_thread(wait_until, lambda: gauge(server, "polyengine_queue_depth") == 0, 5)
            still_running = await asyncio.to_thread(gauge, server, "polyengine_running_requests")
            await running.aclose()
            return left, still_running

    left, still_running = asyncio.run(main())
    assert left and still_running == 1
    assert wait_until(lambda: gauge(server, "polyengine_running_requests") == 0, 5)


def test_sigterm_refuses_new_work_finishes_what_fits_cancels_the_rest_and_exits_0(tmp_path):
    grace = 3.0
    s = LiveServer([*ARGS, "--max-slots", "2", "--shutdown-timeout", str(grace)], tmp_path / "server.log",
                   test_backends=True)

    async def read(stream):
        """(text after the first event, finish_reason, saw [DONE], in-band error) of a stream, however it ends."""
        text, finish, done, error = "", None, False, None
        try:
            async for line in stream.lines:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]
                        continue
                    c = event["choices"][0]
                    text, finish = text + c["text"], c["finish_reason"] or finish
        except httpx.HTTPError:
            pass  # the server closed the connection: the stream was cut
        return text, finish, done, error

    async def main():
        async with httpx.AsyncClient(base_url=s.api, timeout=60) as http:
            short = await _first_chunk(http, body(20))
            long = await _first_chunk(http, body(LONG))
            readers = [asyncio.ensure_future(read(short)), asyncio.ensure_future(read(long))]
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)

            def refused() -> bool:
                """New work is refused: the connection is refused, or (accepted by the kernel
                just before the listener closed) closed without a response."""
                try:
                    httpx.get(s.url + "/health", timeout=1)
                    return False
                except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                    return True  # refused, or accepted just before the listener closed and then dropped

            refused_fast = await asyncio.to_thread(wait_until, refused, grace)
            results = await asyncio.wait_for(asyncio.gather(*readers), grace + 10)
            return refused_fast, results, t0

    refused_fast, (short, long), t0 = asyncio.run(main())
    # A second SIGTERM while the server finishes its stop (what stop() sends when the
    # process is still running) is part of the same stop: exit 0, never -15.
    code = s.stop(timeout=grace + 10)
    took = time.monotonic() - t0
    assert code == 0, s.log()
    assert refused_fast
    assert short[1] == "length" and short[2] and short[3] is None  # finished within the grace period, with [DONE]
    # Cut at the deadline, and told so in-band (OpenAI's error object), then [DONE].
    assert long[1] is None and long[3] is not None and long[3]["code"] == "server_shutting_down", long
    assert long[2]
    assert took < grace + 8, took
