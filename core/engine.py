"""The engine protocol: prefill -> insert into a slot -> generate -> free_resource.

This module draws the boundary between the driver and a backend. The driver owns
requests, text, stop conditions and tools; an engine owns weights, KV caches, slots
and the per-slot sampler. Nothing here imports an array framework: handles a backend
returns (``Prefix.kv``, ``DecodeState``, device arrays inside ``ResultTokens``) are
opaque to the core.

Lifecycle of one request
------------------------
1. ``prefill(params=..., tokens=..., sampling=...)`` runs the prompt (padded to the
   backend's bucket by the backend itself) and returns a :class:`Prefix` plus the first
   token of sample 0 (step 0).
2. ``insert(prefix, state, slot)`` copies the prefix's cache into a free slot and
   installs the request's sampling parameters and stream there; the slot's next input
   is that first token. ``bulk_insert(prefix, state, slots)`` gives sample ``i`` of the
   request to ``slots[i]`` and samples each slot's own first token.
3. ``generate(params, state, overrides=...)`` advances every occupied slot by one step
   (or ``k`` steps for speculative backends) and returns each slot's new tokens.
4. ``free_resource(state, slot)`` empties the slot; until the next insert it reports
   ``valid == 0``.

Concurrency: an engine is driven by one thread. The methods are not re-entrant; a
backend may run work asynchronously (``ResultTokens`` may still be on the device when
``generate`` returns) but each call must observe the effects of the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from polyengine._version import PROTOCOL_VERSION
from polyengine.errors import InvalidRequest, SlotError, UnsupportedFeature
from polyengine.sampling.params import ENGINE_FIELDS, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from polyengine.prefix import PortablePrefix

__all__ = [
    "PROTOCOL_VERSION",
    "Capabilities",
    "EngineConfig",
    "Prefix",
    "DecodeState",
    "ResultTokens",
    "Engine",
    "EngineBase",
]


class Capabilities(BaseModel):
    """What a backend can do. The driver and the conformance suite read only this;
    nothing branches on a backend's name.

    ``sampling_params`` names the :class:`SamplingParams` fields the backend's sampler
    honours; a request that sets any other engine-side field is refused with
    :class:`UnsupportedFeature` before work starts (see :meth:`check_sampling`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtypes: tuple[str, ...] = Field(min_length=1, description="compute dtypes, e.g. float64")
    sampling_params: frozenset[str] = ENGINE_FIELDS
    max_top_logprobs: int = Field(20, ge=0)
    bulk_insert: bool = False
    portable_prefix: bool = False
    prefix_reuse: bool = False
    chunked_prefill: bool = False
    async_results: bool = False
    tokens_per_step: int = Field(1, ge=1, description="k of ResultTokens; >1 for speculation")

    @model_validator(mode="after")
    def _known_fields(self) -> "Capabilities":
        unknown = self.sampling_params - ENGINE_FIELDS
        if unknown:
            raise ValueError(
                f"sampling_params names fields that are not engine-side sampling fields: "
                f"{sorted(unknown)}; engine-side fields are {sorted(ENGINE_FIELDS)}"
            )
        return self

    def check_sampling(self, sampling: SamplingParams, backend: str | None = None) -> None:
        """Raise :class:`UnsupportedFeature` if the request needs something undeclared."""
        used = sampling.active_fields() & ENGINE_FIELDS
        missing = sorted(used - self.sampling_params)
        if missing:
            raise UnsupportedFeature(
                f"sampling parameter(s) {', '.join(missing)}",
                backend,
                "leave them at their defaults or pick a backend that declares them",
            )
        if sampling.top_logprobs > self.max_top_logprobs:
            raise UnsupportedFeature(
                f"top_logprobs={sampling.top_logprobs}",
                backend,
                f"at most {self.max_top_logprobs}",
            )
        if sampling.n > 1 and not self.bulk_insert:
            raise UnsupportedFeature("n > 1 (bulk_insert)", backend)


class EngineConfig(BaseModel):
    """Limits and choices fixed when an engine is built.

    ``max_cache_length`` bounds prompt plus completion per slot. ``prefill_buckets``
    (ascending) are the padded prompt lengths a static-shape backend compiles; ``None``
    lets the backend choose. ``options`` holds backend-specific settings; a backend
    refuses keys it does not know.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_slots: int = Field(8, ge=1, le=4096)
    max_prefill_length: int = Field(512, ge=1)
    max_cache_length: int = Field(1024, ge=2)
    dtype: str | None = None
    prefill_buckets: tuple[int, ...] | None = None
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _limits(self) -> "EngineConfig":
        if self.max_prefill_length >= self.max_cache_length:
            raise ValueError(
                f"max_prefill_length ({self.max_prefill_length}) must be smaller than "
                f"max_cache_length ({self.max_cache_length}) to leave room for a completion"
            )
        if self.prefill_buckets is not None:
            b = self.prefill_buckets
            if not b or list(b) != sorted(set(b)) or b[0] < 1:
                raise ValueError(f"prefill_buckets must be ascending positive lengths, got {b}")
            if b[-1] < self.max_prefill_length:
                raise ValueError(
                    f"the largest prefill bucket ({b[-1]}) must cover max_prefill_length "
                    f"({self.max_prefill_length})"
                )
        return self


@dataclass
class Prefix:
    """A prefilled request, ready to insert into a slot.

    ``kv`` and ``logits`` are backend handles (device arrays, remote refs, ...).
    ``logits`` are the last prompt position's raw logits, kept so ``bulk_insert`` can
    draw each sample's own first token; ``host_logits()`` copies them to the host with
    the backend's ``to_host``. ``sampling`` has a concrete ``seed``.
    """

    kv: Any
    logits: Any
    prompt_tokens: np.ndarray  # (true_length,) int32
    sampling: SamplingParams
    backend: str
    first_token: int  # sample 0's first token (step 0)
    to_host: Callable[[Any], np.ndarray] = field(default=np.asarray, repr=False)
    # Which weights made it (an engine-chosen id, e.g. of its Model object): an engine
    # refuses a prefix made with other weights rather than decode garbage from it.
    model_id: str = ""

    def host_logits(self) -> np.ndarray:
        """The last prompt position's raw logits as a (vocab,) NumPy array."""
        return np.asarray(self.to_host(self.logits)).reshape(-1)

    @property
    def true_length(self) -> int:
        return int(self.prompt_tokens.shape[0])


@runtime_checkable
class DecodeState(Protocol):
    """A backend's per-slot decode state (KV caches, positions, sampler state).

    Opaque to the core. ``num_slots`` equals the engine's ``max_concurrent_decodes``.
    """

    num_slots: int


class ResultTokens:
    """Per-row results of prefill, bulk_insert or one generate step.

    Rows are slots for ``generate`` (``num_slots`` rows), the single request for
    ``prefill``, and ``slots[i]`` for ``bulk_insert``'s row ``i``. Each row holds ``k``
    tokens (``k > 1`` only for speculative backends). ``valid[r, j]`` is 0 where the
    row produced no token (empty slot, or fewer than ``k`` accepted). ``lengths[r]``
    counts the row's completion tokens including these.

    A backend may hand device arrays and a ``to_host`` converter: nothing is copied to
    the host until a field is read, so the backend can start step ``n+1`` before the
    driver reads step ``n``. Reading gives numpy arrays.
    """

    __slots__ = ("_raw", "_host", "_to_host")

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

    def _get(self, name: str) -> np.ndarray | None:
        if name not in self._host:
            raw = self._raw[name]
            self._host[name] = None if raw is None else np.asarray(self._to_host(raw))
        return self._host[name]

    tokens = property(lambda self: self._get("tokens"))
    valid = property(lambda self: self._get("valid"))
    lengths = property(lambda self: self._get("lengths"))
    logprobs = property(lambda self: self._get("logprobs"))
    top_ids = property(lambda self: self._get("top_ids"))
    top_logprobs = property(lambda self: self._get("top_logprobs"))

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def row_tokens(self, row: int) -> list[int]:
        """The valid tokens of one row, in order."""
        toks, ok = self.tokens[row], self.valid[row]
        return [int(t) for t, v in zip(toks, ok) if v]

    def __repr__(self) -> str:
        return f"ResultTokens(rows={self.num_rows}, k={self.tokens.shape[1]})"


@runtime_checkable
class Engine(Protocol):
    """The protocol every backend implements (JetStream's vocabulary, typed).

    Required attributes: ``name``, ``capabilities``, ``max_concurrent_decodes``
    (slots), ``max_prefill_length`` (longest prompt), ``max_cache_length`` (prompt
    plus completion per slot), ``vocab_size`` and ``eos_token_ids`` (masked by
    ``min_tokens``/``ignore_eos``).

    Optional methods, each guarded by a capability (an engine that lacks one raises
    :class:`UnsupportedFeature`): ``bulk_insert`` (``capabilities.bulk_insert``),
    ``export_prefix``/``import_prefix`` (``portable_prefix``), ``existing_prefix`` in
    prefill (``prefix_reuse``).
    """

    name: str
    capabilities: Capabilities
    max_concurrent_decodes: int
    max_prefill_length: int
    max_cache_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def load_params(self) -> Any:
        """Return the weights handle every other call takes (device-resident)."""
        ...

    def init_decode_state(self) -> DecodeState:
        """A fresh state with every slot empty."""
        ...

    def prefill(
        self,
        *,
        params: Any,
        tokens: Sequence[int] | np.ndarray,
        sampling: SamplingParams,
        existing_prefix: Prefix | None = None,
    ) -> tuple[Prefix, ResultTokens]:
        """Run the prompt (true tokens; the backend pads to its bucket).

        Returns the prefix and a one-row :class:`ResultTokens` holding sample 0's first
        token. Raises :class:`InvalidRequest` for an empty or too-long prompt or a token
        id outside the vocabulary, and :class:`UnsupportedFeature` for sampling the
        backend does not declare, both before any work.
        """
        ...

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Install the prefix (sample 0) in an empty slot. Occupied or out-of-range
        slots raise :class:`SlotError`; the state is then unchanged."""
        ...

    def generate(
        self, params: Any, decode_state: DecodeState, *, overrides: Mapping[int, int] | None = None
    ) -> tuple[DecodeState, ResultTokens]:
        """One step for every occupied slot. ``overrides={slot: token}`` replaces the
        token that slot feeds into this step (and records it as the slot's latest
        completion token, for penalties); the driver uses it to force tokens."""
        ...

    def free_resource(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Empty a slot. Freeing an empty slot is allowed; out of range is SlotError."""
        ...


def is_int(value: object) -> bool:
    """An integer (Python or NumPy), not a bool: what token ids and slots must be."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_prompt(
    tokens: Sequence[int] | np.ndarray, *, max_prefill_length: int, vocab_size: int, offset: int = 0
) -> np.ndarray:
    """A prompt as int32, or InvalidRequest saying what is wrong with it (shared by the
    driver, which checks before queueing, and EngineBase, which checks direct callers)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidRequest(f"prompt tokens must be a flat sequence, got shape {arr.shape}")
    if arr.size == 0:
        raise InvalidRequest("prompt is empty: pass at least one token")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequest(f"prompt tokens must be integers, got dtype {arr.dtype}")
    total = offset + arr.size
    if total > max_prefill_length:
        raise InvalidRequest(
            f"prompt has {total} tokens but this engine accepts at most {max_prefill_length} "
            f"(max_prefill_length); shorten it or build the engine with a larger max_prefill_length"
        )
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        raise InvalidRequest(
            f"token id {int(arr[bad][0])} at position {int(np.argmax(bad))} is outside "
            f"the vocabulary [0, {vocab_size})"
        )
    return arr.astype(np.int32)


def check_sampling_ids(sampling: SamplingParams, vocab_size: int) -> None:
    """Token ids named by the sampling parameters must lie inside the vocabulary."""
    for tok in list(sampling.logit_bias) + list(sampling.stop_token_ids):
        if tok >= vocab_size:
            raise InvalidRequest(
                f"token id {tok} in sampling parameters is outside the vocabulary [0, {vocab_size})"
            )


class EngineBase:
    """Shared plumbing for backends (optional to use): request checks in one place and
    the optional methods raising :class:`UnsupportedFeature` by default."""

    name: str = "unnamed"
    capabilities: Capabilities
    max_concurrent_decodes: int
    max_prefill_length: int
    max_cache_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()

    def check_prompt(self, tokens: Sequence[int] | np.ndarray, *, offset: int = 0) -> np.ndarray:
        """Validate a prompt and return it as int32; ``offset`` counts tokens of an
        existing prefix that precede it."""
        return check_prompt(tokens, max_prefill_length=self.max_prefill_length, vocab_size=self.vocab_size, offset=offset)

    def check_sampling(self, sampling: SamplingParams) -> SamplingParams:
        """Refuse undeclared features and bad ids; return the request with a seed."""
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequest(f"sampling must be SamplingParams, not {type(sampling).__name__}")
        self.capabilities.check_sampling(sampling, self.name)
        check_sampling_ids(sampling, self.vocab_size)
        return sampling.with_seed()

    def check_token(self, token: object, what: str) -> int:
        """A token id (an integer inside the vocabulary) as an int, else InvalidRequest."""
        if not is_int(token):
            raise InvalidRequest(f"{what} must be an integer token id, got {token!r}")
        if not 0 <= token < self.vocab_size:
            raise InvalidRequest(f"{what} {token} is outside the vocabulary [0, {self.vocab_size})")
        return int(token)

    def check_slot(self, slot: int) -> int:
        if not is_int(slot):
            raise SlotError(f"slot must be an int, not {type(slot).__name__}")
        if not 0 <= slot < self.max_concurrent_decodes:
            raise SlotError(
                f"slot {slot} is out of range: this engine has slots 0.."
                f"{self.max_concurrent_decodes - 1}"
            )
        return int(slot)

    def bulk_insert(
        self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int]
    ) -> tuple[DecodeState, ResultTokens]:
        raise UnsupportedFeature("bulk_insert", self.name)

    def export_prefix(self, prefix: Prefix) -> "PortablePrefix":
        raise UnsupportedFeature("export_prefix (portable prefixes)", self.name)

    def import_prefix(self, portable: "PortablePrefix") -> Prefix:
        raise UnsupportedFeature("import_prefix (portable prefixes)", self.name)
