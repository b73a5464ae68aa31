"""The built-in calculator: a safe arithmetic interpreter for model-written expressions.

The input is untrusted text the model produced, so nothing in it is ever executed.
``ast.parse(..., mode="eval")`` only builds a syntax tree; :func:`evaluate` then walks
that tree itself and accepts exactly: int and float literals (not bool, complex or
strings), unary ``+``/``-``, binary ``+ - * / // % **``, and parentheses (which the
parser has already folded away). Any other node (a name, attribute, call, subscript,
comprehension, lambda, comparison, ...) is refused, so no Python object other than
the numbers is ever touched.

Work is bounded by sizes checked before the work happens, never by signals or threads
(which only work on the main thread and cannot interrupt a long C-level
multiplication anyway): the input length before parsing, the parenthesis depth before
parsing, the tree depth while walking, the bit length of every integer, and for
``**`` the exponent and an estimate of the result's size before computing it.
Floats must stay finite. Before parsing, characters that cannot occur in such an
expression are refused (letters other than those of hex, binary, octal and exponent
literals, quotes, brackets, ...): that gives the model a precise error, and keeps
the parser from ever seeing strings, whose escape sequences make it emit warnings.
Thousands separators between digits (``1,234``) are removed first, as nanochat's
calculator does, since models write numbers that way; any other comma stays and is
refused.

Results are Python's: ``int`` results print as integers, ``float`` results via
``repr`` (shortest round-tripping form), so ``7/2`` gives ``3.5`` and ``6/3``
gives ``2.0``. Every refusal raises :class:`~polyengine.errors.ToolError` with the
reason; the tool machine shows it to the model as ``error: <reason>``.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Callable, Union

from polyengine.errors import ToolError

__all__ = ["evaluate", "MAX_INPUT_CHARS", "MAX_DEPTH", "MAX_INT_BITS", "MAX_EXPONENT"]

Number = Union[int, float]

MAX_INPUT_CHARS = 256
# Parentheses deeper than this are refused before parsing; the tree depth bound covers
# chains of unary signs and long operator chains, which nest in the tree too.
MAX_PAREN_DEPTH = 32
MAX_DEPTH = 200
# The result becomes forced tokens in the model's context: ~150 decimal digits is far
# beyond any useful answer and keeps every operation (and str()) cheap.
MAX_INT_BITS = 512
MAX_EXPONENT = 1024

_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_ALLOWED = "numbers, + - * / // % ** and parentheses"
# Digits, the letters of 0x/0o/0b and exponent literals, operators, parentheses, spaces.
_REFUSED_NAMES: dict[type, str] = {
    ast.Name: "names",
    ast.Attribute: "attributes",
    ast.Call: "function calls",
    ast.Subscript: "subscripts",
    ast.Compare: "comparisons",
    ast.BoolOp: "boolean operators",
    ast.Lambda: "lambdas",
}
_CHARSET = frozenset("0123456789abcdefABCDEFxXoO_.+-*/%() \t\r\n")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def _check(value: object) -> Number:
    """Keep every intermediate result inside the bounds (and a real number)."""
    if type(value) is int:
        if value.bit_length() > MAX_INT_BITS:
            raise ToolError(f"integer too large (over {MAX_INT_BITS} bits)")
        return value
    if type(value) is float:
        if not math.isfinite(value):
            raise ToolError("result is not a finite number")
        return value
    # int ** negative float and friends can produce complex numbers.
    raise ToolError("result is not a real number")


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError(f"exponent {exponent!r} is too large (at most {MAX_EXPONENT} in magnitude)")
    if base < 0 and type(exponent) is float and not exponent.is_integer():
        raise ToolError("a negative number to a fractional power is not a real number")
    if type(base) is int and type(exponent) is int and exponent > 0 and abs(base) > 1:
        # |base| >= 2**(bits-1), so the result has at least (bits-1)*exponent+1 bits;
        # refusing on that bound means the power we do compute has at most
        # MAX_INT_BITS + MAX_EXPONENT bits.
        if (abs(base).bit_length() - 1) * exponent >= MAX_INT_BITS:
            raise ToolError(f"result of ** would be too large (over {MAX_INT_BITS} bits)")
    return base**exponent


def _refuse_non_arithmetic(node: ast.AST) -> None:
    """Refuse any node that is not a number or an allowed operator, anywhere in the tree,
    before anything is computed: otherwise ``0 / 0 / __import__('os')`` divides by zero
    (left to right) before the walk reaches the call it must refuse."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant):
            if type(sub.value) not in (int, float):
                raise ToolError(f"only numbers are allowed, not {type(sub.value).__name__} literals")
        elif isinstance(sub, ast.UnaryOp):
            if type(sub.op) not in _UNARY:
                raise ToolError(f"operator {type(sub.op).__name__} is not allowed; allowed: {_ALLOWED}")
        elif isinstance(sub, ast.BinOp):
            if type(sub.op) not in _BINARY:
                raise ToolError(f"operator {type(sub.op).__name__} is not allowed; allowed: {_ALLOWED}")
        elif not isinstance(sub, ast.operator | ast.unaryop):
            what = _REFUSED_NAMES.get(type(sub), f"{type(sub).__name__} expressions")
            raise ToolError(f"{what} are not allowed; allowed: {_ALLOWED}")


