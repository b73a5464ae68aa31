"""The decode state: the KV cache addressed by seq_id, the slots' sampler, and what the
host knows without reading the device.

Device side (what the graphs read and write): ``k``/``v``
``[layers, slots, kv_heads, cache positions, head_dim]`` (row = seq_id = slot),
``prompt_len`` and ``occupied`` per slot, and the sampler's per-slot state (its
``step`` counts completion tokens and its ``last_token`` is what the slot feeds next).
On Neuron ``k``/``v`` are None: the cache is the NxD program's state on the
NeuronCores (``device``, :class:`~.nxd.DeviceGraphs`), one per engine, so only the
engine's newest decode state may use it (an older one is ``retired``).

Host side (the kit's :class:`~polyengine.slots.SlotTable`): per slot the prompt length,
an upper bound of the completion (a speculation step adds 1..k tokens, and the host
does not read how many before it submits the next step; the bound picks the sequence
bucket), and whether the slot has run a step since insert. The previous step's packed result is kept (a future or a
tensor) so that an override, which must name a position of the slot's last result,
can be checked and rolled back: that reads the result, which the driver has already
read by then (it overrides only in lock step).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from polyengine.engine import ResultLayout, Slot, SlotTable
from polyengine.errors import InvalidRequest

from polyengine.backends.torch_common.sampling import TorchSampler
from polyengine.backends.torch_common.state import SlotsInFlight
from polyengine.backends.neuron.speculation import Acceptance

__all__ = ["NeuronSlot", "NeuronSlots", "LastStep", "NeuronDecodeState"]


@dataclass
class NeuronSlot(Slot):
    """``completion`` is an upper bound (exact after insert and after an override)."""

    fresh: bool = True  # no generate step since insert: the last result is the first token


@dataclass
class LastStep:
    """The previous generate step's packed result, read only when an override needs it."""

    handle: Future | torch.Tensor | np.ndarray
    layout: ResultLayout
    _host: dict | None = None

    def fields(self) -> dict[str, np.ndarray]:
        if self._host is None:
            h = self.handle
            buf = h.result() if isinstance(h, Future) else h
            self._host = self.layout.unpack(np.asarray(buf))
        return self._host


class NeuronSlots(SlotTable[NeuronSlot]):
    """The slot table whose exact counts, after a step, are in that step's result."""

    def __init__(self, num_slots: int):
        super().__init__(num_slots)
        self.last: LastStep | None = None  # the previous generate step's result

    def last_result(self, slot: int) -> tuple[int, int] | None:
        """``(completion length, tokens in the last result)`` of an occupied slot (reads
        the previous step's result unless the slot has not run one)."""
        s = self[slot]
        if s is None:
            return None
        if s.fresh:
            return 1, 1
        f = self.last.fields()
        return int(f["lengths"][slot]), int(f["valid"][slot].sum())

    def last_tokens(self, slot: int) -> list[int]:
        """The tokens of a slot's last result (after a step; not for a fresh slot)."""
        f = self.last.fields()
        return [int(t) for t, ok in zip(f["tokens"][slot], f["valid"][slot]) if ok]


@dataclass
class NeuronDecodeState(SlotsInFlight):
    num_slots: int
    k: torch.Tensor | None  # (layers, slots, kv_heads, cache positions, head_dim); None on Neuron
    v: torch.Tensor | None
    sampler: TorchSampler
    prompt_len: torch.Tensor  # (slots,) int64
    occupied: torch.Tensor  # (slots,) bool
    acceptance: Acceptance
    slots: NeuronSlots
    pending: Future | None = None  # the newest step queued on the worker thread
    device: Any = None  # on Neuron, the program whose state is this decode state's KV cache
    retired: bool = False  # a newer decode state took the device's cache over
    # The block KV layout (option page_size): k/v are None (the engine's block pools hold
    # every slot's K/V) and each slot is a block list (the host's record; its block-table row).
    seqs: list | None = None

    def check_live(self) -> None:
        if self.retired:
            raise InvalidRequest("this decode state was replaced by a newer one from init_decode_state(): on Neuron the "
                                 "KV cache lives on the device, one per engine; use the newest decode state")

    def write_prefix(self, slot: int, prefix) -> None:
        if self.seqs is not None:  # the slot shares the prefix's blocks: nothing is copied
            self.seqs[slot] = prefix.kv.fork(finalize=True)
        elif self.device is None:
            super().write_prefix(slot, prefix)
        else:  # through the program's insert model: the cache never leaves the device
            self.device.insert(*prefix.kv, slot)

    def rollback(self, slot: int, token: int, position: int) -> None:
        """Force ``token`` at completion ``position`` (inside the last result): forget the
        tokens from ``position`` on, newest first, then record ``token``. The cache needs
        no change: positions come from the step count, and the positions past it are
        rewritten before any query reads them."""
        length, _ = self.slots.last_result(slot)
        rows = torch.tensor([slot], dtype=torch.int64)
        if self.slots[slot].fresh:
            dropped = [self.sampler.state.last_token[slot:slot + 1]]
        else:
            tokens = self.slots.last_tokens(slot)
            dropped = [torch.tensor([t], dtype=torch.int64) for t in tokens[len(tokens) - (length - position):]]
        for t in reversed(dropped):
            self.sampler.forget(t, rows=rows)
        self.sampler.record(torch.tensor([token], dtype=torch.int64), rows=rows)
        self.slots[slot].completion = position + 1
