"""``POST /v1/embeddings``: OpenAI's body and response over ``AsyncLLM.embed``.

Each input is one prompt: a string (encoded as a completion prompt is, BOS included when
the tokenizer adds it), or token ids. The vector is the mean of the prompt's hidden
states after the final norm, L2-normalised unless ``"normalize": false`` (vLLM's extra
field): what vLLM's and llama.cpp's servers return for a generative model
(polyengine.driver.embeddings). ``encoding_format`` ``base64`` is the little-endian
float32 bytes, as OpenAI sends them; ``dimensions`` other than the model's width is
refused (these models cannot shorten their vectors). A backend without hidden states
answers 400 with code ``unsupported_parameter``.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from polyengine.serving.errors import APIError, invalid
from polyengine.serving.protocol import EmbeddingRequest, check_lengths, parse_body

__all__ = ["MAX_EMBEDDING_INPUTS", "parse_embedding_request", "embedding_response"]

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on inputs in one request


def parse_embedding_request(raw: bytes, *, max_prompt_tokens: int, width: int | None) -> EmbeddingRequest:
    """The body, shape-checked (400 naming the field): the inputs' count and lengths
    bounded before validation, ``dimensions`` only as the model's width ``width``."""
    req = parse_body(raw, EmbeddingRequest, lambda data: check_lengths(
        data, max_prompts=MAX_EMBEDDING_INPUTS, max_prompt_tokens=max_prompt_tokens, prompt_field="input",
        why="at most {max} inputs are embedded in one request"))
    if isinstance(req.input, list) and not req.input:
        raise invalid("input is empty: send a string, a list of strings or token ids", "input")
    if req.dimensions is not None and req.dimensions != width:
        raise APIError(400, f"dimensions={req.dimensions} is not supported: this model's embeddings have {width} "
                            f"dimensions and cannot be shortened; omit dimensions", param="dimensions",
                       code="unsupported_parameter")
    return req


def embedding_response(vectors: np.ndarray, *, model: str, prompt_tokens: int, encoding_format: str) -> dict[str, Any]:
    data = []
    for i, vec in enumerate(vectors):
        if encoding_format == "base64":
            value: Any = base64.b64encode(np.asarray(vec, "<f4").tobytes()).decode("ascii")
        else:
            value = [float(x) for x in vec]
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
