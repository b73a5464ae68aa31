"""Running an untrusted Jinja template within bounds of time and size.

A chat template comes from the model file, so it is code written by whoever made the
file. Jinja's :class:`ImmutableSandboxedEnvironment` already keeps it from reaching
Python internals and from mutating its inputs; this module adds the two bounds the
sandbox lacks, so a template cannot loop for hours or allocate gigabytes:

- **Size.** Every value a template builds is measured (characters of strings plus items
  of containers, :func:`size_of`) and refused past :data:`MAX_RENDERED_CHARS`: results
  of operators (``*``, ``**``, ``+``, ``%``), of ``~`` concatenation, of every call and
  filter, and the buffers that ``{% set %}`` blocks, macros and ``{% filter %}`` fill.
  Operations whose result can be much larger than their inputs (``'x' * n``,
  ``'%99999s' % x``, ``'x'.ljust(n)``, ``s.replace('', t)``, ``|center``, ``|indent``,
  ``|join``, ``|sum`` of lists, ``2 ** n``, ...) are estimated *before* they run, so the
  allocation never happens. The rendered output is counted as it streams.
- **Time.** The generated code checks a deadline (:data:`RENDER_SECONDS`) each time it
  enters a block: every loop iteration, branch and macro call, which is every way a
  template can repeat work. Compiling and rendering run on a worker thread, and the
  caller waits at most the deadline plus a grace period, whatever thread it is on: no
  signals, so it works off the main thread too. A single C-level operation cannot be
  interrupted, which is why the size estimates come first; one that runs long anyway
  is abandoned on its daemon thread.

A template that crosses a bound raises :class:`TemplateLimit` (caught by
:mod:`polyengine.models.chat` and turned into its typed error).
"""

from __future__ import annotations

import math
import re
import threading
import time
from typing import Any, Callable

import jinja2.compiler
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from polyengine import limits

__all__ = ["BoundedEnvironment", "TemplateLimit", "run_bounded", "size_of"]

_GRACE_SECONDS = 2.0  # how long the caller waits past the deadline for the worker to notice it
_MAX_JSON_INDENT = 16
_FIELD_WIDTH = re.compile(r"\d+")


class TemplateLimit(Exception):
    """A template went past a bound of time or size; the message says which."""


def _cap() -> int:
    return limits.MAX_RENDERED_CHARS


def size_of(value: Any, budget: int | None = None, known: dict[int, int] | None = None) -> int:
    """Characters of strings plus items of containers in ``value`` (integers count their
    decimal digits), walked iteratively and once per object, stopping past ``budget``.
    ``known`` maps ids of objects already measured (the template's inputs) to sizes."""
    budget = _cap() if budget is None else budget
    total, stack, seen = 0, [value], set()
    while stack and total <= budget:
        v = stack.pop()
        if isinstance(v, (str, bytes, bytearray)):
            total += len(v)
            continue
        if isinstance(v, bool) or v is None or isinstance(v, float):
            total += 1
            continue
        if isinstance(v, int):
            total += v.bit_length() // 3 + 1
            continue
        if known is not None and id(v) in known:
            total += known[id(v)]
            continue
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, jinja2.utils.Namespace):
            v = object.__getattribute__(v, "_Namespace__attrs")
        if isinstance(v, dict):
            total += len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += len(v)
            # Lists of one scalar kind are measured at C speed; only mixed ones are walked.
            kinds = set(map(type, v))
            if kinds == {str}:
                total += sum(map(len, v))
            elif kinds == {int}:
                total += sum(map(int.bit_length, v)) // 3
            elif not kinds <= {float, bool, type(None)}:
                stack.extend(v)
        else:
            total += 1
    return total


