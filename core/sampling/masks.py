"""Allowed-token masks: the packed bitmask a grammar hands the sampler for one step.

A mask says which token ids a slot may produce at its next position: bit ``j`` of
word ``w`` allows token ``32 * w + j`` (little-endian within each 32-bit word, the
layout llguidance, xgrammar and vLLM fill), ``ceil(V / 32)`` words per slot, int32 (or
uint32, the same bits). Bits past the vocabulary in the last word mean nothing. A
disallowed token's logit is ``-inf`` from sampling step 1 on, before the penalties,
the temperature and the filters (``docs/design.md``, "Sampling").

This module is the host side, in NumPy: checking a mask someone passed
(:func:`check_mask`), unpacking and packing it, and whether it leaves a token once
step 1's own masks (``min_tokens``, ``ignore_eos``) are applied (:func:`allows_any`).
Device samplers unpack the words on the device the same way (shift, and 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from polyengine.errors import InvalidRequest
from polyengine.sampling.params import SamplingParams

__all__ = ["SlotMasks", "mask_words", "check_mask", "unpack_mask", "pack_mask", "full_mask", "allows_any", "step_masked_ids"]

_BITS = np.arange(32, dtype=np.int32)


@dataclass(frozen=True)
class SlotMasks:
    """One ``generate`` call's masks, checked, in the dense form a device step takes:
    ``words`` ``(slots, W)`` int32 (rows of unmasked slots allow every token) and
    ``masked`` ``(slots,)`` bool (which slots were given a mask: they yield exactly one
    token this step)."""

    words: np.ndarray
    masked: np.ndarray

    @property
    def slots(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.masked)]


def mask_words(vocab_size: int) -> int:
    """Words of one slot's mask: ``ceil(vocab_size / 32)``."""
    return (int(vocab_size) + 31) // 32


def full_mask(vocab_size: int, rows: int | None = None) -> np.ndarray:
    """A mask allowing every token (every bit set): ``(W,)``, or ``(rows, W)``."""
    shape = (mask_words(vocab_size),) if rows is None else (rows, mask_words(vocab_size))
    return np.full(shape, -1, np.int32)


def unpack_mask(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """``(..., W)`` words as ``(..., vocab_size)`` bools: True where the token is allowed."""
    w = np.asarray(words).astype(np.int32, copy=False)
    bits = (w[..., :, None] >> _BITS) & 1  # (..., W, 32); arithmetic shift, bit 31 included
    return bits.reshape(*w.shape[:-1], -1)[..., :vocab_size].astype(bool)


def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """``(..., V)`` bools as ``(..., ceil(V / 32))`` int32 words (bits past V are 0)."""
    a = np.asarray(allowed, bool)
    v = a.shape[-1]
    padded = np.zeros((*a.shape[:-1], mask_words(v) * 32), bool)
    padded[..., :v] = a
    words = (padded.reshape(*a.shape[:-1], -1, 32).astype(np.uint32) << _BITS.astype(np.uint32)).sum(-1, dtype=np.uint32)
    return words.view(np.int32)


def check_mask(mask: object, vocab_size: int, what: str) -> np.ndarray:
    """A mask as ``(W,)`` int32 words, or InvalidRequest naming ``what`` and the problem:
    not an integer array, the wrong length, or no token allowed."""
    arr = np.asarray(mask)
    w = mask_words(vocab_size)
    if arr.dtype not in (np.int32, np.uint32):
        raise InvalidRequest(f"{what} must be int32 or uint32 words (a packed bitmask), got dtype {arr.dtype}")
    if arr.shape != (w,):
        raise InvalidRequest(
            f"{what} must hold ceil(vocab_size / 32) = {w} words for a vocabulary of {vocab_size}, got shape {arr.shape}")
    arr = arr.view(np.int32)
    if not allows_any(arr, vocab_size):
        raise InvalidRequest(f"{what} allows no token: at least one bit among the first {vocab_size} must be set")
    return arr


def allows_any(words: np.ndarray, vocab_size: int, excluded: Iterable[int] = ()) -> bool:
    """Whether the mask allows a token of the vocabulary outside ``excluded`` (ids)."""
    w = np.array(words, np.int32, copy=True).reshape(-1)
    tail = vocab_size % 32
    if tail:
        w[-1] &= np.int32((1 << tail) - 1)
    ids = np.asarray(list(excluded), np.int64)
    if ids.size:
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        np.bitwise_and.at(w, ids // 32, ~(np.int32(1) << (ids % 32).astype(np.int32)))
    return bool(np.any(w != 0))


def step_masked_ids(params: SamplingParams, step: int, eos_token_ids: Sequence[int]) -> set[int]:
    """The ids sampling step 1 masks for this request at completion position ``step``:
    EOS and the stop ids while ``step < min_tokens``, EOS with ``ignore_eos``."""
    if step < params.min_tokens:
        return {int(t) for t in eos_token_ids} | {int(t) for t in params.stop_token_ids}
    return {int(t) for t in eos_token_ids} if params.ignore_eos else set()
