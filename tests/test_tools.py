"""The calculator (safe arithmetic) and the tool state machine (nanochat's protocol)."""

import ast
import math
import operator
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polyengine.discovery import PluginWarning
from polyengine.errors import InvalidRequest, PluginError, ToolError
from polyengine.hookspecs import hookimpl
from polyengine.plugins import PluginRegistry
from polyengine.tools import CALCULATOR, Tool, ToolMachine, available_tools, evaluate
from polyengine.tools import calculator

from imports import assert_imports_light

PY_START, PY_END, OUT_START, OUT_END = "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"


class CharTokenizer:
    """Every character is a token (id 100 + code point); special tokens get ids from 0.

    Like HF tokenizers, ``encode`` turns special-token text into the special ids even
    without adding special tokens, which lets a test feed delimiters through a tool's output.
    """

    def __init__(self, specials=(PY_START, PY_END, OUT_START, OUT_END)):
        self.specials = list(specials)

    def token_to_id(self, token):
        if token in self.specials:
            return self.specials.index(token)
        return 100 + ord(token) if len(token) == 1 else None

    def encode(self, text):
        ids, i = [], 0
        while i < len(text):
            special = next((s for s in self.specials if text.startswith(s, i)), None)
            if special:
                ids.append(self.specials.index(special))
                i += len(special)
            else:
                ids.append(100 + ord(text[i]))
                i += 1
        return ids

    def decode(self, ids):
        return "".join(self.specials[i] if i < 100 else chr(i - 100) for i in ids)


def run_stream(row, tokens, filler="~", tok=None):
    """Feed the engine's tokens; while output is forced, the engine's proposals are
    ``filler`` (discarded). Returns the completion text and the forced mask."""
    tok = tok or CharTokenizer()
    out, forced_mask = [], []
    queue = list(tokens)
    while queue or row.pending:
        engine_token = tok.encode(filler)[0] if row.pending else queue.pop(0)
        token, forced = row.step(engine_token)
        out.append(token)
        forced_mask.append(forced)
    return tok.decode(out), forced_mask


def script(text):
    return CharTokenizer().encode(text)


# -- calculator: what it computes ------------------------------------------------------