class _Buffer(list):
    """A template's output buffer (``{% set %}`` blocks, macros, filter and call blocks)
    that refuses to grow past the size bound."""

    def __init__(self, env: "BoundedEnvironment"):
        super().__init__()
        self._env, self._chars = env, 0

    def append(self, item: Any) -> None:
        self._grow(item)
        super().append(item)

    def extend(self, items: Any) -> None:
        items = tuple(items)
        for item in items:
            self._grow(item)
        super().extend(items)

    def _grow(self, item: Any) -> None:
        self._chars += len(item) if isinstance(item, str) else size_of(item, known=self._env.known)
        if self._chars > _cap():
            raise TemplateLimit(f"a block of the template built more than {_cap():,} characters")


_deadline = threading.local()  # .at: monotonic deadline of the render on this thread


class _CodeGenerator(jinja2.compiler.CodeGenerator):
    """Jinja's code generator with ``~`` results and output buffers size-checked, and a
    deadline check at the top of every block (loop bodies, branches, macros)."""

    def blockvisit(self, nodes: Any, frame: Any) -> None:
        self.writeline("environment.tick()")
        super().blockvisit(nodes, frame)

    def visit_Concat(self, node: Any, frame: Any) -> None:
        self.write("environment.checked(")
        super().visit_Concat(node, frame)
        self.write(")")

    def buffer(self, frame: Any) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.output_buffer()")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox plus size checks on everything a template computes (see the module
    docstring). ``known`` maps ids of the render's input objects to their sizes, so
    measuring a value that holds the conversation does not walk it again."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._local = threading.local()  # one template may render on several threads at once

    @property
    def known(self) -> dict[int, int]:
        return getattr(self._local, "known", {})

    @known.setter
    def known(self, value: dict[int, int]) -> None:
        self._local.known = value

    def output_buffer(self) -> _Buffer:
        return _Buffer(self)

    @staticmethod
    def tick() -> None:
        """Called by the generated code on entering every block: the deadline check."""
        at = getattr(_deadline, "at", None)
        if at is not None and time.monotonic() > at:
            raise TemplateLimit(f"{_deadline.what} did not finish within {_deadline.seconds:g} seconds")

    def checked(self, value: Any) -> Any:
        """``value``, if it is within the size bound."""
        if isinstance(value, (str, bytes)):
            n = len(value)
        elif isinstance(value, (int, float, bool)) or value is None:
            n = 0 if not isinstance(value, int) or value.bit_length() < 1024 else value.bit_length() // 3
        else:
            n = size_of(value, known=self.known)
        if n > _cap():
            raise TemplateLimit(f"the template built a value of more than {_cap():,} characters or items")
        return value

    def _size(self, value: Any) -> int:
        return size_of(value, known=self.known)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _estimate_binop(self, operator, left, right)
        return self.checked(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any) -> Any:
        """The sandbox's ``str.format``/``format_map`` wrapper, estimated before it runs."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def bounded(*args: Any, **kwargs: Any) -> str:
            values = list(args) + list(kwargs.values())
            if value.__name__ == "format_map" and args and isinstance(args[0], dict):
                values = list(args[0].values())
            _refuse("formatting a string", _format_estimate(self, fmt, values))
            return self.checked(wrapped(*args, **kwargs))

        return bounded

    def call(*args: Any, **kwargs: Any) -> Any:
        self, context, obj, args = args[0], args[1], args[2], args[3:]
        name = getattr(obj, "__name__", None)
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, str) and name in _STR_GROWTH:
            _STR_GROWTH[name](self, owner, args, kwargs)
        elif obj is jinja2.utils.generate_lorem_ipsum:  # the lipsum() global: n paragraphs of up to max words
            given = {**dict(zip(("n", "html", "min", "max"), args)), **kwargs}
            _refuse("lipsum()", _width(given.get("n", 5)) * _width(given.get("max", 100)) * 12)
        return self.checked(ImmutableSandboxedEnvironment.call(self, context, obj, *args, **kwargs))


# -- estimates before an operation runs ------------------------------------------------------


def _refuse(what: str, estimate: float) -> None:
    if estimate > _cap():
        size = "an unbounded number of" if math.isinf(estimate) else f"about {estimate:,.0f}"
        raise TemplateLimit(f"{what} would build {size} characters; at most {_cap():,} are allowed")


def _width(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _estimate_binop(env: BoundedEnvironment, op: str, left: Any, right: Any) -> None:
    seq = (str, bytes, list, tuple)
    if op == "*":
        if isinstance(left, seq) and isinstance(right, int):
            _refuse("repeating a sequence with *", env._size(left) * max(right, 0))
        elif isinstance(right, seq) and isinstance(left, int):
            _refuse("repeating a sequence with *", env._size(right) * max(left, 0))
        elif isinstance(left, int) and isinstance(right, int):
            _refuse("multiplying integers", (abs(left).bit_length() + abs(right).bit_length()) / 3)
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            _refuse("raising to a power with **", abs(left).bit_length() * right / 3)
    elif op == "+":
        if isinstance(left, seq) and isinstance(right, seq):
            _refuse("joining sequences with +", env._size(left) + env._size(right))
    elif op == "%" and isinstance(left, str):
        _refuse("%-formatting", _format_estimate(env, left, right))


def _format_estimate(env: BoundedEnvironment, fmt: str, args: Any) -> float:
    """An upper bound on a formatted string: every field as wide as the widest argument
    or the largest width written in the format."""
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, (tuple, list)) else [args]
    written = _FIELD_WIDTH.findall(fmt)
    if any(len(w) > 9 for w in written):
        return math.inf  # a width of ten digits or more is beyond any bound
    widest = max([env._size(v) for v in values] + [_width(v) for v in values] + [int(w) for w in written] + [0])
    fields = fmt.count("%") + fmt.count("{")
    return len(fmt) + fields * widest


def _str_pad(env: BoundedEnvironment, s: str, args: tuple, kwargs: dict) -> None:
    width = _width(args[0]) if args else _width(kwargs.get("width"))
    _refuse("padding a string", max(len(s), width))


def _str_expandtabs(env: BoundedEnvironment, s: str, args: tuple, kwargs: dict) -> None:
    size = _width(args[0]) if args else _width(kwargs.get("tabsize", 8))
    _refuse("expanding tabs", len(s) + s.count("\t") * size)


def _replace_estimate(length: int, old: Any, new: Any) -> float:
    """An upper bound on replacing every ``old`` by ``new`` in ``length`` characters."""
    if not isinstance(old, str) or not isinstance(new, str):
        return length
    if not old:
        return (length + 1) * len(new) + length
    return length + (length // len(old)) * max(0, len(new) - len(old))


def _str_replace(env: BoundedEnvironment, s: str, args: tuple, kwargs: dict) -> None:
    if len(args) >= 2:
        _refuse("replacing in a string", _replace_estimate(len(s), args[0], args[1]))


def _str_join(env: BoundedEnvironment, s: str, args: tuple, kwargs: dict) -> None:
    items = args[0] if args else ()
    if isinstance(items, (list, tuple, str)):
        _refuse("joining strings", env._size(items) + len(s) * len(items))


_STR_GROWTH: dict[str, Callable[[BoundedEnvironment, str, tuple, dict], None]] = {
    "ljust": _str_pad, "rjust": _str_pad, "center": _str_pad, "zfill": _str_pad,
    "expandtabs": _str_expandtabs, "replace": _str_replace, "join": _str_join,
}


def _filter_estimate(env: BoundedEnvironment, name: str, args: tuple, kwargs: dict) -> None:
    """Estimates for the built-in filters whose output can outgrow their input."""
    value = args[0] if args else None
    rest = args[1:]

    def arg(i: int, key: str, default: Any = None) -> Any:
        return rest[i] if len(rest) > i else kwargs.get(key, default)

    text = env._size(value)
    if name == "center":
        _refuse("|center", max(text, _width(arg(0, "width", 80))))
    elif name == "indent":
        width = arg(0, "width", 4)
        width = len(width) if isinstance(width, str) else _width(width)
        lines = value.count("\n") + 1 if isinstance(value, str) else 1
        _refuse("|indent", text + lines * width)
    elif name == "wordwrap":
        wrap = arg(2, "wrapstring", "\n")
        per = max(1, _width(arg(0, "width", 79)))
        _refuse("|wordwrap", text + (text // per + 1) * (len(wrap) if isinstance(wrap, str) else 1))
    elif name == "replace":
        _refuse("|replace", _replace_estimate(text, arg(0, "old"), arg(1, "new")))
    elif name == "join":
        sep = arg(0, "d", "")
        count = len(value) if isinstance(value, (list, tuple, str)) else 0
        _refuse("|join", text + count * (len(sep) if isinstance(sep, str) else 0))
    elif name == "format" and isinstance(value, str):
        _refuse("|format", _format_estimate(env, value, list(rest) + list(kwargs.values())))
    elif name in ("batch", "slice"):
        _refuse(f"|{name}", text + _width(arg(0, "linecount" if name == "batch" else "slices", 0)))
    elif name == "tojson":
        indent = arg(0, "indent")
        size = len(indent) if isinstance(indent, str) else _width(indent)
        if size > _MAX_JSON_INDENT:
            raise TemplateLimit(f"|tojson indent of {size}; at most {_MAX_JSON_INDENT} is allowed")
    elif name == "sum" and not isinstance(arg(1, "start", 0), (int, float)):
        # Summing sequences copies the running total at every step: quadratic in the
        # items, each counted as often as it appears.
        items = value if isinstance(value, (list, tuple)) else ()
        sizes: dict[int, int] = {}
        total = sum(sizes.setdefault(id(x), env._size(x)) for x in items)
        _refuse("|sum of sequences", len(items) * total / 2)


def bound_filters(env: BoundedEnvironment) -> None:
    """Wrap every filter of ``env`` with the size estimate and check."""
    for name, func in list(env.filters.items()):
        env.filters[name] = _bounded_filter(env, name, func)


def _bounded_filter(env: BoundedEnvironment, name: str, func: Callable) -> Callable:
    pass_arg = getattr(func, "jinja_pass_arg", None)

    def bounded(*args: Any, **kwargs: Any) -> Any:
        value_args = args[1:] if pass_arg is not None else args  # drop the context/environment
        _filter_estimate(env, name, value_args, kwargs)
        return env.checked(func(*args, **kwargs))

    if pass_arg is not None:
        bounded.jinja_pass_arg = pass_arg  # type: ignore[attr-defined]
    bounded.__name__ = getattr(func, "__name__", name)
    return bounded


# -- time ------------------------------------------------------------------------------------


def run_bounded(work: Callable[[], Any], what: str, seconds: float | None = None) -> Any:
    """Run ``work()`` on a worker thread under a deadline of ``seconds`` (default
    :data:`RENDER_SECONDS`): its result, or what it raised; TemplateLimit when the
    deadline passes first. Template code running in ``work`` checks the deadline
    itself (:meth:`BoundedEnvironment.tick`); the caller's thread is never signalled."""
    seconds = limits.RENDER_SECONDS if seconds is None else seconds
    box: dict[str, Any] = {}
    done = threading.Event()

    def worker() -> None:
        _deadline.at, _deadline.what, _deadline.seconds = time.monotonic() + seconds, what, seconds
        try:
            box["result"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            box["error"] = exc
        finally:
            _deadline.at = None
            done.set()

    thread = threading.Thread(target=worker, name="polyengine-template", daemon=True)
    thread.start()
    if not done.wait(seconds + _GRACE_SECONDS):
        # Stuck in one C-level operation between two checks: give up on it (the daemon
        # thread ends when that operation does).
        raise TemplateLimit(f"{what} did not finish within {seconds:g} seconds")
    if "error" in box:
        raise box["error"]
    return box["result"]
