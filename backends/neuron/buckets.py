"""Buckets: the static shapes the graphs are compiled for, and the bucket of each call.

Three kinds, as NxD has them:

- **prefill** (context encoding): padded prompt lengths. ``EngineConfig.prefill_buckets``,
  else powers of two from 64 below ``max_prefill_length``, then ``max_prefill_length``.
  A prompt that continues a prefix (``existing_prefix``) runs the graph of its pair
  (prefix bucket, prompt bucket), both from this list: every pair with room for one
  more token than the prefix's shortest, within ``max_prefill_length`` (``continuations``).
- **batch** (token generation): how many seq_ids one step runs. Option
  ``batch_buckets``, else ``(max_slots,)``: NxD's one compiled batch size, a partial
  batch padded with unused seq_ids. Smaller buckets save work when few slots are busy.
- **sequence** (token generation): how many cache positions attention reads. Option
  ``seq_buckets``, else the whole cache when it is at most 512 positions, else
  powers of two from 256, then the whole cache.

The cache holds ``max_cache_length + tokens_per_step - 1`` positions per slot: a
speculation pass may write ``tokens_per_step - 1`` positions past the last token a
slot can yield (those tokens are never emitted). Every bucket list must cover the
engine's limits, which is checked at construction; a prompt longer than every prefill
bucket is refused naming the buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyengine.engine import EngineConfig, is_int, power_buckets
from polyengine.errors import ContextLengthExceeded, InvalidRequest

__all__ = ["Buckets"]


def _check(name: str, values: tuple, *, top: int, what: str) -> tuple[int, ...]:
    if not values or not all(is_int(v) for v in values) or list(values) != sorted(set(values)) or values[0] < 1:
        raise InvalidRequest(f"option {name}={values!r} must be ascending positive integers")
    if values[-1] != top:
        raise InvalidRequest(f"option {name}={values!r} must end with {top} ({what})")
    return tuple(int(v) for v in values)


@dataclass(frozen=True)
class Buckets:
    prefill: tuple[int, ...]
    batch: tuple[int, ...]
    seq: tuple[int, ...]
    cache: int  # cache positions per slot
    continuations: tuple[tuple[int, int], ...] = ()  # (prefix bucket, prompt bucket) pairs

    @classmethod
    def plan(cls, config: EngineConfig, *, tokens_per_step: int, batch: tuple = (), seq: tuple = ()) -> "Buckets":
        """The buckets of an engine; options that leave a limit uncovered are refused."""
        cache = config.max_cache_length + tokens_per_step - 1
        prefill = config.prefill_buckets or power_buckets(64, config.max_prefill_length)
        batch = _check("batch_buckets", batch, top=config.max_slots, what="max_slots") if batch else (config.max_slots,)
        if seq:
            seq = _check("seq_buckets", seq, top=cache, what=f"max_cache_length + tokens_per_step - 1 = {cache}")
        else:
            seq = (cache,) if cache <= 512 else power_buckets(256, cache)
        prefill = tuple(prefill)
        # A prefix of true length s sits in the prefill bucket of s (prefixes are kept
        # unpadded); the shortest one a bucket holds is one past the bucket below it.
        shortest = dict(zip(prefill, (1, *(b + 1 for b in prefill[:-1]))))
        limit = config.max_prefill_length
        pairs = tuple((q, p) for q in prefill for p in prefill if shortest[q] + shortest[p] <= limit)
        return cls(prefill, batch, seq, cache, pairs)

    def prompt(self, length: int) -> int:
        """The prefill bucket for a prompt of ``length`` tokens."""
        for b in self.prefill:
            if b >= length:
                return b
        raise ContextLengthExceeded(  # the prompt is longer than this engine takes, as check_prompt says
            f"prompt of {length} tokens fits no context-encoding bucket (buckets: "
            f"{', '.join(map(str, self.prefill))}); shorten it or build the engine with larger prefill_buckets",
            field="prompt",
        )

    def batch_for(self, rows: int) -> int:
        """The batch bucket for ``rows`` occupied slots (never more than the largest)."""
        return next(b for b in self.batch if b >= rows)

    def seq_for(self, positions: int) -> int:
        """The sequence bucket whose attention covers ``positions`` cache positions."""
        return next(b for b in self.seq if b >= positions)

    def describe(self) -> str:
        return (f"prefill {self.prefill}, continuations {self.continuations}, batch {self.batch}, sequence {self.seq}, "
                f"cache {self.cache} positions per slot")
