"""What engine calls return: per-row tokens, validity, lengths and log-probs
(:class:`ResultTokens`), optionally packed into one int32 buffer (:class:`ResultLayout`)
so a device backend moves a whole step to the host in one transfer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = ["ResultLayout", "ResultTokens", "NONFINITE_TOKEN"]

# The token a sampler reports for a row whose logits hold NaN or +inf: nothing can be
# drawn from them, and the driver fails that request with NumericalError (any token
# outside the vocabulary is read the same way). The row's later tokens are garbage the
# driver never reads: the slot is freed.
NONFINITE_TOKEN = -1


@dataclass(frozen=True)
class ResultLayout:
    """Where each field of a packed result sits in one int32 buffer ``(rows, width)``.

    Columns in order: ``tokens`` (k), ``valid`` (k, 0/1), ``lengths`` (1), then, when
    ``logprobs``: the tokens' raw log-probs (k, float32 bits), ``top_ids`` (k x top_n)
    and ``top_logprobs`` (k x top_n, float32 bits). A device backend writes this layout
    with its framework (float32 values bit-cast to int32, e.g. ``x.view(torch.int32)``
    or ``lax.bitcast_convert_type``) so one transfer carries a whole step;
    :meth:`pack` is the NumPy version (host backends, tests).
    """

    k: int = 1
    top_n: int = 0
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.k < 1 or self.top_n < 0 or (self.top_n and not self.logprobs):
            raise ValueError(f"invalid result layout {self}")

    @property
    def columns(self) -> dict[str, slice]:
        k, n = self.k, self.top_n
        out = {"tokens": slice(0, k), "valid": slice(k, 2 * k), "lengths": slice(2 * k, 2 * k + 1)}
        if self.logprobs:
            at = 2 * k + 1
            out["logprobs"] = slice(at, at + k)
            out["top_ids"] = slice(at + k, at + k + k * n)
            out["top_logprobs"] = slice(at + k + k * n, at + k + 2 * k * n)
        return out

    @property
    def width(self) -> int:
        return 2 * self.k + 1 + ((self.k + 2 * self.k * self.top_n) if self.logprobs else 0)

    def pack(self, tokens, valid, lengths, logprobs=None, top_ids=None, top_logprobs=None) -> np.ndarray:
        rows = np.asarray(tokens).shape[0]
        out = np.zeros((rows, self.width), np.int32)
        c = self.columns
        out[:, c["tokens"]] = np.asarray(tokens, np.int32).reshape(rows, self.k)
        out[:, c["valid"]] = np.asarray(valid, bool).reshape(rows, self.k)
        out[:, c["lengths"]] = np.asarray(lengths, np.int32).reshape(rows, 1)
        if self.logprobs:
            out[:, c["logprobs"]] = np.asarray(logprobs, np.float32).reshape(rows, self.k).view(np.int32)
            out[:, c["top_ids"]] = np.asarray(top_ids, np.int32).reshape(rows, -1)
            out[:, c["top_logprobs"]] = np.asarray(top_logprobs, np.float32).reshape(rows, -1).view(np.int32)
        return out

    def unpack(self, buffer: np.ndarray) -> dict[str, np.ndarray]:
        buf = np.asarray(buffer)
        if buf.dtype != np.int32 or buf.ndim != 2 or buf.shape[1] != self.width:
            raise ValueError(f"a packed result must be int32 (rows, {self.width}), got {buf.dtype} {buf.shape}")
        rows, c = buf.shape[0], self.columns
        out = {
            "tokens": buf[:, c["tokens"]],
            "valid": buf[:, c["valid"]] != 0,
            "lengths": buf[:, c["lengths"]].reshape(rows),
        }
        if self.logprobs:
            out["logprobs"] = np.ascontiguousarray(buf[:, c["logprobs"]]).view(np.float32)
            out["top_ids"] = buf[:, c["top_ids"]].reshape(rows, self.k, self.top_n)
            out["top_logprobs"] = np.ascontiguousarray(buf[:, c["top_logprobs"]]).view(np.float32).reshape(
                rows, self.k, self.top_n)
        return out


class ResultTokens:
    """Per-row results of prefill, bulk_insert or one generate step.

    Rows are slots for ``generate`` (``num_slots`` rows), the single request for
    ``prefill``, and ``slots[i]`` for ``bulk_insert``'s row ``i``. Each row holds ``k``
    token columns; ``valid[r, j]`` is 1 where the row produced a token and the valid
    ones come first (fewer than ``k`` when a speculative step accepted fewer; none for
    an empty slot or a slot whose cache is full). ``lengths[r]`` counts the row's
    completion tokens including these (0 for an empty slot).

    Two ways to build one: field by field (NumPy arrays, or device arrays with a
    ``to_host`` converter), or :meth:`from_packed`: one device buffer in a
    :class:`ResultLayout`, converted once and sliced, whose host copy can start early.
    Nothing is copied to the host until a field is read, so the backend can start step
    ``n+1`` before the driver reads step ``n``. Reading gives NumPy arrays.
    """

    __slots__ = ("_raw", "_host", "_to_host", "_packed")

    def __init__(
        self,
        *,
        tokens: Any,  # (rows, k) int32
        valid: Any,  # (rows, k) bool
        lengths: Any,  # (rows,) int32
        logprobs: Any = None,  # (rows, k) float32, raw model log-probs of the tokens
        top_ids: Any = None,  # (rows, k, n) int32
        top_logprobs: Any = None,  # (rows, k, n) float32
        to_host: Callable[[Any], np.ndarray] = np.asarray,
    ):
        self._raw = dict(
            tokens=tokens, valid=valid, lengths=lengths,
            logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs,
        )
        self._host: dict[str, np.ndarray | None] = {}
        self._to_host = to_host
        self._packed: tuple[Any, ResultLayout] | None = None

    @classmethod
    def from_packed(
        cls,
        buffer: Any,
        layout: ResultLayout,
        *,
        to_host: Callable[[Any], np.ndarray] = np.asarray,
        start_copy: Callable[[Any], Any] | None = None,
    ) -> "ResultTokens":
        """Results from one packed buffer. ``start_copy(buffer)`` is called at once and
        returns a handle (e.g. a pinned host tensor being filled by a non-blocking copy,
        or a JAX array after ``copy_to_host_async``); the first read calls
        ``to_host(handle)`` once and slices the fields out of that one array."""
        self = cls.__new__(cls)
        self._raw, self._host, self._to_host = {}, {}, to_host
        self._packed = (start_copy(buffer) if start_copy is not None else buffer, layout)
        return self

    def _get(self, name: str) -> np.ndarray | None:
        if name not in self._host:
            if self._packed is not None:
                handle, layout = self._packed
                fields = layout.unpack(np.asarray(self._to_host(handle)))
                self._host.update({f: fields.get(f) for f in ("tokens", "valid", "lengths", "logprobs", "top_ids", "top_logprobs")})
                self._packed = None
            else:
                raw = self._raw[name]
                self._host[name] = None if raw is None else np.asarray(self._to_host(raw))
        return self._host[name]

    tokens = property(lambda self: self._get("tokens"))
    valid = property(lambda self: self._get("valid"))
    lengths = property(lambda self: self._get("lengths"))
    logprobs = property(lambda self: self._get("logprobs"))
    top_ids = property(lambda self: self._get("top_ids"))
    top_logprobs = property(lambda self: self._get("top_logprobs"))

    @classmethod
    def first_tokens(
        cls, tokens: Any, logprobs: Any = None, top_ids: Any = None, top_logprobs: Any = None, *,
        to_host: Callable[[Any], np.ndarray] = np.asarray,
    ) -> "ResultTokens":
        """One token per row, each a slot's first (``lengths == 1``): what prefill and
        bulk_insert return. ``tokens``/``logprobs`` are ``(rows,)``, ``top_ids`` and
        ``top_logprobs`` ``(rows, n)``, host or device arrays read through ``to_host``."""

        def col(x: Any, rows: int) -> Any:
            return None if x is None else x.reshape(rows, 1, -1) if len(x.shape) == 2 else x.reshape(rows, 1)

        rows = int(tokens.shape[0])
        return cls(tokens=tokens.reshape(rows, 1), valid=np.ones((rows, 1), bool), lengths=np.ones(rows, np.int32),
                   logprobs=col(logprobs, rows), top_ids=col(top_ids, rows), top_logprobs=col(top_logprobs, rows),
                   to_host=to_host)

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def row_tokens(self, row: int) -> list[int]:
        """The valid tokens of one row, in order."""
        toks, ok = self.tokens[row], self.valid[row]
        return [int(t) for t, v in zip(toks, ok) if v]

    def __repr__(self) -> str:
        return f"ResultTokens(rows={self.num_rows}, k={self.tokens.shape[1]})"
