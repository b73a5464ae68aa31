"""What a differential program draws for each call: a seeded generator, seed 0 the simplest.

A program is a list of steps; Hypothesis draws each step as two numbers: which call,
and a seed from which :class:`Draw` makes every argument of that call (prompt, request,
slots, overrides). Few choices per step let Hypothesis' shrinker delete whole steps,
and shrink a step's seed towards 0, whose arguments are the simplest ones: the
lowest option everywhere, a one-token prompt, a greedy request with seed 0. Nothing
here depends on the program's state: an index into a list that grows as the program
runs is drawn from a fixed range and taken modulo the list's length, so a step means
the same whatever the steps before it did.

Allowed-token masks (only where the engine declares ``token_masks``) are drawn after
every other argument of a step, from the same generator, so a step's other arguments
are the same whether or not the engine declares them. A mask is drawn as a
:class:`MaskDraw` (which ids, and whether it must also exclude the token the unmasked
draw would pick); the program fits it to the slot it is for, where it knows that token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from polyengine.sampling import SamplingParams
from polyengine.sampling.masks import mask_words, unpack_mask
from polyengine.sampling.params import ENGINE_FIELDS, MAX_TOP_LOGPROBS

from polyengine.conformance.models import TIE_IDS

__all__ = ["Dims", "Draw", "MaskDraw", "STEPS_PER_GENERATE", "OVERRIDE_REFUSALS", "MASK_DENSITIES",
           "GENERATE_MASK_REFUSALS", "PREFILL_MASK_REFUSALS", "show", "show_mask"]

STEPS_PER_GENERATE = 8  # generate steps one call may run (programs must reach deep into the cache)
# Below these the processed logits overflow any float format (x / 1e-320 is inf): the
# open ends of the two ranges are drawn from here up, everything else over its whole range.
_SMALLEST_TEMPERATURE = 1e-3
_SMALLEST_REPETITION_PENALTY = 1e-3
# A setting of each field other than its neutral value (a request setting an undeclared
# field is refused, whatever the value).
_ACTIVE: dict[str, Any] = {
    "temperature": 0.5, "top_k": 5, "top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.3, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "logit_bias": {0: 1.0}, "min_tokens": 2, "ignore_eos": True,
}
# Overrides the protocol refuses (generate must refuse the whole call, applying none).
OVERRIDE_REFUSALS = ("token = vocab_size", "token -1", "token 3.0", "slot = max_slots", "empty slot",
                     "position after the last", "position before the last result")
# How many ids a drawn mask allows: a single one (a grammar's forced token), a few (an
# enum), about half, all but a few (a grammar that forbids a handful of ids).
MASK_DENSITIES = ("one", "few", "half", "all but a few")
# Masks the protocol refuses (InvalidRequest, before any work). "only ids masked there":
# the mask allows only ids that min_tokens/ignore_eos mask at that completion position.
# "no token allowed" includes, with an odd vocabulary, bits set only past its end.
PREFILL_MASK_REFUSALS = ("wrong length", "wrong dtype", "no token allowed", "only ids masked there")
GENERATE_MASK_REFUSALS = (*PREFILL_MASK_REFUSALS, "empty slot")


@dataclass(frozen=True)
class Dims:
    """What a program may draw for one engine: its limits and what it declares."""

    vocab: int
    slots: int
    max_prefill: int
    max_cache: int
    tokens_per_step: int
    eos: tuple[int, ...]
    declared: frozenset[str]
    max_top_logprobs: int
    bulk_insert: bool
    portable_prefix: bool
    prefix_reuse: bool
    token_masks: bool = False
    prefill_lane: bool = False
    mixed_step: int = 0

    @property
    def undeclared(self) -> tuple[str, ...]:
        return tuple(sorted(ENGINE_FIELDS - self.declared - {"seed"}))

    @property
    def special_tokens(self) -> list[int]:
        """Ids worth a bias or a stop: the vocabulary's ends, the exact-tie ids, the EOS ids."""
        return sorted({0, self.vocab - 1, *TIE_IDS, *self.eos})


@dataclass(frozen=True)
class MaskDraw:
    """An allowed-token mask as drawn, before the program fits it to a slot (see
    ``Program._fit_mask``): the ``allowed`` ids ``(V,)``; ``bite``: also exclude the
    token the unmasked sampler would pick there, so the mask changes the stream; and
    ``spare``, the id to allow (or the first allowed one after it) when nothing the step
    may produce is left (a mask must allow a token that min_tokens/ignore_eos leave)."""

    density: str
    allowed: np.ndarray
    bite: bool
    spare: int


