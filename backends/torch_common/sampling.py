"""The core's sampler semantics on a torch device, batched over slots.

:mod:`polyengine.sampling.sampler` is the specification (its docstring gives the order
of the steps); this module computes the same thing for ``B`` rows at once with
per-row parameter tensors, without a host sync. Rows are the engine's: a slot, or a
spare row for padding. The module knows nothing about caches or stop conditions.

API
---
``TorchSampler(vocab_size, num_rows, eos_token_ids, *, device=None, dtype=torch.float32, kernels=None)``
    The stateful wrapper an eager engine uses. Host-side mirrors of the installed
    parameters pick the fast paths (:class:`SamplerFlags`) with no device sync.
    ``kernels`` (:class:`SamplerKernels`): a backend's own computation of the draw from
    float32 rows (float64 inside) and of the random stream's bits (equal to
    :mod:`.threefry`'s; a float64 sampler's noise comes from them); the cpu backend's
    compiled passes; None: torch ops.

    - ``install(row, params, prompt_tokens, *, sample_index=0)``: a request's
      parameters (``params.seed`` resolved), its prompt (for the repetition penalty)
      and its stream position; step 0, no completion tokens yet.
    - ``clear(row)``: back to neutral (greedy, no penalties, no masks).
    - ``sample(logits, rows=None, *, num_top=None, token_mask=None) -> SampleResult``: one
      token per row of ``logits`` (B, V); ``rows`` (B,) maps them to sampler rows (None:
      row b); ``token_mask`` (B, ceil(V/32)) int32 allowed-token words of this step.
    - ``record(tokens, mask=None, rows=None)``: accepted tokens become each row's
      latest completion token (counts, step + 1).
    - ``override(tokens, mask=None, rows=None)``: replace rows' latest completion
      token (a forced token): penalties then count the forced token; step unchanged.
    - ``forget(tokens, mask=None, rows=None)``: undo one ``record`` (the token stops
      counting, step - 1); with ``record`` it rolls a row back over several tokens.
    - ``state`` (:class:`SamplerState`), ``flags`` (:class:`SamplerFlags`).

``sample(state, logits, rows=None, flags=SamplerFlags(), num_top=0, token_mask=None, kernels=None)``,
``record(state, tokens, mask)``, ``override(state, tokens, mask)``, ``forget(state, tokens, mask)``
    The pure functions underneath (state in, state out), for jit/export-style
    backends that keep the state as a pytree.

``record_(state, tokens, mask)``, ``override_(state, tokens, mask)``, ``forget_(state, tokens, mask)``
    The same updates in place, on the state's own tensors: what :class:`TorchSampler`
    runs, so a step allocates no new (R, V) counts (docs/cpu.md, "What it does").

``SampleResult``: ``tokens`` (B,) int64 (``NONFINITE_TOKEN`` for a row whose logits hold
NaN or +inf), ``logprobs`` (B,) raw log-prob of the token,
``top_ids`` (B, n) int64 and ``top_logprobs`` (B, n), descending, ties to the lower id.
Raw log-probs are the log-softmax of the logits before any processing.

Ties go to the lowest token id everywhere (greedy argmax, the top-k boundary, the
top-p order, the Gumbel argmax, top log-probs). ``torch.argmax``/``topk`` promise no
tie order across devices, so this module states it explicitly: argmax as "lowest id
among the maxima", ordering by a *stable* descending sort (documented to keep the
original, i.e. ascending-id, order of equal values).

Precision: the work dtype is the sampler's ``dtype`` (float32 or float64; logits are
cast to it). In float64 the tokens equal the reference's and the log-probs agree to
~1e-15 (only summation order differs). In float32 the penalties, the temperature,
the filters' cumulative sums and the Gumbel noise round; a token can then differ
from the reference's only where two candidates' perturbed scores, or a top-p/min-p
boundary, are within float32 noise of each other (tests/test_torch_sampling.py
states and checks the bound).

Cost (eager, 32 rows x 49152 vocabulary, two CPU cores): the draw's Threefry
stream and Gumbel noise dominate plain sampling; top-p on a row without top-k sorts
the whole vocabulary; ``torch.compile`` of :func:`sample` with fixed flags fuses the
stream into one loop (``benchmarks/scripts/torch_sampler_step.py`` measures all of these).

The caller keeps what cannot be checked on the device: ``step < 2**20`` (the stream's
counter layout), rows given to ``record``/``override`` distinct.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from polyengine.errors import InvalidRequest
from polyengine.results import NONFINITE_TOKEN
from polyengine.sampling.params import SamplingParams
from polyengine.sampling.rows import check_token_ids, request_row

from polyengine.backends.torch_common import threefry
from polyengine.backends.torch_common.transfer import fill_row, to_device

__all__ = ["SamplerState", "SamplerFlags", "SampleResult", "TorchSampler", "SamplerKernels", "sample", "record",
           "override", "forget"]


class SamplerKernels(Protocol):
    """A backend's own computation of parts of :func:`sample` (the cpu backend's
    ``CpuKernels``), for float32 rows on the host."""

    def threefry_bits(self, seed_lo: torch.Tensor, seed_hi: torch.Tensor, ctr_hi: torch.Tensor,
                      vocab: int) -> torch.Tensor:
        """int32 (B, vocab): the first Threefry word of each (row, token id) >> 8, exactly
        as :func:`.threefry.threefry2x32` gives it."""

    def greedy(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 (B,) and bool (B,): :func:`argmax_lowest` of ``x`` exactly, and the rows
        holding NaN or +inf."""

    def gumbel_draw(self, x: torch.Tensor, temperature: torch.Tensor, seed_lo: torch.Tensor, seed_hi: torch.Tensor,
                    ctr_hi: torch.Tensor) -> torch.Tensor:
        """int64 (B,): the draw of plain temperature sampling (no top-k, top-p or min-p):
        argmax of ``(x - max) / T`` plus the stream's Gumbel noise, ties to the lowest id,
        at least as exact as the float32 port's (the core's float64 formula)."""

    def filtered_draw(self, x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor, seed_lo: torch.Tensor, seed_hi: torch.Tensor,
                      ctr_hi: torch.Tensor) -> torch.Tensor:
        """int64 (B,): the draw with top-k, top-p and min-p (per row; 0, 1 and 0 are off),
        the core's steps 3-5 in float64."""

