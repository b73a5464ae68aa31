"""The reference sampler: NumPy float64, the semantics every backend reproduces.

It turns one step's logits ``(B, V)`` plus each row's request state into one token per
row, with the raw model log-probs the request may report. It knows nothing about
slots, caches or stop conditions: the engine keeps a :class:`RowState` per slot and
the driver decides when a row is finished. Backends implement the same steps on the
device and are compared against this module by the conformance suite.

The order of the steps is stated once, in :data:`SAMPLING_ORDER` (the conformance
suite quotes it in its messages; docs/design.md explains it); each step is a function of
:data:`PIPELINE` with its rule in its body, then :func:`draw_token` draws. Two choices
worth knowing: ``min_tokens`` masks the request's ``stop_token_ids`` as well as the EOS
ids (as vLLM does: either would end the completion early), ``ignore_eos`` the EOS ids
only; and the draw is a pure function of the logits and the row's position in its own
stream (:mod:`.threefry`), so it does not depend on the slot, the batch or the hardware.

Reported log-probs are the raw model's (log-softmax of the logits before step 1), so
they compare across backends and do not change with the sampling parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from polyengine.errors import InvalidRequest, NumericalError
from polyengine.results import NONFINITE_TOKEN
from polyengine.sampling.masks import unpack_mask
from polyengine.sampling.params import SamplingParams
from polyengine.sampling.threefry import gumbel

__all__ = [
    "RowState", "SampleOutput", "sample", "process_logits", "filtered_probs", "raw_logprobs", "draw_scores", "draw_token",
    "PIPELINE", "SAMPLING_ORDER",
]


def _token_array(x: object, what: str) -> np.ndarray:
    arr = np.asarray(x).reshape(-1)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequest(f"{what} must be integer token ids, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


@dataclass
class RowState:
    """What the sampler needs to know about one row besides its logits.

    ``step`` counts completion tokens before the one being sampled, forced tokens
    included (it addresses the random stream and gates ``min_tokens``).
    ``params.seed`` must already be resolved (``SamplingParams.with_seed``).
    ``token_mask`` is the allowed-token mask of this step (packed int32 words,
    :mod:`.masks`), or None for none; it belongs to one step, not to the request.
    """

    params: SamplingParams
    sample_index: int = 0
    step: int = 0
    prompt_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    completion_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    token_mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.prompt_tokens = _token_array(self.prompt_tokens, "prompt_tokens")
        self.completion_tokens = _token_array(self.completion_tokens, "completion_tokens")


@dataclass
class SampleOutput:
    """One sampled token per row and the raw model log-probs to report."""

    tokens: np.ndarray  # (B,) int32
    logprobs: np.ndarray  # (B,) float32, raw log-prob of the chosen token
    top_ids: np.ndarray  # (B, n) int32, -1 where a row asked for fewer
    top_logprobs: np.ndarray  # (B, n) float32, -inf where a row asked for fewer


def raw_logprobs(logits: np.ndarray) -> np.ndarray:
    """Log-softmax along the last axis in float64 (the log-probs a request reports)."""
    x = np.asarray(logits, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    # A row that is -inf everywhere has no distribution; shifting by 0 keeps it -inf
    # instead of producing NaN from -inf - -inf.
    m = np.where(np.isfinite(m), m, 0.0)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def _top_ids(values: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest values, largest first, ties to the lower id. O(V)."""
    v = values.shape[0]
    if k >= v:
        # A stable sort of ids in ascending order is exactly "ties to the lower id".
        return np.argsort(-values, kind="stable")
    kth = np.partition(values, v - k)[v - k]  # the k-th largest value
    above = np.flatnonzero(values > kth)
    # Fill with the lowest ids among those equal to the k-th value: that is the tie rule.
    ties = np.flatnonzero(values == kth)[: k - above.size]
    ids = np.sort(np.concatenate([above, ties]))
    return ids[np.argsort(-values[ids], kind="stable")]


