"""Request validation: one sequence for the driver (before it queues a request) and for
engines (before any work), so both refuse the same things with the same messages."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from polyengine.errors import ContextLengthExceeded, InvalidRequest, UnsupportedFeature
from polyengine.limits import MAX_SCHEMA_DEPTH, MAX_TEXT_CHARS, json_depth
from polyengine.sampling.params import ENGINE_FIELDS, SamplingParams, is_int

if TYPE_CHECKING:  # pragma: no cover
    from polyengine.protocol import Capabilities

__all__ = ["is_int", "check_prompt", "check_request", "check_depth", "check_text"]


def check_depth(value: Any, what: str, *, field: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """InvalidRequest (``field``) when the JSON ``value`` nests deeper than ``limit``:
    checked without recursion, before anything recursive (json.dumps, a grammar
    compiler) walks it."""
    if json_depth(value, limit) > limit:
        raise InvalidRequest(f"{what} nests more than {limit} levels of objects and arrays; flatten it", field=field)


def check_prompt(
    tokens: Sequence[int] | np.ndarray, *, max_prefill_length: int, vocab_size: int, offset: int = 0
) -> np.ndarray:
    """A prompt as int32, or InvalidRequest (``field="prompt"``) saying what is wrong
    with it; a prompt longer than the engine takes is :class:`ContextLengthExceeded`."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidRequest(f"prompt tokens must be a flat sequence, got shape {arr.shape}", field="prompt")
    if arr.size == 0:
        raise InvalidRequest("prompt is empty: pass at least one token", field="prompt")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequest(f"prompt tokens must be integers, got dtype {arr.dtype}", field="prompt")
    total = offset + arr.size
    if total > max_prefill_length:
        raise ContextLengthExceeded(
            f"prompt has {total} tokens but this engine accepts at most {max_prefill_length} "
            f"(max_prefill_length); shorten it or build the engine with a larger max_prefill_length",
            field="prompt",
        )
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        raise InvalidRequest(
            f"token id {int(arr[bad][0])} at position {int(np.argmax(bad))} is outside "
            f"the vocabulary [0, {vocab_size})", field="prompt",
        )
    return arr.astype(np.int32)


def check_request(
    engine: Any, tokens: Sequence[int] | np.ndarray, sampling: SamplingParams, *, offset: int = 0
) -> tuple[np.ndarray, SamplingParams]:
    """Validate a request against an engine's limits and capabilities, before any work.

    The one sequence shared by the driver (before it queues a request) and
    :class:`EngineBase` (for callers that drive an engine directly). Returns the prompt
    as int32 and the request with a concrete seed. Raises :class:`InvalidRequest` for a
    bad prompt or token ids outside the vocabulary, :class:`UnsupportedFeature` for
    anything the capabilities do not declare.
    """
    if not isinstance(sampling, SamplingParams):
        raise InvalidRequest(f"sampling must be SamplingParams, not {type(sampling).__name__}", field="sampling")
    toks = check_prompt(tokens, max_prefill_length=engine.max_prefill_length, vocab_size=engine.vocab_size, offset=offset)
    caps: Capabilities = engine.capabilities
    missing = sorted((sampling.active_fields() & ENGINE_FIELDS) - caps.sampling_params)
    if missing:
        raise UnsupportedFeature(
            f"sampling parameter(s) {', '.join(missing)}", engine.name,
            "leave them at their defaults or pick a backend that declares them", field=missing[0],
        )
    if sampling.top_logprobs > caps.max_top_logprobs:
        raise UnsupportedFeature(f"top_logprobs={sampling.top_logprobs}", engine.name, f"at most {caps.max_top_logprobs}",
                                 field="top_logprobs")
    if sampling.n > 1 and not caps.bulk_insert:
        raise UnsupportedFeature("n > 1 (bulk_insert)", engine.name, field="n")
    if sampling.n > engine.max_concurrent_decodes:
        raise InvalidRequest(
            f"n={sampling.n} samples need {sampling.n} slots but the engine has "
            f"{engine.max_concurrent_decodes} (max_slots)", field="n",
        )
    for field in ("logit_bias", "stop_token_ids"):
        for tok in getattr(sampling, field):
            if tok >= engine.vocab_size:
                raise InvalidRequest(f"{field}: token id {tok} is outside the vocabulary [0, {engine.vocab_size})",
                                     field=field)
    return toks, sampling.with_seed()


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: Any, what: str = "prompt", *, max_chars: int | None = None) -> str:
    """``text`` if it is a ``str`` of valid Unicode within ``max_chars`` (at most
    :data:`MAX_TEXT_CHARS`); else InvalidRequest saying what is wrong and where."""
    if not isinstance(text, str):
        raise InvalidRequest(f"{what} must be a string, not {type(text).__name__}")
    limit = MAX_TEXT_CHARS if max_chars is None else min(max_chars, MAX_TEXT_CHARS)
    if len(text) > limit:
        raise ContextLengthExceeded(
            f"{what} has {len(text):,} characters; at most {limit:,} are accepted here (it could not fit in "
            f"the context, and tokenizing it would take memory many times its size); shorten it"
        )
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise InvalidRequest(
            f"{what} is not valid Unicode: a lone surrogate {bad.group()!r} at character {bad.start()} (undecodable "
            f"bytes, e.g. text that was not UTF-8); pass UTF-8 text"
        )
    return text
