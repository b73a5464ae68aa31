"""The backend kit: :class:`EngineBase`, what every backend builds on.

The attributes every engine has, the refusals every engine must make (in one place),
and the optional methods raising :class:`UnsupportedFeature`. ``docs/backends.md`` has
the checklist.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from polyengine.errors import InvalidRequest, SlotError, UnsupportedFeature
from polyengine.protocol import Capabilities, DecodeState, EngineConfig, Override, PrefillRequest, Prefix
from polyengine.results import ResultTokens
from polyengine.sampling.masks import SlotMasks, allows_any, check_mask, full_mask, step_masked_ids
from polyengine.sampling.params import MAX_SAMPLES, SamplingParams
from polyengine.options import check_options
from polyengine.pages import PageList
from polyengine.slots import Slot
from polyengine.validation import check_prompt, check_request, is_int

if TYPE_CHECKING:  # pragma: no cover
    from polyengine.models import Model
    from polyengine.prefix import PortablePrefix

__all__ = ["EngineBase", "on_lane"]

# Bytes per element of the dtypes engines name (Prefix.nbytes, the prefix cache's default budget).
_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


class EngineBase:
    """The kit a backend builds on (optional, recommended): the attributes every engine
    has, the refusals every engine must make, in one place, the shared slot flow, and
    the optional methods raising :class:`UnsupportedFeature`. ``docs/backends.md`` has
    the checklist.

    Construction is one pass, before anything is allocated: ``OPTIONS`` checked
    (:func:`polyengine.options.check_options`: unknown keys, types, choices, bounds;
    InvalidRequest), the limits (``max_cache_length`` beyond the model's positions:
    InvalidRequest), then the capabilities (passed in, or derived from the checked
    options by :meth:`capabilities_for`, which may look at the device), then the dtype
    (undeclared: UnsupportedFeature). The engine then calls :meth:`check_memory` with
    what it will allocate, and per call :meth:`check_prefill`, :meth:`check_prefix`,
    :meth:`check_portable`, :meth:`check_portable_tail`, :meth:`check_empty_slot`, :meth:`check_bulk_slots`,
    :meth:`check_overrides`, :meth:`check_token_mask` and :meth:`check_token_masks`.

    The slot flow: an engine whose decode state has a :class:`~polyengine.slots.SlotTable`
    as ``slots`` gets ``insert``, ``bulk_insert`` and ``free_resource`` from the kit
    (checks first, then its hooks :meth:`_settle`, :meth:`_install` and
    :meth:`_release`, then the table), so every engine refuses the same things in the
    same order and a refused call changes nothing.
    """

    name: str = "unnamed"
    # Backend-specific options (EngineConfig.options) this engine accepts: name ->
    # polyengine.options.Option (or a bare default, whose type the value must have).
    OPTIONS: Mapping[str, Any] = {}
    # What the kit's slot flow records for an inserted slot (a Slot subclass may carry an
    # engine's own per-slot fields, with defaults).
    slot_type: type[Slot] = Slot

    capabilities: Capabilities
    eos_token_ids: tuple[int, ...] = ()
    model: Any = None
    device: str = "cpu"

    def __init__(self, model: "Model", config: EngineConfig, capabilities: Capabilities | None = None, *,
                 device: str = "cpu"):
        mc = model.config
        self.options = self._check_options(config.options)
        if config.max_cache_length > mc.max_position_embeddings:
            raise InvalidRequest(
                f"max_cache_length {config.max_cache_length} exceeds the model's max_position_embeddings "
                f"{mc.max_position_embeddings}; build the engine with max_cache_length <= {mc.max_position_embeddings}"
                f" (--context-length on the command line)", field="max_cache_length",
            )
        self.model, self.config, self.device = model, config, device
        if capabilities is None:
            capabilities = self.capabilities_for(model, config)
        dtype = config.dtype or capabilities.dtypes[0]
        if dtype not in capabilities.dtypes:
            raise UnsupportedFeature(f"dtype {dtype!r}", self.name, f"declared dtypes: {', '.join(capabilities.dtypes)}",
                                     field="dtype")
        if mc.model_type not in capabilities.architectures:
            raise UnsupportedFeature(f"architecture {mc.model_type!r}", self.name,
                                     f"declared architectures: {', '.join(capabilities.architectures)}",
                                     field="model")
        self.capabilities = capabilities
        self.dtype = dtype
        self.model_id = model.instance_id
        self.max_concurrent_decodes = config.max_slots
        self.max_prefill_length = config.max_prefill_length
        self.max_cache_length = config.max_cache_length
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = tuple(model.eos_token_ids)
        self.prefix_cache_bytes = self._prefix_cache_budget(config)
        # The default budget on a cache that grows with use is the room the slots leave:
        # the driver's cached prefixes and the slots' K/V together stay within what a
        # cache reserved for every slot would hold (the driver shrinks the cache as the
        # slots grow). An explicit prefix_cache_bytes is a budget of its own.
        self.prefix_cache_shares_kv = bool(
            self.prefix_cache_bytes and config.prefix_cache_bytes is None and self.kv_grows_with_use())

    def capabilities_for(self, model: "Model", config: EngineConfig) -> Capabilities:
        """What this engine can do with the checked ``self.options`` (and the device they
        pick), for an engine that does not pass ``capabilities`` to ``__init__``. Runs
        after the options and limits are checked and before the dtype is."""
        raise NotImplementedError(f"{type(self).__name__}: pass capabilities to EngineBase.__init__ or override "
                                  f"capabilities_for")

    def _check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        return check_options(self.OPTIONS, options, backend=self.name)

    @property
    def kv_itemsize(self) -> int:
        """Bytes of one K or V element as this engine keeps them (its cache and its
        prefixes): the compute dtype's, unless a backend stores K/V narrower."""
        return _ITEMSIZE.get(self.dtype, 4)

    def kv_bytes(self, positions: int) -> int:
        """Bytes of K and V for ``positions`` cache positions as this engine keeps them
        (:attr:`kv_itemsize`): what a prefix of that many positions (its bucket, for a
        padded one) holds (``Prefix.nbytes``)."""
        return int(positions) * self.model.config.kv_bytes_per_token(self.kv_itemsize)

    def kv_grows_with_use(self) -> bool:
        """Whether this engine's decode cache holds memory only as the slots fill it (and
        gives a freed slot's back) rather than every slot's full context from the start.
        Such an engine's default prefix cache shares the slots' bytes
        (``prefix_cache_shares_kv``). Runs after the options are checked and the
        capabilities (and so the device) are chosen."""
        return False

    def _prefix_cache_budget(self, config: EngineConfig) -> int:
        """The driver's prefix cache budget on this engine (``EngineConfig.prefix_cache_bytes``):
        none without prefix reuse; unset, as many bytes as the slots' KV cache (less what
        the slots hold, on a cache that grows: ``prefix_cache_shares_kv``)."""
        if not self.capabilities.prefix_reuse:
            return 0
        if config.prefix_cache_bytes is not None:
            return config.prefix_cache_bytes
        return self.kv_bytes(config.max_slots * config.max_cache_length)

    # -- memory ----------------------------------------------------------------------------

    def check_memory(self, needs: Mapping[str, int], *, where: str = "host memory",
                     available: int | None | Callable[[], int | None] = None) -> int:
        """Refuse, before allocating, what this engine would allocate and cannot fit
        (:func:`polyengine.memory.check_fits`); ``needs`` maps descriptions to bytes. The
        driver's prefix cache budget (``prefix_cache_bytes``), which lives where the
        engine keeps its prefixes, is counted with them. The advice names only dtypes
        this engine declares (smaller than its own)."""
        from polyengine.memory import check_fits, engine_advice

        budget = getattr(self, "prefix_cache_bytes", 0)
        if budget and not getattr(self, "prefix_cache_shares_kv", False):  # shared: within the KV cache's bytes
            needs = {**needs, "the driver's prefix cache (prefix_cache_bytes; 0 turns it off)": budget}
        own = getattr(self, "dtype", None) or (self.config.dtype if getattr(self, "config", None) else None)
        advice = engine_advice(self.capabilities.dtypes if getattr(self, "capabilities", None) else None, own)
        return check_fits(f"the {self.name} backend", needs, where=where, available=available, advice=advice)

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

    def check_prefill_batch(self, requests: Sequence[PrefillRequest]) -> list[tuple[np.ndarray, SamplingParams, int,
                                                                                  np.ndarray | None]]:
        """What ``prefill_batch`` must refuse before any work: a request list that is not
        a non-empty sequence of :class:`PrefillRequest`, and whatever ``prefill`` refuses
        of any entry (the error's message then names the entry). Returns per entry the
        prompt (int32), the request with a seed, the positions its existing prefix holds
        and its checked first-token mask."""
        if isinstance(requests, (str, bytes, PrefillRequest)) or not isinstance(requests, Sequence) or not requests:
            raise InvalidRequest(f"prefill_batch needs a non-empty sequence of PrefillRequest, got {requests!r:.80}",
                                 field="requests")
        checked = []
        for i, req in enumerate(requests):
            if not isinstance(req, PrefillRequest):
                raise InvalidRequest(f"prefill_batch entry {i} is {type(req).__name__}, not a PrefillRequest",
                                     field="requests")
            try:
                toks, sampling, start = self.check_prefill(req.tokens, req.sampling, req.existing_prefix)
                mask = self.check_token_mask(req.token_mask, sampling)
            except (InvalidRequest, UnsupportedFeature) as exc:
                exc.args = (f"prefill_batch entry {i}: {exc.args[0] if exc.args else exc}", *exc.args[1:])
                raise
            checked.append((toks, sampling, start, mask))
        return checked

    def check_embed(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """What ``embed`` must refuse before work: the capability undeclared, a bad
        prompt (as prefill refuses it). Returns the prompt as int32."""
        if not self.capabilities.embeddings:
            raise UnsupportedFeature("embeddings (embed: a prompt's hidden states)", self.name,
                                     "pick a backend that declares capability 'embeddings' (reference, cpu, cuda_torch)")
        return check_prompt(tokens, max_prefill_length=self.max_prefill_length, vocab_size=self.vocab_size)

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

    def check_portable_tail(self, portable: "PortablePrefix", existing_prefix: Prefix) -> tuple[np.ndarray, SamplingParams]:
        """What ``import_prefix_tail`` must refuse before any work (InvalidRequest): a
        portable prefix ``check_portable`` refuses (a tail allowed); an existing prefix
        this engine did not make (``check_prefix``) or holding fewer than the tail's
        ``start`` positions; a head whose prompt ids differ from the portable's first
        ``start`` (the message names the first that differs). Returns the whole prompt
        (int32) and the request with its seed."""
        from polyengine.prefix import PortablePrefix

        if not isinstance(portable, PortablePrefix):
            raise InvalidRequest(f"import_prefix_tail needs a PortablePrefix, got {type(portable).__name__}",
                                 field="prefix")
        c = self.model.config
        portable.check_compatible(
            fingerprint=self.model.fingerprint, num_layers=c.num_hidden_layers,
            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, vocab_size=c.vocab_size, allow_tail=True,
        )
        self.check_prefix(existing_prefix)
        start, held = portable.start, existing_prefix.true_length
        if start > held:
            raise InvalidRequest(f"the portable prefix's tail starts at position {start} but the existing prefix holds "
                                 f"only {held} positions; import onto a prefix of at least {start} tokens (or ask the "
                                 f"sender for a tail from {held})", field="existing_prefix")
        head = np.asarray(existing_prefix.prompt_tokens)[:start]
        want = portable.prompt_tokens[:start]
        if not np.array_equal(head, want):
            at = int(np.argmax(head != want))
            raise InvalidRequest(f"the existing prefix's prompt differs from the portable prefix's head at token {at} "
                                 f"({int(head[at])} vs {int(want[at])}): its K/V are another prompt's; import onto a "
                                 f"prefix of the same first {start} tokens", field="existing_prefix")
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

    def check_token_mask(self, token_mask: Any, sampling: SamplingParams, *, step: int = 0,
                         what: str = "token_mask") -> np.ndarray | None:
        """One allowed-token mask (prefill's, for the first token; ``step`` 0) as ``(W,)``
        int32 words, None for none. Refuses, before any work: masks on an engine that does
        not declare ``token_masks`` (UnsupportedFeature); a mask that is not
        ``ceil(vocab_size / 32)`` int32/uint32 words or allows no token, or whose allowed
        tokens are all masked by ``min_tokens``/``ignore_eos`` at ``step``
        (InvalidRequest)."""
        if token_mask is None:
            return None
        if not self.capabilities.token_masks:
            raise UnsupportedFeature("allowed-token masks (token_masks)", self.name,
                                     "pick a backend that declares Capabilities.token_masks")
        words = check_mask(token_mask, self.vocab_size, what)
        if sampling is not None and not allows_any(words, self.vocab_size, step_masked_ids(sampling, step, self.eos_token_ids)):
            raise InvalidRequest(
                f"{what} allows only EOS or stop token ids, which min_tokens/ignore_eos mask at completion position "
                f"{step}: every token would be masked; allow another token, lower min_tokens or drop ignore_eos")
        return words

    def check_token_masks(
        self, token_masks: Mapping[int, Any] | None, last_result: Callable[[int], tuple[int, int] | None], *,
        forced: Mapping[int, tuple[int, int]] | None = None, sampling_of: Callable[[int], Any] | None = None,
    ) -> SlotMasks | None:
        """Validate ``generate``'s ``token_masks`` before any work; None when there are none.

        ``last_result`` is as for :meth:`check_overrides` (None: an empty slot, refused);
        ``forced`` the checked overrides (an override at position ``p`` makes the masked
        token completion position ``p + 1``); ``sampling_of(slot)`` the slot's request,
        for the ``min_tokens``/``ignore_eos`` check (see :meth:`check_token_mask`)."""
        if not token_masks:
            return None
        if not self.capabilities.token_masks:
            raise UnsupportedFeature("allowed-token masks (token_masks)", self.name,
                                     "pick a backend that declares Capabilities.token_masks")
        n = self.max_concurrent_decodes
        words, masked = full_mask(self.vocab_size, n), np.zeros(n, bool)
        for slot, mask in dict(token_masks).items():
            if not is_int(slot):
                raise InvalidRequest(f"token_masks keys must be slot indices (ints), got {slot!r}")
            slot = self.check_slot(slot)
            info = last_result(slot)
            if info is None:
                raise InvalidRequest(f"token mask for slot {slot}, which is empty")
            step = forced[slot][1] + 1 if forced and slot in forced else info[0]
            sampling = sampling_of(slot) if sampling_of is not None else None
            words[slot] = self.check_token_mask(mask, sampling, step=step, what=f"token mask for slot {slot}")
            masked[slot] = True
        return SlotMasks(words, masked)

    @staticmethod
    def _bad_override_slot(slot: object) -> int:
        raise InvalidRequest(f"override keys must be slot indices (ints), got {slot!r}")

    # -- the slot flow ----------------------------------------------------------------------

    def _settle(self, decode_state: Any) -> Any:
        """Hook: wait for work in flight that a host change of the state must follow (a
        step on a worker thread); returns the state. Default: nothing to wait for."""
        return decode_state

    def _install(self, prefix: Prefix, state: Any, slots: list[int], *, draw: bool) -> ResultTokens | None:
        """Hook: put ``prefix`` into ``slots`` (checked: distinct, empty, in range): its
        K/V, and sample ``i`` of the request (its parameters and stream) into
        ``slots[i]``. With ``draw`` (``bulk_insert``) each slot draws its own first token
        (sample index ``i``, step 0) and the tokens come back as one row per slot, in the
        order of ``slots`` (:meth:`ResultTokens.first_tokens`); without (``insert``,
        one slot) the slot takes ``prefix.first_token``. Never touches ``state.slots``."""
        raise NotImplementedError(f"{type(self).__name__} uses the kit's insert: implement _install")

    def _release(self, state: Any, slot: int) -> None:
        """Hook: forget what the engine keeps for an occupied slot that is being freed
        (its sampler row); default nothing."""

    def insert(self, prefix: Prefix, decode_state: Any, slot: int) -> Any:
        state = self._settle(decode_state)
        self.check_prefix(prefix).require_logits("insert")
        slot = self.check_empty_slot(slot, state.slots.is_occupied)
        self._install(prefix, state, [slot], draw=False)
        state.slots.put(slot, self.slot_type(prefix.true_length, sampling=prefix.sampling))
        return state

    def bulk_insert(
        self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int]
    ) -> tuple[DecodeState, ResultTokens]:
        if not self.capabilities.bulk_insert:
            raise UnsupportedFeature("bulk_insert", self.name)
        state = self._settle(decode_state)
        self.check_prefix(prefix).require_logits("bulk_insert")
        slots = self.check_bulk_slots(slots, state.slots.is_occupied)
        result = self._install(prefix, state, slots, draw=True)
        for slot in slots:
            state.slots.put(slot, self.slot_type(prefix.true_length, sampling=prefix.sampling))
        return state, result

    def free_resource(self, decode_state: Any, slot: int) -> Any:
        slot = self.check_slot(slot)
        state = self._settle(decode_state)
        if state.slots.is_occupied(slot):
            self._release(state, slot)
            state.slots.free(slot)
        return state

    # -- batched prefill (capability batched_prefill) -----------------------------------

    def prefill_batch(self, *, params: Any, requests: Sequence[PrefillRequest]) -> list[tuple[Prefix, ResultTokens]]:
        """Each entry as its own ``prefill`` call, after every entry is checked (so a refused
        entry prefills nothing): what an engine without ``batched_prefill`` gives. An engine
        that declares the capability overrides this with one forward over the entries."""
        checked = self.check_prefill_batch(requests)
        return [self.prefill(params=params, tokens=toks, sampling=sampling, existing_prefix=req.existing_prefix,
                             **({"token_mask": mask} if mask is not None else {}))
                for req, (toks, sampling, _, mask) in zip(requests, checked)]

    # -- the mixed step (capability mixed_step) ---------------------------------------------

    def generate_with_prefill(self, params: Any, decode_state: DecodeState, *, requests: Sequence[PrefillRequest],
                              overrides: Mapping[int, int | Override] | None = None,
                              token_masks: Mapping[int, np.ndarray] | None = None) -> tuple[DecodeState, ResultTokens, Future]:
        """``prefill_batch`` and then ``generate`` (capability ``mixed_step``; docs/design.md,
        "The mixed step"): here the two calls themselves, the prefixes in a finished Future.
        An engine declares the capability where it overrides this to compute the entries'
        rows inside the step's forward (docs/design.md names which); undeclared, UnsupportedFeature."""
        if not self.capabilities.mixed_step:
            raise UnsupportedFeature("generate_with_prefill (capability mixed_step)", self.name,
                                     "call prefill_batch and then generate; the driver does so on engines without "
                                     "Capabilities.mixed_step")
        return self._prefill_then_generate(params, decode_state, requests, overrides, token_masks)

    def _prefill_then_generate(self, params: Any, decode_state: DecodeState, requests: Sequence[PrefillRequest],
                               overrides: Any, token_masks: Any) -> tuple[DecodeState, ResultTokens, Future]:
        """The two calls in turn; a step refused after the prefill gives the new prefixes' pages
        back (they are no one's yet), so the refused call changes nothing."""
        out = self.prefill_batch(params=params, requests=requests)
        try:
            state, result = self.generate(params, decode_state, overrides=overrides,
                                          **({"token_masks": token_masks} if token_masks is not None else {}))
        except BaseException:
            for prefix, _ in out:
                if isinstance(prefix.kv, PageList):
                    prefix.kv.release()
            raise
        done: Future = Future()
        done.set_result(out)
        return state, result, done

    # -- the prefill lane (capability prefill_lane) -----------------------------------------

    _lane_last: threading.Event | None = None  # set when the lane's latest prefill ends (the next waits)

    def start_prefill(self, *, params: Any, tokens: Sequence[int] | np.ndarray, sampling: SamplingParams,
                      existing_prefix: Prefix | None = None, token_mask: np.ndarray | None = None) -> Future:
        """``prefill`` beside the steps (capability ``prefill_lane``): a Future of its
        ``(Prefix, ResultTokens)``, computed by :meth:`_lane_prefill` on a thread of its own
        (one prefill at a time, in the order started) while the caller goes on with
        ``generate`` and the rest. Each prefill's thread ends with it, so whatever it
        started ends too (an OpenMP runtime's thread team: kept, the process would count
        more threads than cores and the steps' team would sleep between parallel regions;
        measured 6% slower batch-1 steps after a lane kept its thread). It runs at a lower
        priority where the OS has one per thread (nice 10 on Linux; the threads it starts
        inherit it), so where both want a core the caller's threads win. An engine
        declaring the capability makes its ``prefill`` safe beside its other calls
        (docs/design.md, "The prefill lane")."""
        if not self.capabilities.prefill_lane:
            raise UnsupportedFeature("a prefill beside the decode steps (start_prefill)", self.name,
                                     "call prefill between steps; the driver does so on engines without "
                                     "Capabilities.prefill_lane")
        keywords = dict(params=params, tokens=tokens, sampling=sampling, existing_prefix=existing_prefix)
        if token_mask is not None:
            keywords["token_mask"] = token_mask
        future: Future = Future()
        before, ended = self._lane_last, threading.Event()
        self._lane_last = ended  # an event holds no result: a finished prefix is the caller's alone

        def run() -> None:
            try:
                if before is not None:
                    before.wait()
                _lower_priority()
                _LANE.active = True
                if not future.set_running_or_notify_cancel():
                    return
                future.set_result(self._lane_prefill(keywords))
            except BaseException as exc:  # the caller's future carries it
                future.set_exception(exc)
            finally:
                ended.set()

        threading.Thread(target=run, name=f"{self.name}-prefill", daemon=True).start()
        return future

    def _lane_prefill(self, keywords: dict[str, Any]) -> tuple[Prefix, ResultTokens]:
        """The lane's work, on its thread: ``prefill`` (a backend may wrap it)."""
        return self.prefill(**keywords)

    # -- prefix truncation (capability prefix_truncate) -------------------------------------

    def truncate_prefix(self, *, params: Any, prefix: Prefix, length: int) -> Prefix:
        """A prefix of ``prefix``'s first ``length`` tokens, as ``prefill`` of them with
        ``prefix.sampling`` would make it. The kit's way works on any engine with
        ``portable_prefix`` and ``prefix_reuse``: the first ``length - 1`` positions'
        K/V (:meth:`_prefix_head`), continued by the last token, whose prefill gives the
        logits and first token a prefix of ``length`` tokens has (a cut prefix keeps no
        logits of its inner positions). A paged engine overrides :meth:`_prefix_head` to
        share pages instead of copying."""
        if not self.capabilities.prefix_truncate:
            raise UnsupportedFeature("prefix truncation (truncate_prefix)", self.name,
                                     "pick a backend that declares Capabilities.prefix_truncate")
        length = self._check_cut(prefix, length, "truncate_prefix")
        if length == prefix.true_length:
            return prefix
        head = self._prefix_head(prefix, length - 1) if length > 1 else None
        out, _ = self.prefill(params=params, tokens=prefix.prompt_tokens[length - 1: length], sampling=prefix.sampling,
                              existing_prefix=head)
        return out

    # Whether _prefix_head shares the prefix's storage (its pages, device arrays or views)
    # instead of the kit's copy through the host, which needs the prefix's logits to
    # export it: prefix_head is offered, and the driver cuts with it, only then.
    shares_prefix_heads = False

    def prefix_head(self, *, params: Any, prefix: Prefix, length: int) -> Prefix:
        """A prefix of ``prefix``'s first ``length`` tokens that is only to be continued
        (``prefill(existing_prefix=...)``, or cut again): its K/V are ``prefix``'s first
        positions, shared where the engine can (:meth:`_prefix_head`: the same pages or
        device arrays), and no forward runs, so it has no logits or first token of its
        own: ``logits`` None, ``first_token`` -1, and ``insert``, ``bulk_insert``,
        ``host_logits`` and ``export_prefix`` refuse it. What the driver's prefix cache
        files where two prompts part, so the request that parts continues straight from
        the shared positions (docs/prefix-caching.md). Capability ``prefix_truncate``, on
        an engine whose heads share storage (``shares_prefix_heads``)."""
        if not self.capabilities.prefix_truncate or not self.shares_prefix_heads:
            raise UnsupportedFeature("prefix heads (prefix_head)", self.name,
                                     "it needs Capabilities.prefix_truncate and a head that shares the prefix's "
                                     "storage (shares_prefix_heads); truncate_prefix cuts a prefix with logits")
        length = self._check_cut(prefix, length, "prefix_head")
        head = prefix if length == prefix.true_length else self._prefix_head(prefix, length)
        return replace(head, logits=None, first_token=-1, token_mask=None)

    def _check_cut(self, prefix: Prefix, length: Any, method: str) -> int:
        """truncate_prefix's and prefix_head's checks before any work: this engine's prefix
        and a length of 1 to its tokens (InvalidRequest naming ``method``)."""
        self.check_prefix(prefix)
        if not is_int(length) or not 1 <= length <= prefix.true_length:
            raise InvalidRequest(f"{method} length must be an integer in 1..{prefix.true_length} (the "
                                 f"prefix's tokens), got {length!r}", field="length")
        return int(length)

    def _prefix_head(self, prefix: Prefix, length: int) -> Prefix:
        """A prefix holding ``prefix``'s first ``length`` positions, only to be continued
        at once (its logits and first token are ``prefix``'s, not its own): exported,
        cut and imported again, a copy through the host."""
        from polyengine.prefix import PortablePrefix

        whole = self.export_prefix(prefix)
        return self.import_prefix(PortablePrefix(
            k=whole.k[:, :, :length], v=whole.v[:, :, :length], prompt_tokens=whole.prompt_tokens[:length],
            last_logits=whole.last_logits, sampling=whole.sampling, model_fingerprint=whole.model_fingerprint,
        ))

    # -- portable prefix tails (capability portable_prefix_tail) ---------------------------

    def import_prefix_tail(self, portable: "PortablePrefix", *, existing_prefix: Prefix) -> Prefix:
        """The whole prefix ``portable`` (a tail from position ``portable.start``) stands
        for, its first ``start`` positions taken from ``existing_prefix`` (this engine's,
        of at least ``start`` tokens, the same first ``start`` prompt ids; checked by
        :meth:`check_portable_tail` before any work). The kit's way works on any engine
        with ``portable_prefix``: the existing prefix exported, its first ``start``
        positions joined to the tail, the whole imported (a copy through float32 host
        arrays). A paged engine shares the head's pages instead: :attr:`_import_onto_pages`."""
        if not self.capabilities.portable_prefix_tail:
            raise UnsupportedFeature("portable prefix tails (import_prefix_tail)", self.name,
                                     "pick a backend that declares Capabilities.portable_prefix_tail, or import the "
                                     "whole prefix (import_prefix)")
        self.check_portable_tail(portable, existing_prefix)
        return self._import_tail(portable, existing_prefix)

    # Hook: a paged engine's import of a checked tail onto ``existing_prefix``, its pages below
    # the tail's start shared (a partly filled last one copied when the tail's first position
    # is written) and only the tail's positions written. None: the kit's copy, paged or not.
    _import_onto_pages: Callable[["PortablePrefix", Prefix], Prefix] | None = None

    def _import_tail(self, portable: "PortablePrefix", existing_prefix: Prefix) -> Prefix:
        """Hook: :meth:`import_prefix_tail` after its checks. Default: onto the held pages
        where the engine keeps pages and has :attr:`_import_onto_pages`, else through the host."""
        if self.pages is not None and self._import_onto_pages is not None:
            return self._import_onto_pages(portable, existing_prefix)
        if not portable.start:
            return self.import_prefix(portable)
        head = self.export_prefix(existing_prefix)
        s = portable.start
        return self.import_prefix(portable.joined(head.k[:, :, :s], head.v[:, :, :s]))

    # -- pages (capability page_size): what the conformance suite reads --------------------

    # The engine's page pool (polyengine.pages.PagePool) when it keeps K/V in pages.
    pages: Any = None

    def prefix_pages(self, prefix: Prefix) -> Any:
        """The :class:`~polyengine.pages.PageList` holding a prefix's K/V (a paged engine's)."""
        raise UnsupportedFeature("pages (prefix_pages)", self.name, "only an engine that declares page_size has pages")

    def slot_pages(self, decode_state: Any, slot: int) -> Any:
        """The :class:`~polyengine.pages.PageList` of an occupied slot, None for an empty one
        (a paged engine's)."""
        raise UnsupportedFeature("pages (slot_pages)", self.name, "only an engine that declares page_size has pages")

    # -- optional methods: undeclared ------------------------------------------------------

    def export_prefix(self, prefix: Prefix) -> "PortablePrefix":
        raise UnsupportedFeature("export_prefix (portable prefixes)", self.name)

    def import_prefix(self, portable: "PortablePrefix") -> Prefix:
        raise UnsupportedFeature("import_prefix (portable prefixes)", self.name)

    def embed(self, *, params: Any, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        self.check_embed(tokens)  # an engine that declares the capability overrides this method
        raise UnsupportedFeature("embeddings (embed)", self.name, "the engine declares the capability but has no embed")


def _lower_priority() -> None:
    """The calling thread yields to the others where both want a core: nice 10 where the
    OS sets it per thread (Linux), nothing elsewhere (the prefill lane's thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


_LANE = threading.local()  # .active: the calling thread runs a prefill lane's work


def on_lane() -> bool:
    """Whether the calling thread runs a prefill lane's work (EngineBase.start_prefill)."""
    return getattr(_LANE, "active", False)