def _check_ids(ids: np.ndarray, vocab: int, what: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        bad = ids[(ids < 0) | (ids >= vocab)][0]
        raise InvalidRequest(f"{what} holds token id {int(bad)}, outside the vocabulary [0, {vocab})")


def _renormalise(logp: np.ndarray, keep: np.ndarray) -> np.ndarray:
    out = np.full_like(logp, -np.inf)
    kept = logp[keep]
    m = kept.max()
    out[keep] = kept - (m + np.log(np.sum(np.exp(kept - m))))
    return out


def _top_p_keep(logp: np.ndarray, top_p: float) -> np.ndarray:
    """Mask of the smallest highest-first prefix whose probability sums to >= top_p."""
    alive = int(np.count_nonzero(logp > -np.inf))
    # Sorting the whole vocabulary costs ~5 ms at V=50k while the nucleus is usually a
    # few hundred tokens: sort growing candidate sets until one reaches top_p. The
    # candidates are the global order's first m entries, so the cumulative sums (and
    # the kept set) are bit-identical to a full sort's.
    m = min(256, alive)
    while True:
        order = _top_ids(logp, m)  # highest first, ties lower id first
        cum = np.cumsum(np.exp(logp[order]))
        if cum[-1] >= top_p or m == alive:
            break
        m = min(4 * m, alive)
    # Rounding can leave the total just under top_p; then every live token is kept.
    n_keep = min(int(np.searchsorted(cum, top_p, side="left")) + 1, order.size)
    keep = np.zeros(logp.shape[0], dtype=bool)
    keep[order[:n_keep]] = True
    return keep


# -- the steps, in order ---------------------------------------------------------------------
# Each takes the row's float64 logits as the step before left them and returns the next
# state. ``PIPELINE`` lists them; :data:`SAMPLING_ORDER` is the one written statement
# of the order, quoted by the conformance suite's messages.


def apply_token_mask(x: np.ndarray, row: RowState, eos_token_ids: Sequence[int]) -> np.ndarray:
    if row.token_mask is not None:
        x[~unpack_mask(row.token_mask, x.shape[0])] = -np.inf
    return x


def apply_logit_bias(x: np.ndarray, row: RowState, eos_token_ids: Sequence[int]) -> np.ndarray:
    p = row.params
    if p.logit_bias:
        ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias))
        _check_ids(ids, x.shape[0], "logit_bias")
        x[ids] += np.fromiter(p.logit_bias.values(), dtype=np.float64, count=len(p.logit_bias))
    return x


def apply_eos_masks(x: np.ndarray, row: RowState, eos_token_ids: Sequence[int]) -> np.ndarray:
    p = row.params
    masked = []
    if row.step < p.min_tokens:
        masked += [("eos_token_ids", eos_token_ids), ("stop_token_ids", p.stop_token_ids)]
    elif p.ignore_eos:
        masked.append(("eos_token_ids", eos_token_ids))
    for what, ids in masked:
        ids = np.asarray(tuple(ids), dtype=np.int64)
        _check_ids(ids, x.shape[0], what)
        x[ids] = -np.inf
    return x


def apply_repetition_penalty(x: np.ndarray, row: RowState, eos_token_ids: Sequence[int]) -> np.ndarray:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.concatenate([row.prompt_tokens, row.completion_tokens]))
        _check_ids(seen, x.shape[0], "prompt and completion tokens")
        s = x[seen]
        x[seen] = np.where(s > 0, s / p.repetition_penalty, s * p.repetition_penalty)
    return x


def apply_presence_frequency(x: np.ndarray, row: RowState, eos_token_ids: Sequence[int]) -> np.ndarray:
    p = row.params
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and row.completion_tokens.size:
        _check_ids(row.completion_tokens, x.shape[0], "completion tokens")
        counts = np.bincount(row.completion_tokens, minlength=x.shape[0]).astype(np.float64)
        x -= p.presence_penalty * (counts > 0) + p.frequency_penalty * counts
    return x


