"""The engine protocol: prefill -> insert into a slot -> generate -> free_resource.

This module is the one declaration of the protocol. The :class:`Engine` Protocol names
every member (required and optional); :func:`protocol_problems` derives its checks from
that class, and the plugin system (``create_engine``) and the conformance suite both
use it. :class:`EngineBase` is the kit a backend builds on: the refusals every backend
must make, in one place, and the optional methods raising :class:`UnsupportedFeature`.
The contracts themselves are written out in ``docs/design.md``.

The boundary: the driver owns requests, text, stop conditions and tools; an engine
owns weights, KV caches, slots and the per-slot sampler. Nothing here imports an
array framework: handles a backend returns (``Prefix.kv``, ``DecodeState``, device
arrays inside ``ResultTokens``) are opaque to the core.

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
   and returns up to ``capabilities.tokens_per_step`` new tokens per slot.
4. ``free_resource(state, slot)`` empties the slot; until the next insert it reports
   ``valid == 0``.

Concurrency: an engine is driven by one thread. The methods are not re-entrant; a
backend may run work asynchronously (``ResultTokens`` may still be on the device when
``generate`` returns, see ``Capabilities.async_results``) but each call must observe
the effects of the previous one.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from polyengine._version import PROTOCOL_VERSION
from polyengine.errors import InvalidRequest, SlotError, UnsupportedFeature
from polyengine.sampling.params import ENGINE_FIELDS, MAX_SAMPLES, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from polyengine.models import Model
    from polyengine.prefix import PortablePrefix

__all__ = [
    "PROTOCOL_VERSION",
    "Capabilities",
    "EngineConfig",
    "Prefix",
    "DecodeState",
    "Override",
    "ResultLayout",
    "ResultTokens",
    "Engine",
    "EngineBase",
    "OPTIONAL_METHODS",
    "protocol_members",
    "protocol_problems",
    "check_prompt",
    "check_request",
    "is_int",
    "power_buckets",
]


class Capabilities(BaseModel):
    """What a backend can do. The driver and the conformance suite read only this;
    nothing branches on a backend's name.

    ``sampling_params`` names the :class:`SamplingParams` fields the backend's sampler
    honours; a request that sets any other engine-side field is refused with
    :class:`UnsupportedFeature` before work starts (:func:`check_request`).
    ``async_results``: ``generate`` returns before its results are computed or copied
    to the host (they are read through ``to_host``), so the driver dispatches step
    ``n+1`` before it reads step ``n``. ``tokens_per_step``: the most tokens one
    ``generate`` gives a slot (``k`` of ``ResultTokens``; > 1 for speculative decoding).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtypes: tuple[str, ...] = Field(min_length=1, description="compute dtypes, e.g. float64; the first is the default")
    sampling_params: frozenset[str] = ENGINE_FIELDS
    max_top_logprobs: int = Field(20, ge=0)
    bulk_insert: bool = False
    portable_prefix: bool = False
    prefix_reuse: bool = False
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


class EngineConfig(BaseModel):
    """Limits and choices fixed when an engine is built.

    ``max_cache_length`` bounds prompt plus completion per slot. ``prefill_buckets``
    (ascending) are the padded prompt lengths a static-shape backend compiles; ``None``
    lets the backend choose. ``dtype`` None means the backend's default (the first of
    ``Capabilities.dtypes``). ``options`` holds backend-specific settings; a backend
    refuses keys it does not declare (``EngineBase.OPTIONS``).
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

    def buckets(self, smallest: int = 16) -> tuple[int, ...]:
        """The prefill buckets a static-shape backend compiles: ``prefill_buckets`` when
        set, else powers of two from ``smallest`` below ``max_prefill_length``, then
        ``max_prefill_length`` itself."""
        return self.prefill_buckets if self.prefill_buckets is not None else power_buckets(smallest, self.max_prefill_length)


def power_buckets(start: int, limit: int) -> tuple[int, ...]:
    """Powers of two from ``start`` below ``limit``, then ``limit`` itself: the usual
    bucket ladder of a static-shape backend (prompt lengths, sequence lengths)."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return (*out, limit)


