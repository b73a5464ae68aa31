"""The host's mirror of an engine's slots: what can be known without reading the device.

Every engine keeps, per slot, whether it is occupied, how long its prompt is, how many
completion tokens it has and how many of them came in its last result (an override may
replace any of those, see :class:`~polyengine.protocol.Override`). The device may still
be computing a step when the host needs these (async results), so they are counted on
the host as the calls are made, never read back: a one-token-per-step engine knows
them exactly; a speculative engine knows an upper bound until it reads a result and
overrides :meth:`SlotTable.last_result` to read it.

:class:`SlotTable` is sequence-like (``table[i]`` is a :class:`Slot` or None) and gives
``check_overrides`` its input (:meth:`SlotTable.last_result`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Iterator, TypeVar

__all__ = ["Slot", "SlotTable"]


@dataclass
class Slot:
    """An occupied slot: ``prompt_len`` tokens of prompt, ``completion`` tokens of
    completion so far (forced ones included; the first token counts from insert), the
    ``last`` of which came in its last result."""

    prompt_len: int
    completion: int = 1
    last: int = 1

    @property
    def total(self) -> int:
        """Prompt plus completion tokens: what ``max_cache_length`` bounds."""
        return self.prompt_len + self.completion

    @property
    def length(self) -> int:
        """Cache positions filled: the prompt and every completion token but the latest
        (the latest is the slot's next input)."""
        return self.total - 1


S = TypeVar("S", bound=Slot)


class SlotTable(Generic[S]):
    """One entry per slot: a :class:`Slot` (or a subclass with an engine's own fields)
    when occupied, None when free."""

    def __init__(self, num_slots: int):
        self._slots: list[S | None] = [None] * num_slots

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, slot: int) -> S | None:
        return self._slots[slot]

    def __iter__(self) -> Iterator[S | None]:
        return iter(self._slots)

    def is_occupied(self, slot: int) -> bool:
        return self._slots[slot] is not None

    def occupied(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s is not None]

    def free_slots(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s is None]

    def put(self, slot: int, entry: S) -> S:
        self._slots[slot] = entry
        return entry

    def free(self, slot: int) -> bool:
        """Empty ``slot``; whether it was occupied."""
        was = self._slots[slot] is not None
        self._slots[slot] = None
        return was

    def live(self, max_cache_length: int) -> list[int]:
        """Occupied slots with room for another token (prompt + completion below the limit)."""
        return [i for i, s in enumerate(self._slots) if s is not None and s.total < max_cache_length]

    def advance(self, slots: list[int], tokens: int = 1) -> None:
        """The host's count of a step: each of ``slots`` gains ``tokens`` tokens, which are
        its last result."""
        for i in slots:
            s = self._slots[i]
            s.completion += tokens
            s.last = tokens

    def force(self, slot: int, position: int) -> None:
        """An override made completion token ``position`` the slot's latest (the tokens
        after it are dropped); the forced token is its last result."""
        s = self._slots[slot]
        s.completion, s.last = position + 1, 1

    def last_result(self, slot: int) -> tuple[int, int] | None:
        """``(completion tokens, tokens in the last result)`` of an occupied slot, None for
        a free one: the input ``EngineBase.check_overrides`` takes."""
        s = self._slots[slot]
        return None if s is None else (s.completion, s.last)

    def lengths(self) -> list[int]:
        """Each slot's completion tokens (0 for a free slot): a result's ``lengths``."""
        return [0 if s is None else s.completion for s in self._slots]
