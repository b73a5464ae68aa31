"""What the torch backends' decode states share: the KV cache addressed by slot, the
slots' sampler rows, the host's slot table, and the step in flight.

A decode state of a torch engine keeps ``k``/``v`` (``[layers, slots, kv_heads,
positions, head_dim]``, cache row = slot), ``sampler`` (a :class:`TorchSampler` with one
row per slot), ``slots`` (the kit's :class:`~polyengine.slots.SlotTable`) and
``pending``: the step queued on the engine's worker thread (the CPU's async mode),
whose results the caller reads later. Before the host touches the state again it waits
for that step; the step's errors surface where its results are read, not here.

:class:`TorchSlotsEngine` gives an engine on such a state the kit's slot-flow hooks
(``_settle``, ``_install``, ``_release``), so ``insert``, ``bulk_insert`` and
``free_resource`` are the kit's own.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from polyengine.engine import Prefix, ResultTokens
from polyengine.pages import PageList, check_owner
from polyengine.slots import SlotTable

from polyengine.backends.torch_common.sampling import SampleResult, TorchSampler
from polyengine.backends.torch_common.transfer import to_device

__all__ = ["SlotsInFlight", "TorchSlotsEngine", "host_array"]


class SlotsInFlight:
    """Mixin for a dataclass decode state with fields ``k``, ``v``, ``sampler``,
    ``slots`` and ``pending``."""

    k: torch.Tensor
    v: torch.Tensor
    sampler: TorchSampler
    slots: SlotTable
    pending: Future | None

    def wait(self) -> None:
        """Let the step in flight finish (its errors surface when its results are read)."""
        if self.pending is not None:
            try:
                self.pending.result()
            except Exception:
                pass
            self.pending = None

    def is_occupied(self, slot: int) -> bool:
        return self.slots.is_occupied(slot)

    def write_prefix(self, slot: int, prefix: Prefix) -> None:
        """The prefix's K/V into ``slot``'s cache row (a state whose cache lives elsewhere
        overrides this)."""
        n = prefix.true_length
        self.k[:, slot, :, :n], self.v[:, slot, :, :n] = prefix.kv

    @torch.no_grad()
    def install(self, prefix: Prefix, slots: list[int], *, draw: bool) -> tuple[torch.Tensor, SampleResult | None]:
        """Copy the prefix's K/V into each slot's cache row and install sample ``i`` of the
        request in ``slots[i]``'s sampler row; record each slot's first token (drawn from
        the prefix's logits with ``draw``, else ``prefix.first_token``). Returns the first
        tokens ``(len(slots),)`` on the device and, with ``draw``, the sampler's result."""
        for i, slot in enumerate(slots):
            self.write_prefix(slot, prefix)
            self.sampler.install(slot, prefix.sampling, prefix.prompt_tokens, sample_index=i)
        rows = to_device(np.asarray(slots, np.int64), self.sampler.device)
        res = None
        if draw:
            logits = prefix.logits[None].expand(len(slots), -1)
            mask = None if prefix.token_mask is None else np.repeat(prefix.token_mask[None], len(slots), axis=0)
            res = self.sampler.sample(logits, rows, num_top=prefix.sampling.top_logprobs, token_mask=mask)
            first = res.tokens
        else:
            first = torch.full((len(slots),), prefix.first_token, dtype=torch.int64, device=self.sampler.device)
        self.sampler.record(first, rows=rows)
        return first, res


class TorchSlotsEngine:
    """The kit's slot-flow hooks for an ``EngineBase`` whose decode states are
    :class:`SlotsInFlight`: wait for the step in flight, install through the state,
    clear the sampler row on free. ``_installed(state, slots, first)`` is the engine's
    own addition (what else it keeps per slot on the device)."""

    def _settle(self, decode_state: Any) -> Any:
        decode_state.wait()
        return decode_state

    def _install(self, prefix: Prefix, state: Any, slots: list[int], *, draw: bool) -> ResultTokens | None:
        first, res = state.install(prefix, slots, draw=draw)
        self._installed(state, slots, first, prefix)
        if res is None:
            return None
        return ResultTokens.first_tokens(res.tokens, res.logprobs, res.top_ids, res.top_logprobs, to_host=host_array)

    def _installed(self, state: Any, slots: list[int], first: torch.Tensor, prefix: Prefix) -> None:
        """Hook: what the engine keeps per slot besides the cache and the sampler row."""

    def _release(self, state: Any, slot: int) -> None:
        state.sampler.clear(slot)

    # -- pages (option page_size: ``self.pages`` a PagePool, a state's ``seqs`` its slots' PageLists) --

    def check_prefix(self, prefix: Prefix) -> Prefix:
        """The kit's checks, and K/V this engine holds: a paged prefix's pages belong to the
        pool of the engine that made it, which another engine of the same weights must not read."""
        prefix = super().check_prefix(prefix)
        check_owner(self.pages, prefix.kv if isinstance(prefix.kv, PageList) else None, self.name)
        return prefix

    def prefix_pages(self, prefix: Prefix) -> PageList:
        if self.pages is None:
            return super().prefix_pages(prefix)
        return self.check_prefix(prefix).kv

    def slot_pages(self, decode_state: Any, slot: int) -> PageList | None:
        if self.pages is None:
            return super().slot_pages(decode_state, slot)
        decode_state.wait()
        return decode_state.seqs[self.check_slot(slot)]


def host_array(t: Any) -> Any:
    """A tensor (any device, any dtype) or array as a host NumPy array, floats widened
    to float32 (bfloat16 has no NumPy dtype)."""
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.is_floating_point() and t.dtype != torch.float64:
            t = t.float()
        return t.cpu().numpy()
    return np.asarray(t)
