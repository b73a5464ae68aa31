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
    # True when whoever loaded this Model hands it to exactly one engine and keeps no other
    # use for its float arrays (``LLM``, ``create_engine`` and the CLI given a path or
    # None, through ``load_model(..., exclusive=True)``): that engine may then release
    # the arrays it keeps in another form (int8 copies, see ``release``). A Model you
    # build or load yourself is never released.
    exclusive: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.check_weights()

    def release(self, names, *, why: str) -> None:
        """Drop the float arrays ``names`` from ``weights`` (an exclusive Model only, see
        ``exclusive``); reading one later raises :class:`WeightsError` saying ``why``
        and how to get it back. The fingerprint is computed first (it hashes them)."""
        if not self.exclusive:
            raise ValueError("only an exclusive Model releases weights (see Model.exclusive)")
        self.fingerprint  # noqa: B018 -- cached: portable prefixes still need it
        if not isinstance(self.weights, _Weights):
            self.weights = _Weights(self.weights, source=self.source)
        for name in names:
            if name in self.weights:
                del self.weights[name]
                self.weights.released[name] = why

    @property
    def released(self) -> dict[str, str]:
        """Released weight name -> why (empty unless an engine released some)."""
        return dict(getattr(self.weights, "released", {}))

    def check_weights(self) -> None:
        """Every expected tensor present with its shape, nothing extra: else WeightsError."""
        expected = self.config.weight_shapes()
        released = getattr(self.weights, "released", {})
        missing = sorted(set(expected) - set(self.weights) - set(released))
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
            if name in released:
                continue
            got = tuple(self.weights[name].shape)
            if got != shape:
                raise WeightsError(f"shape {got}, expected {shape}", file=self.source, tensor=name)

    @property
    def lm_head(self) -> np.ndarray:
        return self.weights[self.config.head_weight]

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
            h.update(memoryview(arr).cast("B"))  # the bytes in place: no copy of a large table
        return h.hexdigest()

    def __repr__(self) -> str:
        c = self.config
        tag = " RANDOM WEIGHTS" if self.is_random else ""
        return (
            f"Model({self.source!r}{tag}, {c.model_type}, layers={c.num_hidden_layers}, "
            f"hidden={c.hidden_size}, heads={c.num_attention_heads}/{c.num_key_value_heads}, "
            f"vocab={c.vocab_size}, params={c.num_parameters():,})"
        )


class _Weights(dict):
    """A Model's weights: a plain dict of arrays, except that reading one an engine released
    (``Model.release``) says so instead of a bare KeyError."""

    def __init__(self, arrays, *, source: str):
        super().__init__(arrays)
        self.source = source
        self.released: dict[str, str] = {}

    def __missing__(self, name: str):
        if name in self.released:
            raise WeightsError(
                f"released from this Model by an engine ({self.released[name]}); the Model was loaded for that "
                f"engine alone (Model.exclusive). Load the model again for another engine, or load it yourself "
                f"(polyengine.models.load_model) and pass the Model, which is never released",
                file=self.source, tensor=name)
        raise KeyError(name)