@dataclass
class Prefix:
    """A prefilled request, ready to insert into a slot.

    ``kv`` and ``logits`` are backend handles (device arrays, remote refs, ...).
    ``logits`` are the last prompt position's raw logits, kept so ``bulk_insert`` can
    draw each sample's own first token; ``host_logits()`` copies them to the host with
    the backend's ``to_host``. ``sampling`` has a concrete ``seed``. ``model_id`` says
    which weights made it (``EngineBase`` uses the model's ``instance_id``): an engine
    refuses a prefix made with other weights rather than decode garbage from it.

    A prefix stays valid, unchanged, for the life of the engine that made it: no later
    call (prefill, insert, generate, free, in any order) invalidates it, and prefill
    with ``existing_prefix`` never changes the prefix it continues. It may be inserted
    again, into any free slot, any number of times (also through ``bulk_insert``), and
    each insert behaves exactly as its first: a backend that donates its buffers at
    insert copies on reuse. (docs/design.md, Prefixes.)
    """

    kv: Any
    logits: Any
    prompt_tokens: np.ndarray  # (true_length,) int32
    sampling: SamplingParams
    backend: str
    first_token: int  # sample 0's first token (step 0)
    to_host: Callable[[Any], np.ndarray] = field(default=np.asarray, repr=False)
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


class Override(NamedTuple):
    """A token forced into a slot by ``generate(overrides={slot: Override(...)})``.

    ``position`` is the forced token's index in the slot's completion (0-based: the
    number of completion tokens before it). It must fall inside the slot's last
    result (its last step's tokens, or the first token after an insert): the forced
    token replaces the token at ``position``, the tokens after it in that result are
    discarded (the engine rolls its cache, counts and step counter back to them), and
    the forced token is what the slot feeds next. ``None`` means the slot's latest
    token (``lengths - 1``), the only position a one-token-per-step engine has. A bare
    int in ``overrides`` is ``Override(token)``.
    """

    token: int
    position: int | None = None


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

    Attributes: ``name``; ``capabilities``; ``max_concurrent_decodes`` (slots),
    ``max_prefill_length`` (longest prompt), ``max_cache_length`` (prompt plus
    completion per slot); ``vocab_size``; ``eos_token_ids`` (masked by
    ``min_tokens``/``ignore_eos``); ``model`` (the :class:`~polyengine.models.Model` it
    serves, read by the driver and the suite; None for an engine that holds none
    locally); ``device`` (a human-readable description of where it computes, e.g.
    ``"cuda:0 (NVIDIA H100)"``).

    Optional methods, each guarded by a capability (:data:`OPTIONAL_METHODS`; an engine
    that lacks one still has the method and raises :class:`UnsupportedFeature`):
    ``bulk_insert`` (``bulk_insert``), ``export_prefix``/``import_prefix``
    (``portable_prefix``); and ``existing_prefix`` in prefill (``prefix_reuse``).

    Prefixes belong to the caller: a :class:`Prefix` stays valid for the engine's life
    whatever later calls do (prefilling ahead of free slots is allowed), and an
    inserted prefix may be inserted again and behaves as at its first insert. A refused
    call changes nothing.
    """

    name: str
    capabilities: Capabilities
    max_concurrent_decodes: int
    max_prefill_length: int
    max_cache_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    model: Any
    device: str

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
        self, params: Any, decode_state: DecodeState, *, overrides: Mapping[int, int | Override] | None = None
    ) -> tuple[DecodeState, ResultTokens]:
        """One step for every occupied slot: up to ``tokens_per_step`` tokens each.

        A slot whose prompt plus completion has reached ``max_cache_length`` gets no
        token (``valid == 0``). ``overrides={slot: token or Override}`` forces a token
        (see :class:`Override`): it replaces the slot's token at its position, counts as
        a completion token (penalties and ``min_tokens`` see it, the step counter counts
        it) and is what the slot feeds into this step.
        """
        ...

    def free_resource(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Empty a slot. Freeing an empty slot is allowed; out of range is SlotError."""
        ...

    def bulk_insert(
        self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int]
    ) -> tuple[DecodeState, ResultTokens]:
        """Give sample ``i`` of the request to ``slots[i]`` (each draws its own first
        token: sample index ``i``, step 0); one result row per entry of ``slots``, in
        the order given. Distinct, empty, in-range slots only (else SlotError, state
        unchanged). Capability ``bulk_insert``."""
        ...

    def export_prefix(self, prefix: Prefix) -> "PortablePrefix":
        """The prefix as host data any backend can import. Capability ``portable_prefix``."""
        ...

    def import_prefix(self, portable: "PortablePrefix") -> Prefix:
        """A prefix from a portable one made by any backend for the same model (its
        fingerprint is checked). Capability ``portable_prefix``."""
        ...


# Optional method -> the capability that says it works (else it raises UnsupportedFeature).
OPTIONAL_METHODS: dict[str, str] = {
    "bulk_insert": "bulk_insert",
    "export_prefix": "portable_prefix",
    "import_prefix": "portable_prefix",
}


