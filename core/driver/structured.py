"""Structured output in the driver: constraints compiled by llguidance, one matcher per
sample, and the per-step allowed-token masks the engine applies on the device.

The boundary: the engine knows only masks (``prefill(token_mask=...)``,
``generate(token_masks=...)``, capability ``token_masks``); this module knows grammars.
llguidance (``pip install 'polyengine[structured]'``, a Rust library with no torch) is
imported only when a constrained request is made, so the core runs without it.

Per request: :meth:`Grammars.compile` turns a :class:`~polyengine.sampling.params.StructuredOutput`
into llguidance's grammar text (cached by the constraint, checked once against the
tokenizer: a bad schema or an unsupported feature is :class:`InvalidRequest` naming
llguidance's reason). Per sample: a :class:`GrammarRow` (an ``LLMatcher``) consumes
every token the sample accepts, forced ones included, and says when the grammar is
complete. Per step: :meth:`Grammars.fill` writes every constrained slot's mask into one
``(slots, W)`` buffer with llguidance's thread pool (the GIL released), which is what
``generate`` takes.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from polyengine.driver.finite import endless_rules, schema_has_instance
from polyengine.errors import InvalidRequest, UnsupportedFeature
from polyengine.sampling.masks import allows_any, mask_words
from polyengine.sampling.params import StructuredOutput

__all__ = ["Grammars", "GrammarRow", "grammar_text", "closed_schema", "schema_has_instance", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'polyengine[structured]'"
_CACHE = 256  # compiled grammars kept per tokenizer
_CACHE_CHARS = 64 * 1024**2  # and their text (constraint and grammar): a schema can be megabytes
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError:
        raise UnsupportedFeature(
            "structured output (response_format, tools)", None,
            f"the grammar engine llguidance is not installed; {INSTALL_HINT}") from None
    return llguidance


# Keywords whose value is one schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_schema(schema: Any) -> Any:
    """``schema`` with every object schema that lists ``properties`` and says nothing of
    ``additionalProperties`` (nor ``patternProperties``/``unevaluatedProperties``)
    closed: ``"additionalProperties": false``, as vLLM's default grammar engine and
    llama.cpp read such a schema, so a model cannot invent keys. An explicit value
    (``true``, a schema) is kept; an object with no ``properties`` (``{"type":
    "object"}``) stays any object; so does one whose ``required`` names a key it does not
    list, and a member of ``allOf`` (closing it would refuse its siblings' keys). A copy:
    the caller's schema is not changed."""
    def close(node: Any, in_all_of: bool = False) -> Any:
        if not isinstance(node, dict):
            return node
        out = dict(node)
        for key in _SUBSCHEMA:
            if isinstance(out.get(key), dict):
                out[key] = close(out[key])
        for key in _SUBSCHEMA_LISTS:
            if isinstance(out.get(key), list):
                out[key] = [close(s) for s in out[key]]
        if isinstance(out.get("allOf"), list):
            out["allOf"] = [close(s, in_all_of=True) for s in out["allOf"]]
        for key in _SUBSCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {name: close(s) for name, s in out[key].items()}
        props = out.get("properties")
        required = out.get("required") if isinstance(out.get("required"), list) else []
        if (isinstance(props, dict) and props and not in_all_of
                and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & out.keys()
                and all(name in props for name in required)):
            out["additionalProperties"] = False
        return out

    return close(schema)


def grammar_text(spec: StructuredOutput) -> tuple[str, str]:
    """``(format, text)`` of a constraint, as llguidance's ``grammar_from`` takes them;
    a JSON schema's objects closed (:func:`closed_schema`)."""
    if spec.json_schema is not None:
        return "json_schema", json.dumps(closed_schema(spec.json_schema))  # key order kept: properties come out in it
    if spec.json_object:
        return "json_schema", json.dumps({"type": "object"})
    if spec.regex is not None:
        return "regex", spec.regex
    if spec.choice is not None:
        return "lark", "start: " + " | ".join(json.dumps(c) for c in spec.choice)
    return "lark", spec.grammar or ""


def _check_finite(grammar: str) -> None:
    """Refuse a Lark grammar with no finite sentence (every way through ``start``
    recurses forever): llguidance accepts it, and the completion could only stop at the
    length limit or at a token the grammar refuses."""
    found = endless_rules(grammar)
    if found is None:
        return
    rules, endless_json = found
    names = ", ".join(rules[:8]) + (f" and {len(rules) - 8} more" if len(rules) > 8 else "")
    if len(rules) == 1:
        why = f"rule {names} always recurses: every alternative of it needs it again"
        fix = f"give it an alternative that ends, or make the recursion optional ({names}? or {names}*)"
    else:
        why = f"rules {names} always recurse: every alternative of each needs one of them again"
        fix = "give one of them an alternative that ends, or make a recursion optional (x? or x*)"
    if endless_json:
        why += " (or an inline %json schema with no finite instance)"
    raise InvalidRequest(f"the grammar has no finite sentence: {why}; {fix}", field="structured")


def _first_line(message: str, limit: int = 300) -> str:
    """llguidance's error without the parser state it dumps after the first line."""
    line = (message or "").strip().splitlines()[0] if (message or "").strip() else "no detail"
    return line if len(line) <= limit else line[:limit] + "..."


class GrammarRow:
    """One sample's grammar state (an llguidance matcher)."""

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def consume(self, token: int) -> None:
        """Advance over an accepted token; InvalidRequest when the grammar refuses it (a
        forced token the grammar does not allow, or a backend that ignored the mask)."""
        if not self.matcher.consume_token(int(token)):
            raise InvalidRequest(f"token {token} does not follow the request's grammar: {_first_line(self.matcher.get_error())}",
                                 field="structured")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but EOS."""
        return bool(self.matcher.is_stopped())


class Grammars:
    """The grammar engine of one tokenizer: compiles constraints (cached), makes matchers,
    fills masks. Thread-safe: the server's submit thread compiles, the engine thread steps."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer, self.vocab_size, self.eos = tokenizer, int(vocab_size), [int(t) for t in eos_token_ids]
        self.words = mask_words(vocab_size)
        self._ll: Any = None
        self._lltok: Any = None
        self._executor: Any = None
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._cache_chars = 0
        self._lock = threading.Lock()

    def _load(self) -> Any:
        if self._lltok is None:
            ll = _llguidance()
            if self._tokenizer is None:
                raise InvalidRequest("structured output needs the model's tokenizer; this model has none")
            backend = self._tokenizer.backend
            self._lltok = ll.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos or None)
            self._executor = ll.LLExecutor()
            self._ll = ll
        return self._ll

    def compile(self, spec: StructuredOutput) -> str:
        """llguidance's grammar for ``spec`` (cached, by count and by size); InvalidRequest
        (field ``structured``) naming what is wrong with a bad or unsupported constraint,
        with one whose language is empty or holds only the empty text (its completion
        could never be anything), and with one that has no finite sentence or instance
        (it could never end; :mod:`polyengine.driver.finite`). Slow for a large schema: AsyncLLM calls it
        on a worker thread."""
        key = grammar_text(spec)
        with self._lock:
            ll = self._load()
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            fmt, text = key
            try:
                # JSON with fixed separators and no free whitespace: a small model cannot
                # wander into endless newlines (a schema's own "x-guidance" overrides this)
                grammar = (ll.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS) if fmt == "json_schema"
                           else ll.grammar_from(fmt, text))
            except Exception as exc:  # llguidance raises ValueError/RuntimeError for malformed input
                raise InvalidRequest(f"invalid {fmt.replace('_', ' ')}: {exc}", field="structured") from None
            is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, self._lltok)
            if is_error:
                raise InvalidRequest(f"invalid {fmt.replace('_', ' ')}: {messages[0]}", field="structured")
            if spec.json_schema is not None and not schema_has_instance(spec.json_schema):
                raise InvalidRequest("the JSON schema has no finite instance: every way through it requires a value of "
                                     "its own type again (give the recursion a way out: an optional property, an "
                                     "anyOf branch without it)", field="structured")
            self._check_language(grammar)
            if spec.grammar is not None:
                _check_finite(spec.grammar)
            self._cache[key] = grammar
            self._cache_chars += len(text) + len(grammar)
            while len(self._cache) > _CACHE or (self._cache_chars > _CACHE_CHARS and len(self._cache) > 1):
                (_, old), old_grammar = self._cache.popitem(last=False)
                self._cache_chars -= len(old) + len(old_grammar)
            return grammar

    def _check_language(self, grammar: str) -> None:
        """Refuse a grammar no completion can satisfy: one whose matcher fails before the
        first token (an empty language: a rule that only refers to itself, a regex that
        matches nothing) or that allows nothing but the end (only the empty text)."""
        matcher = self._ll.LLMatcher(self._lltok, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the constraint accepts no text at all ({_first_line(matcher.get_error())}); "
                                 f"check its rules for one that can never end", field="structured")
        from llguidance.numpy import fill_next_token_bitmask

        words = self.buffer(1)
        fill_next_token_bitmask(matcher, words, 0)
        if not allows_any(words[0], self.vocab_size, self.eos):
            what = ("accepts only the empty text: the completion could never be anything" if matcher.is_accepting()
                    else "accepts no text at all (no token can begin it); check its rules for one that can never end")
            raise InvalidRequest(f"the constraint {what}", field="structured")

    def row(self, spec: StructuredOutput) -> GrammarRow:
        grammar = self.compile(spec)
        matcher = self._ll.LLMatcher(self._lltok, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the constraint cannot start: {matcher.get_error()}", field="structured")
        return GrammarRow(matcher)

    def buffer(self, rows: int) -> np.ndarray:
        return np.full((rows, self.words), -1, np.int32)

    def fill(self, rows: dict[int, GrammarRow], out: np.ndarray) -> None:
        """Each ``rows`` entry's next-token mask into ``out[slot]``, in parallel."""
        if rows:
            from llguidance.numpy import fill_next_token_bitmask_par

            fill_next_token_bitmask_par(self._executor, [(r.matcher, slot) for slot, r in rows.items()], out)