_NEG_INF = float("-inf")


@dataclass
class SamplerState:
    """Per-row sampling parameters and token statistics, all on one device.

    ``R`` rows, vocabulary ``V``; float fields in the sampler's dtype.
    """

    temperature: torch.Tensor  # (R,) 0 = greedy
    top_k: torch.Tensor  # (R,) int64, 0 = off
    top_p: torch.Tensor  # (R,) 1 = off
    min_p: torch.Tensor  # (R,) 0 = off
    repetition: torch.Tensor  # (R,) 1 = off
    presence: torch.Tensor  # (R,)
    frequency: torch.Tensor  # (R,)
    min_tokens: torch.Tensor  # (R,) int64
    ignore_eos: torch.Tensor  # (R,) bool
    seed_lo: torch.Tensor  # (R,) int32 bits of seed mod 2**32 (no int64: JAX runs without x64)
    seed_hi: torch.Tensor  # (R,) int32 bits of seed >> 32
    sample_index: torch.Tensor  # (R,) int64
    step: torch.Tensor  # (R,) int64, completion tokens so far (forced ones included)
    last_token: torch.Tensor  # (R,) int64, latest completion token (valid when step > 0)
    logit_bias: torch.Tensor  # (R, V) dense
    stop_mask: torch.Tensor  # (R, V) bool, the request's stop_token_ids
    prompt_seen: torch.Tensor  # (R, V) bool
    counts: torch.Tensor  # (R, V) int32, completion token counts
    eos_mask: torch.Tensor  # (V,) bool, the model's EOS ids

    @classmethod
    def neutral(cls, num_rows: int, vocab_size: int, eos_token_ids: Sequence[int], *, device=None, dtype=torch.float32) -> "SamplerState":
        """Every row greedy, unpenalised, unmasked, at step 0."""
        r, v = num_rows, vocab_size

        def full(value, dt):
            return torch.full((r,), value, dtype=dt, device=device)

        eos = torch.zeros(v, dtype=torch.bool, device=device)
        if len(eos_token_ids):
            eos[to_device(np.asarray(list(eos_token_ids), np.int64), eos.device)] = True
        i64 = torch.int64
        return cls(
            temperature=full(0.0, dtype), top_k=full(0, i64), top_p=full(1.0, dtype), min_p=full(0.0, dtype),
            repetition=full(1.0, dtype), presence=full(0.0, dtype), frequency=full(0.0, dtype),
            min_tokens=full(0, i64), ignore_eos=full(False, torch.bool),
            seed_lo=full(0, torch.int32), seed_hi=full(0, torch.int32), sample_index=full(0, i64), step=full(0, i64),
            last_token=full(0, i64),
            logit_bias=torch.zeros((r, v), dtype=dtype, device=device),
            stop_mask=torch.zeros((r, v), dtype=torch.bool, device=device),
            prompt_seen=torch.zeros((r, v), dtype=torch.bool, device=device),
            counts=torch.zeros((r, v), dtype=torch.int32, device=device),
            eos_mask=eos,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.temperature.dtype

    @property
    def vocab_size(self) -> int:
        return int(self.eos_mask.shape[0])

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The tensors by field name (a pytree); ``SamplerState(**d)`` rebuilds it."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class SamplerFlags:
    """Which steps can change anything for the rows in a batch (static, hashable).

    A step whose flag is False is skipped: that is exact, since with its parameters
    at their neutral values the step is the identity. The defaults run everything and
    suit any state (a jit-compiled engine can use them and compile once).

    ``candidates`` bounds the sort that top-k/top-p need: when every row that filters
    by top-k or top-p has a top-k, the kept tokens lie among the ``candidates``
    (= the largest top-k) highest, and only those are ordered (an O(V) selection
    instead of sorting the whole vocabulary). ``None`` sorts the whole vocabulary.
    """

    token_mask: bool = True  # an allowed-token mask is given (rows of all ones change nothing)
    greedy: bool = True  # some row has temperature 0
    sampling: bool = True  # some row has temperature > 0 (False: the greedy fast path)
    bias: bool = True  # some row has logit_bias
    eos_mask: bool = True  # some row has min_tokens > 0 or ignore_eos
    min_tokens: bool = True  # some row has min_tokens > 0 (False: EOS masking is ignore_eos's alone)
    repetition: bool = True  # some row has repetition_penalty != 1
    presence_frequency: bool = True  # some row has presence or frequency penalty
    top_k: bool = True
    top_p: bool = True
    min_p: bool = True
    logprobs: bool = True  # some row reports log-probs (else the raw log-softmax is skipped)
    candidates: int | None = None

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab_size: int) -> "SamplerFlags":
        """The flags that cover every request in ``params`` (greedy rows need no filter)."""
        drawn = [p for p in params if p.temperature > 0]
        top_k = [p.top_k for p in drawn if 0 < p.top_k < vocab_size]
        top_p = [p for p in drawn if p.top_p < 1.0]
        bounded = all(0 < p.top_k < vocab_size for p in top_p)
        return cls(
            greedy=len(drawn) < len(params),
            sampling=bool(drawn),
            bias=any(bool(p.logit_bias) for p in params),
            eos_mask=any(p.min_tokens > 0 or p.ignore_eos for p in params),
            min_tokens=any(p.min_tokens > 0 for p in params),
            repetition=any(p.repetition_penalty != 1.0 for p in params),
            presence_frequency=any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params),
            top_k=bool(top_k),
            top_p=bool(top_p),
            min_p=any(p.min_p > 0.0 for p in drawn),
            logprobs=any(p.logprobs for p in params),
            candidates=max(top_k) if top_k and bounded else None,
        )


