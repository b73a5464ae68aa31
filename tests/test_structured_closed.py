"""Object schemas are closed unless they say otherwise (docs/serving.md, "Structured
output"): a schema that lists ``properties`` without ``additionalProperties`` admits no
other key, in ``response_format`` and in a forced tool call's arguments, as vLLM's
default grammar engine and llama.cpp read it; ``"additionalProperties": true`` opens it.

The model is tiny and random; a logit bias on "," makes greedy decoding take a comma
(another key) wherever the grammar allows one, so an open object always grows a second
key and a closed one must end: no test depends on what the random weights prefer.
"""

from __future__ import annotations

import json

import pytest

from polyengine import LLM, SamplingParams
from polyengine.driver.structured import closed_schema
from polyengine.driver.toolcalls import tool_constraint
from polyengine.sampling.params import StructuredOutput

pytest.importorskip("llguidance")

BOOL_A = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}


def test_closed_schema_closes_listed_objects_only_and_keeps_explicit_choices():
    nested = {"type": "object", "properties": {"inner": BOOL_A, "list": {"type": "array", "items": BOOL_A}},
              "$defs": {"d": BOOL_A}, "anyOf": [BOOL_A]}
    out = closed_schema(nested)
    assert out["additionalProperties"] is False
    assert out["properties"]["inner"]["additionalProperties"] is False
    assert out["properties"]["list"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is False and out["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in BOOL_A  # a copy: the caller's schema is untouched
    for kept in ({**BOOL_A, "additionalProperties": True}, {**BOOL_A, "additionalProperties": {"type": "string"}},
                 {**BOOL_A, "patternProperties": {"^x": {}}}):
        assert closed_schema(kept) == kept
    assert closed_schema({"type": "object"}) == {"type": "object"}  # no properties listed: any object
    assert "additionalProperties" not in closed_schema({**BOOL_A, "required": ["a", "b"]})  # b must come from extras
    both = closed_schema({"allOf": [BOOL_A, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in s for s in both["allOf"])  # closing one would refuse the other's keys
    # a property *named* "properties" is a name, not a schema keyword
    named = closed_schema({"type": "object", "properties": {"properties": {"type": "string"}}})
    assert named["properties"] == {"properties": {"type": "string"}}


@pytest.fixture(scope="module")
def llm():
    return LLM("random:tiny", "reference", max_slots=2, max_cache_length=128)


def _comma_first(llm: LLM, max_tokens: int = 24, **kw) -> SamplingParams:
    comma = llm.tokenizer.encode(",")
    assert len(comma) == 1
    return SamplingParams(max_tokens=max_tokens, temperature=0, logit_bias={str(comma[0]): 100.0}, **kw)


def test_a_schema_without_additional_properties_admits_no_extra_key_and_true_opens_it(llm):
    closed = llm.generate("x", _comma_first(llm, structured=StructuredOutput(json_schema=BOOL_A)))[0]
    assert set(json.loads(closed.text)) == {"a"} and closed.finish_reason == "stop"
    opened = {**BOOL_A, "additionalProperties": True}
    text = llm.generate("x", _comma_first(llm, structured=StructuredOutput(json_schema=opened)))[0].text
    assert text.startswith(('{"a": true, "', '{"a": false, "')), text  # a second key begun


def test_forced_tool_call_arguments_have_only_the_listed_keys(llm):
    """The grammar a forced call runs under (LLM.chat with tool_choice naming the tool),
    on a short raw prompt: a chat prompt with tools does not fit the tiny model's context."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": BOOL_A}}]
    constraint = tool_constraint(tools, {"type": "function", "function": {"name": "f"}})
    text = llm.generate("x", _comma_first(llm, max_tokens=64, structured=constraint))[0].text
    call = json.loads(text[text.index("{"): text.rindex("}") + 1])
    assert call["name"] == "f" and set(call["arguments"]) == {"a"}, text
