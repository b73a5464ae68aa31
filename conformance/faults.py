"""Realistic sampler misimplementations, as the streams they draw.

Each :class:`Fault` is expressed through the reference sampler's own seams: a rewrite
of the request's parameters (a backend with the fault draws exactly what the reference
draws with the rewritten request), replacements of named steps of
:data:`polyengine.sampling.PIPELINE`, a reordering of those steps, or another draw.
The oracle replays a fault's stream (``ReferenceOracle.stream(..., fault=...)``), so
the suite can prove that a check tells the fault apart from correct behaviour (a check
without that power is a suite bug) and can name the fault when a backend draws exactly
its tokens. The project's own broken test backends are built from the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from polyengine.sampling import PIPELINE, SAMPLING_ORDER, RowState, SamplingParams, draw_scores, draw_token
from polyengine.sampling.sampler import Step, _renormalise, _top_p_keep, apply_temperature
from polyengine.sampling.threefry import gumbel

__all__ = ["Fault", "FAULTS", "ORDER"]

ORDER = f"the specified order is: {SAMPLING_ORDER}"


@dataclass(frozen=True)
class Fault:
    message: str
    rewrite: Callable[[SamplingParams], SamplingParams] | None = None
    steps: Mapping[str, Step] = field(default_factory=dict)
    order: Sequence[str] | None = None
    draw: Callable[[np.ndarray, RowState], int] | None = None

    def request(self, sp: SamplingParams) -> SamplingParams:
        return self.rewrite(sp) if self.rewrite is not None else sp

    def pipeline(self) -> tuple[tuple[str, Step], ...]:
        names = self.order or [name for name, _ in PIPELINE]
        base = dict(PIPELINE)
        return tuple((name, self.steps.get(name, base[name])) for name in names)

    def drawer(self) -> Callable[[np.ndarray, RowState], int]:
        return self.draw or draw_token


def _scaled(sp: SamplingParams, names: tuple[str, ...]) -> SamplingParams:
    """``sp`` with these additive terms multiplied by the temperature: the same stream a
    backend that adds them *after* dividing by the temperature draws."""
    t = sp.temperature or 1.0
    update: dict[str, Any] = {}
    for name in names:
        value = getattr(sp, name)
        update[name] = {k: v * t for k, v in value.items()} if isinstance(value, dict) else value * t
    return sp.model_copy(update=update)  # not validated: a scaled penalty may leave the API's range


# -- faulty steps -------------------------------------------------------------------------------


def _bias_skips_zero(x, row, eos):
    for tok, b in row.params.logit_bias.items():
        if tok:  # the classic truthiness bug: id 0 is falsy
            x[tok] += b
    return x


def _masks(x, row, eos, *, eos_ids, stop_under_min, stop_under_ignore):
    p = row.params
    ids: list[int] = []
    if row.step < p.min_tokens:
        ids = list(eos_ids(eos)) + (list(p.stop_token_ids) if stop_under_min else [])
    elif p.ignore_eos:
        ids = list(eos_ids(eos)) + (list(p.stop_token_ids) if stop_under_ignore else [])
    if ids:
        x[np.asarray(ids, np.int64)] = -np.inf
    return x


def _all(eos):
    return eos


def _first(eos):
    return list(eos)[:1]


def _repetition(x, row, eos, *, divide_all=False, completion_only=False):
    p = row.params
    if p.repetition_penalty != 1.0:
        parts = [row.completion_tokens] if completion_only else [row.prompt_tokens, row.completion_tokens]
        seen = np.unique(np.concatenate(parts)).astype(np.int64)
        if seen.size:
            s = x[seen]
            x[seen] = s / p.repetition_penalty if divide_all else np.where(s > 0, s / p.repetition_penalty, s * p.repetition_penalty)
    return x


def _presence_frequency(x, row, eos, *, count_prompt=False, frequency_once=False):
    p = row.params
    toks = np.concatenate([row.prompt_tokens, row.completion_tokens]) if count_prompt else row.completion_tokens
    if (p.presence_penalty or p.frequency_penalty) and toks.size:
        counts = np.bincount(toks.astype(np.int64), minlength=x.shape[0]).astype(np.float64)
        freq = (counts > 0) if frequency_once else counts
        x -= p.presence_penalty * (counts > 0) + p.frequency_penalty * freq
    return x


def _greedy_on_raw(step: Step) -> Step:
    """A greedy fast path that takes the argmax of the raw logits: the step does
    nothing for greedy rows."""
    def faulty(x, row, eos):
        return x if row.params.temperature == 0.0 else step(x, row, eos)
    return faulty


def _top_ids_high_first(values: np.ndarray, k: int) -> np.ndarray:
    """The k largest, ties to the HIGHER id (a descending sort of reversed ids)."""
    order = np.lexsort((-np.arange(values.shape[0]), -values))
    return order[:k]


def _top_k(x, row, eos, *, extra=0, ties_high=False):
    k = row.params.top_k
    if row.params.temperature == 0.0 or not 0 < k < x.shape[0]:
        return x
    keep = np.zeros(x.shape[0], bool)
    ids = _top_ids_high_first(x, k + extra) if ties_high else np.argsort(-x, kind="stable")[: k + extra]
    keep[ids] = True
    return _renormalise(x, keep & (x > -np.inf))


def _top_p(x, row, eos, *, exclusive=False, ties_high=False):
    p = row.params.top_p
    if row.params.temperature == 0.0 or p >= 1.0:
        return x
    if not exclusive and not ties_high:
        return _renormalise(x, _top_p_keep(x, p))
    order = _top_ids_high_first(x, x.shape[0]) if ties_high else np.argsort(-x, kind="stable")
    cum = np.cumsum(np.exp(x[order]))
    # exclusive: only tokens whose running total stays below p (the crossing token is lost)
    n = max(1, int(np.sum(cum < p))) if exclusive else min(int(np.searchsorted(cum, p, side="left")) + 1, order.size)
    keep = np.zeros(x.shape[0], bool)
    keep[order[:n]] = True
    return _renormalise(x, keep)


def _min_p_before_temperature(x, row, eos):
    p = row.params
    if p.temperature == 0.0 or p.min_p <= 0.0:
        return x
    # log-probs after the temperature are (logits / T) + c, so T * (logp - logp_max) is
    # the log of p / p_max before the temperature: the threshold the fault applies.
    finite = x[np.isfinite(x)]
    ratio = np.exp(p.temperature * (x - finite.max()))
    return _renormalise(x, (ratio >= p.min_p) & np.isfinite(x))


def _temperature_ignored(x, row, eos):
    if row.params.temperature == 0.0:
        return apply_temperature(x, row, eos)
    at_one = RowState(row.params.model_copy(update={"temperature": 1.0}), row.sample_index, row.step,
                      row.prompt_tokens, row.completion_tokens)
    return apply_temperature(x, at_one, eos)


def _last_max(x, row) -> int:
    s = draw_scores(x, row)
    return int(s.shape[0] - 1 - np.argmax(s[::-1]))


def _seed_low_word(x, row) -> int:
    p = row.params
    if p.temperature == 0.0:
        return int(np.argmax(x))
    return int(np.argmax(x + gumbel(p.seed & 0xFFFFFFFF, np.arange(x.shape[0]), row.step, row.sample_index)))


_DEFAULT_MASKS = dict(eos_ids=_all, stop_under_min=True, stop_under_ignore=False)


def _masks_with(**kw) -> Step:
    opts = {**_DEFAULT_MASKS, **kw}
    return lambda x, row, eos: _masks(x, row, eos, **opts)


def _step(fn, **kw) -> Step:
    return lambda x, row, eos: fn(x, row, eos, **kw)


_GREEDY_RAW = {name: _greedy_on_raw(fn) for name, fn in PIPELINE[:4]}

# name -> the fault. Each honesty check and sampler setting that names a fault asserts,
# on every run, that the fault's stream or distribution differs from the correct one.
FAULTS: dict[str, Fault] = {
    "bias_after_temperature": Fault(
        "logit_bias is applied after the temperature division (the tokens are exactly those drawn with the bias "
        "multiplied by the temperature); it must be added to the raw logits before the penalties and the temperature",
        rewrite=lambda sp: _scaled(sp, ("logit_bias",)),
    ),
    "penalties_after_temperature": Fault(
        "presence/frequency penalties are applied after the temperature division (the tokens are exactly those "
        "drawn with the penalties multiplied by the temperature); they must be subtracted before dividing",
        rewrite=lambda sp: _scaled(sp, ("presence_penalty", "frequency_penalty")),
    ),
    "min_tokens_off_by_one": Fault(
        "EOS is let through one step early (the tokens are exactly those drawn with min_tokens - 1): EOS and the "
        "stop token ids must be masked while the completion is shorter than min_tokens (step < min_tokens)",
        rewrite=lambda sp: sp.model_copy(update={"min_tokens": max(0, sp.min_tokens - 1)}),
    ),
    "bias_skips_token_zero": Fault(
        "the logit_bias of token id 0 is ignored (a truthiness test on the id?): every id in [0, vocab) takes its bias",
        steps={"logit_bias": _bias_skips_zero},
    ),
    "eos_masks_first_eos_only": Fault(
        "only the first of the model's EOS ids is masked (min_tokens / ignore_eos must mask every id in "
        "eos_token_ids)",
        steps={"eos_masks": _masks_with(eos_ids=_first)},
    ),
    "min_tokens_ignores_stop_ids": Fault(
        "min_tokens masks the EOS ids but not the request's stop_token_ids (both must be masked while "
        "step < min_tokens, or a stop token ends the completion early)",
        steps={"eos_masks": _masks_with(stop_under_min=False)},
    ),
    "ignore_eos_masks_stop_ids": Fault(
        "ignore_eos also masks the request's stop_token_ids (it masks only the EOS ids: the stop tokens the user "
        "asked for keep working)",
        steps={"eos_masks": _masks_with(stop_under_ignore=True)},
    ),
    "repetition_divides_negative": Fault(
        "repetition_penalty divides every seen token's logit, negative ones too (HF semantics: positive logits are "
        "divided by it, negative ones multiplied, so a seen token always becomes less likely)",
        steps={"repetition_penalty": _step(_repetition, divide_all=True)},
    ),
    "repetition_completion_only": Fault(
        "repetition_penalty counts only the completion's tokens (it applies to the set of prompt and completion "
        "tokens)",
        steps={"repetition_penalty": _step(_repetition, completion_only=True)},
    ),
    "presence_counts_prompt": Fault(
        "presence/frequency penalties count the prompt's tokens too (OpenAI semantics: the completion's only)",
        steps={"presence_frequency": _step(_presence_frequency, count_prompt=True)},
    ),
    "frequency_counts_once": Fault(
        "frequency_penalty is applied once per token, like presence (it is multiplied by the token's count in the "
        "completion)",
        steps={"presence_frequency": _step(_presence_frequency, frequency_once=True)},
    ),
    "greedy_ignores_processing": Fault(
        "temperature 0 takes the argmax of the raw logits, skipping logit_bias, masks and penalties (greedy is the "
        "argmax of the processed logits)",
        steps=_GREEDY_RAW,
    ),
    "greedy_ties_to_highest_id": Fault(
        "an exact tie is resolved to the highest token id (ties go to the lowest id)",
        draw=_last_max,
    ),
    "filter_ties_to_highest_id": Fault(
        "top_k/top_p resolve exact ties to the higher token id (they keep the lower id first)",
        steps={"top_k": _step(_top_k, ties_high=True), "top_p": _step(_top_p, ties_high=True)},
    ),
    "top_k_keeps_one_more": Fault(
        "top_k keeps k + 1 tokens (it keeps exactly k)",
        steps={"top_k": _step(_top_k, extra=1)},
    ),
    "top_p_excludes_crossing_token": Fault(
        "top_p drops the token whose probability carries the running total past top_p (the kept set is the "
        "smallest highest-first set whose mass reaches top_p, that token included)",
        steps={"top_p": _step(_top_p, exclusive=True)},
    ),
    "top_p_before_top_k": Fault(
        "top_p is applied before top_k (top_k first, then top_p on the renormalised distribution)",
        order=("logit_bias", "eos_masks", "repetition_penalty", "presence_frequency", "temperature", "top_p",
               "top_k", "min_p"),
    ),
    "min_p_before_temperature": Fault(
        "min_p compares probabilities before the temperature (it compares p / p_max of the tempered, top-k/top-p "
        "filtered distribution)",
        steps={"min_p": _min_p_before_temperature},
    ),
    "temperature_ignored": Fault(
        "the temperature is ignored (tokens are drawn at temperature 1)",
        steps={"temperature": _temperature_ignored},
    ),
    "seed_low_word_only": Fault(
        "only the low 32 bits of the seed key the stream (the key is (seed mod 2^32, seed >> 32): seeds that differ "
        "above bit 32 must draw different streams)",
        draw=_seed_low_word,
    ),
}