@pytest.mark.parametrize(
    "expr, result",
    [
        ("1+2", "3"),
        ("7/2", "3.5"),
        ("6/3", "2.0"),  # true division gives a float, printed as Python does
        ("7//2", "3"),
        ("-7 % 3", "2"),
        ("2**10", "1024"),
        ("2**-2", "0.25"),
        ("(1 + 2) * (3 - 4)", "-3"),
        ("-(-(+5))", "5"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("1e3 * 2", "2000.0"),
        ("1,234 + 1", "1235"),
        ("12,345,678 * 2", "24691356"),
        ("0x10 + 0b11 + 0o7", "26"),
        ("1_000 * 3", "3000"),
        ("  42  ", "42"),
        ("2**511", str(2**511)),
        ("(-8) ** 2.0", "64.0"),
    ],
)
def test_calculator_values(expr, result):
    assert evaluate(expr) == result


@pytest.mark.parametrize(
    "expr, reason",
    [
        ("__import__('os')", "not allowed"),
        ("__import__('os').system('true')", "not allowed"),
        ("9**9**9", "exponent"),
        ("10**10**10", "exponent"),
        ("(" * 1000 + "1" + ")" * 1000, "too long"),
        ("'1'*100000", "not allowed"),
        ("9" * 10000, "too long"),
        ("9" * 200, "integer too large"),
        ("2**512", "too large"),
        ("(2**300) * (2**300)", "integer too large"),
        ("(" * 40 + "1" + ")" * 40, "parentheses are nested too deeply"),
        ("-" * 250 + "1", "nested too deeply"),
        ("1/0", "division by zero"),
        ("1 % 0", "division by zero"),
        ("1.5 // 0.0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("1e308 * 10", "not a finite number"),
        ("1e400", "not a finite number"),
        ("10.0 ** 400", "overflow"),
        ("(-8) ** 0.5", "negative number to a fractional power"),
        ("1j", "not allowed"),
        ("True + 1", "not allowed"),
        ("abc", "names are not allowed"),
        ("a.b", "attributes are not allowed"),
        ("f(1)", "function calls are not allowed"),
        ("0x1f.e", "attributes are not allowed"),
        ("1 << 5", "not allowed"),
        ("(1, 2)", "not allowed"),
        ("1 +", "not a valid expression"),
        ("", "empty"),
        ("1\x00", "not allowed"),
    ],
)
def test_calculator_refusals(expr, reason):
    start = time.perf_counter()
    with pytest.raises(ToolError, match=reason):
        evaluate(expr)
    assert time.perf_counter() - start < 1.0  # refused by size checks, not by running out a clock


def test_calculator_refuses_non_text():
    with pytest.raises(ToolError, match="must be text"):
        evaluate(12)


# Every expression node the walker accepts; everything else must be refused.
ACCEPTED_NODES = {ast.Constant, ast.BinOp, ast.UnaryOp}


@pytest.mark.parametrize("node_type", sorted(set(ast.expr.__subclasses__()) - ACCEPTED_NODES, key=lambda c: c.__name__))
def test_walker_refuses_every_other_node_type(node_type):
    """A structural proof that nothing but arithmetic runs: any node that is not a number
    or an arithmetic operator is refused before its fields are even looked at."""
    with pytest.raises(ToolError, match="not allowed"):
        calculator._walk(node_type(), 0)


@pytest.mark.parametrize("value", [True, False, None, "1", b"1", 1j, ..., (1,), frozenset()])
def test_walker_refuses_non_number_constants(value):
    with pytest.raises(ToolError, match="only numbers"):
        calculator._walk(ast.Constant(value), 0)


@pytest.mark.parametrize("op", sorted(set(ast.operator.__subclasses__()) - set(calculator._BINARY), key=lambda c: c.__name__))
def test_walker_refuses_other_binary_operators(op):
    with pytest.raises(ToolError, match="not allowed"):
        calculator._walk(ast.BinOp(ast.Constant(1), op(), ast.Constant(2)), 0)


@pytest.mark.parametrize("op", [ast.Not, ast.Invert])
def test_walker_refuses_other_unary_operators(op):
    with pytest.raises(ToolError, match="not allowed"):
        calculator._walk(ast.UnaryOp(op(), ast.Constant(1)), 0)


HOSTILE = [
    "__import__('os')", "x", "a.b", "f(1)", "[1][0]", "(lambda: 1)", "(1 for x in y)", "'s'",
    "True", "None", "1j", "(1 if 1 else 2)", "(1 < 2)", "(not 1)", "(~1)", "(1 << 2)", "(1 & 2)",
    "{}", "...", "b'x'", "f'{1}'", "(yield)", "(x := 1)", "().__class__", "open('/etc/passwd')",
]


@given(st.lists(st.one_of(st.sampled_from(HOSTILE), st.integers(0, 99).map(str)), min_size=1, max_size=5)
       .filter(lambda parts: any(p in HOSTILE for p in parts)),
       st.sampled_from(["+", "-", "*", "/", "**", "%"]))
def test_expressions_with_anything_but_arithmetic_are_refused(parts, op):
    text = f" {op} ".join(parts)
    with pytest.raises(ToolError):
        evaluate(text)
    # The walker alone (without the character check) refuses them too.
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return
    with pytest.raises(ToolError):
        calculator._walk(tree.body, 0)


@given(st.text(max_size=300))
def test_fuzz_any_text(text):
    try:
        assert isinstance(evaluate(text), str)
    except ToolError:
        pass


@given(st.text(alphabet="0123456789+-*/%().e_x ", max_size=60))
def test_fuzz_arithmetic_alphabet(text):
    try:
        result = evaluate(text)
    except ToolError:
        return
    assert isinstance(result, str) and result


# Arithmetic trees, evaluated here with Python's operators under the documented bounds.
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
        "//": operator.floordiv, "%": operator.mod, "**": operator.pow}

leaves = st.one_of(
    st.integers(-1000, 10**6),
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False).filter(lambda f: f == 0 or abs(f) > 1e-6),
)


