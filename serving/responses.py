"""OpenAI response bodies and stream chunks, built from the driver's outputs.

Choices are numbered ``prompt_index * n + sample_index`` (OpenAI's order for several
prompts in one /v1/completions request). Log-probs are the raw model's, one entry per
completion token, including the EOS or stop token that ended a choice (its text is
not in the content); a token the tool machine forced has ``logprob`` null.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from polyengine.driver.outputs import Completion
from polyengine.driver.toolcalls import CALL_OPEN, parse_tool_calls
from polyengine.models.tokenizer import BYTE_TO_UNICODE

__all__ = ["TokenText", "Responder", "sse"]

_UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def sse(data: Any) -> bytes:
    """One server-sent event carrying a JSON object (or the literal ``[DONE]``)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


class TokenText:
    """A token id's bytes and display string (as OpenAI's logprobs show tokens).

    Byte-level BPE pieces map back to their exact bytes, SentencePiece byte tokens
    (``<0xE2>``) to their byte; other pieces decode normally. A piece that is part of
    a UTF-8 character shows as ``\\xe2``-style escapes; ``bytes`` stay exact.
    """

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._byte_level = tokenizer is not None and "ByteLevel" in repr(tokenizer.backend.decoder)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="backslashreplace"), list(raw))
        return hit

    def _bytes(self, i: int) -> bytes:
        tok = self._tok
        if tok is None:
            return str(i).encode()
        piece = tok.id_to_token(i) or ""
        if i in tok.special_token_ids:
            return piece.encode()
        if i in tok.byte_fallback_ids:
            return bytes([int(piece[3:5], 16)])
        if self._byte_level and piece and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return tok.decode([i]).encode()


class Responder:
    """Builds the bodies of one response (its id, creation time, model and kind)."""

    def __init__(self, kind: str, model: str, token_text: TokenText, fingerprint: str, tools: list | None = None,
                 parallel: bool = True):
        self.kind = kind  # "chat" or "completion"
        self.tools = tools  # offered function tools: completions are parsed for calls
        self.parallel = parallel  # parallel_tool_calls: False returns the first call only
        self._held: dict[int, str] = {}  # streamed text held back while it may open a tool call
        self._free: set[int] = set()  # choices whose text cannot be a tool call any more
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.text_of = token_text
        self.fingerprint = fingerprint

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    # -- log-probs -----------------------------------------------------------------------

    def logprobs(self, ids: list[int], lps: list | None, tops: list | None, offset: int = 0) -> Any:
        if lps is None:
            return None
        tops = tops if tops is not None else [{} for _ in ids]
        if self.kind == "chat":
            content = []
            for tid, lp, top in zip(ids, lps, tops):
                text, raw = self.text_of(tid)
                alts = [{"token": self.text_of(a)[0], "logprob": v, "bytes": self.text_of(a)[1]} for a, v in top.items()]
                content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alts})
            return {"content": content}
        tokens, offsets = [], []
        for tid in ids:
            offsets.append(offset)
            text = self.text_of(tid)[0]
            tokens.append(text)
            offset += len(text)
        top_maps = [{self.text_of(a)[0]: v for a, v in top.items()} for top in tops]
        return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top_maps, "text_offset": offsets}

    # -- whole responses -----------------------------------------------------------------

    def full(self, completions: list[Completion]) -> dict[str, Any]:
        choices = []
        n = len(completions[0].outputs)
        for p, c in enumerate(completions):
            for o in c.outputs:
                lps = self.logprobs(o.token_ids, o.logprobs, o.top_logprobs)
                choice: dict[str, Any] = {"index": p * n + o.index, "finish_reason": o.finish_reason, "logprobs": lps}
                if self.kind == "chat":
                    choice["message"] = {"role": "assistant", "content": o.text}
                    if self.tools:
                        content, calls = parse_tool_calls(o.text, self.tools, parallel=self.parallel)
                        if calls:
                            choice["message"] = {"role": "assistant", "content": content,
                                                 "tool_calls": [c.to_dict() for c in calls]}
                            choice["finish_reason"] = "tool_calls"
                else:
                    choice["text"] = o.text
                choices.append(choice)
        body = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        body.update(choices=choices, usage=usage(completions), seed=completions[0].seed)
        return body

    # -- stream chunks -------------------------------------------------------------------

    def chunk(self, index: int, text: str, finish_reason: str | None, logprobs: Any = None,
              *, role: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text or role:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body["choices"] = [choice]
        return body

    def stream_chunks(self, index: int, text: str, finish_reason: str | None, logprobs: Any = None) -> list[dict[str, Any]]:
        """The chunks for one stream delta. With tools offered, text that may open a
        ``<tool_call>`` is held back; at the end held text becomes ``tool_calls`` deltas
        (one per call, with ``finish_reason`` "tool_calls") or content."""
        if not self.tools or index in self._free:
            return [self.chunk(index, text, finish_reason, logprobs)] if text or finish_reason or logprobs is not None else []
        held = self._held.get(index, "") + text
        start = held.lstrip()
        if finish_reason is None:
            if CALL_OPEN.startswith(start) or start.startswith(CALL_OPEN):
                self._held[index] = held
                return []
            self._free.add(index)
            self._held.pop(index, None)
            return [self.chunk(index, held, None, logprobs)]
        self._held.pop(index, None)
        content, calls = parse_tool_calls(held, self.tools, parallel=self.parallel)
        if not calls:
            return [self.chunk(index, held, finish_reason, logprobs)]
        out = [self.chunk(index, content, None, logprobs)] if content else []
        for i, call in enumerate(calls):
            body = self.chunk(index, "", None)
            body["choices"][0]["delta"] = {"tool_calls": [{"index": i, **call.to_dict()}]}
            out.append(body)
        out.append(self.chunk(index, "", "tool_calls"))
        return out

    def usage_chunk(self, completions: list[Completion]) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        body.update(choices=[], usage=usage(completions), seed=completions[0].seed)
        return body


def usage(completions: list[Completion]) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` counts the prompt
    tokens the prefix cache supplied."""
    prompt = sum(c.usage.prompt_tokens for c in completions)
    done = sum(c.usage.completion_tokens for c in completions)
    cached = sum(c.usage.cached_tokens for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": cached}}
