"""OpenAI-style function calling over any chat template: the tool prompt, the
constraint that makes a call well formed, and parsing calls out of the text.

The format is the one HF chat templates with a tool section (Hermes, Qwen2.5) and vLLM's
``hermes`` parser use: tools listed as JSON inside ``<tools></tools>`` in a system
message; a call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; a
tool's answer goes back as ``<tool_response>...</tool_response>`` in a user turn. A
template that renders ``tools`` itself (it mentions the variable) gets the tools and
the messages as they are; a template without a tool section (SmolLM2's) gets the
system message and the rewritten turns from here.

``tool_choice``: ``"none"`` (no tools offered, plain text), ``"auto"`` (tools offered,
the model may answer or call; its text is parsed afterwards), ``"required"`` (one or
more calls, enforced by a grammar), or ``{"type": "function", "function": {"name": N}}``
(exactly a call of N, enforced). ``parallel_tool_calls=False``: at most one call is
returned (the first; a forced choice makes one anyway).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Sequence

from polyengine.errors import InvalidRequest
from polyengine.validation import check_depth
from polyengine.sampling.params import StructuredOutput

__all__ = ["ToolCall", "check_tools", "check_tool_calls", "tool_messages", "tool_constraint", "parse_tool_calls", "CALL_OPEN"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# JSON with fixed separators and no free whitespace: a small model cannot wander off into newlines
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


@dataclass
class ToolCall:
    """One parsed call: ``arguments`` is the JSON text of the arguments object."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = "call_" + secrets.token_hex(12)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(tools: Any, tool_choice: Any) -> tuple[list[dict[str, Any]], Any]:
    """``tools`` as a list of ``{"type": "function", "function": {...}}`` and the choice
    (default ``"auto"`` with tools, ``"none"`` without); InvalidRequest naming the problem
    (a parameters schema nested past MAX_SCHEMA_DEPTH included: it is checked before
    anything walks it recursively)."""
    if tools is None:
        tools = []
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequest(f"tools must be a list of {{\"type\": \"function\", \"function\": {{...}}}}, "
                             f"not {type(tools).__name__}", field="tools")
    tools = list(tools)
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                 f"\"parameters\": {{...}}}}}}", field="tools")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON Schema object", field="tools")
        check_depth(params, f"tools[{i}].function.parameters", field="tools")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise InvalidRequest(f"tool names must be distinct, got {names}", field="tools")
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise InvalidRequest(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                                 f"\"function\": {{\"name\": ...}}}}, got {choice!r:.200}", field="tool_choice")
        if name not in names:
            raise InvalidRequest(f"tool_choice names function {name!r}, which is not among the tools {names}",
                                 field="tool_choice")
    elif not isinstance(choice, str) or choice not in ("none", "auto", "required"):
        raise InvalidRequest(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                             f"\"function\": {{\"name\": ...}}}}, got {choice!r}", field="tool_choice")
    elif choice == "required" and not tools:
        raise InvalidRequest("tool_choice 'required' needs tools", field="tool_choice")
    return tools, choice


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    from polyengine.driver.structured import closed_schema  # arguments get the keys the tool lists, no others

    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             "arguments": closed_schema(fn.get("parameters", {"type": "object"}))},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": _COMPACT}


def tool_constraint(tools: list[dict[str, Any]], choice: Any) -> StructuredOutput | None:
    """The grammar of a forced call: ``"required"`` one call of any tool, a named choice one
    call of it; None for ``"auto"``/``"none"`` (free text, parsed afterwards; several
    calls may come that way). A forced answer is one call: the grammar ends after it, so
    a small model cannot start a second one it has no room to finish."""
    if isinstance(choice, dict) or choice == "required":
        from polyengine.driver.structured import schema_has_instance

        callable_ = [t["function"] for t in tools if not isinstance(choice, dict)
                     or t["function"]["name"] == choice["function"]["name"]]
        # one endless tool among finite ones is refused too: a model that starts its call
        # under the forced grammar could never finish it
        endless = [fn["name"] for fn in callable_ if not schema_has_instance(fn.get("parameters", {"type": "object"}))]
        if endless:
            raise InvalidRequest(f"tool_choice forces a call, but the parameters of {endless} have no finite instance "
                                 f"(each requires a value of its own type again), so a call of it could never end; "
                                 f"give the recursion a way out or leave the tool out", field="tools")
    if isinstance(choice, dict):
        fn = next(t["function"] for t in tools if t["function"]["name"] == choice["function"]["name"])
        return StructuredOutput(grammar=f'start: "{CALL_OPEN}\\n" call "\\n{CALL_CLOSE}"\ncall: %json '
                                        + json.dumps(_call_schema(fn)))
    if choice == "required":
        schema = {"anyOf": [_call_schema(t["function"]) for t in tools], "x-guidance": _COMPACT}
        return StructuredOutput(grammar=f'start: "{CALL_OPEN}\\n" call "\\n{CALL_CLOSE}"\ncall: %json ' + json.dumps(schema))
    return None


