"""Issue 38: a grammar with no finite sentence is refused when it compiles.

``start: "a" start`` (or a rule reached from ``start`` whose every alternative needs it
again) has a first token, so llguidance accepts it; the completion could only run into
the length limit or end at a token the grammar refuses. The driver now refuses it at
compile with an InvalidRequest naming the rules, by the productivity fixed point
(``polyengine.driver.finite``). The other half of the contract is that nothing with a
finite sentence is refused: each tricky-but-finite grammar below carries a witness
sentence that llguidance itself accepts to the end. Tiny random model, reference backend.
"""

from __future__ import annotations

import json

import pytest

from polyengine import LLM, StructuredOutput
from polyengine.driver.finite import endless_rules, schema_has_instance
from polyengine.errors import InvalidRequest

pytestmark = pytest.mark.filterwarnings("ignore::polyengine.models.RandomWeightsWarning")

R = {"$ref": "#"}
TREE = {"type": "object", "properties": {"kids": {"type": "array", "items": R}}, "required": ["kids"]}
ENDLESS_SCHEMA = {"type": "object", "properties": {"next": R}, "required": ["next"]}

# (grammar, the rules named): every sentence is infinite
ENDLESS = [
    ('start: "a" start', ["start"]),
    ('start: x\nx: "a" x', ["start", "x"]),
    ('start: "(" a ")"\na: "[" b "]"\nb: "{" a "}"', ["start", "a", "b"]),  # mutual, no exit
    ('start: item+\nitem: "b" item -> more', ["start", "item"]),  # x+ of an endless x
    ('start: "(" start~1..3 ")"', ["start"]),  # at least one: no exit
    ('start: "(" start{2} ")"\n', ["start"]),
    ('?start: ("a"\n    | "b") start  // a comment\n', ["start"]),
    ('%import common.NUMBER\nstart: NUMBER "," start', ["start"]),
    ('start: "x" call\ncall: %json ' + json.dumps(ENDLESS_SCHEMA), ["start", "call"]),  # an endless inline schema
]

# (grammar, a sentence of it): finite, however close to the edge
FINITE = [
    ('start: "a" start | "b"', "aab"),
    ('start: x+\nx: "a" | "b"', "ab"),
    ('start: a\na: "(" b ")" | "z"\nb: "[" a "]"', "([z])"),  # mutual recursion with an exit
    ('start: "(" start? ")"', "(())"),  # optional recursion
    ('start: "(" [start] ")"', "()"),
    ('start: "<" start* ">"', "<<><>>"),
    ('start: "(" start{0,2} ")"', "(())"),
    ('start: x\nx: y "!"\ny: "a" x | "b"', "ab!!"),
    ('start: "x" call\ncall: %json ' + json.dumps(TREE), 'x{"kids": [{"kids": []}]}'),  # recursion through a list
    ('%import common.NUMBER\nstart: NUMBER ("," start)?', "1,2"),
]


@pytest.mark.parametrize("grammar, rules", ENDLESS)
def test_the_endless_rules_are_found(grammar, rules):
    found = endless_rules(grammar)
    assert found is not None and found[0] == rules, found


@pytest.mark.parametrize("grammar", [g for g, _ in FINITE] + [
    'start{x}: x',  # a template: not modelled, no verdict
    'start: "a" start\n%override start: "b"',  # %override: no verdict
    'start: x?y',  # `?y` lexes as a name: ambiguous, no verdict
    'start: "a" ("b"\n start)',  # a newline inside a group: not this reader's grammar, no verdict
    'start: %lark { x }',  # a construct newer than the reader
])
def test_a_finite_or_unread_grammar_gets_no_verdict(grammar):
    assert endless_rules(grammar) is None


def test_schemas_whose_every_instance_is_infinite():
    obj = {"type": "object"}
    assert not schema_has_instance({**obj, "additionalProperties": R, "minProperties": 1})
    assert not schema_has_instance({**obj, "patternProperties": {"^x": R}, "additionalProperties": False,
                                    "minProperties": 1})
    # a required property named in an anyOf / allOf branch, defined beside it
    assert not schema_has_instance({**obj, "properties": {"a": R, "b": R}, "anyOf": [{"required": ["a"]},
                                                                                    {"required": ["b"]}]})
    assert not schema_has_instance({**obj, "properties": {"a": R}, "allOf": [{"required": ["a"]}]})
    # ... and the finite neighbours of each
    assert schema_has_instance({**obj, "additionalProperties": R})
    assert schema_has_instance({**obj, "properties": {"a": R, "b": {}}, "minProperties": 1})
    assert schema_has_instance({**obj, "properties": {"a": R, "b": {}}, "anyOf": [{"required": ["a"]},
                                                                                 {"required": ["b"]}]})
    assert schema_has_instance({**obj, "patternProperties": {"^x": {}}, "additionalProperties": False,
                                "required": ["xy"]})
    assert schema_has_instance({"properties": {"a": R}, "required": ["a"]})  # untyped: 0 is an instance


