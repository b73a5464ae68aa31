"""Issue 38: every request field is validated by the schema layer, and grammars are safe.

Request structure that used to end in 500s or RecursionError (``tools: 5``,
``tool_choice: {"function": "x"}``, an assistant turn with ``tool_calls: "abc"``, a
schema nested hundreds or thousands deep, a portable prefix whose header nests past
json's depth) is refused as a 400 / InvalidRequest naming the field; strings are not
coerced into numbers or booleans (``parallel_tool_calls: "yes"``, ``n: "3"``), and
``parallel_tool_calls: false`` is honoured. Grammars compile off the event loop, their
cache is bounded by size, and one whose language is empty, holds only the empty text,
or (a JSON schema) has no finite instance is refused when it compiles. Tiny random model, reference backend.
"""

from __future__ import annotations

import asyncio
import json
import struct
import threading

import httpx
import pytest

from live_server import LiveServer
from polyengine import LLM, AsyncLLM, SamplingParams, StructuredOutput
from polyengine.driver import structured
from polyengine.driver.toolcalls import parse_tool_calls
from polyengine.errors import InvalidRequest
from polyengine.prefix import PortablePrefix

pytestmark = pytest.mark.filterwarnings("ignore::polyengine.models.RandomWeightsWarning")

MODEL = "random:tiny"
MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
# An object that requires a property of its own type: no finite JSON value is valid.
ENDLESS = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                                "required": ["next"]}}}
ENDLESS_TOOL = {"type": "function", "function": {"name": "loop", "parameters": ENDLESS}}
ENDLESS_BY_COUNT = {"type": "object", "additionalProperties": {"$ref": "#"}, "minProperties": 1}
ENDLESS_BY_BRANCH = {"type": "object", "properties": {"a": {"$ref": "#"}, "b": {"$ref": "#"}},
                     "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, "reference", max_slots=2, max_cache_length=96, max_prefill_length=64, tools=False)


@pytest.mark.parametrize("kwargs, field", [
    ({"tools": 5}, "tools"),
    ({"tools": [TOOL], "tool_choice": {"function": "x"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": ["auto"]}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "deep", "parameters": _nested(3000)}}]}, "tools"),
])
def test_the_python_api_refuses_bad_tool_structure_naming_the_field(llm, kwargs, field):
    with pytest.raises(InvalidRequest) as err:
        llm.chat(MSGS, {"max_tokens": 2}, **kwargs)
    assert err.value.field == field, err.value


def test_a_forced_call_of_a_tool_without_finite_arguments_is_refused(llm):
    with pytest.raises(InvalidRequest, match="no finite instance") as err:
        llm.chat(MSGS, {"max_tokens": 2}, tools=[ENDLESS_TOOL], tool_choice={"type": "function",
                                                                           "function": {"name": "loop"}})
    assert err.value.field == "tools"
    with pytest.raises(InvalidRequest, match=r"\['loop'\] have no finite instance") as err:  # beside a finite tool
        llm.chat(MSGS, {"max_tokens": 2}, tools=[TOOL, ENDLESS_TOOL], tool_choice="required")
    assert err.value.field == "tools"
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]}
    assert structured.schema_has_instance(tree)  # recursion with a way out (an empty list) is fine


def test_a_forced_call_of_a_tool_that_accepts_nothing_is_refused_when_its_grammar_compiles(llm):
    """(The server names ``tools`` for it; its tool prompt does not fit this tiny model's context.)"""
    from polyengine.driver.toolcalls import tool_constraint

    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "[^\\s\\S]"}}, "required": ["a"]}}}
    with pytest.raises(InvalidRequest, match="accepts no text|invalid") as err:
        llm.submit([1, 2, 3], {"max_tokens": 4, "structured": tool_constraint([tool], "required")})
    assert err.value.field == "structured"


def test_a_past_turn_with_malformed_tool_calls_is_refused(llm):
    msgs = [*MSGS, {"role": "assistant", "content": None, "tool_calls": "abc"}, {"role": "user", "content": "?"}]
    with pytest.raises(InvalidRequest, match=r"messages\[1\].tool_calls") as err:
        llm.chat(msgs, {"max_tokens": 2}, tools=[TOOL])
    assert err.value.field == "messages"


def test_a_schema_nested_thousands_deep_is_refused_before_anything_recurses():
    with pytest.raises(InvalidRequest, match="nests more than 64") as err:
        SamplingParams(structured={"json_schema": _nested(3000)})
    assert err.value.field == "structured"
    SamplingParams(structured={"json_schema": _nested(20)})  # a deep real schema still passes