def _tree(children):
    return st.tuples(st.sampled_from(sorted(_OPS)), children, children) | st.tuples(st.just("-"), children)


class Refused(Exception):
    pass


def _text(tree):
    if not isinstance(tree, tuple):
        text = repr(tree)
        return f"({text})" if text.startswith("-") else text  # -x ** y means -(x ** y)
    if len(tree) == 2:
        return f"(-{_text(tree[1])})"
    op, left, right = tree
    return f"({_text(left)} {op} {_text(right)})"


def _value(tree):
    """The tree's value, or Refused where the calculator must refuse."""
    if not isinstance(tree, tuple):
        return tree
    if len(tree) == 2:
        return _bounded(-_value(tree[1]))
    op, left, right = tree
    lv, rv = _value(left), _value(right)
    if op == "**":
        if abs(rv) > calculator.MAX_EXPONENT:
            raise Refused
        if lv < 0 and isinstance(rv, float) and not rv.is_integer():
            raise Refused
    try:
        return _bounded(_OPS[op](lv, rv))
    except (ZeroDivisionError, OverflowError):
        raise Refused from None


def _bounded(v):
    if isinstance(v, complex) or (isinstance(v, float) and not math.isfinite(v)):
        raise Refused
    if isinstance(v, int) and v.bit_length() > calculator.MAX_INT_BITS:
        raise Refused
    return v


@given(st.recursive(leaves, _tree, max_leaves=8))
def test_arithmetic_matches_python(tree):
    """Python's own arithmetic on small operands, with every intermediate held to the
    documented bounds, agrees with the calculator: same text, or a refusal."""
    text = _text(tree)
    try:
        value = _value(tree)
    except Refused:
        with pytest.raises(ToolError):
            evaluate(text)
        return
    if len(text) > calculator.MAX_INPUT_CHARS:
        with pytest.raises(ToolError, match="too long"):
            evaluate(text)
        return
    assert evaluate(text) == (str(value) if type(value) is int else repr(value))


# -- tools and plugins -----------------------------------------------------------------


def test_tool_validation():
    with pytest.raises(TypeError):
        Tool(name="", run=str)
    with pytest.raises(TypeError):
        Tool(name="x", run="not callable")
    with pytest.raises(ValueError, match="must differ"):
        Tool(name="x", run=str, end_token=PY_START)
    assert CALCULATOR.delimiters == (PY_START, PY_END, OUT_START, OUT_END)


def _registry_with(monkeypatch, *plugins):
    registry = PluginRegistry(entry_points=False)
    for i, plugin in enumerate(plugins):
        registry.register(plugin, name=f"plugin{i}")
    monkeypatch.setattr("polyengine.discovery.get_registry", lambda: registry)


class ShoutPlugin:
    @hookimpl
    def polyengine_tools(self):
        return [Tool("shout", str.upper, "<|shout|>", "<|/shout|>", "<|said|>", "<|/said|>")]


def test_available_tools_include_plugins(monkeypatch):
    _registry_with(monkeypatch)
    assert available_tools() == [CALCULATOR]
    _registry_with(monkeypatch, ShoutPlugin())
    assert [t.name for t in available_tools()] == ["calculator", "shout"]


