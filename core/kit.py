"""The backend kit: :class:`EngineBase`, what every backend builds on.

The attributes every engine has, the refusals every engine must make (in one place),
and the optional methods raising :class:`UnsupportedFeature`. ``docs/backends.md`` has
the checklist.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from polyengine.errors import InvalidRequest, SlotError, UnsupportedFeature
from polyengine.protocol import Capabilities, DecodeState, EngineConfig, Override, Prefix
from polyengine.results import ResultTokens
from polyengine.sampling.params import MAX_SAMPLES, SamplingParams
from polyengine.validation import check_request, is_int

if TYPE_CHECKING:  # pragma: no cover
    from polyengine.models import Model
    from polyengine.prefix import PortablePrefix

__all__ = ["EngineBase"]


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