class Draw:
    """The arguments of one call, from a generator seeded by the step's seed (0: the
    simplest arguments: every draw takes its lowest option)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.simple = seed == 0

    def integer(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi] (any width: seeds take 64 bits)."""
        if self.simple:
            return lo
        if hi - lo < 1 << 62:
            return int(self.rng.integers(lo, hi + 1))
        return lo + int(self.rng.integers(0, 1 << 64, dtype=np.uint64)) % (hi - lo + 1)

    def chance(self, p: float) -> bool:
        return False if self.simple else bool(self.rng.random() < p)

    def choice(self, items: Sequence[Any]) -> Any:
        return items[self.integer(0, len(items) - 1)]

    def index(self) -> int:
        """An index into a list that grows as the program runs (take it modulo the length)."""
        return self.integer(0, 1 << 20)

    def uniform(self, lo: float, hi: float) -> float:
        return lo if self.simple else float(self.rng.uniform(lo, hi))

    def log_uniform(self, lo: float, hi: float) -> float:
        return lo if self.simple else float(np.exp(self.rng.uniform(np.log(lo), np.log(hi))))

    def order(self, n: int) -> list[int]:
        """0..n-1 in a random order."""
        return list(range(n)) if self.simple else [int(i) for i in self.rng.permutation(n)]

    def tokens(self, d: Dims, low: int, high: int) -> list[int]:
        """A prompt of low..high valid ids, now and then with repeats (penalties see them)."""
        n = self.integer(low, high)
        pool = [self.integer(0, d.vocab - 1) for _ in range(4)] if self.chance(0.3) else None
        return [self.choice(pool) if pool else self.integer(0, d.vocab - 1) for _ in range(n)]

    def token(self, d: Dims) -> int:
        return self.choice(d.special_tokens) if self.chance(0.5) else self.integer(0, d.vocab - 1)

    def seed(self) -> int:
        """A request's seed anywhere in [0, 2^64): half of them with a high word (a backend
        that keeps only the low 32 bits on some path draws other tokens there), and the
        range's ends."""
        if self.chance(0.1):
            return self.choice([1 << 32, (1 << 63) + 7, (1 << 64) - 1])
        return self.integer(0, (1 << 32) - 1) if self.chance(0.5) else self.integer(1 << 32, (1 << 64) - 1)

    def sampling(self, d: Dims) -> SamplingParams:
        """A request: each declared field left neutral or drawn over its whole range (about
        half of them set, so they combine), sometimes one undeclared field (a refusal)."""
        if self.simple:
            return SamplingParams(temperature=0.0, seed=0)
        values: dict[str, Any] = {}
        set_ = {name: self.chance(0.5) for name in sorted(ENGINE_FIELDS)}
        draws = {
            "temperature": lambda: self.choice([0.0, 0.0, 1.0, self.uniform(_SMALLEST_TEMPERATURE, 2.0),
                                                self.log_uniform(_SMALLEST_TEMPERATURE, 100.0)]),
            "top_k": lambda: self.integer(1, 8) if self.chance(0.5) else self.integer(1, d.vocab + 2),
            "top_p": lambda: self.choice([self.uniform(1e-6, 1.0), self.log_uniform(1e-6, 1.0)]),
            "min_p": lambda: self.choice([self.uniform(0.0, 1.0), self.log_uniform(1e-4, 1.0)]),
            "repetition_penalty": lambda: self.log_uniform(_SMALLEST_REPETITION_PENALTY, 100.0),
            "presence_penalty": lambda: self.uniform(-2.0, 2.0),
            "frequency_penalty": lambda: self.uniform(-2.0, 2.0),
            "logit_bias": lambda: {self.token(d): self.choice([self.uniform(-100.0, 100.0), self.uniform(-3.0, 3.0)])
                                   for _ in range(self.integer(1, 4))},
            "min_tokens": lambda: self.integer(0, 8) if self.chance(0.6) else self.integer(0, 80),
            "ignore_eos": lambda: True,
        }
        for name in sorted(d.declared & set(draws)):
            if set_[name]:
                values[name] = draws[name]()
        undeclared = [n for n in d.undeclared if n in draws or n in ("logprobs", "top_logprobs")]
        if undeclared and self.chance(0.25):
            name = self.choice(undeclared)
            if name in ("logprobs", "top_logprobs"):
                values.update(logprobs=True, top_logprobs=1 if name == "top_logprobs" else 0)
            else:
                values[name] = _ACTIVE[name]
        if "logprobs" in d.declared and "logprobs" not in values and self.chance(0.5):
            values["logprobs"] = True
            if "top_logprobs" in d.declared and self.chance(0.7):
                # one past the declared maximum is a refusal (where the protocol allows asking it)
                values["top_logprobs"] = self.integer(0, min(MAX_TOP_LOGPROBS, d.max_top_logprobs + 1))
        if values.get("min_tokens") or self.chance(0.3):
            values["stop_token_ids"] = tuple(self.token(d) for _ in range(self.integer(1, 2)))
        # n > 1 (for bulk_insert) now and then; past the slots (or without bulk_insert) it is refused
        n = self.integer(2, d.slots + 1) if self.chance(0.15) else 1
        return SamplingParams(**values, n=n, seed=self.seed())

    def mask(self, d: Dims) -> MaskDraw:
        """An allowed-token mask of one of :data:`MASK_DENSITIES` (ids often the special
        ones: the vocabulary's ends, the tie ids, EOS), half of them biting."""
        density = self.choice(MASK_DENSITIES)
        allowed = np.zeros(d.vocab, bool)
        if density == "one":
            allowed[self.token(d)] = True
        elif density == "few":
            allowed[[self.token(d) for _ in range(self.integer(2, 8))]] = True
        elif density == "half":
            allowed = self.rng.random(d.vocab) < 0.5
        else:
            allowed[:] = True
            allowed[[self.token(d) for _ in range(self.integer(1, 4))]] = False
        return MaskDraw(density, allowed, self.chance(0.5), self.integer(0, d.vocab - 1))

    def slot_masks(self, d: Dims) -> dict[int, MaskDraw]:
        """A mask for each slot, or none, half and half (the program keeps those of
        occupied slots with room)."""
        return {s: self.mask(d) for s in range(d.slots) if self.chance(0.5)}

    def step_masks(self, d: Dims, steps: int) -> list[dict[int, MaskDraw]] | None:
        """Per generate step, the slots' masks (most steps some, some none), for two
        calls in five on an engine that declares ``token_masks``; else None."""
        if not (d.token_masks and self.chance(0.4)):
            return None
        return [self.slot_masks(d) if self.chance(0.7) else {} for _ in range(steps)]

    def mask_refusal(self, d: Dims, kinds: Sequence[str], p: float) -> tuple[str, int, int, MaskDraw] | None:
        """With probability ``p`` (on an engine that declares ``token_masks``) a mask the
        protocol refuses: its kind, a variant, an index choosing its slot, and a drawn
        mask to spoil."""
        if not (d.token_masks and self.chance(p)):
            return None
        return self.choice(kinds), self.integer(0, 1), self.index(), self.mask(d)

    def overrides(self, d: Dims) -> tuple[list[tuple[int, int, int, bool]], str | None, int]:
        """Per picked slot (slot, tokens back from the latest, token, bare int), an
        override the protocol refuses (its kind, or None) and an index choosing its slot."""
        picked = self.order(d.slots)[: self.integer(1, d.slots)]
        picks = [(s, self.integer(0, d.tokens_per_step - 1), self.integer(0, d.vocab - 1), self.chance(0.5))
                 for s in picked]
        refusal = self.choice(OVERRIDE_REFUSALS) if self.chance(0.35) else None
        return picks, refusal, self.index()


def show_mask(mask: Any, vocab: int) -> str:
    """A mask as code: ``mask([ids])`` (``polyengine.sampling.masks.pack_mask`` of a
    vocabulary allowing those ids), ``mask(all_but=[ids])``, ``words([...])`` (the int32
    words themselves), or the raw array of a mask the protocol refuses."""
    a = np.asarray(mask)
    if a.dtype != np.int32 or a.shape != (mask_words(vocab),):
        return f"np.array({a.tolist()!r}, np.{a.dtype})"
    allowed = unpack_mask(a, vocab)
    ids, off = np.flatnonzero(allowed).tolist(), np.flatnonzero(~allowed).tolist()
    if not ids:
        return f"words({a.tolist()!r})"
    if len(ids) <= 12:
        return f"mask({ids})"
    if len(off) <= 12:
        return f"mask(all_but={off})"
    return f"words({a.tolist()!r})"


def show(sp: SamplingParams) -> str:
    """A request as code, its non-default fields only."""
    fields = sp.model_dump(exclude_defaults=True)
    fields.setdefault("seed", sp.seed)
    return "SamplingParams(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"
