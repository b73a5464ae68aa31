"""The tool state machine: per-row tool calls in the token stream (nanochat's protocol).

A row that emits ``<|python_start|>`` expr ``<|python_end|>`` gets the tool's result
forced into its completion as ``<|output_start|>`` result ``<|output_end|>``. The
machine only looks at token ids: the driver calls :meth:`ToolRow.step` with each
token the engine produced and feeds any forced token back through ``generate``'s
``overrides``. It does no I/O and knows nothing about engines, slots or stopping;
backends know nothing about tools.

A :class:`Tool` names its four delimiter tokens (nanochat's python ones by default)
and a ``run(text) -> text`` function; the calculator is built in and plugins add
tools through the ``polyengine_tools`` hook. A :class:`~polyengine.errors.ToolError`
from ``run`` becomes the output text ``error: <reason>``, so the model sees why its
call failed and can carry on; any other exception is a bug in the tool and
propagates. Forced tokens are never interpreted, so a tool's output cannot start
another call.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from polyengine.errors import InvalidRequest, PluginError, ToolError
from polyengine.tools.calculator import evaluate

__all__ = [
    "Tool",
    "CALCULATOR",
    "available_tools",
    "TokenizerLike",
    "ToolMachine",
    "ToolRow",
    "MAX_EXPRESSION_TOKENS",
]

# An expression longer than this is not arithmetic a model should write; collecting
# stops there (memory stays bounded) and the call answers with an error.
MAX_EXPRESSION_TOKENS = 256


@dataclass(frozen=True)
class Tool:
    """A tool the model can call: ``start`` expr ``end`` → ``output_start`` result ``output_end``.

    ``run`` takes the decoded text between the delimiters and returns the result
    text; it raises :class:`ToolError` to refuse its input.
    """

    name: str
    run: Callable[[str], str]
    start_token: str = "<|python_start|>"
    end_token: str = "<|python_end|>"
    output_start_token: str = "<|output_start|>"
    output_end_token: str = "<|output_end|>"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"Tool name must be a non-empty string, got {self.name!r}")
        if not callable(self.run):
            raise TypeError(f"Tool {self.name!r}: run must be callable, got {type(self.run).__name__}")
        delims = self.delimiters
        if not all(isinstance(d, str) and d for d in delims):
            raise TypeError(f"Tool {self.name!r}: delimiter tokens must be non-empty strings, got {delims}")
        if len(set(delims)) != 4:
            raise ValueError(f"Tool {self.name!r}: the four delimiter tokens must differ, got {delims}")

    @property
    def delimiters(self) -> tuple[str, str, str, str]:
        return (self.start_token, self.end_token, self.output_start_token, self.output_end_token)


CALCULATOR = Tool(name="calculator", run=evaluate)


def available_tools() -> list[Tool]:
    """The built-in calculator followed by every tool plugins return from ``polyengine_tools``.

    A plugin's mistake leaves the other tools working: an item that is not a Tool, or a
    tool whose name is already taken, is skipped with a
    :class:`~polyengine.discovery.PluginWarning` (a failing hook is skipped by discovery).
    """
    import warnings

    from polyengine.discovery import PluginWarning
    from polyengine.discovery import get_registry  # plugins discovery is only needed here

    tools = [CALCULATOR]
    for tool in get_registry().tools():
        if not isinstance(tool, Tool):
            problem = (f"a plugin returned {type(tool).__name__} from polyengine_tools(); expected "
                       f"polyengine.tools.Tool; it is left out")
        elif any(t.name == tool.name for t in tools):
            problem = f"tool name {tool.name!r} is registered twice; the second is left out (rename one of the tools)"
        else:
            tools.append(tool)
            continue
        warnings.warn(problem, PluginWarning, stacklevel=2)
    return tools


class TokenizerLike(Protocol):
    """What the machine needs from a tokenizer (duck-typed)."""

    def token_to_id(self, token: str) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...  # without special tokens

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class _BoundTool:
    """A tool with its delimiters resolved to this tokenizer's ids."""

    tool: Tool
    start: int
    end: int
    output_start: int
    output_end: int