def apply_temperature(x: np.ndarray, row: RowState, eos_token_ids: Sequence[int]) -> np.ndarray:
    """Greedy rows keep their logits (the draw takes the argmax); others become the
    log-softmax of ``logits / temperature``."""
    if np.isnan(x).any():
        # NaN compares false with everything: left alone it would look like "every token
        # masked" and be blamed on min_tokens.
        raise NumericalError(
            f"the model's logits are NaN for {int(np.isnan(x).sum())} of {x.shape[0]} tokens at this step: an "
            "overflow in the backend's arithmetic or non-finite weights, not the sampling parameters; try a wider dtype"
        )
    if not np.any(x > -np.inf):
        raise InvalidRequest(
            "every token is masked at this step (the allowed-token mask, and min_tokens/ignore_eos masking the "
            "EOS and stop token ids, leave nothing); lower min_tokens, drop ignore_eos or allow more tokens"
        )
    t = row.params.temperature
    if t == 0.0:
        return x
    # Shift by the max before dividing: log-softmax does not change, and a tiny
    # temperature then sends the others to -inf instead of making inf - inf = NaN.
    finite = x[np.isfinite(x)]
    with np.errstate(over="ignore"):
        return raw_logprobs((x - (finite.max() if finite.size else 0.0)) / t)


def apply_top_k(x: np.ndarray, row: RowState, eos_token_ids: Sequence[int]) -> np.ndarray:
    k = row.params.top_k
    if row.params.temperature == 0.0 or not 0 < k < x.shape[0]:
        return x
    keep = np.zeros(x.shape[0], dtype=bool)
    keep[_top_ids(x, k)] = True
    return _renormalise(x, keep & (x > -np.inf))


def apply_top_p(x: np.ndarray, row: RowState, eos_token_ids: Sequence[int]) -> np.ndarray:
    if row.params.temperature == 0.0 or row.params.top_p >= 1.0:
        return x
    return _renormalise(x, _top_p_keep(x, row.params.top_p))


def apply_min_p(x: np.ndarray, row: RowState, eos_token_ids: Sequence[int]) -> np.ndarray:
    if row.params.temperature == 0.0 or row.params.min_p <= 0.0:
        return x
    probs = np.exp(x)
    return _renormalise(x, probs >= row.params.min_p * probs.max())


Step = Callable[[np.ndarray, RowState, Sequence[int]], np.ndarray]
PIPELINE: tuple[tuple[str, Step], ...] = (
    ("token_mask", apply_token_mask),
    ("logit_bias", apply_logit_bias),
    ("eos_masks", apply_eos_masks),
    ("repetition_penalty", apply_repetition_penalty),
    ("presence_frequency", apply_presence_frequency),
    ("temperature", apply_temperature),
    ("top_k", apply_top_k),
    ("top_p", apply_top_p),
    ("min_p", apply_min_p),
)

SAMPLING_ORDER = (
    "1. tokens outside the step's allowed-token mask set to -inf; logit_bias added; EOS ids and the request's stop_token_ids masked while "
    "step < min_tokens, EOS ids always with ignore_eos; "
    "2. repetition_penalty over the set of prompt and completion tokens (positive logits divided, negative "
    "multiplied), then presence/frequency penalties over the completion's token counts; "
    "3. temperature 0: argmax, ties to the lowest id, done; else divide by the temperature and take the "
    "log-softmax; "
    "4. top_k (ties to the lower id), then top_p (smallest highest-first set with mass >= top_p), then min_p "
    "(p >= min_p * p_max), each renormalised; "
    "5. Gumbel-max draw: argmax of logp + g, g = -log(-log(u)), u from Threefry-2x32 keyed by the seed and "
    "counted by (token id, step + 2^20 * sample index), ties to the lowest id"
)


def process_logits(
    logits_row: np.ndarray, row: RowState, eos_token_ids: Sequence[int], *, pipeline: Sequence[tuple[str, Step]] = PIPELINE
) -> np.ndarray:
    """Steps 1-4 for one row, float64 ``(V,)``.

    For ``temperature > 0``: the filtered, renormalised log-probs the draw uses, ``-inf``
    for removed tokens. For ``temperature == 0``: the logits after steps 1-2, whose
    argmax (ties to the lowest id) is the greedy token. ``pipeline`` replaces the steps
    (the conformance suite builds realistic misimplementations from it).
    """
    x = np.array(logits_row, dtype=np.float64).reshape(-1)  # (V,), a copy the steps may change
    for _, step in pipeline:
        x = step(x, row, eos_token_ids)
    return x


