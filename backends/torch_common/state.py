"""What the torch backends' decode states share: slots and the step in flight.

A decode state of a torch engine keeps ``slots`` (one entry per slot, None when free)
and ``pending``: the step queued on the engine's worker thread (the CPU's async mode),
whose results the caller reads later. Before the host touches the state again it waits
for that step; the step's errors surface where its results are read, not here.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

__all__ = ["SlotsInFlight"]


class SlotsInFlight:
    """Mixin for a dataclass decode state with fields ``slots`` and ``pending``."""

    slots: list[Any]
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
        return self.slots[slot] is not None