@dataclass
class SampleResult:
    tokens: torch.Tensor  # (B,) int64
    logprobs: torch.Tensor  # (B,) raw model log-prob of the token
    top_ids: torch.Tensor  # (B, n) int64, descending log-prob, ties to the lower id
    top_logprobs: torch.Tensor  # (B, n)


# -- primitives ---------------------------------------------------------------------------


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """The reference's ``raw_logprobs`` formula: shift by the max (0 for an all -inf
    row, which stays -inf rather than NaN), subtract the log-sum-exp."""
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    z = x - m
    return z - torch.log(torch.exp(z).sum(dim=-1, keepdim=True))


def argmax_lowest(x: torch.Tensor) -> torch.Tensor:
    """Argmax over the last axis, ties to the lowest index (int64, (B,)).

    A row without a maximum (NaN) gives its last index, never an out-of-range id.
    """
    v = x.shape[-1]
    ids = torch.arange(v, device=x.device)
    hit = x == x.amax(dim=-1, keepdim=True)
    return torch.where(hit, ids, v).amin(dim=-1).clamp(max=v - 1)


def top_n(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` largest values per row, descending, ties to the lower id: (ids, values).

    O(V) without a full sort: ``topk`` finds the n-th value; everything above it is in,
    and of the ties at it the lowest ids fill the rest (counted by a running rank).
    """
    b, v = x.shape
    n = min(n, v)
    if n == 0:
        return x.new_zeros((b, 0), dtype=torch.int64), x.new_zeros((b, 0))
    ids = torch.arange(v, device=x.device)
    nth = torch.topk(x, n, dim=-1, sorted=True).values[:, -1:]  # (B, 1)
    above = x > nth
    tie = x == nth
    need = n - above.sum(dim=-1, keepdim=True)
    rank = torch.cumsum(tie.to(torch.int32), dim=-1)  # 1-based rank among the ties
    chosen = above | (tie & (rank <= need))  # exactly n per row
    # Keys V - id are distinct and positive for chosen ids: topk returns them in
    # ascending id order, and a stable descending sort by value keeps that for ties.
    picked = torch.topk(torch.where(chosen, v - ids, 0), n, dim=-1).indices  # (B, n)
    vals = x.gather(-1, picked)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return picked.gather(-1, order), vals.gather(-1, order)


def _renormalise(logp: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Log-probs of the kept tokens renormalised (the reference's formula), -inf elsewhere."""
    kept = torch.where(keep, logp, _NEG_INF)
    m = kept.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    lse = m + torch.log(torch.exp(kept - m).sum(dim=-1, keepdim=True))
    return torch.where(keep, logp - lse, _NEG_INF)


def _rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return t if rows is None else t[rows]


def allowed_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed allowed-token masks (B, W) int32 as (B, vocab_size) bools: bit ``j`` of word
    ``w`` is token ``32 w + j`` (:mod:`polyengine.sampling.masks`)."""
    bits = torch.arange(32, dtype=torch.int32, device=words.device)
    allowed = torch.bitwise_and(torch.bitwise_right_shift(words.to(torch.int32)[:, :, None], bits), 1)  # (B, W, 32)
    return allowed.reshape(words.shape[0], -1)[:, :vocab_size] != 0


# -- the steps, in the specification's order ----------------------------------------------


def penalised_logits(state: SamplerState, logits: torch.Tensor, rows: torch.Tensor | None, flags: SamplerFlags,
                     token_mask: torch.Tensor | None = None, eos_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1-2: the allowed-token mask, logit bias, EOS/stop masking, repetition then
    presence/frequency. ``eos_ids``: the model's EOS ids (int64, on the logits' device),
    for the sparse EOS masking where no row has min_tokens (:func:`_mask_ignored_eos`)."""
    x = logits.to(state.dtype)  # (B, V)
    if flags.token_mask and token_mask is not None:
        x = x.masked_fill(~allowed_tokens(token_mask, x.shape[-1]), _NEG_INF)
    if flags.bias:
        x = x + _rows(state.logit_bias, rows)
    if _sparse_eos(flags, eos_ids):
        x = _mask_ignored_eos(state, x, logits, rows, eos_ids)
    elif flags.eos_mask:
        early = (_rows(state.step, rows) < _rows(state.min_tokens, rows))[:, None]  # (B, 1)
        eos = state.eos_mask[None, :]
        masked = (early & (eos | _rows(state.stop_mask, rows))) | (_rows(state.ignore_eos, rows)[:, None] & eos)
        x = x.masked_fill(masked, _NEG_INF)
    if flags.repetition or flags.presence_frequency:
        counts = _rows(state.counts, rows)  # (B, V)
        if flags.repetition:
            seen = _rows(state.prompt_seen, rows) | (counts > 0)
            rp = _rows(state.repetition, rows)[:, None]
            x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
        if flags.presence_frequency:
            c = counts.to(x.dtype)
            presence = _rows(state.presence, rows)[:, None]
            frequency = _rows(state.frequency, rows)[:, None]
            x = x - (presence * (c > 0).to(x.dtype) + frequency * c)
    return x


def _sparse_eos(flags: SamplerFlags, eos_ids: torch.Tensor | None) -> bool:
    """Whether step 2's EOS masking is the sparse one (:func:`_mask_ignored_eos`): EOS ids
    given, some row ignores EOS, and none has min_tokens (which masks stop ids too)."""
    return eos_ids is not None and flags.eos_mask and not flags.min_tokens


def _mask_ignored_eos(state: SamplerState, x: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor | None,
                      eos_ids: torch.Tensor) -> torch.Tensor:
    """Step 2's EOS masking where no row has min_tokens (so none masks its stop ids): the
    ignore_eos rows' EOS columns become -inf, written into those few columns (of a copy
    where ``x`` is still the logits) instead of a mask over the whole vocabulary. The
    same values as the dense mask, whose early term is then false on every row."""
    if x is logits:
        x = x.clone()
    ignore = _rows(state.ignore_eos, rows)[:, None]  # (B, 1)
    x[:, eos_ids] = torch.where(ignore, _NEG_INF, x[:, eos_ids])
    return x


def filtered_logprobs(state: SamplerState, x: torch.Tensor, rows: torch.Tensor | None, flags: SamplerFlags) -> torch.Tensor:
    """Steps 3-4 for sampling rows: temperature, log-softmax, top-k, top-p, min-p.

    Greedy rows get temperature 1 here (their result is not used). A filter changes
    only the rows where it is active, so inactive rows keep the exact log-softmax.
    """
    v = x.shape[-1]
    temp = _rows(state.temperature, rows)[:, None]  # (B, 1)
    temp = torch.where(temp > 0, temp, torch.ones_like(temp))
    # Shift by the max before dividing (as the reference): a tiny temperature then
    # sends the others to -inf instead of making inf - inf = NaN.
    logp = log_softmax((x - x.amax(dim=-1, keepdim=True)) / temp)  # (B, V)

    if flags.top_k or flags.top_p:
        # The candidates in the order both filters need: descending, ties lower id
        # first. Renormalising keeps the order, so top-p works on the same permutation.
        if flags.candidates is None or flags.candidates >= v:
            sv, si = torch.sort(logp, dim=-1, descending=True, stable=True)  # (B, V)
        else:
            si, sv = top_n(logp, flags.candidates)  # (B, K)
        rank = torch.arange(sv.shape[-1], device=x.device)[None, :]
        k = _rows(state.top_k, rows)[:, None]
        k_on = (k > 0) & (k < v)
        p = _rows(state.top_p, rows)[:, None]
        p_on = p < 1
        if flags.top_k:
            sv = torch.where(k_on, _renormalise(sv, (rank < k) & (sv > _NEG_INF)), sv)
        if flags.top_p:
            cum = torch.cumsum(torch.exp(sv), dim=-1)
            before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)  # exclusive
            # The smallest prefix reaching top_p: a token stays if what precedes it is
            # still short of top_p (so at least one token always stays).
            sv = torch.where(p_on, _renormalise(sv, (before < p) & (sv > _NEG_INF)), sv)
        # Tokens outside the candidates were removed by the row's own top-k.
        filtered = torch.full_like(logp, _NEG_INF).scatter_(-1, si, sv)
        logp = torch.where(k_on | p_on, filtered, logp)

    if flags.min_p:
        mp = _rows(state.min_p, rows)[:, None]
        probs = torch.exp(logp)
        keep = probs >= mp * probs.amax(dim=-1, keepdim=True)
        logp = torch.where(mp > 0, _renormalise(logp, keep), logp)
    return logp


def _draw(state: SamplerState, x: torch.Tensor, rows: torch.Tensor | None, flags: SamplerFlags,
          kernels: SamplerKernels | None) -> torch.Tensor:
    """Steps 3-5 for sampling rows: the filters, then the Gumbel-max draw on the stream."""
    ctr = threefry.counter_hi(_rows(state.step, rows), _rows(state.sample_index, rows))  # (B,)
    lo, hi = _rows(state.seed_lo, rows), _rows(state.seed_hi, rows)
    host = kernels is not None and x.device.type == "cpu"
    if host and x.dtype == torch.float32:  # the kernels' whole draw, in float64
        if not (flags.top_k or flags.top_p or flags.min_p):  # plain temperature
            return kernels.gumbel_draw(x, _rows(state.temperature, rows), lo, hi, ctr)
        return kernels.filtered_draw(x, _rows(state.temperature, rows), _rows(state.top_k, rows), _rows(state.top_p, rows),
                                     _rows(state.min_p, rows), lo, hi, ctr)
    logp = filtered_logprobs(state, x, rows, flags)
    if host:  # a float64 sampler (option sampler_dtype): the stream's bits in one pass, the noise from them
        g = threefry.gumbel_from_bits(kernels.threefry_bits(lo, hi, ctr, x.shape[-1]), dtype=state.dtype)
    else:
        ids = torch.arange(x.shape[-1], device=x.device)[None, :]  # (1, V)
        g = threefry.gumbel(lo[:, None], hi[:, None], ids, ctr[:, None], dtype=state.dtype)
    return argmax_lowest(logp + g)  # removed tokens are -inf: they never win


def _greedy_and_broken(x: torch.Tensor, logits: torch.Tensor, greedy: bool,
                       kernels: SamplerKernels | None,
                       differs_at: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Step 3 for greedy rows (``argmax_lowest(x)``; None where no row is greedy) and the
    rows whose raw logits hold NaN or +inf. Such a row (an overflow in the model's
    arithmetic) has no distribution to draw from: its token becomes NONFINITE_TOKEN,
    which the driver reads as a NumericalError for that request alone (no host sync here:
    the check stays on the device). On the host with kernels, one pass over float32 rows
    does both (the same tokens). ``differs_at``: the only columns where ``x`` may differ
    from the logits (-inf written there: the sparse EOS masking), checked on the logits
    apart instead of a second pass over them."""
    if kernels is not None and logits.device.type == "cpu" and logits.dtype == x.dtype == torch.float32:
        tokens, broken = kernels.greedy(x)
        if x is not logits and differs_at is not None:
            raw = logits[:, differs_at]
            broken = broken | torch.isnan(raw).any(dim=-1) | torch.isposinf(raw).any(dim=-1)
        elif x is not logits:  # a mask, a bias or penalties made x: the check is on the raw logits
            broken = kernels.greedy(logits)[1]
        return (tokens if greedy else None), broken
    broken = torch.isnan(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1)
    return (argmax_lowest(x) if greedy else None), broken


def sample(
    state: SamplerState,
    logits: torch.Tensor,  # (B, V)
    rows: torch.Tensor | None = None,  # (B,) int64 sampler row of each logits row
    flags: SamplerFlags = SamplerFlags(),
    num_top: int = 0,
    token_mask: torch.Tensor | None = None,  # (B, W) int32 allowed-token words of this step
    kernels: SamplerKernels | None = None,
    eos_ids: torch.Tensor | None = None,  # (E,) int64 the model's EOS ids: sparse EOS masking (penalised_logits)
) -> SampleResult:
    """One token per row of ``logits`` with that row's parameters and stream; tokens a
    row's ``token_mask`` leaves out are never drawn."""
    b, v = logits.shape
    if v != state.vocab_size:
        raise ValueError(f"logits have {v} columns but the sampler's vocabulary is {state.vocab_size}")
    # Reported log-probs are the raw model's, before any processing; a full pass over the
    # vocabulary, skipped when no row reports them.
    raw = log_softmax(logits.to(state.dtype)) if flags.logprobs or num_top else None
    x = penalised_logits(state, logits, rows, flags, token_mask, eos_ids)
    # Step 3 for greedy rows; rows not installed are greedy too, but nobody reads them.
    tokens, broken = _greedy_and_broken(x, logits, flags.greedy or not flags.sampling, kernels,
                                        _eos_only(flags, token_mask, eos_ids))
    if flags.sampling:
        drawn = _draw(state, x, rows, flags, kernels)
        tokens = drawn if tokens is None else torch.where(_rows(state.temperature, rows) > 0, drawn, tokens)
    tokens = torch.where(broken, torch.full_like(tokens, NONFINITE_TOKEN), tokens)
    if raw is None:
        zeros = torch.zeros(b, dtype=state.dtype, device=logits.device)
        return SampleResult(tokens=tokens, logprobs=zeros, top_ids=torch.zeros((b, 0), dtype=torch.int64, device=logits.device),
                            top_logprobs=zeros[:, None][:, :0])
    top_ids, top_lp = top_n(raw, num_top)
    return SampleResult(tokens=tokens, logprobs=raw.gather(-1, tokens[:, None])[:, 0], top_ids=top_ids, top_logprobs=top_lp)


def _eos_only(flags: SamplerFlags, token_mask: torch.Tensor | None, eos_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The EOS ids where the sparse EOS masking is the only step that changed the logits
    (so x differs from them in those columns alone), else None."""
    if not _sparse_eos(flags, eos_ids):
        return None
    if (flags.token_mask and token_mask is not None) or flags.bias or flags.repetition or flags.presence_frequency:
        return None
    return eos_ids


def record_(state: SamplerState, tokens: torch.Tensor, mask: torch.Tensor) -> None:
    """:func:`record` in place: the state's own ``counts``, ``step`` and ``last_token``
    change (what :class:`TorchSampler` does each step: no new (R, V) counts a step)."""
    r = torch.arange(tokens.shape[0], device=tokens.device)
    state.counts.index_put_((r, tokens), mask.to(torch.int32), accumulate=True)
    state.step.add_(mask.to(torch.int64))
    state.last_token.copy_(torch.where(mask, tokens, state.last_token))


def override_(state: SamplerState, tokens: torch.Tensor, mask: torch.Tensor) -> None:
    """:func:`override` in place."""
    r = torch.arange(tokens.shape[0], device=tokens.device)
    had = mask & (state.step > 0)
    state.counts.index_put_((r, state.last_token), -had.to(torch.int32), accumulate=True)
    state.counts.index_put_((r, tokens), mask.to(torch.int32), accumulate=True)
    state.step.add_((mask & ~had).to(torch.int64))
    state.last_token.copy_(torch.where(mask, tokens, state.last_token))


def forget_(state: SamplerState, tokens: torch.Tensor, mask: torch.Tensor) -> None:
    """:func:`forget` in place."""
    r = torch.arange(tokens.shape[0], device=tokens.device)
    state.counts.index_put_((r, tokens), -mask.to(torch.int32), accumulate=True)
    state.step.sub_(mask.to(torch.int64))


def _updated(state: SamplerState, update: Callable[[SamplerState, torch.Tensor, torch.Tensor], None],
             tokens: torch.Tensor, mask: torch.Tensor) -> SamplerState:
    """A new state: ``update`` applied to copies of the fields the updates change."""
    out = replace(state, counts=state.counts.clone(), step=state.step.clone(), last_token=state.last_token.clone())
    update(out, tokens, mask)
    return out


def record(state: SamplerState, tokens: torch.Tensor, mask: torch.Tensor) -> SamplerState:
    """Append ``tokens`` (R,) to the completions of the rows where ``mask`` (R,) holds."""
    return _updated(state, record_, tokens, mask)


def override(state: SamplerState, tokens: torch.Tensor, mask: torch.Tensor) -> SamplerState:
    """Replace the latest completion token of the rows where ``mask`` holds.

    The replaced token stops counting and the new one counts; the step is unchanged.
    A row with no completion token yet gets ``tokens`` as its first (step 1), as the
    reference's list replacement does.
    """
    return _updated(state, override_, tokens, mask)


def forget(state: SamplerState, tokens: torch.Tensor, mask: torch.Tensor) -> SamplerState:
    """Undo :func:`record` of ``tokens`` (R,) for the rows where ``mask`` holds: each stops
    counting and the step goes back by one. ``last_token`` is not restored (the caller
    records what the row feeds next). A speculative engine forgets the tokens an
    override discards, newest first, then records the forced token.
    """
    return _updated(state, forget_, tokens, mask)


# -- the stateful wrapper -------------------------------------------------------------------


class TorchSampler:
    """Per-row sampler state on a device plus host mirrors of the parameters.

    The mirrors make the fast paths free: the flags come from the installed requests,
    not from reading device tensors, and cover all of them, so they are valid for any
    subset of rows a call addresses. Rows not installed are neutral (greedy, nothing
    active), so they never turn a path on; their tokens are meaningless.
    """

    def __init__(self, vocab_size: int, num_rows: int, eos_token_ids: Sequence[int], *, device=None, dtype: torch.dtype = torch.float32,
                 kernels: SamplerKernels | None = None):
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"the sampler works in float32 or float64, not {dtype}")
        eos = np.asarray(list(eos_token_ids), dtype=np.int64)
        check_token_ids(eos, vocab_size, "eos_token_ids")
        self.vocab_size = vocab_size
        self.num_rows = num_rows
        self.eos_token_ids = tuple(int(i) for i in eos)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.state = SamplerState.neutral(num_rows, vocab_size, self.eos_token_ids, device=self.device, dtype=dtype)
        # The EOS ids on the device once, for the sparse EOS masking (penalised_logits).
        self.eos_ids = torch.as_tensor(np.unique(eos), dtype=torch.int64).to(self.device)
        self._params: dict[int, SamplingParams] = {}
        self.flags = SamplerFlags.of([], vocab_size)
        self.kernels = kernels

    # -- installing requests --------------------------------------------------------------

    def _check_row(self, row: int) -> int:
        if not 0 <= row < self.num_rows:
            raise InvalidRequest(f"sampler row {row} is outside [0, {self.num_rows})")
        return int(row)

    def install(self, row: int, params: SamplingParams, prompt_tokens: Sequence[int] | np.ndarray, *, sample_index: int = 0) -> None:
        """Put a request in ``row``: its parameters, prompt and stream, at step 0.

        Raises :class:`InvalidRequest` (nothing changed) for a missing seed, ids
        outside the vocabulary, or masks that would leave no token: the core's
        :func:`~polyengine.sampling.rows.request_row` makes the row and every refusal;
        this only moves it to the device (a few non-blocking transfers, not one per field).
        """
        row = self._check_row(row)
        s, dev = self.state, self.device
        r = request_row(params, prompt_tokens, self.vocab_size, self.eos_token_ids, sample_index=sample_index,
                        float_dtype=np.float64 if s.dtype == torch.float64 else np.float32)
        floats = to_device(np.array([r.temperature, r.top_p, r.min_p, r.repetition, r.presence, r.frequency],
                                    np.float64), dev, s.dtype)
        for i, t in enumerate((s.temperature, s.top_p, s.min_p, s.repetition, s.presence, s.frequency)):
            t[row] = floats[i]
        ints = to_device(np.array([r.top_k, r.min_tokens, r.sample_index, 0, 0], np.int64), dev)
        for i, t in enumerate((s.top_k, s.min_tokens, s.sample_index, s.step, s.last_token)):
            t[row] = ints[i]
        words = to_device(np.array([r.seed_lo, r.seed_hi], np.uint32).view(np.int32), dev)
        s.seed_lo[row], s.seed_hi[row] = words[0], words[1]
        fill_row(s.ignore_eos, row, bool(r.ignore_eos))
        s.logit_bias[row] = to_device(r.logit_bias, dev, s.dtype)
        s.stop_mask[row] = to_device(r.stop_mask, dev)
        s.prompt_seen[row] = to_device(r.prompt_seen, dev)
        fill_row(s.counts, row, 0)
        self._params[row] = params
        self.flags = SamplerFlags.of(list(self._params.values()), self.vocab_size)

    def clear(self, row: int) -> None:
        """Return ``row`` to the neutral state (greedy, nothing active)."""
        row = self._check_row(row)
        neutral = SamplerState.neutral(1, self.vocab_size, (), device=self.device, dtype=self.state.dtype)
        for f in fields(SamplerState):
            if f.name != "eos_mask":
                getattr(self.state, f.name)[row] = getattr(neutral, f.name)[0]
        self._params.pop(row, None)
        self.flags = SamplerFlags.of(list(self._params.values()), self.vocab_size)

    def params(self, row: int) -> SamplingParams | None:
        return self._params.get(row)

    @property
    def max_top_logprobs(self) -> int:
        """The largest ``top_logprobs`` among the installed requests."""
        return max((p.top_logprobs for p in self._params.values()), default=0)

    # -- per step -------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, rows: torch.Tensor | None = None, *, num_top: int | None = None,
               token_mask: torch.Tensor | np.ndarray | None = None) -> SampleResult:
        """Sample ``logits`` (B, V); ``num_top`` defaults to :attr:`max_top_logprobs`
        (a static-shape engine passes a fixed value instead); ``token_mask`` (B, W)
        allowed-token words for this step (host or device; None: no mask)."""
        n = self.max_top_logprobs if num_top is None else num_top
        if token_mask is None:
            return sample(self.state, logits, rows, replace(self.flags, token_mask=False), n, kernels=self.kernels,
                          eos_ids=self.eos_ids)
        if isinstance(token_mask, np.ndarray):
            token_mask = torch.from_numpy(np.ascontiguousarray(token_mask, np.int32))
        return sample(self.state, logits, rows, self.flags, n, token_mask.to(logits.device), kernels=self.kernels,
                      eos_ids=self.eos_ids)

    def _full(self, tokens: torch.Tensor, mask: torch.Tensor | None, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, mask)`` over all rows from a batch addressed by ``rows``."""
        tokens = tokens.to(device=self.device, dtype=torch.int64).reshape(-1)
        mask = torch.ones_like(tokens, dtype=torch.bool) if mask is None else mask.to(self.device, torch.bool).reshape(-1)
        if rows is None:
            return tokens, mask
        full_t = torch.zeros(self.num_rows, dtype=torch.int64, device=self.device).index_put((rows,), tokens)
        full_m = torch.zeros(self.num_rows, dtype=torch.bool, device=self.device).index_put((rows,), mask)
        return full_t, full_m

    def record(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> None:
        """Record accepted tokens: ``tokens``/``mask`` per sampler row (R,), or per
        batch row (B,) with ``rows`` (distinct) saying which sampler row each is."""
        t, m = self._full(tokens, mask, rows)
        record_(self.state, t, m)

    def override(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> None:
        """Replace the latest completion token of the masked rows (same addressing as
        :meth:`record`)."""
        t, m = self._full(tokens, mask, rows)
        override_(self.state, t, m)

    def forget(self, tokens: torch.Tensor, mask: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> None:
        """Undo one :meth:`record` of the masked rows (same addressing as :meth:`record`)."""
        t, m = self._full(tokens, mask, rows)
        forget_(self.state, t, m)