def filtered_probs(logits_row: np.ndarray, row: RowState, eos_token_ids: Sequence[int], **kw) -> np.ndarray:
    """The exact distribution :func:`sample` draws from for this row (float64, sums to 1).

    One-hot at the greedy token for ``temperature == 0``.
    """
    x = process_logits(logits_row, row, eos_token_ids, **kw)
    if row.params.temperature == 0.0:
        out = np.zeros_like(x)
        out[int(np.argmax(x))] = 1.0
        return out
    probs = np.exp(x)
    return probs / probs.sum()


def draw_token(x: np.ndarray, row: RowState) -> int:
    """Step 5: the token, argmax of :func:`draw_scores`, ties to the lowest id (NumPy's
    first maximum)."""
    return int(np.argmax(draw_scores(x, row)))


def draw_scores(x: np.ndarray, row: RowState) -> np.ndarray:
    """Step 5's scores: ``x`` itself for greedy, else ``x`` plus the row's Gumbel noise.
    The token is their argmax, ties to the lowest id (NumPy's first maximum)."""
    p = row.params
    if p.temperature == 0.0:
        return x
    if p.seed is None:
        raise InvalidRequest(
            "the row's sampling parameters have no seed: resolve it with "
            "SamplingParams.with_seed() when the request is admitted"
        )
    return x + gumbel(p.seed, np.arange(x.shape[0]), row.step, row.sample_index)


def sample(
    logits: np.ndarray, rows: Sequence[RowState], eos_token_ids: Sequence[int], *,
    pipeline: Sequence[tuple[str, Step]] = PIPELINE,
    draw: Callable[[np.ndarray, RowState], int] = draw_token,
) -> SampleOutput:
    """Draw one token per row of ``logits`` ``(B, V)`` with that row's parameters.

    A row whose logits hold NaN or +inf gets ``NONFINITE_TOKEN`` (and a NaN log-prob)
    instead of a draw. Returns the tokens, their raw model log-probs and, for rows asking
    ``top_logprobs``, the highest raw log-probs (descending, ties to the lower id);
    ``n`` is the largest ``top_logprobs`` among the rows, shorter rows padded.
    ``pipeline`` and ``draw`` replace steps 1-4 and step 5 (the conformance suite builds
    realistic misimplementations from them; everything else uses the defaults).
    """
    logits = np.asarray(logits)
    if logits.ndim != 2:
        raise InvalidRequest(f"logits must be (batch, vocab), got shape {logits.shape}")
    if logits.shape[0] != len(rows):
        raise InvalidRequest(f"logits have {logits.shape[0]} rows but {len(rows)} row states were given")
    batch = logits.shape[0]
    n_top = max((r.params.top_logprobs for r in rows), default=0)

    tokens = np.zeros(batch, dtype=np.int32)
    logprobs = np.zeros(batch, dtype=np.float32)
    top_ids = np.full((batch, n_top), -1, dtype=np.int32)
    top_lp = np.full((batch, n_top), -np.inf, dtype=np.float32)
    for b, row in enumerate(rows):
        if np.isnan(logits[b]).any() or np.isposinf(logits[b]).any():
            # Nothing to draw from: the driver fails this request alone with NumericalError.
            tokens[b], logprobs[b] = NONFINITE_TOKEN, np.nan
            continue
        tok = draw(process_logits(logits[b], row, eos_token_ids, pipeline=pipeline), row)
        raw = raw_logprobs(logits[b])  # (V,)
        tokens[b] = tok
        logprobs[b] = raw[tok]
        k = row.params.top_logprobs
        if k:
            ids = _top_ids(raw, min(k, raw.shape[0]))
            top_ids[b, : ids.size] = ids
            top_lp[b, : ids.size] = raw[ids]
    return SampleOutput(tokens=tokens, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_lp)