def tool_messages(messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]], choice: Any, *,
                  template_has_tools: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages to render and the template variables: ``tools`` for a template with a
    tool section, else the tool system prompt and rewritten tool turns."""
    offered = tools if choice != "none" else []
    if template_has_tools:
        return [dict(m) for m in messages], ({"tools": offered} if offered else {})
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = [f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                    "arguments": _arguments(c["function"].get("arguments"))})
                     + f"\n{CALL_CLOSE}" for c in m["tool_calls"]]
            text = ((m.get("content") or "") + "\n" if m.get("content") else "") + "\n".join(calls)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append(dict(m))
    if offered:
        listing = "\n".join(json.dumps(t) for t in offered)
        system = SYSTEM_PROMPT.format(tools=listing)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, {}


def _arguments(value: Any) -> Any:
    """Arguments of a past call as an object (clients send them as JSON text)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value if value is not None else {}


def check_tool_calls(messages: Sequence[Any]) -> None:
    """The ``tool_calls`` of past assistant turns: a list of ``{"type": "function",
    "function": {"name": str, "arguments": str or object}}``; InvalidRequest naming the
    message otherwise (they are read when the conversation is rendered)."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls is None:
            continue
        if not isinstance(calls, (list, tuple)):
            raise InvalidRequest(f"messages[{i}].tool_calls must be a list of calls, not {type(calls).__name__}",
                                 field="messages")
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                    or not isinstance(fn.get("arguments", {}), (str, dict, type(None)))):
                raise InvalidRequest(f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", \"function\": "
                                     f"{{\"name\": ..., \"arguments\": \"<JSON text>\"}}}}", field="messages")


def parse_tool_calls(text: str, tools: list[dict[str, Any]], *, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` from a completion: every well-formed ``<tool_call>`` block
    naming an offered tool becomes a call (only the first unless ``parallel``; later
    ones are dropped with their text); the text outside them is the content (None when
    empty). Malformed blocks stay in the content."""
    names = {t["function"]["name"] for t in tools}
    calls, kept, at = [], [], 0
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in names:
            continue
        kept.append(text[at:m.start()])
        at = m.end()
        if calls and not parallel:
            continue
        args = obj.get("arguments", {})
        calls.append(ToolCall(obj["name"], json.dumps(args if args is not None else {})))
    if not calls:
        return text, []
    kept.append(text[at:])
    content = "".join(kept).strip()
    return (content or None), calls


def prepare_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], sampling: Any, tools: Any = None,
                 tool_choice: Any = None) -> tuple[str, Any, list[dict[str, Any]], Any]:
    """Render a conversation with tools: ``(prompt text, sampling, tools, choice)``, the
    sampling constrained to a call when the choice forces one (a request that also sets
    ``structured`` is refused: one grammar per request)."""
    tools, choice = check_tools(tools, tool_choice)
    check_tool_calls(messages)
    template = getattr(tokenizer, "chat_template", None) or ""
    msgs, variables = tool_messages(messages, tools, choice, template_has_tools="tools" in template)
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, **variables)
    constraint = tool_constraint(tools, choice)
    if constraint is not None:
        if sampling.structured is not None:
            raise InvalidRequest("a forced tool call and a response format cannot both constrain one answer",
                                 field="tool_choice")
        sampling = sampling.model_copy(update={"structured": constraint})
    return text, sampling, tools, choice
