"""The engine protocol's types and its one declaration: prefill -> insert into a slot ->
generate -> free_resource.

The :class:`Engine` Protocol names every member (required and optional);
:func:`protocol_problems` derives its checks from that class, and the plugin system
(``create_engine``) and the conformance suite both use it. The contracts themselves are
written out in ``docs/design.md``; :mod:`polyengine.results` holds what a call returns,
:mod:`polyengine.validation` the request checks, :mod:`polyengine.kit` the base class a
backend builds on (``polyengine.engine`` re-exports all of them).

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
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from polyengine._version import PROTOCOL_VERSION
from polyengine.limits import DEFAULT_CONTEXT_LENGTH
from polyengine.models.blocks import FLOAT_FORMATS, FORMATS
from polyengine.models.config import ARCHITECTURES, LLAMA_FAMILY
from polyengine.sampling.params import ENGINE_FIELDS, SamplingParams
from polyengine.validation import is_int

if TYPE_CHECKING:  # pragma: no cover
    from concurrent.futures import Future

    from polyengine.prefix import PortablePrefix
    from polyengine.results import ResultTokens

__all__ = [
    "PROTOCOL_VERSION",
    "Capabilities",
    "EngineConfig",
    "DEFAULT_STEP_TOKENS",
    "DEFAULT_CONTEXT_LENGTH",
    "Prefix",
    "PrefillRequest",
    "DecodeState",
    "Override",
    "Engine",
    "OPTIONAL_METHODS",
    "CAPABILITY_KEYWORDS",
    "CAPABILITY_METHODS",
    "protocol_members",
    "protocol_problems",
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
    ``architectures``: the ``ModelConfig.model_type`` values the backend computes (a
    backend that declares none is taken to run the Llama family, ``llama`` and
    ``qwen2``); a model of any other is refused with :class:`UnsupportedFeature` when
    the engine is built.
    ``token_masks``: ``prefill`` takes ``token_mask`` and ``generate`` takes
    ``token_masks`` (allowed-token masks for a slot's next token, applied in sampling
    step 1 on the device); an engine without it refuses masks with
    :class:`UnsupportedFeature`, and need not have the keywords at all.
    ``prefix_truncate``: ``truncate_prefix`` makes a prefix of the first tokens of a
    prefix (the driver's prefix cache serves the shared part of a cached prompt that a new
    prompt leaves; docs/prefix-caching.md). ``EngineBase`` implements it for every engine
    with ``portable_prefix`` and ``prefix_reuse``; an engine may lack the method without it.
    ``portable_prefix_tail``: ``import_prefix_tail`` imports a tail of a portable prefix
    (``PortablePrefix.start`` > 0) onto a prefix the engine holds whose prompt begins
    with the tail's head; needs ``portable_prefix``. ``EngineBase`` implements it for
    every engine (the head exported, joined to the tail, imported: a copy); a paged
    engine shares the head's pages instead. An engine may lack the method without it.
    ``paged_kv``: the engine keeps K/V in pages of ``page_size`` tokens (0: contiguous)
    under the page rules of docs/design.md ("Pages").
    ``weight_formats``: the weight formats (``polyengine.models.blocks.FORMATS``: F32,
    F16, BF16, Q8_0, Q4_K...) the backend computes on as stored; it reads its weights
    through ``Model.weight(name, weight_formats)``, which converts a tensor of any other
    format to float32, one tensor at a time (docs/models.md, "Weight formats").
    ``embeddings``: ``embed`` returns a prompt's final hidden states (what the driver
    pools into ``LLM.embed`` and the server's ``/v1/embeddings``); an engine without it
    raises :class:`UnsupportedFeature` there, and need not have the method at all.
    ``batched_prefill``: ``prefill_batch`` runs several prompts or chunks (each possibly
    continuing its own prefix) in one forward of the model, not one call after another;
    ``EngineBase`` gives every engine the method as a loop over ``prefill``, and the
    driver batches a step's pieces only on an engine that declares it.
    ``prefill_lane``: ``start_prefill`` runs a ``prefill`` on threads of the engine's own
    and returns a ``concurrent.futures.Future`` of its ``(Prefix, ResultTokens)``; while
    it runs, the driver goes on calling ``generate``, ``insert``, ``bulk_insert``,
    ``free_resource`` and ``prefill`` (one caller thread), and every result, the lane's
    included, is what the same calls give one after another, within the backend's float
    tolerances (docs/design.md, "The prefill lane"). An engine without it raises
    :class:`UnsupportedFeature` there.
    ``mixed_step``: the most prompt tokens (all entries together) that
    ``generate_with_prefill`` computes inside the decode step's own pass over the
    weights, a new request's prompt rows beside the running slots' rows (0: the engine
    has no such call and may lack the method). Given more, or where the engine cannot
    mix them, the call runs ``prefill_batch`` and then ``generate``: the results are the
    same either way (docs/design.md, "The mixed step").
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
    architectures: tuple[str, ...] = Field(
        LLAMA_FAMILY, min_length=1,
        description="model types (ModelConfig.model_type) the backend computes; others are refused at construction")
    token_masks: bool = False
    prefix_truncate: bool = False
    portable_prefix_tail: bool = False
    page_size: int = Field(0, ge=0, description="tokens per K/V page; 0: a contiguous cache (no pages)")
    weight_formats: tuple[str, ...] = Field(
        FLOAT_FORMATS, min_length=1,
        description="weight formats computed on as stored; others are converted to float32 one tensor at a time")
    embeddings: bool = False
    batched_prefill: bool = False
    prefill_lane: bool = False
    mixed_step: int = Field(0, ge=0, description="prompt tokens generate_with_prefill runs in the decode step's "
                                                 "pass (0: no such call)")

    @property
    def paged_kv(self) -> bool:
        """Whether the engine keeps K/V in pages (``page_size`` > 0)."""
        return self.page_size > 0

    @model_validator(mode="after")
    def _known_fields(self) -> "Capabilities":
        if self.prefix_truncate and not self.prefix_reuse:
            raise ValueError("prefix_truncate needs prefix_reuse: a truncated prefix is there to be continued")
        if self.portable_prefix_tail and not self.portable_prefix:
            raise ValueError("portable_prefix_tail needs portable_prefix: a tail is a portable prefix")
        unknown_formats = sorted(set(self.weight_formats) - set(FORMATS))
        if unknown_formats:
            raise ValueError(f"weight_formats names unknown formats {unknown_formats}; known: {list(FORMATS)}")
        unknown_arch = sorted(set(self.architectures) - set(ARCHITECTURES))
        if unknown_arch:
            raise ValueError(f"architectures names unknown model types {unknown_arch}; known: {list(ARCHITECTURES)}")
        unknown = self.sampling_params - ENGINE_FIELDS
        if unknown:
            raise ValueError(
                f"sampling_params names fields that are not engine-side sampling fields: "
                f"{sorted(unknown)}; engine-side fields are {sorted(ENGINE_FIELDS)}"
            )
        return self


# Prompt tokens one scheduler step prefills while other requests decode, over every
# request being prefilled (EngineConfig.max_num_batched_tokens unset). Measured in
# docs/serving.md ("Prefill and decode in one step"). Here so that the driver and an
# engine's memory check read one value without the engine importing the driver.
DEFAULT_STEP_TOKENS = 64


class EngineConfig(BaseModel):
    """Limits and choices fixed when an engine is built.

    ``max_cache_length`` bounds prompt plus completion per slot (the context length:
    ``--context-length`` on the command line and the server); its default is
    :data:`DEFAULT_CONTEXT_LENGTH`, which :func:`polyengine.create_engine` lowers to the
    model's ``max_position_embeddings`` when that is smaller. ``max_prefill_length``
    (the longest prompt) defaults to ``max_cache_length - 1``. ``prefill_buckets``
    (ascending) are the padded prompt lengths a static-shape backend compiles; ``None``
    lets the backend choose. ``dtype`` None means the backend's default (the first of
    ``Capabilities.dtypes``). ``options`` holds backend-specific settings; a backend
    refuses keys it does not declare (``EngineBase.OPTIONS``).

    Two settings belong to the driver that runs on the engine, and are here so the
    engine can account for them where its memory is (docs/prefix-caching.md):
    ``prefix_cache_bytes`` bounds the K/V the driver's prefix cache may keep (None: as
    much as the slots' KV cache holds, less what the slots hold now on a cache that
    grows with use; 0: no cache), counted by the engine's memory check; ``prefill_chunk`` is the most prompt tokens one prefill call runs while
    other requests decode (None: the measured default; 0: whole prompts at once);
    ``max_num_batched_tokens`` the most prompt tokens one scheduler step prefills, over
    every request being prefilled, while other requests decode (vLLM's name; None: the
    measured default, docs/serving.md "Prefill and decode in one step").
    All three need ``Capabilities.prefix_reuse`` and are off without it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_slots: int = Field(8, ge=1, le=4096)
    max_prefill_length: int = Field(None, ge=1)  # type: ignore[assignment]  # None: max_cache_length - 1
    max_cache_length: int = Field(DEFAULT_CONTEXT_LENGTH, ge=2)
    dtype: str | None = None
    prefill_buckets: tuple[int, ...] | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    prefix_cache_bytes: int | None = Field(None, ge=0)
    prefill_chunk: int | None = Field(None, ge=0)
    max_num_batched_tokens: int | None = Field(None, ge=1)

    @field_validator("max_slots", "max_prefill_length", "max_cache_length", "prefix_cache_bytes", "prefill_chunk",
                     "max_num_batched_tokens", "prefill_buckets", mode="before")
    @classmethod
    def _integers(cls, value: Any) -> Any:
        """Integers only (NumPy's too): True is not 1 byte, "3" is not 3 slots, 2.5 is not
        2 (pydantic's lax mode would take all three)."""
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is not None and not is_int(item):
                raise ValueError(f"must be an integer, not {type(item).__name__} {item!r:.40}")
        return value

    @model_validator(mode="after")
    def _limits(self) -> "EngineConfig":
        if self.max_prefill_length is None:  # frozen: set once, here, by the one rule
            object.__setattr__(self, "max_prefill_length", self.max_cache_length - 1)
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

    def bucket_for(self, length: int, smallest: int = 16) -> int:
        """The smallest of :meth:`buckets` that holds ``length`` tokens; a length beyond
        every bucket is InvalidRequest naming them (the prefill checks refuse such a
        prompt first, by ``max_prefill_length``)."""
        for b in self.buckets(smallest):
            if b >= length:
                return b
        from polyengine.errors import InvalidRequest

        raise InvalidRequest(
            f"{length} tokens fit no prefill bucket (buckets: {', '.join(map(str, self.buckets(smallest)))}); "
            f"shorten the prompt or build the engine with larger prefill_buckets"
        )


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
    ``token_mask`` is the allowed-token mask prefill drew the first token under (host
    int32 words, or None): ``bulk_insert`` draws every sample's first token under it.

    ``nbytes`` is the memory its K/V hold where the engine keeps them (padding
    included), which the driver's prefix cache counts against its budget; 0 means the
    engine does not say (the driver then estimates it from the model).

    A prefix head (``EngineBase.prefix_head``: ``logits`` None, ``first_token`` -1) holds
    the first positions of another prefix for continuation only: ``prefill`` continues it,
    ``insert``, ``bulk_insert``, ``host_logits`` and exports refuse it.

    A prefix stays valid for the life of the engine that made it: no later call
    (prefill, insert, bulk_insert, generate, free_resource, in any order) changes it,
    ``prefill(existing_prefix=p)`` leaves ``p`` as it was, and it may be inserted any
    number of times, into any free slot, each time behaving as at its first insert.
    """

    kv: Any
    logits: Any
    prompt_tokens: np.ndarray  # (true_length,) int32
    sampling: SamplingParams
    backend: str
    first_token: int  # sample 0's first token (step 0)
    to_host: Callable[[Any], np.ndarray] = field(default=np.asarray, repr=False)
    model_id: str = ""
    token_mask: np.ndarray | None = field(default=None, repr=False)
    nbytes: int = 0

    def host_logits(self) -> np.ndarray:
        """The last prompt position's raw logits as a (vocab,) NumPy array (a prefix head:
        refused, :meth:`require_logits`)."""
        self.require_logits("host_logits")
        return np.asarray(self.to_host(self.logits)).reshape(-1)

    def require_logits(self, what: str) -> "Prefix":
        """This prefix, unless it is a head (``EngineBase.prefix_head``: no logits or first
        token of its own), which ``what`` refuses with InvalidRequest."""
        if self.logits is None:
            from polyengine.errors import InvalidRequest

            raise InvalidRequest(f"{what}: this prefix is a head (prefix_head), which has no logits or first token "
                                 "of its own and can only be continued: prefill at least one more token with "
                                 "existing_prefix=it, then use that prefix", field="prefix")
        return self

    @property
    def true_length(self) -> int:
        return int(self.prompt_tokens.shape[0])


@dataclass(frozen=True)
class PrefillRequest:
    """One entry of ``prefill_batch``: the keywords of one ``prefill`` call (its tokens,
    its request, the prefix it continues, its first token's allowed-token mask)."""

    tokens: Sequence[int] | np.ndarray
    sampling: SamplingParams
    existing_prefix: Prefix | None = None
    token_mask: np.ndarray | None = None


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
    (``portable_prefix``), ``embed`` (``embeddings``); and ``existing_prefix`` in prefill
    (``prefix_reuse``). ``truncate_prefix`` (``prefix_truncate``), ``prefill_batch``
    (``batched_prefill``), ``start_prefill`` (``prefill_lane``), ``generate_with_prefill``
    (``mixed_step``) and ``embed`` may be
    absent without their capabilities (:data:`CAPABILITY_METHODS`).
    Optional keywords, each guarded by a capability (:data:`CAPABILITY_KEYWORDS`; an
    engine that does not declare it may lack the keyword): ``token_mask`` of prefill
    and ``token_masks`` of generate (``token_masks``).

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
        token_mask: np.ndarray | None = None,
    ) -> tuple[Prefix, ResultTokens]:
        """Run the prompt (true tokens; the backend pads to its bucket).

        Returns the prefix and a one-row :class:`ResultTokens` holding sample 0's first
        token. Raises :class:`InvalidRequest` for an empty or too-long prompt or a token
        id outside the vocabulary, and :class:`UnsupportedFeature` for sampling the
        backend does not declare, both before any work. ``token_mask`` (capability
        ``token_masks``): the first token's allowed-token mask, ``ceil(V / 32)`` int32
        words (:mod:`polyengine.sampling.masks`); the prefix keeps it for
        ``bulk_insert``.
        """
        ...

    def prefill_batch(self, *, params: Any, requests: Sequence[PrefillRequest]) -> list[tuple[Prefix, ResultTokens]]:
        """Prefill several prompts or chunks in one call: entry ``i`` gives what
        ``prefill(params=params, **vars(requests[i]))`` would (the same prefix, logits within
        the backend's tolerance, the first token drawn with that request's own parameters
        and seed), in order. Every entry is checked before any work; one that prefill would
        refuse makes the whole call raise that error (its message names the entry) and
        nothing is prefilled. Capability ``batched_prefill`` says the entries share one
        forward; ``EngineBase`` gives engines without it a loop over ``prefill``."""
        ...

    def start_prefill(self, *, params: Any, tokens: Sequence[int] | np.ndarray, sampling: SamplingParams,
                      existing_prefix: Prefix | None = None, token_mask: np.ndarray | None = None) -> "Future":
        """``prefill`` beside the steps (capability ``prefill_lane``): returns at once a
        ``concurrent.futures.Future`` of what ``prefill`` with these keywords returns (or
        raises), computed on threads of the engine's own while the caller goes on calling
        the other methods from its thread; every result, the lane's included, is what the
        same calls give one after another, within the backend's float tolerances
        (docs/design.md, "The prefill lane")."""
        ...

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Install the prefix (sample 0) in an empty slot. Occupied or out-of-range
        slots raise :class:`SlotError`; the state is then unchanged."""
        ...

    def generate(
        self, params: Any, decode_state: DecodeState, *, overrides: Mapping[int, int | Override] | None = None,
        token_masks: Mapping[int, np.ndarray] | None = None,
    ) -> tuple[DecodeState, ResultTokens]:
        """One step for every occupied slot: up to ``tokens_per_step`` tokens each.

        A slot whose prompt plus completion has reached ``max_cache_length`` gets no
        token (``valid == 0``). ``overrides={slot: token or Override}`` forces a token
        (see :class:`Override`): it replaces the slot's token at its position, counts as
        a completion token (penalties and ``min_tokens`` see it, the step counter counts
        it) and is what the slot feeds into this step. ``token_masks={slot: words}``
        (capability ``token_masks``) allows only the masked-in ids for the slot's next
        token; a masked slot yields exactly one token in this step.
        """
        ...

    def generate_with_prefill(
        self, params: Any, decode_state: DecodeState, *, requests: Sequence[PrefillRequest],
        overrides: Mapping[int, int | Override] | None = None, token_masks: Mapping[int, np.ndarray] | None = None,
    ) -> tuple[DecodeState, ResultTokens, "Future"]:
        """``prefill_batch(requests=requests)`` and then ``generate(decode_state,
        overrides=..., token_masks=...)`` as one call (capability ``mixed_step``): the
        decode state and step result ``generate`` gives, and a
        ``concurrent.futures.Future`` of the list ``prefill_batch`` gives (done once the
        step is; with ``async_results`` the call returns before, so the caller reads the
        previous step meanwhile), within the backend's float tolerances. Up to
        ``mixed_step`` prompt tokens in all, the engine computes the prompts' rows in the
        step's own forward, so a new request's prefill costs the running slots less than a
        call of its own. Every entry, override and mask is checked before any work; a
        refused call changes nothing. The prefixes are new ones, not yet in any slot:
        insert them after."""
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

    def truncate_prefix(self, *, params: Any, prefix: Prefix, length: int) -> Prefix:
        """A prefix of ``prefix``'s first ``length`` tokens (``1 <= length <=
        true_length``), as ``prefill`` of those tokens with ``prefix.sampling`` would make
        it (its logits, its first token); ``prefix`` stays as it was. A paged engine
        shares the full pages (docs/design.md, "Pages"). Capability ``prefix_truncate``;
        a bad length or a foreign prefix is InvalidRequest before any work."""
        ...

    def export_prefix(self, prefix: Prefix) -> "PortablePrefix":
        """The prefix as host data any backend can import. Capability ``portable_prefix``."""
        ...

    def import_prefix(self, portable: "PortablePrefix") -> Prefix:
        """A prefix from a portable one made by any backend for the same model (its
        fingerprint is checked). Capability ``portable_prefix``."""
        ...

    def import_prefix_tail(self, portable: "PortablePrefix", *, existing_prefix: Prefix) -> Prefix:
        """The whole prefix ``portable`` stands for, from a tail of it (K/V from position
        ``portable.start``) and ``existing_prefix``, a prefix this engine holds of at
        least ``start`` tokens whose first ``start`` prompt ids are the portable's: as
        ``import_prefix`` of the whole would make it. A paged engine shares the existing
        prefix's pages below ``start``. A head that differs, a start beyond the existing
        prefix, a foreign prefix or a bad portable is InvalidRequest before any work;
        ``existing_prefix`` stays as it was. Capability ``portable_prefix_tail``."""
        ...

    def embed(self, *, params: Any, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """The prompt's hidden states after the model's final norm (the input of the LM
        head), one row per token: a host ``(len(tokens), hidden_size)`` float array. It
        uses no slot and changes no decode state or prefix; the prompt is checked as
        prefill checks it (InvalidRequest, before any work). Capability ``embeddings``."""
        ...


# Optional method -> the capability that says it works (else it raises UnsupportedFeature).
OPTIONAL_METHODS: dict[str, str] = {
    "bulk_insert": "bulk_insert",
    "export_prefix": "portable_prefix",
    "import_prefix": "portable_prefix",
    "embed": "embeddings",
}


# Optional keyword parameters: (method, keyword) -> the capability that requires it. An
# engine that does not declare the capability may lack the keyword (an engine written
# before it existed keeps passing protocol_problems); the caller never passes it then.
CAPABILITY_KEYWORDS: dict[tuple[str, str], str] = {
    ("prefill", "token_mask"): "token_masks",
    ("start_prefill", "token_mask"): "token_masks",
    ("generate", "token_masks"): "token_masks",
    ("generate_with_prefill", "token_masks"): "token_masks",
}


# Methods an engine may lack unless it declares the capability (an engine written before
# they existed keeps passing protocol_problems); the caller checks the capability first.
CAPABILITY_METHODS: dict[str, str] = {
    "truncate_prefix": "prefix_truncate",
    "import_prefix_tail": "portable_prefix_tail",
    "prefill_batch": "batched_prefill",
    "embed": "embeddings",
    "start_prefill": "prefill_lane",
    "generate_with_prefill": "mixed_step",
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
    caps = getattr(engine, "capabilities", None)
    for m in methods:
        fn = getattr(engine, m.name, None)
        guard_method = CAPABILITY_METHODS.get(m.name)
        if not callable(fn) and guard_method is not None and not getattr(caps, guard_method, False):
            continue
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
            guard = CAPABILITY_KEYWORDS.get((m.name, p))
            if guard is not None and not getattr(caps, guard, False):
                continue
            if inspect.Parameter.VAR_KEYWORD not in kinds:
                why = f" (capability {guard!r} is declared)" if guard else ""
                problems.append(f"{m.name}: needs keyword parameter {p!r}{why}")
        for p in m.defaults_none:
            if p in params and params[p].default is not None:
                problems.append(f"{m.name}: {p} must default to None")
    return problems
