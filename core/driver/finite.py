"""Whether a constraint can finish: a JSON schema or a Lark grammar (llguidance's dialect)
every one of whose sentences is infinite.

llguidance accepts such a constraint, masks the first token, and then follows the model
token after token until the cache is full or some token fails with a parser dump. Both
checks here are structural and conservative: they answer "no finite sentence" only when
every way through the constraint must recurse forever, and anything they do not model
(an external ``$ref``, a Lark construct this reader does not know, a constraint too large
to walk within the work bound) counts as finishing, leaving llguidance's own checks as
the only ones. They never refuse a constraint that has a finite sentence.

For a grammar this is the textbook productivity check: a rule is *productive* when one of
its alternatives consists only of terminals and productive rules, found by iterating to
a fixed point; the grammar has a finite sentence exactly when ``start`` is productive.
Terminals (strings, regexes, special tokens, imported names, ``@`` references) count as
productive; whether their language is empty is llguidance's first-token check.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["schema_has_instance", "endless_rules"]

_SCHEMA_VISITS = 100_000  # work bound of schema_has_instance: past it, a schema is given the benefit of the doubt
_GRAMMAR_WORK = 2_000_000  # node visits of endless_rules' fixed point; past it, a grammar is given the same
_GRAMMAR_DEPTH = 200  # nesting of groups a grammar may have before the reader gives up on it


def schema_has_instance(schema: Any) -> bool:
    """Whether some finite JSON value is valid under ``schema`` as far as its structure
    decides: False when every way through it must recurse forever (an object that
    requires a property of its own type, with no way out), which llguidance accepts and
    then follows token after token without an end. Conservative: what it cannot judge
    (external ``$ref``, keywords it does not model, a schema too large to walk) counts
    as having an instance."""
    visits = 0

    def resolve(ref: str) -> Any:
        if not ref.startswith("#"):
            return True
        node: Any = schema
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return True
        return node

    def charge(node: dict, copies: int) -> None:
        """Count the keys an overlay copies as visits: a wide node under many branches
        must not make the walk quadratic past its bound."""
        nonlocal visits
        props = node.get("properties")
        visits += copies * (len(node) + (len(props) if isinstance(props, dict) else 0))
        if visits > _SCHEMA_VISITS:
            raise OverflowError

    def has(node: Any, path: frozenset[int]) -> bool:
        nonlocal visits
        visits += 1
        if visits > _SCHEMA_VISITS:
            raise OverflowError
        if not isinstance(node, dict):
            return node is not False
        if id(node) in path:  # a finite value needs no node twice on one branch
            return False
        path = path | {id(node)}
        if "$ref" in node and not has(resolve(str(node["$ref"])), path):
            return False
        if isinstance(node.get("allOf"), list):
            if not all(has(s, path) for s in node["allOf"]):
                return False
            # the branches' keywords and the node's hold together: a `required` in one
            # branch names a property the node (or another branch) defines
            charge(node, len(node["allOf"]))
            node = _overlay({k: v for k, v in node.items() if k != "allOf"}, *node["allOf"])
        for key in ("anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                rest = {k: v for k, v in node.items() if k not in (key, "$ref")}
                charge(rest, len(node[key]))
                if not any(has(_overlay(rest, s) if isinstance(s, dict) else s, path) for s in node[key]):
                    return False
        kinds = node.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else None
        if kinds is None or "object" in kinds:
            if not has_object(node, path):
                if kinds is not None and kinds == ["object"]:
                    return False
                kinds = [k for k in (kinds or []) if k != "object"] or None
                if kinds is None:  # untyped: another type may still do
                    return True
        if kinds is not None and kinds == ["array"]:
            low = node.get("minItems", 0)
            prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
            if isinstance(low, int) and low > 0:
                need = prefix[:low] + [node.get("items", True)] * max(0, low - len(prefix))
                if not all(has(s, path) for s in need):
                    return False
        return True

    def has_object(node: dict, path: frozenset[int]) -> bool:
        """An object with every required property and at least minProperties of them."""
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        patterns = node.get("patternProperties") if isinstance(node.get("patternProperties"), dict) else {}
        required = list(dict.fromkeys(n for n in node["required"] if isinstance(n, str))) \
            if isinstance(node.get("required"), list) else []
        open_names: list[bool] = []

        def open_ok() -> bool:
            """Some name outside ``properties`` can take a finite value: its value falls
            under a pattern's schema or under ``additionalProperties``; which one is not judged)."""
            if not open_names:
                open_names.append(any(has(sub, path) for sub in patterns.values())
                                  or has(node.get("additionalProperties", True), path))
            return open_names[0]

        if not all(has(props[name], path) if name in props else open_ok() for name in required):
            return False
        least = node.get("minProperties", 0)
        if not isinstance(least, int) or least <= len(required) or open_ok():
            return True
        more = sum(1 for name, sub in props.items() if name not in required and has(sub, path))
        return len(required) + more >= least

    try:
        return has(schema, frozenset())
    except (OverflowError, RecursionError):
        return True


