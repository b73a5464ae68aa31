"""``POST /tokenize`` and ``POST /detokenize``, as vLLM's server has them.

``/tokenize`` takes ``{"prompt": text}`` (``add_special_tokens`` default true: the ids a
completion request would run) or ``{"messages": [...]}`` rendered with the model's chat
template (``add_generation_prompt`` default true, ``add_special_tokens`` default false:
the ids a chat request would run), and answers ``{"tokens", "count",
"max_model_len"}`` (plus ``token_strs``, the vocabulary's pieces, with
``return_token_strs``). ``/detokenize`` takes ``{"tokens": [...]}`` and answers
``{"prompt": text}`` (special tokens kept, so the round trip is exact); an id outside
the vocabulary is a 400 naming it. ``model`` is optional in both and checked when sent.
Neither runs the engine: both are answered on a worker thread from the tokenizer.
"""

from __future__ import annotations

from typing import Any

from polyengine.serving.errors import invalid
from polyengine.serving.protocol import DetokenizeRequest, TokenizeRequest, chat_messages

__all__ = ["tokenize", "detokenize"]


def _tokenizer(llm: Any) -> Any:
    if llm.tokenizer is None:
        raise invalid("this model has no tokenizer: the server takes and returns token ids only")
    return llm.tokenizer


def tokenize(req: TokenizeRequest, llm: Any, *, max_model_len: int) -> dict[str, Any]:
    """``llm``: the served :class:`~polyengine.LLM` (its tokenizer and prompt bounds).
    Errors are PolyengineErrors naming the field (the caller maps them to 400s)."""
    tok = _tokenizer(llm)
    if (req.prompt is None) == (req.messages is None):
        raise invalid('send exactly one of "prompt" (text) and "messages" (a conversation)',
                      "prompt" if req.prompt is not None else None)
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tok.encode(req.prompt, add_special_tokens=special, max_chars=llm.max_prompt_chars)
    else:
        text = tok.apply_chat_template(chat_messages(req), add_generation_prompt=req.add_generation_prompt)
        ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens), max_chars=llm.max_prompt_chars,
                         what="the rendered conversation")
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": list(ids)}
    if req.return_token_strs:
        out["token_strs"] = [tok.id_to_token(i) for i in ids]
    return out


def detokenize(req: DetokenizeRequest, llm: Any) -> dict[str, Any]:
    tok = _tokenizer(llm)
    size = tok.vocab_size
    for i, t in enumerate(req.tokens):
        if not 0 <= t < size:
            raise invalid(f"tokens[{i}]: token id {t} is outside the vocabulary [0, {size})", f"tokens[{i}]")
    return {"prompt": tok.decode(req.tokens)}
