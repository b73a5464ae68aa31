"""The portable prefix: a prefilled request as host data any backend can import.

Layout (format version 1): K and V as float32 ``[layers, kv_heads, true_length,
head_dim]``, K after RoPE in the HF rotate-half convention, no padding; the prompt ids;
the raw last-position logits (float32); the request's sampling parameters (with a
concrete seed); and the fingerprint of the model (config and weights) that made it.
Serialized as safetensors with JSON metadata in the header: never pickle, so a prefix
from an untrusted peer can be read safely.

A prefix is untrusted data (another host, another backend, a file). Construction
checks its structure (shapes, dtypes, token ids that are integers representable as
int32, never wrapped); :meth:`PortablePrefix.check_compatible`, which every engine's
``import_prefix`` runs through ``EngineBase.check_portable``, checks it against the
model (fingerprint, shapes, vocabulary) and checks its values (every K, V and logit
finite): a bad prefix is an ``InvalidRequest`` (``field="prefix"``), never garbage
decoded from NaN.

A portable prefix may be a *tail* (``start`` > 0): its K/V cover positions
``start..true_length-1`` only, while ``prompt_tokens`` stays the whole prompt (ids are
cheap, and the importer must check that the head it holds is the same). A receiver that
already holds the first ``start`` positions (a system prompt, say; it compares
:meth:`PortablePrefix.page_keys` with its own to know how many full pages it has)
imports the tail onto that prefix (``EngineBase.import_prefix_tail``); plain
``import_prefix`` refuses a tail. Data without ``start`` in its metadata (what every
writer before tails wrote) is a whole prefix, start 0: the format version stays 1, and a
reader from before tails refuses a tail (its K/V are shorter than its prompt) rather
than misreading it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from polyengine.errors import InvalidRequest
from polyengine.limits import MAX_PREFIX_BYTES
from polyengine.pages import page_keys
from polyengine.sampling.params import SamplingParams

__all__ = ["FORMAT_VERSION", "PortablePrefix"]

FORMAT_VERSION = 1
_FORMAT = "polyengine.prefix"


@dataclass
class PortablePrefix:
    k: np.ndarray  # (layers, kv_heads, true_length - start, head_dim) float32
    v: np.ndarray  # (layers, kv_heads, true_length - start, head_dim) float32
    prompt_tokens: np.ndarray  # (true_length,) int32: the whole prompt, a tail's head too
    last_logits: np.ndarray  # (vocab,) float32
    sampling: SamplingParams
    model_fingerprint: str
    version: int = FORMAT_VERSION
    start: int = 0  # the first position K/V hold (0: the whole prefix; > 0: a tail)

    def __post_init__(self) -> None:
        self.k = _floats(self.k, "K")
        self.v = _floats(self.v, "V")
        self.prompt_tokens = _token_ids(self.prompt_tokens)
        if self.last_logits is None:
            raise _bad("a prefix head (Engine.prefix_head) has no logits of its own and cannot be exported: export "
                       "the prefix it was cut from, or continue it with at least one more token first")
        self.last_logits = _floats(self.last_logits, "logits")
        if self.k.ndim != 4 or self.k.shape != self.v.shape:
            raise _bad(f"prefix K/V must be equal 4-d arrays, got {self.k.shape} and {self.v.shape}")
        n = self.prompt_tokens.shape[0]
        if isinstance(self.start, (bool, np.bool_)) or not isinstance(self.start, (int, np.integer)) \
                or not 0 <= self.start <= n:
            raise _bad(f"prefix start must be an integer position in 0..{n} (its prompt's tokens), got {self.start!r}")
        self.start = int(self.start)
        if self.k.shape[2] != n - self.start:
            what = f"a tail from position {self.start} of {n} prompt tokens needs" if self.start else \
                f"{n} prompt tokens need"
            raise _bad(f"prefix K/V hold {self.k.shape[2]} positions but {what} {n - self.start}")
        if self.last_logits.ndim != 1:
            raise _bad(f"prefix logits must be one row (vocab,), got shape {self.last_logits.shape}")
        if not isinstance(self.sampling, SamplingParams):
            raise _bad(f"prefix sampling must be SamplingParams, not {type(self.sampling).__name__}")
        if self.sampling.seed is None:
            raise _bad("a portable prefix needs sampling parameters with a concrete seed")
        if not isinstance(self.model_fingerprint, str):
            raise _bad("prefix model_fingerprint must be a string")

    @property
    def true_length(self) -> int:
        return int(self.prompt_tokens.shape[0])

    @property
    def is_tail(self) -> bool:
        return self.start > 0

    def tail(self, start: int) -> "PortablePrefix":
        """This prefix's positions ``start..true_length-1`` (``start`` from this prefix's
        own start to ``true_length``; a paged sender cuts at a multiple of the page size,
        but any start is valid): the same prompt ids, logits and request. Views of this
        prefix's arrays, not copies."""
        if isinstance(start, (bool, np.bool_)) or not isinstance(start, (int, np.integer)) \
                or not self.start <= start <= self.true_length:
            raise _bad(f"a tail of this prefix starts at a position in {self.start}..{self.true_length}, got {start!r}")
        cut = int(start) - self.start
        return PortablePrefix(k=self.k[:, :, cut:], v=self.v[:, :, cut:], prompt_tokens=self.prompt_tokens,
                              last_logits=self.last_logits, sampling=self.sampling,
                              model_fingerprint=self.model_fingerprint, version=self.version, start=int(start))

    def joined(self, head_k: np.ndarray, head_v: np.ndarray) -> "PortablePrefix":
        """The whole prefix (start 0): ``head_k``/``head_v`` (float, ``[layers, kv_heads,
        start, head_dim]``: the positions below this tail's start, from a prefix of the
        same prompt head) followed by this tail's K/V."""
        head_k, head_v = _floats(head_k, "head K"), _floats(head_v, "head V")
        want = (self.k.shape[0], self.k.shape[1], self.start, self.k.shape[3])
        if head_k.shape != want or head_v.shape != want:
            raise _bad(f"a head for a tail from position {self.start} must be K/V of shape {want}, "
                       f"got {head_k.shape} and {head_v.shape}")
        return PortablePrefix(k=np.concatenate([head_k, self.k], axis=2), v=np.concatenate([head_v, self.v], axis=2),
                              prompt_tokens=self.prompt_tokens, last_logits=self.last_logits, sampling=self.sampling,
                              model_fingerprint=self.model_fingerprint, version=self.version)

    def page_keys(self, page_size: int) -> list[str]:
        """The keys of this prompt's full pages of ``page_size`` positions
        (:func:`polyengine.pages.page_keys` under this prefix's model fingerprint): key
        ``i`` names tokens ``[0, (i + 1) * page_size)``."""
        return page_keys(self.prompt_tokens.tolist(), page_size, fingerprint=self.model_fingerprint)

    def check_compatible(self, *, fingerprint: str, num_layers: int, num_kv_heads: int, head_dim: int, vocab_size: int,
                         allow_tail: bool = False) -> None:
        """Raise InvalidRequest unless this prefix was made by the same model and holds
        only finite values and token ids of its vocabulary; a tail (``start`` > 0) only
        with ``allow_tail`` (an importer that puts it onto a prefix holding its head)."""
        if self.version != FORMAT_VERSION:
            raise _bad(f"prefix format version {self.version} is not supported (this polyengine reads {FORMAT_VERSION})")
        if self.model_fingerprint != fingerprint:
            raise _bad(
                f"prefix was made by model {self.model_fingerprint[:12]}..., not this engine's model "
                f"{fingerprint[:12]}...; import it into an engine running the same weights"
            )
        if not 0 <= self.start <= self.true_length or self.k.shape[2] != self.true_length - self.start:
            raise _bad(f"prefix K/V hold {self.k.shape[2]} positions from position {self.start} of a "
                       f"{self.true_length}-token prompt")  # fields changed after construction
        if self.start and not allow_tail:
            raise _bad(f"this portable prefix is a tail (its K/V start at position {self.start}); import it with "
                       f"import_prefix_tail onto a prefix that holds its first {self.start} prompt tokens")
        want = (num_layers, num_kv_heads, head_dim)
        got = (self.k.shape[0], self.k.shape[1], self.k.shape[3])
        if got != want:
            raise _bad(f"prefix K/V shape (layers, kv_heads, head_dim) {got} does not match the model's {want}")
        if self.last_logits.shape != (vocab_size,):
            raise _bad(f"prefix logits have shape {self.last_logits.shape}, expected ({vocab_size},)")
        ids = self.prompt_tokens
        outside = (ids < 0) | (ids >= vocab_size)
        if outside.any():
            at = int(np.argmax(outside))
            raise _bad(f"prefix prompt token {at} is {int(ids[at])}, outside the vocabulary [0, {vocab_size})")
        for name, arr in (("K", self.k), ("V", self.v), ("logits", self.last_logits)):
            finite = np.isfinite(arr)
            if not finite.all():
                at = np.unravel_index(int(np.argmin(finite)), arr.shape)
                raise _bad(f"prefix {name} holds a non-finite value ({arr[at]}) at index {tuple(map(int, at))}: "
                           f"the prefix is corrupt or was made by an overflowing engine; prefill the prompt again")

    # -- serialization ------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        from safetensors.numpy import save

        meta = {
            "format": _FORMAT,
            "version": str(self.version),
            "model_fingerprint": self.model_fingerprint,
            "sampling": self.sampling.model_dump_json(),
            "start": str(self.start),
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
        except (SafetensorError, ValueError, RecursionError) as exc:  # RecursionError: a header nested past json's depth
            raise _bad(f"not a polyengine prefix (unreadable safetensors data: {type(exc).__name__}: {exc})") from None
        if meta.get("format") != _FORMAT:
            raise _bad(f"not a polyengine prefix (format {meta.get('format')!r})")
        missing = {"k", "v", "prompt_tokens", "last_logits"} - set(tensors)
        if missing:
            raise _bad(f"prefix data lacks tensors {sorted(missing)}")
        try:
            sampling = SamplingParams.model_validate_json(meta["sampling"])
            version = int(meta["version"])
            start = int(meta.get("start", "0"))  # absent: written before tails, a whole prefix
        except (KeyError, ValueError) as exc:
            raise _bad(f"prefix metadata is malformed: {exc}") from None
        return cls(
            k=tensors["k"], v=tensors["v"], prompt_tokens=tensors["prompt_tokens"],
            last_logits=tensors["last_logits"], sampling=sampling,
            model_fingerprint=meta.get("model_fingerprint", ""), version=version, start=start,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(self.to_bytes())

    @classmethod
    def load(cls, path: str | Path) -> "PortablePrefix":
        """Read a saved prefix: a regular file of at most ``MAX_PREFIX_BYTES`` (a FIFO,
        a device or a directory is refused at once, never read)."""
        from polyengine.files import read_regular

        return cls.from_bytes(read_regular(path, limit=MAX_PREFIX_BYTES, what="portable prefix",
                                           error=lambda msg: _bad(f"{path}: {msg}")))


def _bad(message: str) -> InvalidRequest:
    return InvalidRequest(message, field="prefix")


def _floats(a: np.ndarray, name: str) -> np.ndarray:
    """A float array as contiguous float32; integers or objects are refused, not cast."""
    arr = np.asarray(a)
    if not np.issubdtype(arr.dtype, np.floating):
        raise _bad(f"prefix {name} must hold floating-point values, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _token_ids(a: np.ndarray) -> np.ndarray:
    """Prompt ids as int32: integers that int32 represents, never wrapped or truncated."""
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise _bad(f"prefix prompt tokens must be one row, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise _bad(f"prefix prompt tokens must be integers, got dtype {arr.dtype}")
    info = np.iinfo(np.int32)
    if arr.size and (arr.min() < info.min or arr.max() > info.max):
        bad = int(np.argmax((arr < info.min) | (arr > info.max)))
        raise _bad(f"prefix prompt token {bad} is {int(arr[bad])}, which no vocabulary holds (not an int32)")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _header_metadata(data: bytes) -> dict[str, str]:
    """The header's ``__metadata__``: a JSON object of strings, else ValueError."""
    if len(data) < 8:
        raise ValueError("too short")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError("header length past end of data")
    header = json.loads(data[8 : 8 + n])
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("the header's __metadata__ must be an object of strings")
    return meta