def test_bad_tool_plugins(monkeypatch):
    class NotATool:
        @hookimpl
        def polyengine_tools(self):
            return ["calculator"]

    # A plugin's mistake is skipped with a warning; the other tools keep working.
    _registry_with(monkeypatch, NotATool())
    with pytest.warns(PluginWarning, match="expected polyengine.tools.Tool"):
        assert available_tools() == [CALCULATOR]
    _registry_with(monkeypatch, ShoutPlugin(), ShoutPlugin())
    with pytest.warns(PluginWarning, match="registered twice"):
        assert [t.name for t in available_tools()] == ["calculator", "shout"]


# -- the state machine -----------------------------------------------------------------


def test_off_without_tool_tokens():
    assert ToolMachine.create(CharTokenizer(specials=()), [CALCULATOR]) is None
    # Half a protocol cannot run: without the output tokens the calculator is left out.
    assert ToolMachine.create(CharTokenizer(specials=(PY_START, PY_END)), [CALCULATOR]) is None


def test_default_tools_come_from_plugins(monkeypatch):
    _registry_with(monkeypatch, ShoutPlugin())
    tok = CharTokenizer(specials=(PY_START, PY_END, OUT_START, OUT_END, "<|shout|>", "<|/shout|>", "<|said|>", "<|/said|>"))
    machine = ToolMachine.create(tok)
    assert [t.name for t in machine.tools] == ["calculator", "shout"]
    assert machine.delimiter_ids == frozenset(range(8))


def test_calculator_call_is_answered_with_forced_tokens():
    machine = ToolMachine.create(CharTokenizer(), [CALCULATOR])
    row = machine.new_row()
    text, forced = run_stream(row, script(f"So {PY_START}12*3{PY_END} then"))
    assert text == f"So {PY_START}12*3{PY_END}{OUT_START}36{OUT_END} then"
    n_before = len("So ") + 1 + len("12*3") + 1
    assert forced == [False] * n_before + [True] * 4 + [False] * len(" then")
    assert not row.pending and not row.in_call


def test_first_forced_token_replaces_the_engine_token():
    machine = ToolMachine.create(CharTokenizer(), [CALCULATOR])
    row = machine.new_row()
    for t in script(f"{PY_START}1+1"):
        assert row.step(t) == (t, False)
    assert row.in_call
    assert row.step(1) == (1, False) and row.pending  # the end token itself is the model's
    assert row.step(script("z")[0]) == (2, True)  # the engine's "z" is discarded
    assert row.step(script("z")[0]) == (script("2")[0], True)
    assert row.step(script("z")[0]) == (3, True)
    assert not row.pending
    assert row.step(script("z")[0]) == (script("z")[0], False)


def test_tool_errors_become_error_output():
    machine = ToolMachine.create(CharTokenizer(), [CALCULATOR])
    text, _ = run_stream(machine.new_row(), script(f"{PY_START}1/0{PY_END}"))
    assert text.endswith(f"{OUT_START}error: division by zero{OUT_END}")
    text, _ = run_stream(machine.new_row(), script(f"{PY_START}open('x'){PY_END}"))
    assert f"{OUT_START}error: " in text


def test_overlong_expression_is_an_error_and_memory_stays_bounded():
    machine = ToolMachine.create(CharTokenizer(), [CALCULATOR], max_expression_tokens=10)
    row = machine.new_row()
    text, _ = run_stream(row, script(f"{PY_START}{'1+' * 20}1{PY_END}"))
    assert text.endswith(f"{OUT_START}error: expression longer than 10 tokens{OUT_END}")
    # A call exactly at the cap still runs.
    text, _ = run_stream(machine.new_row(), script(f"{PY_START}{'1+' * 4}10{PY_END}"))
    assert text.endswith(f"{OUT_START}14{OUT_END}")


def test_forced_output_is_never_interpreted():
    sneaky = Tool("sneaky", lambda text: f"{PY_START}1+1{PY_END}")
    machine = ToolMachine.create(CharTokenizer(), [sneaky])
    row = machine.new_row()
    text, forced = run_stream(row, script(f"{PY_START}x{PY_END}"))
    assert text == f"{PY_START}x{PY_END}{OUT_START}{PY_START}1+1{PY_END}{OUT_END}"
    assert not row.pending and not row.in_call


