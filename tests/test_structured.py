"""Token masks in the protocol and structured output in the driver, on tiny models.

The backends' behaviour under masks is the conformance suite's (``test_token_masks``);
here: the mask format, the protocol's optional keywords, the driver's grammar engine on
the reference backend, tool-call rendering and parsing, and the error without the
``structured`` extra.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import numpy as np
import pytest

from polyengine import LLM, SamplingParams, StructuredOutput
from polyengine.engine import Capabilities, protocol_problems
from polyengine.errors import InvalidRequest, UnsupportedFeature
from polyengine.sampling.masks import allows_any, check_mask, mask_words, pack_mask, unpack_mask
from polyengine.driver.toolcalls import parse_tool_calls, tool_constraint, tool_messages

pytestmark = pytest.mark.filterwarnings("ignore::polyengine.models.RandomWeightsWarning")


def test_mask_words_round_trip_and_llguidance_layout():
    rng = np.random.default_rng(0)
    for v in (1, 31, 32, 33, 288, 1000):
        allowed = rng.random(v) < 0.3
        allowed[0] = True
        words = pack_mask(allowed)
        assert words.shape == (mask_words(v),) and words.dtype == np.int32
        assert (unpack_mask(words, v) == allowed).all()
    # bit j of word w is token 32 w + j, little-endian within the word (bit 31 is the sign bit)
    words = np.zeros(2, np.int32)
    words[1] = np.int32(-(2**31))
    assert np.flatnonzero(unpack_mask(words, 64)).tolist() == [63]
    assert allows_any(words, 64) and not allows_any(words, 64, excluded=[63])
    assert not allows_any(words, 63)  # bits past the vocabulary mean nothing
    with pytest.raises(InvalidRequest, match="allows no token"):
        check_mask(words, 63, "m")
    with pytest.raises(InvalidRequest, match="2 words"):
        check_mask(np.zeros(3, np.int32), 40, "m")


class _Old:
    """A third-party engine written before masks: no keywords, no capability."""

    name, max_concurrent_decodes, max_prefill_length, max_cache_length = "old", 1, 8, 16
    vocab_size, eos_token_ids, model, device = 10, (0,), None, "cpu"

    def __init__(self, masks: bool = False):
        self.capabilities = Capabilities(dtypes=("float32",), token_masks=masks)

    def load_params(self): ...
    def init_decode_state(self): ...
    def prefill(self, *, params, tokens, sampling, existing_prefix=None): ...
    def insert(self, prefix, decode_state, slot): ...
    def generate(self, params, decode_state, *, overrides=None): ...
    def free_resource(self, decode_state, slot): ...
    def bulk_insert(self, prefix, decode_state, slots): ...
    def export_prefix(self, prefix): ...
    def import_prefix(self, portable): ...


def test_protocol_keywords_are_required_only_with_the_capability():
    assert protocol_problems(_Old()) == []
    problems = protocol_problems(_Old(masks=True))
    assert any("token_masks" in p and "generate" in p for p in problems), problems
    assert any("token_mask" in p and "prefill" in p for p in problems), problems


@pytest.fixture(scope="module")
def llm():
    return LLM("random:tiny", "reference", max_slots=4, max_cache_length=128, max_prefill_length=64, tools=False)


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9},
                                           "c": {"enum": ["x", "y"]}, "l": {"type": "array", "items": {"type": "boolean"},
                                                                           "maxItems": 2}},
          "required": ["n", "c", "l"], "additionalProperties": False}


def test_json_schema_output_validates_and_finishes_with_the_grammar(llm):
    """Random weights, so only the grammar makes this JSON: every sample validates and
    ends with the grammar ("stop", no EOS token appended)."""
    sp = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=100, structured=StructuredOutput(json_schema=SCHEMA))
    outs = llm.generate(["a", "b"], sp)
    for c in outs:
        for o in c.outputs:
            assert o.finish_reason == "stop", o
            jsonschema.validate(json.loads(o.text), SCHEMA)
            assert o.token_ids[-1] not in llm.engine.eos_token_ids


def test_choice_regex_and_streams_follow_their_constraint(llm):
    c = llm.generate("q", SamplingParams(seed=1, max_tokens=20, structured=StructuredOutput(choice=("yes", "no"))))[0]
    assert c.text in ("yes", "no")
    c = llm.generate("q", SamplingParams(seed=2, max_tokens=20, structured=StructuredOutput(regex=r"[0-9]{3}-[a-c]{2}")))[0]
    assert c.finish_reason == "stop" and len(c.text) == 6 and c.text[3] == "-", c.text
    text = "".join(d.text for d in llm.stream("q", SamplingParams(seed=4, max_tokens=60,
                                                                   structured=StructuredOutput(json_object=True))))
    assert isinstance(json.loads(text), dict)


def test_bad_constraints_are_refused_at_submit_naming_the_field(llm):
    with pytest.raises(InvalidRequest, match="Invalid type") as err:
        llm.submit("q", SamplingParams(structured=StructuredOutput(json_schema={"type": "strin"})))
    assert err.value.field == "structured"
    with pytest.raises(InvalidRequest, match="look-around"):
        llm.submit("q", SamplingParams(structured=StructuredOutput(regex="(?<=a)b")))
    with pytest.raises(InvalidRequest, match="exactly one"):
        StructuredOutput(regex="a", json_object=True)


def test_min_tokens_cannot_extend_a_complete_grammar(llm):
    """The grammar completes after "no"; min_tokens cannot make it go on (EOS is masked
    and nothing else is allowed): the driver finishes it, never sending an empty mask."""
    c = llm.generate("q", SamplingParams(seed=1, min_tokens=5, max_tokens=20,
                                         structured=StructuredOutput(choice=("no",))))[0]
    assert c.text == "no" and c.finish_reason == "stop"


def test_an_engine_without_masks_refuses_constraints():
    from polyengine.backends.reference.engine import ReferenceEngine
    from polyengine.models import load_model

    eng = ReferenceEngine(load_model("random:tiny"), __import__("polyengine").EngineConfig(
        max_slots=1, max_cache_length=64, max_prefill_length=32))
    eng.capabilities = eng.capabilities.model_copy(update={"token_masks": False})
    llm = LLM.from_engine(eng, eng.model.tokenizer, tools=False)
    with pytest.raises(UnsupportedFeature, match="token_masks"):
        llm.submit("q", SamplingParams(structured=StructuredOutput(json_object=True)))
    with pytest.raises(UnsupportedFeature):
        eng.prefill(params=eng.load_params(), tokens=[1, 2], sampling=SamplingParams(),
                    token_mask=pack_mask(np.ones(eng.vocab_size, bool)))


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                                               "required": ["a", "b"], "additionalProperties": False}}}]


def test_forced_tool_calls_follow_the_function_schema(llm):
    """The grammar of a forced call on random weights (the tool system prompt does not
    fit the tiny model's 512 positions; LLM.chat with tools runs on the default model in
    test_structured_default_model.py)."""
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        c = llm.generate("q", SamplingParams(seed=5, max_tokens=100, structured=tool_constraint(TOOLS, choice)))[0]
        content, calls = parse_tool_calls(c.text, TOOLS)
        assert c.finish_reason == "stop" and content is None and len(calls) == 1, c.text
        assert calls[0].name == "add"
        jsonschema.validate(json.loads(calls[0].arguments), TOOLS[0]["function"]["parameters"])
    with pytest.raises(InvalidRequest, match="not among the tools"):
        llm.chat([{"role": "user", "content": "x"}], tools=TOOLS, tool_choice={"type": "function", "function": {"name": "mul"}})


def test_tool_turns_render_for_a_template_without_a_tool_section():
    msgs = [{"role": "user", "content": "add"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    out, variables = tool_messages(msgs, TOOLS, "auto", template_has_tools=False)
    assert variables == {} and out[0]["role"] == "system" and '"name": "add"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    assert tool_messages(msgs, TOOLS, "auto", template_has_tools=True)[1] == {"tools": TOOLS}
    content, calls = parse_tool_calls('ok <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
                                      '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', TOOLS)
    assert [c.name for c in calls] == ["add"] and json.loads(calls[0].arguments) == {"a": 1}
    assert content.startswith("ok") and "nope" in content


def test_the_core_imports_without_llguidance_and_names_the_extra():
    """llguidance hidden: polyengine and plain requests work; a constrained one says
    which extra to install."""
    code = (
        "import sys; sys.modules['llguidance'] = None\n"
        "import warnings; warnings.simplefilter('ignore')\n"
        "from polyengine import LLM, SamplingParams, StructuredOutput\n"
        "llm = LLM('random:tiny', 'reference', max_slots=1, max_cache_length=64, max_prefill_length=32)\n"
        "assert llm.generate('a', SamplingParams(max_tokens=2, seed=1))[0].token_ids\n"
        "try:\n"
        "    llm.submit('a', SamplingParams(structured=StructuredOutput(json_object=True)))\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "UnsupportedFeature" in out.stdout and "polyengine[structured]" in out.stdout, out.stdout


# -- every built-in backend behind `polyengine serve` (issue 24: "on every backend") --------

_TOOL = {"type": "function", "function": {
    "name": "pick", "parameters": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                                   "required": ["color"], "additionalProperties": False}}}
_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "ok": {"type": "boolean"}},
           "required": ["n", "ok"], "additionalProperties": False}


# What each backend's server needs beyond the common flags. neuron compiles a graph per
# static shape: one prefill bucket and one attention length (whole prompts, no prefix
# cache), without batched prefill's graphs, make its server's warm-up two graphs instead of the
# default's dozen.
_SERVE_FLAGS = {
    "reference": [], "cpu": [], "tpu_jax": [],
    "neuron": ["--prefill-buckets", "1024", "--option", "seq_buckets=[1024]", "--option", "batched_prefill=off",
               "--prefill-chunk", "0"],
}


@pytest.mark.parametrize("backend", sorted(_SERVE_FLAGS))
def test_response_format_and_tool_calls_through_the_openai_client_on_every_backend(backend, tmp_path):
    """A tiny random model behind ``polyengine serve`` on each built-in backend: a
    ``json_schema`` response validates and a forced tool call parses into ``tool_calls``,
    through the official ``openai`` client (the masks run on the backend's device path:
    neuron's on its CPU compile path's graphs). The tool prompt (the Hermes tool list,
    ~700 tokens) needs a 1024-token context."""
    openai = pytest.importorskip("openai")
    from live_server import LiveServer

    env = None
    if backend == "tpu_jax":  # XLA's optimizations off for a tiny model (as the CLI suite runs it)
        env = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    elif backend == "neuron":  # the session's artifact cache (tests/neuron_support.py)
        from neuron_support import shared_cache

        env = {"POLYENGINE_NEURON_CACHE": str(shared_cache())}
    model, context = "random:tiny-llama3", "1024"
    s = LiveServer(["--model", model, "--backend", backend, "--max-slots", "2", "--context-length", context,
                    "--prefix-cache-mib", "0", *_SERVE_FLAGS[backend]], tmp_path / "server.log", start_timeout=900,
                   env=env)
    try:
        client = openai.OpenAI(base_url=s.api, api_key="unused", max_retries=0, timeout=300)
        msgs = [{"role": "user", "content": "Pick one."}]
        r = client.chat.completions.create(model=model, messages=msgs, temperature=0.7, seed=3, max_tokens=40,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": _SCHEMA}})
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content), _SCHEMA)
        r = client.chat.completions.create(model=model, messages=msgs, tools=[_TOOL], tool_choice="required",
                                           temperature=0, max_tokens=200)  # a tiny vocabulary: short tokens
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls[0].function.name == "pick"
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments),
                            _TOOL["function"]["parameters"])
    finally:
        assert s.stop() == 0, s.log()