@dataclass(frozen=True)
class _Method:
    name: str
    positional: tuple[str, ...]
    keyword_only: tuple[str, ...]
    defaults_none: tuple[str, ...]


def protocol_members() -> tuple[tuple[str, ...], tuple[_Method, ...]]:
    """The protocol's attribute names and methods (parameter names after ``self``),
    read from the :class:`Engine` class: the one declaration everything checks against."""
    attributes = tuple(a for a in Engine.__annotations__)
    methods = []
    for name, fn in vars(Engine).items():
        if name.startswith("_") or not inspect.isfunction(fn):
            continue
        params = list(inspect.signature(fn).parameters.values())[1:]
        methods.append(_Method(
            name,
            tuple(p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD),
            tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY),
            tuple(p.name for p in params if p.default is None),
        ))
    return attributes, tuple(methods)


def protocol_problems(engine: Any) -> list[str]:
    """What ``engine`` lacks or gets wrong of the protocol's surface (empty: none)."""
    attributes, methods = protocol_members()
    problems = [f"attribute {a!r} is missing" for a in attributes if not hasattr(engine, a)]
    for m in methods:
        fn = getattr(engine, m.name, None)
        if not callable(fn):
            hint = f" (optional, capability {OPTIONAL_METHODS[m.name]!r}: raise UnsupportedFeature)" if m.name in OPTIONAL_METHODS else ""
            problems.append(f"method {m.name!r} is missing{hint}")
            continue
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # a builtin or C callable: nothing to check
            continue
        kinds = {p.kind for p in params.values()}
        for p in m.positional:
            if inspect.Parameter.VAR_POSITIONAL in kinds:
                break
            if p not in params or params[p].kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY):
                problems.append(f"{m.name}: needs positional parameter {p!r}")
        for p in m.keyword_only:
            if p in params and params[p].kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
                continue
            if inspect.Parameter.VAR_KEYWORD not in kinds:
                problems.append(f"{m.name}: needs keyword parameter {p!r}")
        for p in m.defaults_none:
            if p in params and params[p].default is not None:
                problems.append(f"{m.name}: {p} must default to None")
    return problems


# -- request validation: one sequence for the driver and for engines --------------------------