@pytest.fixture(scope="module")
def llm():
    return LLM("random:tiny", "reference", max_slots=2, max_cache_length=96, max_prefill_length=64, tools=False)


@pytest.mark.parametrize("grammar, rules", ENDLESS)
def test_the_python_api_refuses_a_grammar_with_no_finite_sentence(llm, grammar, rules):
    with pytest.raises(InvalidRequest, match="no finite sentence") as err:
        llm.submit([1, 2, 3], {"max_tokens": 4, "structured": {"grammar": grammar}})
    assert err.value.field == "structured"
    assert f"rule{'s' if len(rules) > 1 else ''} {', '.join(rules)} always recurse" in str(err.value)


@pytest.mark.parametrize("grammar, sentence", FINITE)
def test_a_finite_grammar_is_accepted_and_llguidance_finishes_its_witness(llm, grammar, sentence):
    import llguidance

    out = llm.generate([[1, 2, 3]], {"max_tokens": 3, "structured": {"grammar": grammar}})[0]
    assert out.outputs[0].finish_reason in ("stop", "length")
    grammars = llm.scheduler._grammars
    compiled = grammars.compile(StructuredOutput(grammar=grammar))
    matcher = llguidance.LLMatcher(grammars._lltok, compiled, log_level=0)
    tokens = grammars._lltok.tokenize_str(sentence)
    assert matcher.consume_tokens(tokens), matcher.get_error()
    assert matcher.is_accepting(), f"{sentence!r} does not finish {grammar!r}"


def _random_grammar(rng) -> tuple[str, str | None]:
    """A random grammar over the operators the reader models, and its shortest sentence
    (None: it has none) found on the grammar's own tree, independently of the reader."""
    names = [f"r{i}" for i in range(rng.randint(1, 4))]

    def item(depth):
        pick = rng.random()
        if pick < 0.35:
            return ("t", rng.choice("abc"))
        if pick < 0.7 or depth > 1:
            return ("n", rng.choice(names))
        op = rng.choice(["?", "*", "+", "[]", "()", "{0,2}", "{1,2}", "~2"])
        return ("op", op, alternatives(depth + 1))

    def alternatives(depth):
        return [[item(depth) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 2))]

    rules = {name: alternatives(0) for name in names}

    def text(node):
        if node[0] == "t":
            return json.dumps(node[1])
        if node[0] == "n":
            return node[1] if node[1] != "r0" else "start"
        body = " | ".join(" ".join(text(i) for i in alt) for alt in node[2])
        return {"[]": f"[{body}]", "()": f"({body})"}.get(node[1], f"({body}){node[1]}")

    def shortest(node, known):
        if node[0] == "t":
            return node[1]
        if node[0] == "n":
            return known.get(node[1])
        alts = [s for s in (seq(alt, known) for alt in node[2]) if s is not None]
        one = min(alts, key=len) if alts else None
        least = {"+": 1, "{1,2}": 1, "~2": 2, "()": 1}.get(node[1], 0)
        return "" if least == 0 else None if one is None else one * least

    def seq(alt, known):
        parts = [shortest(i, known) for i in alt]
        return None if any(p is None for p in parts) else "".join(parts)

    known: dict[str, str] = {}
    for _ in range(len(names) + 1):
        for name, alts in rules.items():
            found = [s for s in (seq(a, known) for a in alts) if s is not None]
            if found and (name not in known or len(min(found, key=len)) < len(known[name])):
                known[name] = min(found, key=len)
    grammar = "\n".join(f"{text(('n', n))}: " + " | ".join(" ".join(text(i) for i in alt) for alt in alts)
                        for n, alts in rules.items())
    return grammar, known.get("r0")


def test_random_grammars_agree_with_their_own_trees_and_with_llguidance(llm):
    """200 random grammars: the reader refuses exactly those with no sentence on their own
    tree, and llguidance finishes the shortest sentence of every one it accepts (so the
    operators mean to the reader what they mean to llguidance). Deterministic (seeded)."""
    import random

    import llguidance

    grammars = llm.scheduler._grammars
    grammars._load()
    rng, endless, finite = random.Random(38), 0, 0
    for _ in range(200):
        grammar, sentence = _random_grammar(rng)
        found = endless_rules(grammar)
        if sentence is None:
            endless += 1
            assert found is not None, grammar
            continue
        finite += 1
        assert found is None, (grammar, sentence)
        matcher = llguidance.LLMatcher(grammars._lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        assert not matcher.is_error(), (grammar, matcher.get_error())
        assert matcher.consume_tokens(grammars._lltok.tokenize_str(sentence)) and matcher.is_accepting(), \
            (grammar, sentence, matcher.get_error())
    assert endless > 20 and finite > 20, (endless, finite)