class ToolMachine:
    """Tool-call detection for one tokenizer and set of tools; makes one :class:`ToolRow` per row."""

    def __init__(
        self,
        tokenizer: TokenizerLike,
        bound: Sequence[_BoundTool],
        *,
        max_expression_tokens: int = MAX_EXPRESSION_TOKENS,
    ):
        self._tokenizer = tokenizer
        self._bound = tuple(bound)
        self.max_expression_tokens = int(max_expression_tokens)
        self._by_start: dict[int, _BoundTool] = {}
        for b in self._bound:
            other = self._by_start.get(b.start)
            if other is not None:
                raise InvalidRequest(
                    f"tools {other.tool.name!r} and {b.tool.name!r} both open with token "
                    f"{b.tool.start_token!r}; give one of them its own delimiters"
                )
            self._by_start[b.start] = b

    @classmethod
    def create(
        cls,
        tokenizer: TokenizerLike,
        tools: Sequence[Tool] | None = None,
        *,
        max_expression_tokens: int = MAX_EXPRESSION_TOKENS,
    ) -> "ToolMachine | None":
        """A machine for the tools whose four delimiters are all tokens of ``tokenizer``.

        ``tools=None`` means :func:`available_tools`. Returns None (tools off) when no
        tool qualifies, which is the case for tokenizers without tool tokens. A tool
        with only some of its delimiters in the vocabulary cannot run its protocol
        and is left out.
        """
        tools = available_tools() if tools is None else list(tools)
        for tool in tools:
            if not isinstance(tool, Tool):
                raise InvalidRequest(f"tools must be polyengine.tools.Tool objects, got {type(tool).__name__}")
        bound = []
        for tool in tools:
            ids = [tokenizer.token_to_id(d) for d in tool.delimiters]
            if all(i is not None for i in ids):
                bound.append(_BoundTool(tool, *(int(i) for i in ids)))
        if not bound:
            return None
        return cls(tokenizer, bound, max_expression_tokens=max_expression_tokens)

    @property
    def tools(self) -> tuple[Tool, ...]:
        """The tools this machine runs."""
        return tuple(b.tool for b in self._bound)

    @property
    def delimiter_ids(self) -> frozenset[int]:
        """Every delimiter token id of every tool (e.g. to keep them out of detokenized text)."""
        return frozenset(i for b in self._bound for i in (b.start, b.end, b.output_start, b.output_end))

    def new_row(self) -> "ToolRow":
        return ToolRow(self)

    def _output(self, bound: _BoundTool, expr_ids: list[int], overflow: bool) -> list[int]:
        """The forced tokens answering one call."""
        if overflow:
            text = f"error: expression longer than {self.max_expression_tokens} tokens"
        else:
            try:
                text = bound.tool.run(self._tokenizer.decode(expr_ids))
                if not isinstance(text, str):
                    raise PluginError(
                        bound.tool.name, None,
                        f"tool run() returned {type(text).__name__}, expected str",
                    )
            except ToolError as exc:
                text = f"error: {exc}"
        return [bound.output_start, *(int(t) for t in self._tokenizer.encode(text)), bound.output_end]


class ToolRow:
    """One row's tool state: outside a call, inside one (collecting), or forcing output."""

    __slots__ = ("_machine", "_open", "_expr", "_overflow", "_queue")

    def __init__(self, machine: ToolMachine):
        self._machine = machine
        self._open: _BoundTool | None = None
        self._expr: list[int] = []
        self._overflow = False
        self._queue: deque[int] = deque()

    @property
    def pending(self) -> bool:
        """Forced tokens are queued: the next :meth:`step` returns one of them."""
        return bool(self._queue)

    @property
    def in_call(self) -> bool:
        """A call has been opened and its end token not yet seen."""
        return self._open is not None

    def step(self, token: int) -> tuple[int, bool]:
        """Take the token the engine produced; return ``(completion token, forced)``.

        With forced tokens queued, the engine's token is discarded and the next forced
        one returned (the driver feeds it through ``overrides``). Otherwise the token
        is accepted: it may open a call, extend the expression, or close the call,
        which runs the tool and queues its output.
        """
        if self._queue:
            return self._queue.popleft(), True
        token = int(token)
        if self._open is None:
            self._open = self._machine._by_start.get(token)
            self._expr, self._overflow = [], False
        elif token == self._open.end:
            self._queue.extend(self._machine._output(self._open, self._expr, self._overflow))
            self._open, self._expr = None, []
        elif len(self._expr) < self._machine.max_expression_tokens:
            self._expr.append(token)
        else:
            self._overflow = True
        return token, False
