"""The OpenAI request bodies the server accepts, and their translation to SamplingParams.

Only the shape is checked here (types, unknown or unsupported fields, the length of
the lists and strings only the server takes: messages, content parts, ``user``);
value ranges and the sampler's lists (``stop``, ``stop_token_ids``, ``logit_bias``)
are the core's (``SamplingParams``), so the server and the Python API refuse the same
values with the same words, and the core names the field. A parameter that cannot be honoured is refused,
never ignored: unknown fields, tool calling, structured output, ``echo``, ``suffix``
and ``best_of`` other than ``n``. ``user`` is accepted: it identifies the caller and
changes nothing in the output (as in OpenAI's API), nor which cached prompts a request
may continue (``cache_salt`` does that, app.py's ``partition``).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from polyengine.driver.scheduler import MAX_CACHE_SALT_CHARS
from polyengine.errors import InvalidRequest
from polyengine.limits import (
    MAX_LOGIT_BIAS, MAX_SCHEMA_DEPTH, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, json_depth,
)
from polyengine.sampling.params import SamplingParams, StructuredOutput
from polyengine.serving.errors import invalid

__all__ = ["CompletionRequest", "ChatRequest", "EmbeddingRequest", "TokenizeRequest", "DetokenizeRequest", "parse_body", "check_lengths", "to_sampling", "chat_messages"]

# Bounds on what only the server takes (the body's size bounds the rest): a message list
# or a string this long is not a conversation but an attempt to make parsing expensive.
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024
MAX_NAME_CHARS = 1024  # model, user, a message's role
MAX_TOOLS = 128  # tools offered, calls in one past turn (OpenAI's bound on tools)
# How deep a body's JSON may nest: a schema (response_format, a tool's parameters) at its
# bound, under the few levels of the body around it. Checked before the body is validated.
MAX_BODY_DEPTH = MAX_SCHEMA_DEPTH + 6

# Extra fields (vLLM's names) for sampler features OpenAI's API lacks.
_EXTRAS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids")
_PYDANTIC_TAGS = {"str", "int", "float", "bool", "list", "dict", "list[int]", "list[str]", "list[list[int]]"}


class _Strict(BaseModel):
    # strict: "3" is not a number nor "yes" a boolean (pydantic's lax mode would coerce both)
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str = Field(max_length=MAX_NAME_CHARS)
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    # vLLM's field: requests share cached prompt prefixes only with requests of the same salt.
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's legacy default: 16 tokens unless max_tokens says otherwise.
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; its depth is bounded before the body is validated
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str = Field(max_length=MAX_NAME_CHARS)
    arguments: str  # JSON text, as OpenAI sends it back


class AssistantToolCall(_Strict):
    id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    # Templates may read fields beyond role and content (name, tool_call_id, ...).
    model_config = ConfigDict(extra="allow", strict=True)
    role: str = Field(max_length=MAX_NAME_CHARS)
    content: str | list[TextPart] | None = None
    tool_calls: list[AssistantToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=MAX_NAME_CHARS)
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)

    @field_validator("content")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_CONTENT_PARTS:
            raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts, got {len(v)}")
        return v


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def tool_arguments(self) -> tuple[list[dict[str, Any]] | None, Any]:
        """``tools`` and ``tool_choice`` as the core takes them (plain JSON)."""
        tools = None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, BaseModel) else self.tool_choice
        return tools, choice


class EmbeddingRequest(_Strict):
    """``POST /v1/embeddings``: OpenAI's body, plus vLLM's ``normalize`` (default true)."""

    model: str = Field(max_length=MAX_NAME_CHARS)
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    normalize: bool = True

    def inputs(self) -> list[str | list[int]]:
        """The prompts: a string or a flat token list is one, a list of either is several."""
        several = isinstance(self.input, list) and bool(self.input) and not isinstance(self.input[0], int)
        return list(self.input) if several else [self.input]


class TokenizeRequest(_Strict):
    """``POST /tokenize`` as vLLM's server has it: ``prompt`` (text), or ``messages``
    rendered with the model's chat template; ``model`` optional."""

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (the template frames them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """``POST /detokenize``: token ids back to text (special tokens kept, as vLLM does)."""

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tokens: list[int]


# What a field that may take several forms must be, said once instead of per form.
_SHAPES = {"tool_choice": '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
           "input": "a string, a list of strings, a list of token ids or a list of lists of token ids"}


def _param(loc: tuple) -> str:
    """A pydantic location as an OpenAI param: ``messages[0].content``."""
    out = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif (part not in _PYDANTIC_TAGS and "[" not in str(part) and "-" not in str(part)
              and not str(part)[:1].isupper()):  # a union member's class name: not part of the param
            out += f".{part}"
    return out


# Every list a body may carry, with its bound, checked on the decoded JSON *before* the
# request model validates it: validating a million-item list costs the server far more
# than refusing it (the sampler's bounds are the core's, polyengine.limits).
LIST_BOUNDS = {"messages": MAX_MESSAGES, "stop": MAX_STOP_STRINGS, "stop_token_ids": MAX_STOP_TOKEN_IDS,
               "logit_bias": MAX_LOGIT_BIAS, "tools": MAX_TOOLS}


def check_lengths(data: dict[str, Any], *, max_prompts: int, max_prompt_tokens: int, prompt_field: str = "prompt",
                  why: str = "this server holds at most {max} requests at once (--max-slots + --max-queue)") -> None:
    """Refuse (400 naming the field) a list longer than its bound: :data:`LIST_BOUNDS`,
    content parts per message, and ``prompt_field`` (``prompt``; ``input`` for
    embeddings): at most ``max_prompts`` prompts (``why`` says whence that bound), each
    list of token ids at most ``max_prompt_tokens`` long (code context_length_exceeded)."""
    for field, value in data.items():  # depth first: validating the body walks it recursively
        if json_depth(value, MAX_BODY_DEPTH) > MAX_BODY_DEPTH - 1:
            raise invalid(f"{field} nests more than {MAX_BODY_DEPTH - 1} levels of objects and arrays (a JSON schema "
                          f"at most {MAX_SCHEMA_DEPTH}); flatten it", str(field))
    for field, bound in LIST_BOUNDS.items():
        value = data.get(field)
        if isinstance(value, (list, dict)) and len(value) > bound:
            raise invalid(f"{field}: at most {bound:,} items are accepted, got {len(value):,}", field)
    messages = data.get("messages")
    if isinstance(messages, list):
        for i, m in enumerate(messages):
            parts = m.get("content") if isinstance(m, dict) else None
            if isinstance(parts, list) and len(parts) > MAX_CONTENT_PARTS:
                raise invalid(f"messages[{i}].content: at most {MAX_CONTENT_PARTS} content parts, got {len(parts):,}",
                              f"messages[{i}].content")
    prompt = data.get(prompt_field)
    if not isinstance(prompt, list) or not prompt:
        return
    several = not isinstance(prompt[0], int) or isinstance(prompt[0], bool)
    if several and len(prompt) > max_prompts:
        raise invalid(f"{len(prompt):,} prompts in one request, but {why.format(max=max_prompts)}: send fewer per "
                      f"request", prompt_field)
    for ids in (prompt if several else [prompt]):
        if isinstance(ids, list) and len(ids) > max_prompt_tokens:
            raise invalid(f"a prompt of {len(ids):,} token ids cannot fit: this server accepts at most "
                          f"{max_prompt_tokens} (--context-length): shorten it", prompt_field,
                          code="context_length_exceeded")


def parse_body(raw: bytes, model: type[BaseModel], precheck: Callable[[dict[str, Any]], None] | None = None) -> Any:
    """Decode and shape-check a JSON body; APIError 400 naming the field otherwise.
    ``precheck`` sees the decoded object before the model validates it."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise invalid(f"could not parse the request body as JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid(f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    if precheck is not None:
        precheck(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        if not err["loc"]:
            raise invalid(err["msg"]) from None
        param, loc_field = _param(err["loc"]), str(err["loc"][0])
        if err["type"] == "extra_forbidden":
            raise invalid(f"unrecognized request argument supplied: {param}", param=param) from None
        if err["type"] == "missing":
            raise invalid(f"missing required parameter: {param}", param=param) from None
        if loc_field in _SHAPES and len(exc.errors()) > 1:  # a union: every member's complaint would confuse
            raise invalid(f"{loc_field} must be {_SHAPES[loc_field]}", param=loc_field) from None
        raise invalid(f"{param}: {err['msg']}", param=param) from None


def _refuse_unsupported(req: _Common) -> None:
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise invalid("echo=true is not supported (the prompt is not returned with the completion)", "echo")
        if req.suffix:
            raise invalid("suffix is not supported (no fill-in-the-middle)", "suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise invalid("best_of other than n is not supported (no server-side ranking of samples)", "best_of")
    if isinstance(req, ChatRequest):
        for name in ("functions", "function_call"):
            if getattr(req, name) is not None:
                raise invalid(f"{name} is OpenAI's deprecated form: send tools and tool_choice instead", name)
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")


def to_sampling(req: _Common) -> tuple[SamplingParams, dict[str, str]]:
    """SamplingParams for the request (with a seed: the caller's or a fresh one, so
    every prompt of the request shares it and the response can report it), and the
    map from SamplingParams fields back to the request's parameter names."""
    _refuse_unsupported(req)
    names = {f: f for f in SamplingParams.model_fields}
    values: dict[str, Any] = {}
    for field in ("n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", *_EXTRAS):
        if getattr(req, field) is not None:
            values[field] = getattr(req, field)
    if req.stop is not None:
        values["stop"] = req.stop
    if req.logit_bias:  # string keys: the core reads them as token ids (and refuses what is not one)
        values["logit_bias"] = req.logit_bias
    max_tokens = req.max_tokens
    if isinstance(req, ChatRequest):
        if req.max_completion_tokens is not None:
            if max_tokens is not None and max_tokens != req.max_completion_tokens:
                raise invalid("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
            max_tokens = req.max_completion_tokens
            names["max_tokens"] = "max_completion_tokens"
        if req.top_logprobs is not None and not req.logprobs:
            raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
        if req.logprobs:
            values["logprobs"] = True
            values["top_logprobs"] = req.top_logprobs or 0
    elif req.logprobs is not None:  # /v1/completions: logprobs=k asks for k alternatives
        values["logprobs"] = True
        values["top_logprobs"] = req.logprobs
        names["top_logprobs"] = names["logprobs"] = "logprobs"
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    if isinstance(req, ChatRequest) and req.response_format is not None:
        structured = response_format(req.response_format)
        if structured is not None:
            values["structured"] = structured
            names["structured"] = "response_format"
    try:
        sampling = SamplingParams(**values)
    except InvalidRequest as exc:
        raise invalid(str(exc), names.get(exc.field, exc.field)) from None
    return sampling.with_seed(), names


def response_format(fmt: Any) -> StructuredOutput | None:
    """OpenAI's ``response_format`` as a constraint: ``text`` (none), ``json_object``
    (any JSON object), ``json_schema`` (``{"name", "schema", "strict"}``; enforced by the
    grammar whether or not ``strict`` is set)."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise invalid('response_format.json_schema must be {"name": ..., "schema": {...}, "strict": ...}',
                          "response_format.json_schema")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema must be a JSON Schema object",
                          "response_format.json_schema.schema")
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            raise invalid("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
        return StructuredOutput(json_schema=schema)
    raise invalid(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                  "response_format.type")


def chat_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """The conversation as template input: text parts joined, None fields dropped."""
    out = []
    for i, m in enumerate(req.messages):
        msg = m.model_dump(exclude_none=True)
        if m.content is None and not (m.role == "assistant" and msg.get("tool_calls")):
            raise invalid(f"messages[{i}].content is missing: every message needs text content (an assistant "
                          f"message may carry tool_calls instead)", f"messages[{i}].content")
        if isinstance(m.content, list):
            msg["content"] = "".join(part.text for part in m.content)
        out.append(msg)
    return out
