"""The core's sampler semantics in JAX, batched over slots, for the jitted steps.

:mod:`polyengine.sampling.sampler` is the specification and
``polyengine.backends.torch_common.sampling`` the torch port this mirrors function by
function (``penalised_logits``, ``filtered_logprobs``, ``sample``, ``record``,
``override``), so the two read the same. The random stream is JAX's own
``threefry_2x32`` (``jax.extend.random``) keyed and counted exactly as the core's
(:func:`uniform_bits`; ``tests/test_tpu_jax_sampling.py`` proves the uniforms equal
the core's bit for bit). This module knows nothing about caches, slots or requests'
lifetimes: the steps (:mod:`.steps`) decide which rows are live.

One executable for every mix of requests: parameters are per-row arrays, never static
arguments, and the expensive parts (the Threefry stream and the filters' sort, the
top log-probs) run under ``lax.cond`` on predicates computed from the live rows, so a
greedy batch pays for none of them and nothing recompiles when the mix changes. Rows
that are not live never switch a path on.

Host side: the core's :func:`polyengine.sampling.rows.request_row` makes a request's row
and every refusal (seed, ids in the vocabulary, masks that would leave no token);
:func:`request_row` here puts it in this port's one-row :class:`SamplerState`, which a
step installs into the rows it names (:func:`install`).

Precision: float32 throughout (JAX runs without x64). A token can differ from the
reference's only where two candidates' perturbed scores, or a top-p/min-p boundary,
are within float32 noise (the conformance suite's near-tie allowance). Ties go to the
lowest id everywhere: argmax as "lowest id among the maxima", orders by a stable
descending sort, and ``lax.top_k`` (lower index first among equal values, with -0.0
folded into 0.0 first, since top_k orders the two zeros).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry_2x32

from polyengine.results import NONFINITE_TOKEN
from polyengine.sampling.params import SamplingParams
from polyengine.sampling.rows import request_row as core_row
from polyengine.sampling.rows import split_seed

__all__ = [
    "SamplerState", "SampleResult", "request_row", "neutral_rows", "neutral_state", "sample", "record", "override", "install",
    "uniform_bits", "uniforms", "gumbel_from_bits", "split_seed",
]

_NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclass
class SamplerState:
    """Per-row parameters and token statistics (``R`` rows, vocabulary ``V``)."""

    temperature: jax.Array  # (R,) float32, 0 = greedy
    top_k: jax.Array  # (R,) int32, 0 = off
    top_p: jax.Array  # (R,) float32, 1 = off
    min_p: jax.Array  # (R,) float32, 0 = off
    repetition: jax.Array  # (R,) float32, 1 = off
    presence: jax.Array  # (R,) float32
    frequency: jax.Array  # (R,) float32
    min_tokens: jax.Array  # (R,) int32
    ignore_eos: jax.Array  # (R,) bool
    top_logprobs: jax.Array  # (R,) int32, how many top log-probs the request reports
    seed_lo: jax.Array  # (R,) uint32, seed mod 2**32
    seed_hi: jax.Array  # (R,) uint32, seed >> 32
    sample_index: jax.Array  # (R,) int32
    step: jax.Array  # (R,) int32, completion tokens so far (forced ones included)
    last_token: jax.Array  # (R,) int32, latest completion token (valid when step > 0)
    logit_bias: jax.Array  # (R, V) float32, dense
    stop_mask: jax.Array  # (R, V) bool, the request's stop_token_ids
    prompt_seen: jax.Array  # (R, V) bool
    counts: jax.Array  # (R, V) int32, completion token counts
    eos_mask: jax.Array  # (V,) bool, the model's EOS ids (shared by every row)

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])


# Fields with one entry per row (every field but the shared EOS mask).
ROW_FIELDS = tuple(f.name for f in fields(SamplerState) if f.name != "eos_mask")


@jax.tree_util.register_dataclass
@dataclass
class SampleResult:
    tokens: jax.Array  # (B,) int32
    logprobs: jax.Array  # (B,) float32, raw model log-prob of the token
    top_ids: jax.Array  # (B, n) int32, descending, ties to the lower id
    top_logprobs: jax.Array  # (B, n) float32


# -- host side: requests as rows ---------------------------------------------------------------


def neutral_rows(num_rows: int, vocab_size: int, eos_token_ids: Sequence[int]) -> SamplerState:
    """NumPy rows that are greedy, unpenalised and unmasked, at step 0."""
    r, v = num_rows, vocab_size
    eos = np.zeros(v, bool)
    eos[np.asarray(list(eos_token_ids), np.int64)] = True
    f32 = lambda x: np.full(r, x, np.float32)  # noqa: E731
    i32 = lambda x: np.full(r, x, np.int32)  # noqa: E731
    return SamplerState(
        temperature=f32(0), top_k=i32(0), top_p=f32(1), min_p=f32(0), repetition=f32(1), presence=f32(0),
        frequency=f32(0), min_tokens=i32(0), ignore_eos=np.zeros(r, bool), top_logprobs=i32(0),
        seed_lo=np.zeros(r, np.uint32), seed_hi=np.zeros(r, np.uint32), sample_index=i32(0), step=i32(0),
        last_token=i32(0), logit_bias=np.zeros((r, v), np.float32), stop_mask=np.zeros((r, v), bool),
        prompt_seen=np.zeros((r, v), bool), counts=np.zeros((r, v), np.int32), eos_mask=eos,
    )


def neutral_state(num_rows: int, eos_mask: jax.Array) -> SamplerState:
    """:func:`neutral_rows` built on the device (inside a jitted step: no big constants)."""
    r, v = num_rows, eos_mask.shape[0]
    full = lambda x, dt, shape=(r,): jnp.full(shape, x, dt)  # noqa: E731
    return SamplerState(
        temperature=full(0, jnp.float32), top_k=full(0, jnp.int32), top_p=full(1, jnp.float32),
        min_p=full(0, jnp.float32), repetition=full(1, jnp.float32), presence=full(0, jnp.float32),
        frequency=full(0, jnp.float32), min_tokens=full(0, jnp.int32), ignore_eos=full(False, bool),
        top_logprobs=full(0, jnp.int32), seed_lo=full(0, jnp.uint32), seed_hi=full(0, jnp.uint32),
        sample_index=full(0, jnp.int32), step=full(0, jnp.int32), last_token=full(0, jnp.int32),
        logit_bias=full(0, jnp.float32, (r, v)), stop_mask=full(False, bool, (r, v)),
        prompt_seen=full(False, bool, (r, v)), counts=full(0, jnp.int32, (r, v)), eos_mask=eos_mask,
    )


def request_row(
    params: SamplingParams, prompt_tokens: Sequence[int] | np.ndarray, vocab_size: int, eos_token_ids: Sequence[int]
) -> SamplerState:
    """One request as a one-row NumPy :class:`SamplerState` at step 0 (sample index 0;
    :func:`install` sets each row's own): the core's row
    (:func:`polyengine.sampling.rows.request_row`, which makes every refusal before any
    device work) in this port's dtypes, with zero counts."""
    row = neutral_rows(1, vocab_size, eos_token_ids)
    for name, value in core_row(params, prompt_tokens, vocab_size, eos_token_ids, float_dtype=np.float32).as_dict().items():
        getattr(row, name)[0] = value
    return row


# -- the stream: JAX's threefry_2x32, keyed and counted as the core's --------------------------


def uniform_bits(seed_lo: jax.Array, seed_hi: jax.Array, token_ids: jax.Array, ctr_hi: jax.Array) -> jax.Array:
    """The top 24 bits ``x >> 8`` of Threefry-2x32's first output word, (B, V) uint32.

    Key ``(seed_lo, seed_hi)`` (B,), counter ``(token_id, ctr_hi)`` with ``token_ids``
    (V,) and ``ctr_hi = step + 2**20 * sample_index`` (B,). ``threefry_2x32`` splits its
    count into halves (first words, second words), so each row's count is the ids
    followed by its counter word repeated; its output's first half is the first word.
    """
    v = token_ids.shape[-1]

    def row(lo, hi, ctr):
        count = jnp.concatenate([token_ids.astype(jnp.uint32), jnp.full((v,), ctr, jnp.uint32)])
        return threefry_2x32((lo, hi), count)[:v]

    x = jax.vmap(row)(seed_lo.astype(jnp.uint32), seed_hi.astype(jnp.uint32), ctr_hi.astype(jnp.uint32))
    return x >> 8


def counter_hi(step: jax.Array, sample_index: jax.Array) -> jax.Array:
    """The counter's second word ``step + 2**20 * sample_index`` (below 2**32) as uint32."""
    return step.astype(jnp.uint32) + (sample_index.astype(jnp.uint32) << 20)


def uniforms(seed_lo, seed_hi, token_ids, ctr_hi, dtype=jnp.float32) -> jax.Array:
    """``u = ((x >> 8) + 0.5) * 2**-24`` in ``dtype``: bit-equal to the core's in float64
    (needs x64), the core's value rounded to float32 otherwise."""
    return (uniform_bits(seed_lo, seed_hi, token_ids, ctr_hi).astype(dtype) + 0.5) * 2.0**-24


def gumbel_from_bits(m: jax.Array) -> jax.Array:
    """Gumbel noise ``-log(-log(u))`` for ``u = (m + 0.5) * 2**-24``, float32.

    A float32 ``u`` would round (the largest to exactly 1.0: ``+inf`` noise), so
    ``-log(u)`` comes from float32-exact pieces, as in the torch port:
    ``-log((m + 0.5) * 2**-24)`` below 2**23 and ``-log1p(-(2**24 - 1 - m + 0.5) * 2**-24)``
    above; both arguments need at most 24 significant bits.
    """
    upper = m >= (1 << 23)
    low = -jnp.log((m.astype(jnp.float32) + 0.5) * 2.0**-24)
    high = -jnp.log1p(-(((1 << 24) - 1 - m).astype(jnp.float32) + 0.5) * 2.0**-24)
    return -jnp.log(jnp.where(upper, high, low))


# -- primitives -------------------------------------------------------------------------------


def log_softmax(x: jax.Array) -> jax.Array:
    """The reference's formula: shift by the max (0 for an all -inf row), subtract the LSE."""
    m = x.max(axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    z = x - m
    return z - jnp.log(jnp.exp(z).sum(axis=-1, keepdims=True))


def argmax_lowest(x: jax.Array) -> jax.Array:
    """Argmax over the last axis, ties to the lowest index, (B,) int32 (NaN rows: last id)."""
    v = x.shape[-1]
    ids = jnp.arange(v, dtype=jnp.int32)
    hit = x == x.max(axis=-1, keepdims=True)
    return jnp.minimum(jnp.where(hit, ids, v).min(axis=-1), v - 1)


def top_n(x: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """The ``n`` largest per row, descending, ties to the lower id: (ids int32, values)."""
    # lax.top_k orders -0.0 below 0.0; adding 0.0 turns -0.0 into 0.0.
    values, ids = lax.top_k(x + 0.0, n)
    return ids.astype(jnp.int32), values


def _renormalise(logp: jax.Array, keep: jax.Array) -> jax.Array:
    kept = jnp.where(keep, logp, _NEG_INF)
    m = kept.max(axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = m + jnp.log(jnp.exp(kept - m).sum(axis=-1, keepdims=True))
    return jnp.where(keep, logp - lse, _NEG_INF)


# -- the steps, in the specification's order -----------------------------------------------


def allowed_tokens(words: jax.Array, vocab_size: int) -> jax.Array:
    """Packed allowed-token masks (B, W) int32 as (B, vocab_size) bools: bit ``j`` of word
    ``w`` is token ``32 w + j`` (:mod:`polyengine.sampling.masks`)."""
    bits = jnp.arange(32, dtype=jnp.int32)
    allowed = (jnp.right_shift(words.astype(jnp.int32)[:, :, None], bits) & 1) != 0  # (B, W, 32)
    return allowed.reshape(words.shape[0], -1)[:, :vocab_size]


def penalised_logits(s: SamplerState, logits: jax.Array, token_mask: jax.Array | None = None) -> jax.Array:
    """Steps 1-2: the allowed-token mask, logit bias, EOS/stop masking, repetition then
    presence/frequency.

    Elementwise over (B, V), so always computed: XLA fuses them into one pass (a step
    without masks passes all bits set)."""
    x = logits.astype(jnp.float32)
    if token_mask is not None:
        x = jnp.where(allowed_tokens(token_mask, x.shape[-1]), x, _NEG_INF)
    x = x + s.logit_bias
    early = (s.step < s.min_tokens)[:, None]
    eos = s.eos_mask[None, :]
    masked = (early & (eos | s.stop_mask)) | (s.ignore_eos[:, None] & eos)
    x = jnp.where(masked, _NEG_INF, x)
    seen = s.prompt_seen | (s.counts > 0)
    rp = s.repetition[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rp, x * rp), x)
    c = s.counts.astype(jnp.float32)
    return x - (s.presence[:, None] * (c > 0) + s.frequency[:, None] * c)


def _filter_sorted(s: SamplerState, logp: jax.Array, si: jax.Array, sv: jax.Array) -> jax.Array:
    """top-k then top-p on candidates ``si``/``sv`` (descending, ties lower id first)."""
    v = logp.shape[-1]
    rank = jnp.arange(sv.shape[-1])[None, :]
    k = s.top_k[:, None]
    k_on = (k > 0) & (k < v)
    p = s.top_p[:, None]
    p_on = p < 1
    sv = jnp.where(k_on, _renormalise(sv, (rank < k) & (sv > _NEG_INF)), sv)
    cum = jnp.cumsum(jnp.exp(sv), axis=-1)
    before = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=-1)  # exclusive
    # The smallest prefix reaching top_p: a token stays while what precedes it is short.
    sv = jnp.where(p_on, _renormalise(sv, (before < p) & (sv > _NEG_INF)), sv)
    rows = jnp.arange(logp.shape[0])[:, None]
    # Tokens outside the candidates were removed by the row's own top-k.
    filtered = jnp.full_like(logp, _NEG_INF).at[rows, si].set(sv)
    return jnp.where(k_on | p_on, filtered, logp)


def filtered_logprobs(s: SamplerState, x: jax.Array, drawing: jax.Array, candidates: int) -> jax.Array:
    """Steps 3-4 for drawing rows: temperature, log-softmax, top-k, top-p, min-p.

    ``drawing`` (B,) marks the rows whose result is used. When every drawing row that
    filters by top-k/top-p has ``top_k <= candidates``, only that many candidates are
    ordered (``lax.top_k``); otherwise the whole vocabulary is sorted.
    """
    v = x.shape[-1]
    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    # Shift by the max before dividing: a tiny temperature then sends the others to
    # -inf instead of making inf - inf = NaN (as the reference).
    logp = log_softmax((x - x.max(axis=-1, keepdims=True)) / temp)
    k_on = (s.top_k > 0) & (s.top_k < v)
    filtering = drawing & (k_on | (s.top_p < 1))
    bounded = jnp.all(~filtering | (k_on & (s.top_k <= candidates)))

    def by_candidates(lp):
        si, sv = top_n(lp, min(candidates, v))
        return _filter_sorted(s, lp, si, sv)

    def by_sort(lp):
        si = jnp.argsort(lp, axis=-1, descending=True, stable=True).astype(jnp.int32)
        return _filter_sorted(s, lp, si, jnp.take_along_axis(lp, si, axis=-1))

    logp = lax.cond(
        jnp.any(filtering), lambda lp: lax.cond(bounded, by_candidates, by_sort, lp), lambda lp: lp, logp)
    mp = s.min_p[:, None]
    probs = jnp.exp(logp)
    keep = probs >= mp * probs.max(axis=-1, keepdims=True)
    return jnp.where(mp > 0, _renormalise(logp, keep), logp)


def sample(s: SamplerState, logits: jax.Array, live: jax.Array, *, num_top: int, candidates: int,
           token_mask: jax.Array | None = None) -> SampleResult:
    """One token per row of ``logits`` (B, V) with that row's parameters and stream.

    ``live`` (B,) marks the rows whose tokens are used: only they switch the drawing,
    filtering and top-log-prob paths on. ``num_top`` is the static width of the top
    log-probs (rows that ask fewer read a prefix of it). ``token_mask`` (B, W) int32:
    this step's allowed-token words (an input array, so masks never recompile).
    """
    b, v = logits.shape
    raw = log_softmax(logits.astype(jnp.float32))  # reported log-probs: before any processing
    x = penalised_logits(s, logits, token_mask)
    greedy = argmax_lowest(x)
    drawing = live & (s.temperature > 0)

    def draw(x):
        logp = filtered_logprobs(s, x, drawing, candidates)
        ids = jnp.arange(v, dtype=jnp.uint32)
        g = gumbel_from_bits(uniform_bits(s.seed_lo, s.seed_hi, ids, counter_hi(s.step, s.sample_index)))
        return argmax_lowest(logp + g)  # removed tokens are -inf: they never win

    drawn = lax.cond(jnp.any(drawing), draw, lambda x: greedy, x)
    tokens = jnp.where(s.temperature > 0, drawn, greedy)
    n = min(num_top, v)
    if n == 0:
        top_ids, top_lp = jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32)
    else:
        top_ids, top_lp = lax.cond(
            jnp.any(live & (s.top_logprobs > 0)), lambda r: top_n(r, n),
            lambda r: (jnp.zeros((b, n), jnp.int32), jnp.zeros((b, n), jnp.float32)), raw)
    logprobs = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    # NaN or +inf logits (an overflow in the model): nothing to draw from; the driver
    # reads NONFINITE_TOKEN as a NumericalError of that request alone.
    broken = jnp.isnan(logits).any(axis=-1) | jnp.isposinf(logits).any(axis=-1)
    tokens = jnp.where(broken, jnp.asarray(NONFINITE_TOKEN, tokens.dtype), tokens)
    return SampleResult(tokens=tokens, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_lp)


def record(s: SamplerState, tokens: jax.Array, mask: jax.Array) -> SamplerState:
    """Append ``tokens`` (R,) to the completions of the rows where ``mask`` holds."""
    r = jnp.arange(tokens.shape[0])
    return replace(
        s,
        counts=s.counts.at[r, tokens].add(mask.astype(jnp.int32)),
        step=s.step + mask.astype(jnp.int32),
        last_token=jnp.where(mask, tokens, s.last_token),
    )


def override(s: SamplerState, tokens: jax.Array, mask: jax.Array) -> SamplerState:
    """Replace the latest completion token of the masked rows (a forced token): the
    replaced token stops counting, the new one counts, the step is unchanged (a row
    with no completion token yet gets it as its first, as the reference does)."""
    r = jnp.arange(tokens.shape[0])
    had = mask & (s.step > 0)
    counts = s.counts.at[r, s.last_token].add(-had.astype(jnp.int32))
    counts = counts.at[r, tokens].add(mask.astype(jnp.int32))
    return replace(
        s,
        counts=counts,
        step=s.step + (mask & ~had).astype(jnp.int32),
        last_token=jnp.where(mask, tokens, s.last_token),
    )


def install(s: SamplerState, row: SamplerState, mask: jax.Array, sample_index: jax.Array) -> SamplerState:
    """Put the one-row request ``row`` into every row where ``mask`` (R,) holds, with
    that row's ``sample_index`` (R,), at step 0 with no completion tokens."""
    out = {}
    for name in ROW_FIELDS:
        old, new = getattr(s, name), getattr(row, name)
        m = mask.reshape((-1,) + (1,) * (old.ndim - 1))
        out[name] = jnp.where(m, new, old)
    out["sample_index"] = jnp.where(mask, sample_index, s.sample_index)
    return SamplerState(**out, eos_mask=s.eos_mask)