def _overlay(base: dict, *parts: Any) -> dict:
    """``base`` with each part's keywords laid over it: ``required`` lists joined,
    ``properties`` merged, any other keyword the part's. Every value valid under all of
    them is valid under the overlay (it drops constraints, never adds one), so an overlay
    with no finite instance proves the same of them."""
    out = dict(base)
    for part in parts:
        if not isinstance(part, dict):
            continue
        for key, value in part.items():
            if key == "required" and isinstance(value, list) and isinstance(out.get(key), list):
                out[key] = out[key] + value
            elif key == "properties" and isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = {**out[key], **value}
            else:
                out[key] = value
    return out


class _Unknown(Exception):
    """The grammar uses something this reader does not model: no verdict."""


# llguidance's lexemes of the Lark dialect, tried in this order at each position; a name
# runs as far as its characters go, as llguidance's longest match does.
_LEXEMES = re.compile(r"""[ \t]*(?:
    (?P<nl>(?:\r?\n)+[ \t]*)
  | (?P<skip>[ \t]+|(?:\#|//)[^\n]*)
  | (?P<string>"(?:\\(?:["\\/bfnrt]|u[a-fA-F0-9]{4})|[^"\\\x00-\x1f\x7f])*"i?)
  | (?P<regex>/(?:\\.|[^/\\])+/[imslux]*)
  | (?P<special><[^<>\s]+>)
  | (?P<ref>@[a-zA-Z0-9_\-]+)
  | (?P<directive>%[a-z]+)
  | (?P<number>[+-]?[0-9]+(?:\.(?!\.)[0-9]*)?)
  | (?P<rule>!?[_?]?[a-z][_a-z0-9\-]*)
  | (?P<token>_?[A-Z][_A-Z0-9]*)
  | (?P<punct>->|\.\.|[:,.(){}\[\]~|=+*?])
)""", re.VERBOSE)
_NAME_CHAR = re.compile(r"[A-Za-z0-9_\-]")
_BLANKS = re.compile(r"[ \t]*")