def test_a_portable_prefix_nested_past_json_depth_is_refused():
    header = b"[" * 200_000
    with pytest.raises(InvalidRequest, match="not a polyengine prefix") as err:
        PortablePrefix.from_bytes(struct.pack("<Q", len(header)) + header)
    assert err.value.field == "prefix"


def test_parallel_tool_calls_false_returns_the_first_call_only():
    tools = [TOOL]
    text = 'a <tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call> <tool_call>{"name": "add"}</tool_call>'
    assert len(parse_tool_calls(text, tools)[1]) == 2
    content, calls = parse_tool_calls(text, tools, parallel=False)
    assert [c.arguments for c in calls] == ['{"x": 1}'] and content == "a"


@pytest.mark.parametrize("spec, reason", [
    ({"grammar": "start: x\nx: x"}, "accepts no text at all"),  # a rule that only refers to itself
    ({"regex": "[^\\s\\S]"}, "accepts no text at all"),  # matches nothing
    ({"choice": [""]}, "only the empty text"),
    ({"json_schema": ENDLESS}, "no finite instance"),
])
def test_a_grammar_that_can_never_produce_text_is_refused_at_submit(llm, spec, reason):
    with pytest.raises(InvalidRequest, match=reason) as err:
        llm.submit([1, 2, 3], {"max_tokens": 4, "structured": spec})
    assert err.value.field == "structured"


def test_the_grammar_cache_is_bounded_by_size(llm, monkeypatch):
    grammars = llm.scheduler._grammars
    monkeypatch.setattr(structured, "_CACHE_CHARS", 3000)
    for i in range(4):
        grammars.compile(StructuredOutput(json_schema={"enum": [f"{i}-{j:04d}" for j in range(60)]}))
    assert 1 <= len(grammars._cache) < 4 and grammars._cache_chars <= 3000 + 2000
    assert grammars._cache_chars == sum(len(k[1]) + len(g) for k, g in grammars._cache.items())


def test_grammars_compile_off_the_event_loop(monkeypatch):
    seen = []
    real = structured.Grammars.compile

    def spy(self, spec):
        seen.append(threading.current_thread())
        return real(self, spec)

    monkeypatch.setattr(structured.Grammars, "compile", spy)

    async def main():
        async with AsyncLLM(MODEL, "reference", max_slots=1, max_cache_length=48, max_prefill_length=32,
                            tools=False) as eng:
            done = await eng.generate([1, 2, 3], {"max_tokens": 3, "structured": {"choice": ["yes", "no"]}})
            return threading.current_thread(), done

    loop_thread, done = asyncio.run(main())
    assert seen and all(t is not loop_thread for t in seen)
    assert done.outputs[0].text in ("yes", "no")


# -- through the server: 400 naming the field, never 500 -------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = LiveServer(["--model", MODEL, "--backend", "reference", "--context-length", "256", "--max-slots", "2"],
                   tmp_path_factory.mktemp("requests") / "server.log")
    yield s
    assert s.stop() == 0
    assert "Traceback" not in s.log(), s.log()


@pytest.mark.parametrize("extra, param", [
    ({"tools": 5}, "tools"),
    ({"tools": [TOOL], "tool_choice": {"function": "x"}}, "tool_choice"),
    ({"messages": [*MSGS, {"role": "assistant", "content": None, "tool_calls": "abc"}]}, "messages[1].tool_calls"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"n": "3"}, "n"),
    ({"temperature": "0.5"}, "temperature"),
    ({"stream": "off"}, "stream"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(240)}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(240)}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS}}}, "response_format"),
    ({"tools": [ENDLESS_TOOL], "tool_choice": "required"}, "tools"),
    # every instance infinite through minProperties, or through a `required` in an anyOf branch
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS_BY_COUNT}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS_BY_BRANCH}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ENDLESS_BY_BRANCH}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "[^\\s\\S]"}}}}, "response_format"),
])
def test_bad_request_structure_is_a_400_naming_the_field(server, extra, param):
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 2, **extra}
    r = httpx.post(server.api + "/chat/completions", content=json.dumps(body), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_parallel_tool_calls_is_accepted_as_a_boolean(server):
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 2, "tools": [TOOL], "parallel_tool_calls": False,
            "tool_choice": "none"}  # tools offered to a template this small would not fit the context
    r = httpx.post(server.api + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
