"""Chat templates: the model's own Jinja template, rendered as transformers renders it.

The environment matches transformers' ``apply_chat_template(..., tokenize=False)``:
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
``loopcontrols`` extension and a no-op ``{% generation %}`` block; globals
``raise_exception``, ``strftime_now``, a restricted ``dict`` and ``namespace``; a
``tojson`` filter that does not HTML-escape. The variables are ``messages``, ``tools``,
``documents``, ``add_generation_prompt``, the tokenizer's named special tokens
(``bos_token``, ``eos_token``, ...) and any extra keyword arguments.

Messages are normalised the same way: pydantic models and dataclasses become dicts,
keys whose value is None are dropped (templates test for presence), and a reasoning
field is mirrored under ``reasoning_content`` and ``thinking``.

Templates come from the model and are untrusted: the sandbox forbids attribute access
to internals, :mod:`polyengine.models.sandbox` bounds compiling and rendering in time
(:data:`~polyengine.limits.RENDER_SECONDS`, on a worker thread, so it works from any
thread) and every value and the output in size
(:data:`~polyengine.limits.MAX_RENDERED_CHARS`), and anything the template raises or
any bound it crosses becomes a :class:`ChatTemplateError`. A conversation larger than
the output bound is refused before rendering.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes

from polyengine import limits
from polyengine.errors import InvalidRequest
from polyengine.validation import check_text
from polyengine.models.sandbox import BoundedEnvironment, TemplateLimit, bound_filters, run_bounded, size_of

__all__ = ["ChatTemplate", "ChatTemplateError"]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(InvalidRequest):
    """A chat template failed to compile, or refused the conversation while rendering
    (e.g. "roles must alternate"); the message carries the template's own words."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
    rendering only needs its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, so a template cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} may not start with '_'")


class _Dict:
    """``dict(...)`` for templates, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> BoundedEnvironment:
    env = BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    bound_filters(env)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


def _plain(value: Any) -> Any:
    """JSON-like data only: what a sandboxed template may safely see."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if callable(getattr(value, "item", None)):  # NumPy scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _normalise(messages: Any) -> list[dict]:
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """A compiled chat template (compiling is bounded in time like rendering)."""

    def __init__(self, source: str):
        if not isinstance(source, str):
            raise ChatTemplateError(f"a chat template must be a string, not {type(source).__name__}")
        if len(source) > limits.MAX_TEMPLATE_BYTES:
            raise ChatTemplateError(f"the chat template has {len(source):,} characters; at most "
                                    f"{limits.MAX_TEMPLATE_BYTES:,} are accepted")
        self.source = source
        self._env = _environment()
        try:
            self._template = run_bounded(lambda: self._env.from_string(source), "compiling the chat template")
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc} (line {exc.lineno})") from None
        except TemplateLimit as exc:
            raise ChatTemplateError(f"the model's chat template exceeded a limit: {exc}") from None
        except (RecursionError, MemoryError) as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: it nests too deeply "
                                    f"({type(exc).__name__})") from None

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> str:
        if not messages:
            raise ChatTemplateError("cannot render an empty conversation; give at least one message")
        try:
            variables = {
                **dict(special_tokens or {}),
                **_plain(kwargs),
                "messages": _normalise(messages),
                "tools": _plain(tools),
                "documents": _plain(documents),
                "add_generation_prompt": add_generation_prompt,
            }
        except RecursionError:
            raise ChatTemplateError("the conversation nests too deeply to render") from None
        known = self._admit(variables)
        try:
            return run_bounded(lambda: self._render(variables, known), "rendering the chat template")
        except TemplateLimit as exc:
            raise ChatTemplateError(f"the model's chat template exceeded a limit: {exc}") from None
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template refused this conversation: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError) as exc:
            raise ChatTemplateError(f"the model's chat template failed on this conversation: {exc!r}") from None
        except RecursionError:
            raise ChatTemplateError("the model's chat template recursed too deeply (a template that calls "
                                    "itself without end)") from None
        except MemoryError:
            raise ChatTemplateError("the model's chat template ran out of memory") from None

    def _admit(self, variables: dict[str, Any]) -> dict[int, int]:
        """Measure the inputs once (the renderer counts them by identity afterwards) and
        refuse a conversation whose text alone would exceed the output bound."""

        cap = limits.MAX_RENDERED_CHARS
        known: dict[int, int] = {}
        for value in variables.values():
            _measure(value, known, cap)
        total = size_of(list(variables.values()), cap, known)
        if total > cap:
            raise ChatTemplateError(
                f"the conversation has more than {cap:,} characters; the rendered prompt could not fit in any "
                f"context, so it is refused before rendering"
            )
        for message in variables["messages"]:
            for key, value in message.items():
                if isinstance(value, str):
                    check_text(value, f"message {key!r}")
        return known

    def _render(self, variables: dict[str, Any], known: dict[int, int]) -> str:
        self._env.known = known  # on the worker thread that renders: its sizes of the inputs
        cap, out, n = limits.MAX_RENDERED_CHARS, [], 0
        for chunk in self._template.generate(**variables):
            n += len(chunk)
            if n > cap:
                raise TemplateLimit(f"the rendered prompt passed {cap:,} characters")
            out.append(chunk)
        return "".join(out)


def _measure(value: Any, known: dict[int, int], cap: int) -> int:
    """Size of every container inside ``value``, recorded by id (bottom-up, iterative)."""
    if not isinstance(value, (dict, list, tuple)):
        return size_of(value, cap)
    order, stack = [], [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (dict, list, tuple)) and id(v) not in known:
            known[id(v)] = 0
            order.append(v)
            stack.extend(v.values() if isinstance(v, dict) else v)
    for v in reversed(order):
        items = list(v.items()) if isinstance(v, dict) else v
        flat = [x for kv in items for x in kv] if isinstance(v, dict) else list(items)
        known[id(v)] = min(cap + 1, len(v) + sum(known.get(id(x), 0) if isinstance(x, (dict, list, tuple))
                                                 else size_of(x, cap) for x in flat))
    return known[id(value)]