def _lex(text: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    pos, decoder = 0, json.JSONDecoder()
    while pos < len(text):
        m = _LEXEMES.match(text, pos)
        if m is None:
            raise _Unknown(text[pos:pos + 20])
        kind, pos = m.lastgroup, m.end()
        value = m.group(kind)
        if kind in ("rule", "token") and pos < len(text) and _NAME_CHAR.match(text, pos):
            raise _Unknown(value)  # a name mixing cases: how llguidance splits it is its business
        if kind == "skip":
            continue
        if kind == "nl":
            if not out or out[-1][0] != "nl":
                out.append(("nl", None))
            continue
        if kind == "directive" and value in ("%json", "%regex", "%llguidance"):
            try:
                payload, pos = decoder.raw_decode(text, _BLANKS.match(text, pos).end())
            except ValueError:
                raise _Unknown(value) from None
            out.append((value, payload))
            continue
        out.append((value if kind in ("punct", "directive") else kind, value))
    out.append(("nl", None))
    return out


class _Reader:
    """A recursive-descent reader of the dialect's rules into small trees:
    ``("t",)`` a terminal, ``("n", name)``, ``("seq", [..])``, ``("alt", [..])``,
    ``("rep", node, least)`` (``x?``, ``x*``, ``[x]`` have least 0, ``x+`` 1)."""

    def __init__(self, tokens: list[tuple[str, Any]]):
        self.toks, self.at, self.depth = tokens, 0, 0
        self.rules: dict[str, Any] = {}
        self.endless_json = False

    def peek(self, ahead: int = 0) -> str:
        i = self.at + ahead
        return self.toks[i][0] if i < len(self.toks) else "eof"

    def take(self, kind: str) -> Any:
        if self.peek() != kind:
            raise _Unknown(f"expected {kind}, found {self.peek()}")
        self.at += 1
        return self.toks[self.at - 1][1]

    def grammar(self) -> dict[str, Any]:
        while self.peek() != "eof":
            kind = self.peek()
            if kind == "nl":
                self.at += 1
            elif kind in ("rule", "token"):
                self.definition()
            elif kind in ("%import", "%ignore", "%declare"):
                # imported and declared names are terminals defined elsewhere: an
                # undefined name counts as productive, so the statement adds nothing
                while self.peek() != "nl":
                    self.at += 1
            elif kind == "%llguidance":
                self.at += 1
            else:  # %override and anything newer: no verdict
                raise _Unknown(kind)
        return self.rules

    def definition(self) -> None:
        name = self.take(self.peek()).lstrip("!?")
        if self.peek() == "{":
            raise _Unknown("template")
        if self.peek() == ".":  # priority
            self.at += 1
            self.take("number")
        if self.peek() == "[":  # attributes (lazy, capture, stop=..., max_tokens=...): no bearing on finiteness
            while self.peek() not in ("]", "eof", "nl"):
                self.at += 1
            self.take("]")
        self.take(":")
        if name in self.rules:
            raise _Unknown(f"{name} defined twice")
        self.rules[name] = self.alternatives()
        if self.peek() != "nl":
            raise _Unknown(f"after {name}: {self.peek()}")

    def alternatives(self) -> Any:
        self.depth += 1
        if self.depth > _GRAMMAR_DEPTH:
            raise _Unknown("nesting")
        alts = [self.sequence()]
        while self.peek() == "|" or (self.peek() == "nl" and self.peek(1) == "|"):
            self.at += 1 if self.peek() == "|" else 2
            alts.append(self.sequence())
        self.depth -= 1
        return alts[0] if len(alts) == 1 else ("alt", alts)

    def sequence(self) -> Any:
        items = []
        while self.peek() not in ("nl", "|", "->", ")", "]", "eof"):
            items.append(self.item())
        if self.peek() == "->":  # an alias names the tree node only
            self.at += 1
            self.take("rule")
        return items[0] if len(items) == 1 else ("seq", items)

    def item(self) -> Any:
        atom = self.atom()
        kind = self.peek()
        if kind in ("?", "*"):
            self.at += 1
            return ("rep", atom, 0)
        if kind == "+":
            self.at += 1
            return ("rep", atom, 1)
        if kind == "~":  # x~n, x~n..m
            self.at += 1
            least = self.count(self.take("number"))
            if self.peek() == "..":
                self.at += 1
                self.count(self.take("number"))
            return ("rep", atom, least)
        if kind == "{":  # x{n}, x{n,}, x{,m}, x{n,m}
            self.at += 1
            least = self.count(self.take("number")) if self.peek() == "number" else 0
            while self.peek() in (",", "number"):
                self.at += 1
            self.take("}")
            return ("rep", atom, least)
        return atom

    @staticmethod
    def count(text: str) -> int:
        if not text.isdigit():
            raise _Unknown(text)
        return int(text)

    def atom(self) -> Any:
        kind = self.peek()
        if kind in ("(", "["):
            self.at += 1
            inner = self.alternatives()
            self.take(")" if kind == "(" else "]")
            return inner if kind == "(" else ("rep", inner, 0)
        if kind == "string":
            self.at += 1
            if self.peek() == "..":  # "a".."z"
                self.at += 1
                self.take("string")
            return ("t",)
        if kind in ("regex", "special", "ref", "%regex"):
            self.at += 1
            return ("t",)
        if kind == "%json":
            schema = self.take("%json")
            if schema_has_instance(schema):
                return ("t",)
            self.endless_json = True
            return ("alt", [])  # no alternative: never productive
        if kind in ("rule", "token"):
            name = self.take(kind)
            if name[0] in "!?":  # `x?y` lexes as x then a rule `?y`: ambiguous, no verdict
                raise _Unknown(name)
            return ("n", name)
        raise _Unknown(kind)


def endless_rules(grammar: str) -> tuple[list[str], bool] | None:
    """For a Lark grammar whose ``start`` has no finite sentence: the rules reachable from
    ``start`` that can never finish (``start`` first), and whether an inline ``%json``
    schema with no finite instance is among the reasons. None when ``start`` has a finite
    sentence, and when the text uses something this reader does not model or is too large
    to judge within the work bound (no verdict: the grammar is not refused for it)."""
    try:
        reader = _Reader(_lex(grammar))
        rules = reader.grammar()
        if "start" not in rules:
            return None
        work = 0

        def productive(node: Any, known: set[str]) -> bool:
            nonlocal work
            work += 1
            if work > _GRAMMAR_WORK:
                raise _Unknown("too large")
            tag = node[0]
            if tag == "t":
                return True
            if tag == "n":
                return node[1] in known or node[1] not in rules
            if tag == "seq":
                return all(productive(n, known) for n in node[1])
            if tag == "alt":
                return any(productive(n, known) for n in node[1])
            return node[2] == 0 or productive(node[1], known)

        # a worklist fixed point: a rule is looked at again only when a rule it names
        # has just turned out productive, so a long chain of rules stays linear
        referrers: dict[str, set[str]] = {}
        for name, body in rules.items():
            for used in _names(body):
                referrers.setdefault(used, set()).add(name)
        known: set[str] = set()
        todo = list(rules)
        while todo:
            name = todo.pop()
            if name not in known and productive(rules[name], known):
                known.add(name)
                todo.extend(r for r in referrers.get(name, ()) if r not in known)
    except (_Unknown, RecursionError):
        return None
    if "start" in known:
        return None
    endless, todo = [], ["start"]
    while todo:
        name = todo.pop()
        if name in endless:
            continue
        endless.append(name)
        todo.extend(reversed([n for n in _names(rules[name]) if n in rules and n not in known]))
    return endless, reader.endless_json


def _names(node: Any) -> list[str]:
    if node[0] == "n":
        return [node[1]]
    if node[0] in ("seq", "alt"):
        return [n for child in node[1] for n in _names(child)]
    if node[0] == "rep":
        return _names(node[1])
    return []