def is_int(value: object) -> bool:
    """An integer (Python or NumPy), not a bool: what token ids and slots must be."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_prompt(
    tokens: Sequence[int] | np.ndarray, *, max_prefill_length: int, vocab_size: int, offset: int = 0
) -> np.ndarray:
    """A prompt as int32, or InvalidRequest saying what is wrong with it."""
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


def check_request(
    engine: Any, tokens: Sequence[int] | np.ndarray, sampling: SamplingParams, *, offset: int = 0
) -> tuple[np.ndarray, SamplingParams]:
    """Validate a request against an engine's limits and capabilities, before any work.

    The one sequence shared by the driver (before it queues a request) and
    :class:`EngineBase` (for callers that drive an engine directly). Returns the prompt
    as int32 and the request with a concrete seed. Raises :class:`InvalidRequest` for a
    bad prompt or token ids outside the vocabulary, :class:`UnsupportedFeature` for
    anything the capabilities do not declare.
    """
    if not isinstance(sampling, SamplingParams):
        raise InvalidRequest(f"sampling must be SamplingParams, not {type(sampling).__name__}")
    toks = check_prompt(tokens, max_prefill_length=engine.max_prefill_length, vocab_size=engine.vocab_size, offset=offset)
    caps: Capabilities = engine.capabilities
    missing = sorted((sampling.active_fields() & ENGINE_FIELDS) - caps.sampling_params)
    if missing:
        raise UnsupportedFeature(
            f"sampling parameter(s) {', '.join(missing)}", engine.name,
            "leave them at their defaults or pick a backend that declares them",
        )
    if sampling.top_logprobs > caps.max_top_logprobs:
        raise UnsupportedFeature(f"top_logprobs={sampling.top_logprobs}", engine.name, f"at most {caps.max_top_logprobs}")
    if sampling.n > 1 and not caps.bulk_insert:
        raise UnsupportedFeature("n > 1 (bulk_insert)", engine.name)
    if sampling.n > engine.max_concurrent_decodes:
        raise InvalidRequest(
            f"n={sampling.n} samples need {sampling.n} slots but the engine has "
            f"{engine.max_concurrent_decodes} (max_slots)"
        )
    for tok in (*sampling.logit_bias, *sampling.stop_token_ids):
        if tok >= engine.vocab_size:
            raise InvalidRequest(f"token id {tok} in sampling parameters is outside the vocabulary [0, {engine.vocab_size})")
    return toks, sampling.with_seed()


# -- the kit -----------------------------------------------------------------------------------


class EngineBase:
    """The kit a backend builds on (optional, recommended): the attributes every engine
    has, the refusals every engine must make, in one place, and the optional methods
    raising :class:`UnsupportedFeature`. ``docs/backends.md`` has the checklist.

    ``__init__(model, config, capabilities, device=...)`` refuses, before anything is
    allocated: an undeclared dtype (UnsupportedFeature), option keys not in ``OPTIONS``
    or of the wrong type (InvalidRequest), a ``max_cache_length`` beyond the model's
    positions (InvalidRequest). Then the engine calls :meth:`check_memory` with what it
    will allocate, and per call :meth:`check_prefill`, :meth:`check_prefix`,
    :meth:`check_empty_slot`, :meth:`check_bulk_slots`, :meth:`check_overrides`.
    """

    name: str = "unnamed"
    # Backend-specific options (EngineConfig.options) this engine accepts, with defaults;
    # a value must have its default's type (an int is accepted for a float).
    OPTIONS: Mapping[str, Any] = {}

    capabilities: Capabilities
    eos_token_ids: tuple[int, ...] = ()
    model: Any = None
    device: str = "cpu"

    def __init__(self, model: "Model", config: EngineConfig, capabilities: Capabilities, *, device: str = "cpu"):
        mc = model.config
        dtype = config.dtype or capabilities.dtypes[0]
        if dtype not in capabilities.dtypes:
            raise UnsupportedFeature(f"dtype {dtype!r}", self.name, f"declared dtypes: {', '.join(capabilities.dtypes)}")
        self.options = self._check_options(config.options)
        if config.max_cache_length > mc.max_position_embeddings:
            raise InvalidRequest(
                f"max_cache_length {config.max_cache_length} exceeds the model's max_position_embeddings "
                f"{mc.max_position_embeddings}; build the engine with max_cache_length <= {mc.max_position_embeddings}"
            )
        self.model, self.config, self.capabilities, self.device = model, config, capabilities, device
        self.dtype = dtype
        self.model_id = model.instance_id
        self.max_concurrent_decodes = config.max_slots
        self.max_prefill_length = config.max_prefill_length
        self.max_cache_length = config.max_cache_length
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = tuple(model.eos_token_ids)

    def _check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            known = ", ".join(f"{k} (default {v!r})" for k, v in self.OPTIONS.items()) or "none"
            raise InvalidRequest(f"unknown option(s) {unknown} for backend {self.name!r}; its options: {known}")
        for key, value in options.items():
            default = self.OPTIONS[key]
            want = type(default)
            ok = (
                default is None
                or (want is bool and isinstance(value, bool))
                or (want is int and is_int(value))
                or (want is float and (is_int(value) or isinstance(value, float)))
                or (want not in (bool, int, float) and isinstance(value, want))
            )
            if not ok:
                raise InvalidRequest(
                    f"option {key!r} of backend {self.name!r} must be a {want.__name__} (like its default "
                    f"{default!r}), got {value!r}"
                )
        return {**self.OPTIONS, **options}

    # -- memory ----------------------------------------------------------------------------

    def check_memory(self, needs: Mapping[str, int], *, where: str = "host memory",
                     available: int | None | Callable[[], int | None] = None) -> int:
        """Refuse, before allocating, what this engine would allocate and cannot fit
        (:func:`polyengine.memory.check_fits`); ``needs`` maps descriptions to bytes."""
        from polyengine.memory import check_fits

        return check_fits(f"the {self.name} backend", needs, where=where, available=available)

    # -- per-call checks -------------------------------------------------------------------

    def check_prefill(
        self, tokens: Sequence[int] | np.ndarray, sampling: SamplingParams, existing_prefix: Prefix | None = None
    ) -> tuple[np.ndarray, SamplingParams, int]:
        """Everything prefill must refuse before work: ``existing_prefix`` without the
        capability or from elsewhere, a bad prompt, undeclared sampling. Returns the
        prompt (int32), the request with a seed, and the number of positions the
        existing prefix already holds."""
        start = 0
        if existing_prefix is not None:
            if not self.capabilities.prefix_reuse:
                raise UnsupportedFeature("prefix reuse (existing_prefix)", self.name)
            self.check_prefix(existing_prefix)
            start = existing_prefix.true_length
        toks, sampling = check_request(self, tokens, sampling, offset=start)
        return toks, sampling, start

    def check_prefix(self, prefix: Prefix) -> Prefix:
        """A prefix this engine made (backend and weights) that fits its limits."""
        if not isinstance(prefix, Prefix) or prefix.backend != self.name:
            raise InvalidRequest(
                f"prefix was made by backend {getattr(prefix, 'backend', None)!r}; move prefixes "
                f"between backends with export_prefix/import_prefix"
            )
        if prefix.model_id != self.model_id:
            raise InvalidRequest(
                "prefix was made with other weights than this engine's model; prefill it again here "
                "(or import a portable prefix, which checks the model fingerprint)"
            )
        if prefix.true_length > self.max_prefill_length:
            raise InvalidRequest(
                f"prefix holds {prefix.true_length} tokens but this engine accepts at most "
                f"{self.max_prefill_length} (max_prefill_length)"
            )
        return prefix

    def check_portable(self, portable: "PortablePrefix") -> tuple[np.ndarray, SamplingParams]:
        """A portable prefix made for this engine's model (fingerprint and shapes) whose
        prompt and request this engine accepts: returns the prompt (int32) and the
        request with its seed, for ``import_prefix``."""
        c = self.model.config
        portable.check_compatible(
            fingerprint=self.model.fingerprint, num_layers=c.num_hidden_layers,
            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
        )
        return check_request(self, portable.prompt_tokens, portable.sampling)

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

    def check_empty_slot(self, slot: int, occupied: Callable[[int], bool]) -> int:
        """An in-range, empty slot (insert's target), else SlotError."""
        slot = self.check_slot(slot)
        if occupied(slot):
            raise SlotError(f"slot {slot} is occupied; free_resource it before inserting")
        return slot

    def check_bulk_slots(self, slots: Sequence[int], occupied: Callable[[int], bool]) -> list[int]:
        """bulk_insert's targets: a non-empty list of distinct, in-range, empty slots."""
        try:
            slots = list(slots)
        except TypeError:
            raise SlotError(f"bulk_insert needs a sequence of slots, got {slots!r}") from None
        if not slots or len(slots) > MAX_SAMPLES:
            raise SlotError(f"bulk_insert needs 1..{MAX_SAMPLES} slots, got {len(slots)}")
        checked = [self.check_empty_slot(s, occupied) for s in slots]
        if len(set(checked)) != len(checked):
            raise SlotError(f"bulk_insert needs distinct slots, got {checked}")
        return checked

    def check_overrides(
        self, overrides: Mapping[int, int | Override] | None, last_result: Callable[[int], tuple[int, int] | None]
    ) -> dict[int, tuple[int, int]]:
        """Validate ``generate``'s overrides before any work: ``{slot: (token, position)}``.

        ``last_result(slot)`` gives an occupied slot's ``(completion length, tokens in its
        last result)`` and None for an empty slot; the position must fall inside that
        last result (see :class:`Override`).
        """
        out: dict[int, tuple[int, int]] = {}
        for slot, value in dict(overrides or {}).items():
            slot = self.check_slot(slot) if is_int(slot) else self._bad_override_slot(slot)
            info = last_result(slot)
            if info is None:
                raise InvalidRequest(f"override for slot {slot}, which is empty")
            length, last = info
            ov = value if isinstance(value, Override) else Override(value)
            token = self.check_token(ov.token, f"override for slot {slot}")
            position = length - 1 if ov.position is None else ov.position
            if not is_int(position) or not length - last <= position <= length - 1:
                raise InvalidRequest(
                    f"override for slot {slot} at completion position {ov.position!r}: it must replace one of the "
                    f"tokens of the slot's last result, positions {length - last}..{length - 1}"
                )
            out[slot] = (token, int(position))
        return out

    @staticmethod
    def _bad_override_slot(slot: object) -> int:
        raise InvalidRequest(f"override keys must be slot indices (ints), got {slot!r}")

    # -- optional methods: undeclared ------------------------------------------------------

    def bulk_insert(
        self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int]
    ) -> tuple[DecodeState, ResultTokens]:
        raise UnsupportedFeature("bulk_insert", self.name)

    def export_prefix(self, prefix: Prefix) -> "PortablePrefix":
        raise UnsupportedFeature("export_prefix (portable prefixes)", self.name)

    def import_prefix(self, portable: "PortablePrefix") -> Prefix:
        raise UnsupportedFeature("import_prefix (portable prefixes)", self.name)
