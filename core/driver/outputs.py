"""What the driver hands back: completions, their samples, usage, and stream deltas.

``finish_reason`` uses OpenAI's values: ``"stop"`` (EOS, end of turn, a stop token or a
stop string) and ``"length"`` (``max_tokens`` or the engine's cache limit); a request
cancelled by its caller ends with ``"cancelled"``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Completion", "CompletionOutput", "StreamDelta", "Usage"]


@dataclass
class Usage:
    """Token counts of a request; ``cached_tokens`` of its prompt tokens came from the
    prefix cache (their K/V were not computed again)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class CompletionOutput:
    """One sample of a request.

    ``token_ids`` are the completion's ids, including the EOS or stop token that ended
    it (that token's text is not in ``text``). ``forced`` marks tokens the tool machine
    forced (1 = forced, 0 = sampled). ``logprobs[i]`` is the raw model log-prob of
    token ``i`` (None for forced tokens); ``top_logprobs[i]`` maps ids to log-probs.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    forced: list[int] = field(default_factory=list)
    logprobs: list[float | None] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    tool_calls: list[Any] | None = None  # ToolCall objects parsed by LLM.chat(tools=...)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Completion:
    """The result of one request (``n`` samples)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    seed: int
    usage: Usage

    # The common case is n=1: read the first sample directly.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "outputs": [o.to_dict() for o in self.outputs],
            "seed": self.seed,
            "usage": self.usage.to_dict(),
        }


@dataclass
class StreamDelta:
    """New text of one sample, with the token ids that produced it.

    ``logprobs`` and ``top_logprobs`` hold one entry per token id, as in
    :class:`CompletionOutput`, when the request asked for them (else None).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[float | None] | None = None
    top_logprobs: list[dict[int, float]] | None = None
