"""A loaded model: config, host weights (NumPy, HF names and layouts) and tokenizer.

This is what every backend's factory receives. Weights are HF-named, HF-shaped
(``[out, in]`` for projections), float32 unless the loader was asked for float16.
Q/K rows are in HF order (GGUF's permutation already undone), so RoPE is the
rotate-half convention everywhere.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from polyengine.errors import WeightsError
from polyengine.models.config import ModelConfig

if TYPE_CHECKING:  # pragma: no cover
    from polyengine.models.tokenizer import Tokenizer

__all__ = ["Model"]


@dataclass(eq=False)
class Model:
    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: "Tokenizer | None" = None
    source: str = "<memory>"
    is_random: bool = False
    meta: dict[str, str] = field(default_factory=dict)
    # Unique per loaded object (never reused, unlike id()): engines stamp prefixes with
    # it so a prefix made with other weights is refused.
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex, init=False, repr=False)

    def __post_init__(self) -> None:
        self.check_weights()

    def check_weights(self) -> None:
        """Every expected tensor present with its shape, nothing extra: else WeightsError."""
        expected = self.config.weight_shapes()
        missing = sorted(set(expected) - set(self.weights))
        if missing:
            raise WeightsError(
                f"{len(missing)} tensor(s) missing (first: {missing[0]!r})", file=self.source, tensor=missing[0]
            )
        extra = sorted(set(self.weights) - set(expected))
        if extra:
            raise WeightsError(
                f"unexpected tensor(s) {extra[:5]} for this config", file=self.source, tensor=extra[0]
            )
        for name, shape in expected.items():
            got = tuple(self.weights[name].shape)
            if got != shape:
                raise WeightsError(f"shape {got}, expected {shape}", file=self.source, tensor=name)

    @property
    def lm_head(self) -> np.ndarray:
        w = self.weights
        return w["model.embed_tokens.weight"] if self.config.tie_word_embeddings else w["lm_head.weight"]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a completion: the config's EOS plus the tokenizer's end-of-turn."""
        ids = list(self.config.eos_token_ids)
        if self.tokenizer is not None:
            ids += [t for t in self.tokenizer.eos_token_ids if t not in ids]
        return tuple(ids)

    @cached_property
    def fingerprint(self) -> str:
        """A stable hash of the config and the weights' values (computed once, lazily).

        Portable prefixes carry it so a prefix is only imported into the same model.
        """
        h = hashlib.blake2b(digest_size=16)
        h.update(json.dumps(self.config.model_dump(mode="json"), sort_keys=True).encode())
        for name in sorted(self.weights):
            arr = np.ascontiguousarray(self.weights[name], dtype=np.float32)
            h.update(name.encode())
            h.update(str(arr.shape).encode())
            h.update(arr.tobytes())
        return h.hexdigest()

    def __repr__(self) -> str:
        c = self.config
        tag = " RANDOM WEIGHTS" if self.is_random else ""
        return (
            f"Model({self.source!r}{tag}, {c.model_type}, layers={c.num_hidden_layers}, "
            f"hidden={c.hidden_size}, heads={c.num_attention_heads}/{c.num_key_value_heads}, "
            f"vocab={c.vocab_size}, params={c.num_parameters():,})"
        )
