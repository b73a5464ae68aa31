"""A live server (tiny random model, reference backend) driven by the official
``openai`` client: results equal the Python API's, errors are OpenAI's, and a bounded
load test loses nothing.

Comparisons with the in-process driver are exact: the same model, seed and parameters
give the same tokens whatever the batch (the reference backend's invariance).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from live_server import LiveServer
from polyengine import LLM, SamplingParams

KEY = "sk-test-only"
MODEL = "random:tiny"
MSGS = [{"role": "user", "content": "Say something."}]
SLOTS, QUEUE, CONTEXT = 4, 8, 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = LiveServer(["--model", MODEL, "--backend", "reference", "--max-slots", str(SLOTS), "--max-queue", str(QUEUE),
                    "--context-length", str(CONTEXT), "--api-key", KEY,
                    # keep-alive connections stay open between a client's requests, even on a
                    # loaded machine (pytest -n 2): a close racing the next request is the
                    # client's ReadError, and the connection limits have tests of their own
                    # (test_hostile_server.py)
                    "--idle-timeout", "120", "--header-timeout", "120"],
                   tmp_path_factory.mktemp("serve") / "server.log")
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture(scope="module")
def oracle():
    return LLM(MODEL, "reference", max_slots=SLOTS, max_cache_length=CONTEXT, max_prefill_length=CONTEXT - 1)


@pytest.fixture(scope="module")
def client(server):
    # max_retries=0: the client would otherwise retry 429s and 5xx behind our back.
    return openai.OpenAI(base_url=server.api, api_key=KEY, max_retries=0, timeout=60)


def test_chat_equals_the_python_api(client, oracle):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, seed=7, temperature=0.8)
    want = oracle.chat(MSGS, SamplingParams(max_tokens=12, seed=7, temperature=0.8))
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)


def test_streamed_chat_equals_the_whole_response_and_ends_with_usage(client):
    args = dict(model=MODEL, messages=MSGS, max_tokens=16, seed=11)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_with_several_prompts_and_n_samples(client, oracle):
    prompts = ["The sky is", "Water boils at"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, seed=5, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    sp = SamplingParams(n=2, max_tokens=6, seed=5)
    for p, prompt in enumerate(prompts):
        want = oracle.generate([prompt], sp)[0]
        assert [r.choices[2 * p + i].text for i in range(2)] == [o.text for o in want.outputs]
    streamed = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, seed=5, stream=True)
    texts = ["", "", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in r.choices]


def test_n_samples_differ_and_sample_zero_is_the_n1_answer(client):
    """False-failure probability: three 12-token samples at temperature 1 from a
    288-token vocabulary coinciding is below 1e-20."""
    r = client.chat.completions.create(model=MODEL, messages=MSGS, n=3, max_tokens=12, seed=21)
    one = client.chat.completions.create(model=MODEL, messages=MSGS, n=1, max_tokens=12, seed=21)
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3
    assert texts[0] == one.choices[0].message.content
    assert r.usage.completion_tokens == 36


def test_a_seed_reproduces_and_an_unseeded_answer_reports_its_seed(client):
    args = dict(model=MODEL, messages=MSGS, max_tokens=12)
    a = client.chat.completions.create(**args, seed=99)
    b = client.chat.completions.create(**args, seed=99)
    assert a.choices[0].message.content == b.choices[0].message.content
    free = client.chat.completions.create(**args)
    seed = free.model_extra["seed"]
    again = client.chat.completions.create(**args, seed=seed)
    assert again.choices[0].message.content == free.choices[0].message.content


def test_stop_strings_cut_the_text(client):
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
    full = client.completions.create(**args).choices[0].text
    stop = next(ch for ch in full[3:] if ch.strip())  # a visible character past the start
    cut = client.completions.create(**args, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stop=stop, stream=True))
    assert streamed == cut.text


def test_logprobs_are_the_models_in_both_formats(client, oracle):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, seed=3, logprobs=True, top_logprobs=3)
    want = oracle.chat(MSGS, SamplingParams(max_tokens=8, seed=3, logprobs=True, top_logprobs=3)).outputs[0]
    content = r.choices[0].logprobs.content
    assert [t.logprob for t in content] == want.logprobs
    assert [[alt.logprob for alt in t.top_logprobs] for t in content] == [list(d.values()) for d in want.top_logprobs]
    assert all(len(t.top_logprobs) == 3 for t in content)
    # The byte-level tokenizer of random presets: ids below 256 are the byte of that value.
    assert [t.bytes for t in content] == [[i] if i < 256 else t.bytes for i, t in zip(want.token_ids, content)]
    assert all(t.bytes and t.token for i, t in zip(want.token_ids, content) if i < 256)

    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, seed=4, logprobs=2)
    want = oracle.generate(["Hello"], SamplingParams(max_tokens=5, seed=4, logprobs=True, top_logprobs=2))[0].outputs[0]
    lp = c.choices[0].logprobs
    assert lp.token_logprobs == want.logprobs and len(lp.tokens) == 5
    assert all(len(d) <= 2 for d in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, seed=3, logprobs=True,
                                                 top_logprobs=3, stream=True))
    streamed = [t.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    assert streamed == [t.logprob for t in content]


def test_sampler_extras_go_through_extra_body(client, oracle):
    extras = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3, "min_tokens": 4}
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=10, seed=8, presence_penalty=0.5,
                                       frequency_penalty=0.3, logit_bias={"101": 5.0}, extra_body=extras)
    want = oracle.chat(MSGS, SamplingParams(max_tokens=10, seed=8, presence_penalty=0.5, frequency_penalty=0.3,
                                            logit_bias={101: 5.0}, **extras))
    assert r.choices[0].message.content == want.text


def test_models_health_and_metrics_need_no_key_but_the_api_does(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.get(server.url + "/metrics").status_code == 200
    models = openai.OpenAI(base_url=server.api, api_key=KEY).models.list()
    assert [m.id for m in models.data] == [MODEL]
    missing = httpx.get(server.api + "/models")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError) as err:
        openai.OpenAI(base_url=server.api, api_key="sk-wrong", max_retries=0).models.list()
    assert err.value.code == "invalid_api_key"


def test_a_shared_system_prompt_is_served_from_the_prefix_cache(client, server, oracle):
    """Chat requests sharing a system prompt: from the second on (cut from the first's
    entry, truncate_prefix), usage reports the cached prompt tokens (OpenAI's prompt_tokens_details.cached_tokens), the answers equal the
    Python API's, and /metrics counts the queries, the hit tokens and the cache's size."""
    system = {"role": "system", "content": "You answer tersely and never apologise. " * 2}
    before = server.metrics()
    cached = []
    for i in range(4):
        msgs = [system, {"role": "user", "content": f"Question {i}?"}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, seed=3)
        assert r.choices[0].message.content == oracle.chat(msgs, SamplingParams(max_tokens=4, seed=3)).text
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and cached[1] == cached[2] == cached[3] >= 64, cached
    after = server.metrics()
    grew = {name: after[(name,)] - before.get((name,), 0) for name in (
        "polyengine_prefix_cache_queries_total", "polyengine_prefix_cache_hit_tokens_total")}
    assert grew == {"polyengine_prefix_cache_queries_total": 4, "polyengine_prefix_cache_hit_tokens_total": sum(cached)}
    assert 0 < after[("polyengine_prefix_cache_bytes",)] <= after[("polyengine_prefix_cache_budget_bytes",)]
    assert after[("polyengine_prefix_cache_entries",)] >= 1 and ("polyengine_prefix_cache_evictions_total",) in after


def _bad(client, **kwargs) -> openai.APIStatusError:
    create = client.completions.create if "prompt" in kwargs else client.chat.completions.create
    kwargs.setdefault("model", MODEL)
    if "prompt" not in kwargs:
        kwargs.setdefault("messages", MSGS)
    with pytest.raises(openai.APIStatusError) as err:
        create(**kwargs)
    return err.value


@pytest.mark.parametrize("kwargs, status, param, code", [
    (dict(model="gpt-4"), 404, "model", "model_not_found"),
    (dict(temperature=-1), 400, "temperature", None),
    (dict(top_p=0), 400, "top_p", None),
    (dict(n=0), 400, "n", None),
    (dict(seed=-5), 400, "seed", None),
    (dict(max_tokens=0), 400, "max_tokens", None),
    (dict(max_completion_tokens=999), 400, "max_completion_tokens", "context_length_exceeded"),
    (dict(n=SLOTS + 1), 400, "n", None),
    (dict(top_logprobs=2), 400, "top_logprobs", None),
    (dict(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    (dict(logit_bias={"x": 1}), 400, "logit_bias", None),
    (dict(logit_bias={"100000": 1}), 400, "logit_bias", None),
    (dict(presence_penalty=3), 400, "presence_penalty", None),
    (dict(tools=[{"type": "function", "function": {}}]), 400, "tools[0].function.name", None),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}}),
     400, "tool_choice", None),
    (dict(response_format={"type": "xml"}), 400, "response_format.type", None),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}), 400,
     "response_format", None),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                                         "pattern": "(?<=a)b"}}}),
     400, "response_format", None),
    (dict(functions=[{"name": "f"}]), 400, "functions", None),
    (dict(extra_body={"bogus": 1}), 400, "bogus", None),
    (dict(extra_body={"min_tokens": 5}, max_tokens=3), 400, "min_tokens", None),
    (dict(messages=[{"role": "user", "content": "x" * 300}]), 400, "messages", "context_length_exceeded"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages", None),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages[0].content", None),
    (dict(prompt="x" * 300), 400, "prompt", "context_length_exceeded"),
    (dict(prompt="hi", logprobs=21), 400, "logprobs", None),
    (dict(prompt="hi", echo=True), 400, "echo", None),
    (dict(prompt=[]), 400, "prompt", None),
    (dict(prompt=[[1, 2], [1, 99999]]), 400, "prompt", None),
])
def test_errors_are_openai_errors_naming_the_parameter(client, kwargs, status, param, code):
    err = _bad(client, **kwargs)
    assert err.status_code == status, err.body
    assert err.param == param and err.code == code, err.body
    assert err.body["message"] and err.body["type"]


def test_malformed_bodies_are_400(server):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for body in (b"{", b"[1, 2]", b"\xff\xfe"):
        r = httpx.post(server.api + "/chat/completions", content=body, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    r = httpx.post(server.api + "/completions", json={"model": MODEL}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


# -- bounded load ---------------------------------------------------------------------

REQUESTS, CLIENTS, MAX_TOKENS = 200, 32, 8


def _cases():
    """Eight distinct requests (chat or completion, streamed or not, two prompts)."""
    out = []
    for i in range(8):
        kind, stream, prompt = ("chat", "completion")[i % 2], bool(i // 2 % 2), ("Hi there", "Tell me")[i // 4]
        out.append((kind, stream, prompt, 1000 + i))
    return out


def _request(kind, stream, prompt, seed, k):
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "seed": seed, "user": f"req-{k}"}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return ("/chat/completions" if kind == "chat" else "/completions"), body


async def _one(http, kind, stream, prompt, seed, k):
    """(status, text, finish_reason, usage) of one request, read completely."""
    path, body = _request(kind, stream, prompt, seed, k)
    if not stream:
        r = await http.post(path, json=body)
        if r.status_code != 200:
            return r.status_code, r.headers.get("retry-after"), None, None
        c = r.json()["choices"][0]
        return 200, c["message"]["content"] if kind == "chat" else c["text"], c["finish_reason"], r.json()["usage"]
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, r.headers.get("retry-after"), None, None
        text, finish, usage, done = "", None, None, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                text += (c["delta"].get("content") or "") if kind == "chat" else c["text"]
                finish = c["finish_reason"] or finish
        assert done, "stream ended without [DONE]"
        return 200, text, finish, usage


def test_bounded_load_every_request_answered_once_correctly_or_429(server, oracle):
    cases = _cases()
    want = {}
    for kind, _, prompt, seed in cases:
        sp = SamplingParams(max_tokens=MAX_TOKENS, seed=seed)
        c = oracle.chat([{"role": "user", "content": prompt}], sp) if kind == "chat" else oracle.generate([prompt], sp)[0]
        want[(kind, prompt, seed)] = (c.text, c.finish_reason, c.usage.prompt_tokens, c.usage.completion_tokens)
    before = server.metrics()

    async def main():
        results: dict[int, tuple] = {}
        todo = iter(range(REQUESTS))
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=server.api, headers={"Authorization": f"Bearer {KEY}"},
                                     limits=limits, timeout=60) as http:
            async def worker():
                for k in todo:
                    assert k not in results
                    results[k] = await _one(http, *cases[k % len(cases)], k)

            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(CLIENTS))), 180)
        return results

    results = asyncio.run(main())
    assert sorted(results) == list(range(REQUESTS))  # none lost, none answered twice
    ok = rejected = prompt_tokens = completion_tokens = 0
    for k, (status, text, finish, usage) in results.items():
        kind, _, prompt, seed = cases[k % len(cases)]
        if status == 429:
            assert text == "1"  # the Retry-After header
            rejected += 1
            continue
        assert status == 200
        assert (text, finish, usage["prompt_tokens"], usage["completion_tokens"]) == want[(kind, prompt, seed)], k
        ok += 1
        prompt_tokens += usage["prompt_tokens"]
        completion_tokens += usage["completion_tokens"]
    # 32 clients against 4 slots + 8 queue places: some are always turned away.
    assert rejected > 0 and ok >= CLIENTS, (ok, rejected)

    after = server.metrics()

    def delta(name, **labels):
        key = (name, *sorted(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    served = sum(delta("polyengine_requests_total", endpoint=e, status="200")
                 for e in ("/v1/chat/completions", "/v1/completions"))
    refused = sum(delta("polyengine_requests_total", endpoint=e, status="429")
                  for e in ("/v1/chat/completions", "/v1/completions"))
    assert (served, refused) == (ok, rejected)
    assert delta("polyengine_generation_tokens_total") == completion_tokens
    assert delta("polyengine_prompt_tokens_total") == prompt_tokens
    assert delta("polyengine_time_to_first_token_seconds_count") == ok
    assert delta("polyengine_requests_cancelled_total") == 0
    assert after[("polyengine_queue_depth",)] == 0 and after[("polyengine_running_requests",)] == 0
