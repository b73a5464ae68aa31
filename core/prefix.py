"""The portable prefix: a prefilled request as host data any backend can import.

Layout (format version 1): K and V as float32 ``[layers, kv_heads, true_length,
head_dim]``, K after RoPE in the HF rotate-half convention, no padding; the prompt ids;
the raw last-position logits (float32); the request's sampling parameters (with a
concrete seed); and the fingerprint of the model (config and weights) that made it.
Serialized as safetensors with JSON metadata in the header: never pickle, so a prefix
from an untrusted peer can be read safely.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from polyengine.errors import InvalidRequest
from polyengine.sampling.params import SamplingParams

__all__ = ["FORMAT_VERSION", "PortablePrefix"]

FORMAT_VERSION = 1
_FORMAT = "polyengine.prefix"


@dataclass
class PortablePrefix:
    k: np.ndarray  # (layers, kv_heads, true_length, head_dim) float32
    v: np.ndarray  # (layers, kv_heads, true_length, head_dim) float32
    prompt_tokens: np.ndarray  # (true_length,) int32
    last_logits: np.ndarray  # (vocab,) float32
    sampling: SamplingParams
    model_fingerprint: str
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        self.k = np.ascontiguousarray(self.k, dtype=np.float32)
        self.v = np.ascontiguousarray(self.v, dtype=np.float32)
        self.prompt_tokens = np.ascontiguousarray(self.prompt_tokens, dtype=np.int32)
        self.last_logits = np.ascontiguousarray(self.last_logits, dtype=np.float32)
        if self.k.ndim != 4 or self.k.shape != self.v.shape:
            raise InvalidRequest(f"prefix K/V must be equal 4-d arrays, got {self.k.shape} and {self.v.shape}")
        if self.k.shape[2] != self.prompt_tokens.shape[0]:
            raise InvalidRequest(
                f"prefix K/V hold {self.k.shape[2]} positions but {self.prompt_tokens.shape[0]} prompt tokens"
            )
        if self.sampling.seed is None:
            raise InvalidRequest("a portable prefix needs sampling parameters with a concrete seed")

    @property
    def true_length(self) -> int:
        return int(self.prompt_tokens.shape[0])

    def check_compatible(self, *, fingerprint: str, num_layers: int, num_kv_heads: int, head_dim: int, vocab_size: int) -> None:
        """Raise InvalidRequest unless this prefix was made by the same model."""
        if self.version != FORMAT_VERSION:
            raise InvalidRequest(f"prefix format version {self.version} is not supported (this polyengine reads {FORMAT_VERSION})")
        if self.model_fingerprint != fingerprint:
            raise InvalidRequest(
                f"prefix was made by model {self.model_fingerprint[:12]}..., not this engine's model "
                f"{fingerprint[:12]}...; import it into an engine running the same weights"
            )
        want = (num_layers, num_kv_heads, head_dim)
        got = (self.k.shape[0], self.k.shape[1], self.k.shape[3])
        if got != want:
            raise InvalidRequest(f"prefix K/V shape (layers, kv_heads, head_dim) {got} does not match the model's {want}")
        if self.last_logits.shape != (vocab_size,):
            raise InvalidRequest(f"prefix logits have shape {self.last_logits.shape}, expected ({vocab_size},)")

    # -- serialization ------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        from safetensors.numpy import save

        meta = {
            "format": _FORMAT,
            "version": str(self.version),
            "model_fingerprint": self.model_fingerprint,
            "sampling": self.sampling.model_dump_json(),
        }
        tensors = {"k": self.k, "v": self.v, "prompt_tokens": self.prompt_tokens, "last_logits": self.last_logits}
        return save(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> "PortablePrefix":
        from safetensors import SafetensorError
        from safetensors.numpy import load

        try:
            meta = _header_metadata(data)
            tensors = load(data)
        except (SafetensorError, ValueError, json.JSONDecodeError) as exc:
            raise InvalidRequest(f"not a polyengine prefix (unreadable safetensors data: {exc})") from None
        if meta.get("format") != _FORMAT:
            raise InvalidRequest(f"not a polyengine prefix (format {meta.get('format')!r})")
        missing = {"k", "v", "prompt_tokens", "last_logits"} - set(tensors)
        if missing:
            raise InvalidRequest(f"prefix data lacks tensors {sorted(missing)}")
        try:
            sampling = SamplingParams.model_validate_json(meta["sampling"])
            version = int(meta["version"])
        except (KeyError, ValueError) as exc:
            raise InvalidRequest(f"prefix metadata is malformed: {exc}") from None
        return cls(
            k=tensors["k"], v=tensors["v"], prompt_tokens=tensors["prompt_tokens"],
            last_logits=tensors["last_logits"], sampling=sampling,
            model_fingerprint=meta.get("model_fingerprint", ""), version=version,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(self.to_bytes())

    @classmethod
    def load(cls, path: str | Path) -> "PortablePrefix":
        return cls.from_bytes(Path(path).read_bytes())


def _header_metadata(data: bytes) -> dict[str, str]:
    if len(data) < 8:
        raise ValueError("too short")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError("header length past end of data")
    header = json.loads(data[8 : 8 + n])
    return header.get("__metadata__", {}) or {}