def test_end_token_outside_a_call_is_an_ordinary_token():
    machine = ToolMachine.create(CharTokenizer(), [CALCULATOR])
    text, forced = run_stream(machine.new_row(), script(f"a{PY_END}{OUT_START}b"))
    assert text == f"a{PY_END}{OUT_START}b" and not any(forced)


def test_several_tools_and_several_calls():
    tools = [CALCULATOR, Tool("shout", str.upper, "<|shout|>", "<|/shout|>", "<|said|>", "<|/said|>")]
    tok = CharTokenizer(specials=(PY_START, PY_END, OUT_START, OUT_END, "<|shout|>", "<|/shout|>", "<|said|>", "<|/said|>"))
    machine = ToolMachine.create(tok, tools)
    row = machine.new_row()
    stream = tok.encode(f"{PY_START}2**5{PY_END}, <|shout|>hi<|/shout|> and {PY_START}3-5{PY_END}.")
    text, _ = run_stream(row, stream, tok=tok)
    assert text == (f"{PY_START}2**5{PY_END}{OUT_START}32{OUT_END}, <|shout|>hi<|/shout|><|said|>HI<|/said|>"
                    f" and {PY_START}3-5{PY_END}{OUT_START}-2{OUT_END}.")


def test_rows_are_independent():
    machine = ToolMachine.create(CharTokenizer(), [CALCULATOR])
    a, b = machine.new_row(), machine.new_row()
    for t in script(f"{PY_START}1+"):
        a.step(t)
    assert a.in_call and not b.in_call
    b.step(0)
    for t in script(f"5{PY_END}"):
        b.step(t)
    assert b.pending and not a.pending


def test_tool_configuration_errors():
    tok = CharTokenizer()
    with pytest.raises(InvalidRequest, match="both open with token"):
        ToolMachine.create(tok, [CALCULATOR, Tool("other", str)])
    bad_type = ToolMachine.create(tok, [Tool("number", lambda s: 3)])
    row = bad_type.new_row()
    for t in script(f"{PY_START}x"):
        row.step(t)
    with pytest.raises(PluginError, match="returned int, expected str"):
        row.step(1)

    def broken(text):
        raise KeyError("bug")

    row = ToolMachine.create(tok, [Tool("broken", broken)]).new_row()
    row.step(0)
    with pytest.raises(KeyError):  # a bug in a tool is not fed to the model as output
        row.step(1)


@given(st.lists(st.sampled_from([0, 1, 2, 3] + script("12+*/(x") ), max_size=60))
def test_machine_on_random_streams(stream):
    """Whatever the engine emits, the completion is its accepted tokens with each closed
    call's answer inserted, and forced tokens never come from the engine."""
    tok = CharTokenizer()
    row = ToolMachine.create(tok, [CALCULATOR]).new_row()
    out, forced = [], []
    for t in stream:
        token, was_forced = row.step(t)
        out.append(token)
        forced.append(was_forced)
    while row.pending:
        token, was_forced = row.step(tok.encode("~")[0])
        out.append(token)
        forced.append(was_forced)
    # Replay the protocol by hand from the accepted tokens.
    accepted = [t for t, f in zip(out, forced) if not f]
    expected, inside, expr = [], False, []
    for t in accepted:
        expected.append(t)
        if not inside and t == 0:
            inside, expr = True, []
        elif inside and t == 1:
            inside = False
            try:
                answer = evaluate(tok.decode(expr))
            except ToolError as exc:
                answer = f"error: {exc}"
            expected += [2] + tok.encode(answer) + [3]
        elif inside:
            expr.append(t)
    assert out == expected


def test_core_imports_no_frameworks():
    assert_imports_light("import polyengine.sampling, polyengine.tools")
