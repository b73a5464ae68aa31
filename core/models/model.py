"""A loaded model: config, weights (HF names and layouts, in their stored formats) and tokenizer.

This is what every backend's factory receives. Weights are HF-named, HF-shaped
(``[out, in]`` for projections) :class:`~polyengine.models.weights.Weight` records in
``records``, each in the format its file holds (F32, F16, BF16, or GGUF blocks such as
Q4_K), memory-mapped when loaded from a file. Q/K rows are in HF order (GGUF's
permutation already undone, as a row permutation of the records), so RoPE is the
rotate-half convention everywhere.

Two ways to read them:

- :meth:`Model.weight` gives a record in one of the formats a backend computes on
  (``Capabilities.weight_formats``): the record itself when its format is one of them,
  else its float32 conversion, made then, for that one tensor, and not kept.
- ``weights``, the float view every torch/JAX backend reads: a mapping of HF names to
  float arrays, F32/F16/F64 records as they are (no copy), every other format converted
  to float32 on each read (one tensor at a time, never kept by the Model).

So the Model never holds a float copy of the whole model: whoever converts keeps what
it converted. The widening that ``load_model(dtype="float32")`` asks for happens at load
instead, into F32 records (the Model then holds them, as it did before records).
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Iterator, Mapping

import numpy as np

from polyengine.errors import WeightsError
from polyengine.models.blocks import FLOAT_FORMATS
from polyengine.models.config import ModelConfig
from polyengine.models.weights import Weight

if TYPE_CHECKING:  # pragma: no cover
    from polyengine.models.tokenizer import Tokenizer

__all__ = ["Model", "Weights"]


@dataclass(eq=False)
class Model:
    config: ModelConfig
    # Given: HF names to float arrays or Weight records; after construction: the float
    # view (``Weights``) over ``records``.
    weights: "Mapping[str, np.ndarray | Weight]"
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
        given = self.weights.records if isinstance(self.weights, Weights) else self.weights
        self.records: dict[str, Weight] = {
            name: w if isinstance(w, Weight) else Weight.from_array(w, source=self.source, name=name)
            for name, w in given.items()}
        self.weights = Weights(self.records, source=self.source)
        self.check_weights()

    def weight(self, name: str, formats: tuple[str, ...] = FLOAT_FORMATS) -> Weight:
        """Weight ``name`` in one of ``formats`` (a backend's ``Capabilities.weight_formats``):
        its record when stored in one of them, else its float32 conversion (exact; made
        now, for this tensor alone, and not kept), after which the record's file pages
        leave the process's resident memory (:meth:`Weight.release_pages`: the conversion
        is what the caller reads; the record reads back from the file if asked again)."""
        record = self.weights.record(name)
        if record.format in formats:
            return record
        converted = Weight.from_array(record.to_float(np.float32), source=self.source, name=name)
        record.release_pages()
        return converted

    def require(self, names) -> None:
        """Raise what reading each of ``names`` would raise (a released weight says why),
        without converting anything."""
        for name in names:
            self.weights.record(name)

    @property
    def formats(self) -> dict[str, int]:
        """Format -> how many tensors are stored in it."""
        counts: dict[str, int] = {}
        for w in self.records.values():
            counts[w.format] = counts.get(w.format, 0) + 1
        return counts

    def conversion_bytes(self, names=None, itemsize: int = 4) -> int:
        """The bytes that reading ``names`` (default: all) through ``weights`` allocates:
        every record not stored as F32 converted to ``itemsize``-byte floats (an engine's
        memory check; F32 records are read as they are)."""
        names = self.records if names is None else names
        return sum(math.prod(self.records[n].shape) * itemsize for n in names
                   if n in self.records and self.records[n].format != "F32")

    @property
    def stored_bytes(self) -> int:
        """The bytes of the records as stored (mapped or held)."""
        return sum(w.nbytes for w in self.records.values())

    def release(self, names, *, why: str) -> None:
        """Drop the records ``names`` (an exclusive Model only, see ``exclusive``);
        reading one later raises :class:`WeightsError` saying ``why`` and how to get it
        back. The fingerprint is computed first (it hashes them)."""
        if not self.exclusive:
            raise ValueError("only an exclusive Model releases weights (see Model.exclusive)")
        self.fingerprint  # noqa: B018 -- cached: portable prefixes still need it
        for name in names:
            if name in self.records:
                del self.records[name]
                self.weights.released[name] = why

    @property
    def released(self) -> dict[str, str]:
        """Released weight name -> why (empty unless an engine released some)."""
        return dict(self.weights.released)

    def check_weights(self) -> None:
        """Every expected tensor present with its shape, nothing extra: else WeightsError."""
        expected = self.config.weight_shapes()
        released = self.weights.released
        missing = sorted(set(expected) - set(self.records) - set(released))
        if missing:
            raise WeightsError(
                f"{len(missing)} tensor(s) missing (first: {missing[0]!r})", file=self.source, tensor=missing[0]
            )
        extra = sorted(set(self.records) - set(expected))
        if extra:
            raise WeightsError(
                f"unexpected tensor(s) {extra[:5]} for this config", file=self.source, tensor=extra[0]
            )
        for name, shape in expected.items():
            if name in released:
                continue
            got = tuple(self.records[name].shape)
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
        """A stable hash of the config and the weights as stored (format, shape, raw
        bytes; computed once, lazily, without converting anything).

        Portable prefixes carry it so a prefix is only imported into the same model.
        """
        h = hashlib.blake2b(digest_size=16)
        h.update(json.dumps(self.config.model_dump(mode="json"), sort_keys=True).encode())
        for name in sorted(self.records):
            w = self.records[name]
            h.update(name.encode())
            h.update(f"{w.format}{w.shape}".encode())
            for chunk in w.bytes_for_hash():
                h.update(chunk)
        return h.hexdigest()

    def __repr__(self) -> str:
        c = self.config
        tag = " RANDOM WEIGHTS" if self.is_random else ""
        return (
            f"Model({self.source!r}{tag}, {c.model_type}, layers={c.num_hidden_layers}, "
            f"hidden={c.hidden_size}, heads={c.num_attention_heads}/{c.num_key_value_heads}, "
            f"vocab={c.vocab_size}, params={c.num_parameters():,})"
        )


class Weights(Mapping[str, np.ndarray]):
    """A Model's float view: HF names to float arrays, converted from the records on each
    read (see the module docstring), never kept. Reading a weight an engine released
    (``Model.release``) says so instead of a bare KeyError."""

    def __init__(self, records: dict[str, Weight], *, source: str):
        self.records = records
        self.source = source
        self.released: dict[str, str] = {}

    def record(self, name: str) -> Weight:
        try:
            return self.records[name]
        except KeyError:
            if name in self.released:
                raise WeightsError(
                    f"released from this Model by an engine ({self.released[name]}); the Model was loaded for that "
                    f"engine alone (Model.exclusive). Load the model again for another engine, or load it yourself "
                    f"(polyengine.models.load_model) and pass the Model, which is never released",
                    file=self.source, tensor=name) from None
            raise

    def __getitem__(self, name: str) -> np.ndarray:
        """The float array of ``name``: a float32/float16 record as it is, any other
        converted now, after which the record's file pages leave the process's resident
        memory (:meth:`Weight.release_pages`; they read back from the file if asked again)."""
        record = self.record(name)
        out = record.to_float()
        if not np.may_share_memory(out, record.data):
            record.release_pages()
        return out

    def get(self, name: str, default=None):
        return self[name] if name in self.records else default

    def __contains__(self, name: object) -> bool:
        return name in self.records

    def __iter__(self) -> Iterator[str]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)
