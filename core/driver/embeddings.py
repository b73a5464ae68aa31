"""Embeddings: a prompt's final hidden states pooled into one vector.

The engine returns the hidden states after the model's final norm, one row per prompt
token (``Engine.embed``, capability ``embeddings``); pooling is the driver's, written
once for every backend. The rule is vLLM's and llama.cpp's servers' for a generative
model served for embeddings: the mean over the prompt's tokens (BOS included when the
tokenizer adds it), then scaled to unit L2 norm unless ``normalize=False``. The pooling
runs in float64 and the vector comes back as float32, as those servers return it.
"""

from __future__ import annotations

import numpy as np

from polyengine.errors import PluginError

__all__ = ["pool"]


def pool(hidden: np.ndarray, *, normalize: bool = True, backend: str = "?") -> np.ndarray:
    """Mean-pool ``hidden`` (tokens, hidden_size) into (hidden_size,) float32, L2
    normalised when ``normalize``. A backend that returned the wrong shape or values
    that are not finite is a PluginError naming it, never a silently wrong vector."""
    h = np.asarray(hidden, dtype=np.float64)
    if h.ndim != 2 or h.shape[0] == 0:
        raise PluginError(backend, None, f"embed returned hidden states of shape {h.shape}; expected (tokens, hidden_size)")
    vec = h.mean(axis=0)
    if not np.isfinite(vec).all():
        raise PluginError(backend, None, "embed returned hidden states that are not finite (NaN or inf)")
    if normalize:
        norm = float(np.linalg.norm(vec))
        vec = vec / norm if norm > 0 else vec
    return vec.astype(np.float32)