def _walk(node: ast.AST, depth: int) -> Number:
    if depth > MAX_DEPTH:
        raise ToolError(f"expression is nested too deeply (over {MAX_DEPTH} levels)")
    if depth == 0:
        _refuse_non_arithmetic(node)
    if isinstance(node, ast.Constant):
        value = node.value
        if type(value) not in (int, float):  # bool is an int subclass: exact type check
            raise ToolError(f"only numbers are allowed, not {type(value).__name__} literals")
        return _check(value)
    if isinstance(node, ast.UnaryOp):
        op = _UNARY.get(type(node.op))
        if op is None:
            raise ToolError(f"operator {type(node.op).__name__} is not allowed; allowed: {_ALLOWED}")
        return _check(op(_walk(node.operand, depth + 1)))
    if isinstance(node, ast.BinOp):
        op = _BINARY.get(type(node.op))
        if op is None:
            raise ToolError(f"operator {type(node.op).__name__} is not allowed; allowed: {_ALLOWED}")
        left = _walk(node.left, depth + 1)
        right = _walk(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            return _check(_power(left, right))
        return _check(op(left, right))
    what = _REFUSED_NAMES.get(type(node), f"{type(node).__name__} expressions")
    raise ToolError(f"{what} are not allowed; allowed: {_ALLOWED}")


def _paren_depth(text: str) -> int:
    depth = deepest = 0
    for ch in text:
        if ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    return deepest


def evaluate(expr: str) -> str:
    """Evaluate an arithmetic expression and return the result as text.

    Raises :class:`ToolError` (and nothing else) for anything that is not bounded
    arithmetic on numbers: other syntax, oversized input or numbers, division by zero,
    non-finite or complex results.
    """
    if not isinstance(expr, str):
        raise ToolError(f"expression must be text, not {type(expr).__name__}")
    if len(expr) > MAX_INPUT_CHARS:
        raise ToolError(f"expression is too long ({len(expr)} characters, at most {MAX_INPUT_CHARS})")
    text = _THOUSANDS.sub("", expr).strip()
    if not text:
        raise ToolError("expression is empty")
    bad = next((ch for ch in text if ch not in _CHARSET), None)
    if bad is not None:
        raise ToolError(f"character {bad!r} is not allowed; allowed: {_ALLOWED}")
    if _paren_depth(text) > MAX_PAREN_DEPTH:
        raise ToolError(f"parentheses are nested too deeply (at most {MAX_PAREN_DEPTH})")
    try:
        tree = ast.parse(text, mode="eval")
        value = _walk(tree.body, 0)
    except ToolError:
        raise
    except SyntaxError as exc:
        raise ToolError(f"not a valid expression ({exc.msg})") from None
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError("numeric overflow") from None
    except RecursionError:
        raise ToolError("expression is nested too deeply") from None
    except MemoryError:
        raise ToolError("expression needs too much memory") from None
    except (ValueError, TypeError) as exc:
        # ValueError: e.g. null bytes in the source, or an over-long integer literal.
        raise ToolError(f"cannot evaluate: {exc}") from None
    return str(value) if type(value) is int else repr(value)
