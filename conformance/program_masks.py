"""Allowed-token masks in differential programs: fitting drawn masks to slots, and the
masks the protocol refuses.

Only on an engine that declares ``token_masks`` (an undeclared capability is checked by
the sampler layer's ``test_token_masks``, not here). A drawn mask
(:class:`~polyengine.conformance.program_draws.MaskDraw`) is fitted to the completion
position it is for (:meth:`MaskCalls._fit_mask`): when it bites it also excludes the
token the reference's sampler would pick there without it, so the stream changes; and
it always leaves a token that ``min_tokens``/``ignore_eos`` do not mask at that
position, so the protocol accepts it. The program then records it in the request's
:class:`~polyengine.conformance.program_checks.SlotTrack` (``masks``, by completion
position), and the judge compares each token under its mask (the oracle's decision
applies the mask in sampling step 1, as the rule says) and checks that a masked-out
token never comes back and that a masked slot yields one token in its step.

Refusals (:data:`~polyengine.conformance.program_draws.GENERATE_MASK_REFUSALS`): the
wrong length or dtype, no token allowed, a mask for an empty slot, or only ids that
``min_tokens``/``ignore_eos`` mask at that position. A refused ``generate`` carries
good masks (and overrides) beside the bad one, none of which may be applied. The mirror
receives the bad mask alone: its slots hold one token each (it never generates), and a
refusal of any of these kinds there does not depend on how far the slot got (the ids
``min_tokens`` masks at position 1 include those it masks at any later position).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from polyengine.engine import Override
from polyengine.sampling import RowState, SamplingParams
from polyengine.sampling.masks import mask_words, pack_mask, step_masked_ids

from polyengine.conformance.oracle import decide
from polyengine.conformance.program_draws import MaskDraw, show_mask

__all__ = ["MaskCalls"]


class MaskCalls:
    """The mask half of a program (mixed into ``programs.Program``): expects its
    ``run``, ``d``, ``slots``, ``state``/``mstate`` and its ``_say``/``_both``/
    ``_fail_if_accepted``/``_steps`` helpers."""

    def _fit_mask(self, m: MaskDraw, prompt: Sequence[int], completion: Sequence[int], sampling: SamplingParams,
                  sample_index: int) -> np.ndarray:
        """The drawn mask as int32 words for completion position ``len(completion)`` of
        a request: biting (the unmasked pick excluded) when drawn so, and leaving at
        least one id that step 1's own masks leave."""
        d, run = self.d, self.run
        allowed = np.array(m.allowed, bool)
        position = len(completion)
        pick = None
        if m.bite:
            row = RowState(sampling, sample_index, position, np.array(prompt), np.array(completion, np.int64))
            pick = decide(run.oracle.logits(list(prompt) + list(completion)), row, d.eos).token
            allowed[pick] = False
            run.count("masks excluding the unmasked pick")
        masked = step_masked_ids(sampling, position, d.eos)
        usable = allowed.copy()
        usable[sorted(masked)] = False
        if not usable.any():
            spare = next(t for t in ((m.spare + i) % d.vocab for i in range(d.vocab)) if t not in masked and t != pick)
            allowed[spare] = True
        return pack_mask(allowed)

    def _live_masks(self, plan: dict[int, MaskDraw], completions: dict[int, list[int]] | None = None) -> dict[int, np.ndarray]:
        """The drawn masks of the occupied slots with room, fitted to each slot's next
        position (``completions[slot]``: the slot's completion once this call's override
        is applied)."""
        out = {}
        for s, m in sorted(plan.items()):
            t = self.slots.get(s)
            if t is None or len(t.prompt) + len(t.tokens) >= self.d.max_cache:
                continue  # a full slot yields nothing: whether a mask there counts is not specified
            done = t.tokens if completions is None or s not in completions else completions[s]
            out[s] = self._fit_mask(m, t.prompt, done, t.sampling, t.sample_index)
        return out

    @staticmethod
    def _first_masks(mask: np.ndarray | None) -> dict[int, np.ndarray]:
        """A request's masks when it enters a slot: prefill's, for its first token."""
        return {} if mask is None else {0: mask}

    def _record_masks(self, masks: dict[int, np.ndarray]) -> None:
        """Masks a step was given: each for its slot's next completion position."""
        for s, words in masks.items():
            self.slots[s].masks[len(self.slots[s].tokens)] = words
        if masks:
            self.run.count("generate masks", len(masks))

    @staticmethod
    def _completion_after(tokens: list[int], ov: Any) -> list[int]:
        """A slot's completion once an override is applied (its next token then follows it)."""
        ov = ov if isinstance(ov, Override) else Override(ov)
        position = len(tokens) - 1 if ov.position is None else ov.position
        return [*tokens[:position], int(ov.token)]

    def show_masks(self, masks: dict[int, Any]) -> str:
        return "{" + ", ".join(f"{s}: {show_mask(w, self.d.vocab)}" for s, w in masks.items()) + "}"

    # -- refusals ------------------------------------------------------------------------------

    def _spoil(self, kind: str, variant: int, m: MaskDraw, masked_ids: set[int]) -> np.ndarray:
        """A mask of a refused ``kind`` (see GENERATE_MASK_REFUSALS) made from a drawn one."""
        d = self.d
        allowed = np.array(m.allowed, bool)
        allowed[m.spare] = True
        words = pack_mask(allowed)
        if kind == "wrong length":
            return words[:-1] if variant == 0 else np.append(words, np.int32(-1)).astype(np.int32)
        if kind == "wrong dtype":
            return words.astype(np.int64) if variant == 0 else words.astype(np.float32)
        if kind == "no token allowed":
            words = np.zeros(mask_words(d.vocab), np.int32)
            tail = d.vocab % 32
            if variant == 1 and tail:  # bits past the vocabulary allow nothing
                words[-1] = np.array(~((1 << tail) - 1) & 0xFFFFFFFF, np.uint32).view(np.int32)
            return words
        if kind == "only ids masked there":
            only = np.zeros(d.vocab, bool)
            only[sorted(masked_ids)] = True
            return pack_mask(only)
        return words  # "empty slot": a good mask, for a slot that holds no request

    def _refused_prefill_mask(self, refusal, sampling: SamplingParams) -> tuple[np.ndarray, SamplingParams, str]:
        """A prefill's refused mask, and the request it goes with (for "only ids masked
        there", one whose min_tokens or ignore_eos masks ids at the first position)."""
        kind, variant, _, m = refusal
        if kind == "only ids masked there":
            if "min_tokens" in self.d.declared:
                sampling = sampling.model_copy(update={"min_tokens": 1 + variant})
            elif "ignore_eos" in self.d.declared:
                sampling = sampling.model_copy(update={"ignore_eos": True})
            else:
                kind = "no token allowed"
        return self._spoil(kind, variant, m, step_masked_ids(sampling, 0, self.d.eos)), sampling, kind

    def _refused_generate_masks(self, refusal, plan: dict[int, MaskDraw]) -> None:
        """A generate call the protocol refuses for one mask, beside good masks for the
        other slots: refused with the reference's error type, and nothing applied (the
        steps after it are compared as if it had not been made)."""
        run, d = self.run, self.d
        kind, variant, index, m = refusal
        self._read_pending()
        good = self._live_masks(plan)
        occupied = sorted(self.slots)
        empty = [s for s in range(d.slots) if s not in self.slots]
        masked_ids: set[int] = set()
        if kind == "only ids masked there":
            targets = [(s, ids) for s, t in sorted(self.slots.items())
                       if len(t.prompt) + len(t.tokens) < d.max_cache
                       and (ids := step_masked_ids(t.sampling, len(t.tokens), d.eos))]
            if targets:
                slot, masked_ids = targets[index % len(targets)]
            else:
                kind = "no token allowed"
        if kind == "empty slot" and not empty or kind != "empty slot" and not occupied:
            kind = "no token allowed" if occupied else "empty slot"
        if kind == "empty slot":
            slot = empty[index % len(empty)]
        elif kind != "only ids masked there":
            slot = occupied[index % len(occupied)]
        bad = self._spoil(kind, variant, m, masked_ids)
        masks = {**{s: w for s, w in good.items() if s != slot}, slot: bad}
        at = self._say(f"state, r{len(run.log)} = engine.generate(params, state, token_masks={self.show_masks(masks)})")
        self._both(at, lambda: run.engine.generate(run.params, self.state, token_masks=masks),
                   lambda: run.mirror.generate(run.mirror_params, self.mstate, token_masks={slot: bad}))
        self._fail_if_accepted(at, f"a token mask the protocol refuses ({kind}, for slot {slot})")
        run.count("mask refusals compared")
