"""The host half of a device sampler: one request as one row of per-slot parameters.

A device sampler (the torch port the torch backends share, the JAX port of tpu_jax) keeps one row of parameter arrays per slot and
installs a request's row at insert. Everything about that row that is not device work
is here, in NumPy, once: the refusals (a request without a seed, token ids outside the
vocabulary, masks that would leave no token at a step, a sample index beyond the
stream's layout), the seed's key words, the dense per-token tables (logit bias, stop
ids, the prompt's tokens for the repetition penalty) and how many bytes a slot's row
costs on the device. A port only moves :func:`request_row`'s arrays to its device.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

from polyengine.errors import InvalidRequest
from polyengine.sampling.params import MAX_SAMPLES, SamplingParams

__all__ = ["SamplerRow", "request_row", "split_seed", "check_token_ids", "row_bytes"]

_MASK32 = (1 << 32) - 1


def split_seed(seed: int) -> tuple[int, int]:
    """A 64-bit seed as its Threefry key words ``(seed mod 2**32, (seed >> 32) mod 2**32)``."""
    seed = int(seed)
    return seed & _MASK32, (seed >> 32) & _MASK32


def check_token_ids(ids: np.ndarray, vocab_size: int, what: str) -> None:
    """InvalidRequest naming ``what`` if any id lies outside ``[0, vocab_size)``."""
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)][0]
        raise InvalidRequest(f"{what} holds token id {int(bad)}, outside the vocabulary [0, {vocab_size})")


@dataclass
class SamplerRow:
    """One request's sampler row at step 0, in NumPy: scalars as 0-d arrays of the
    row's dtypes, per-token tables as ``(V,)`` arrays. Field names are the device
    samplers' state fields (``temperature`` ... ``prompt_seen``); the counts of
    completion tokens, the step and the latest token start at zero and are not here."""

    temperature: np.ndarray  # float; 0 = greedy, a positive value never rounds to 0
    top_k: np.ndarray  # int64; 0 = off
    top_p: np.ndarray  # float; 1 = off
    min_p: np.ndarray  # float; 0 = off
    repetition: np.ndarray  # float; 1 = off
    presence: np.ndarray  # float
    frequency: np.ndarray  # float
    min_tokens: np.ndarray  # int64
    ignore_eos: np.ndarray  # bool
    top_logprobs: np.ndarray  # int64
    seed_lo: np.ndarray  # uint32: seed mod 2**32
    seed_hi: np.ndarray  # uint32: seed >> 32
    sample_index: np.ndarray  # int64
    logit_bias: np.ndarray  # (V,) float, dense
    stop_mask: np.ndarray  # (V,) bool: the request's stop_token_ids
    prompt_seen: np.ndarray  # (V,) bool: the prompt's tokens

    def as_dict(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def request_row(
    params: SamplingParams, prompt_tokens: Sequence[int] | np.ndarray, vocab_size: int, eos_token_ids: Sequence[int],
    *, sample_index: int = 0, float_dtype: np.dtype | type = np.float32,
) -> SamplerRow:
    """One request as a sampler row (sample ``sample_index`` of it), refusing with
    :class:`InvalidRequest`, before any device work, what a device step cannot refuse
    mid-flight: no seed, ids outside the vocabulary, a sample index outside the
    stream's layout, or masks that would leave no token. ``float_dtype`` is the
    sampler's float type: a positive temperature below its smallest normal is raised
    to it, so it still leaves ties to the draw instead of turning the row greedy."""
    v = vocab_size
    if params.seed is None:
        raise InvalidRequest("the request has no seed: resolve it with SamplingParams.with_seed() when it is admitted")
    if not 0 <= sample_index < MAX_SAMPLES:
        raise InvalidRequest(f"sample_index {sample_index} is outside [0, {MAX_SAMPLES})")
    prompt = np.asarray(prompt_tokens, np.int64).reshape(-1)
    bias_ids = np.fromiter(params.logit_bias, np.int64, len(params.logit_bias))
    stop_ids = np.asarray(params.stop_token_ids, np.int64)
    check_token_ids(bias_ids, v, "logit_bias")
    check_token_ids(stop_ids, v, "stop_token_ids")
    check_token_ids(prompt, v, "prompt tokens")
    eos = {int(t) for t in eos_token_ids}
    if (params.min_tokens > 0 and len(eos | set(params.stop_token_ids)) >= v) or (params.ignore_eos and len(eos) >= v):
        raise InvalidRequest(
            "every token is masked at this step (min_tokens/ignore_eos mask the EOS and stop token ids, and "
            "nothing else is left); lower min_tokens or drop ignore_eos"
        )
    fdt = np.dtype(float_dtype)
    lo, hi = split_seed(params.seed)
    temperature = max(params.temperature, float(np.finfo(fdt).tiny)) if params.temperature > 0 else 0.0
    bias = np.zeros(v, np.float64)
    np.add.at(bias, bias_ids, np.fromiter(params.logit_bias.values(), np.float64, len(params.logit_bias)))
    stop = np.zeros(v, bool)
    stop[stop_ids] = True
    seen = np.zeros(v, bool)
    seen[prompt] = True
    f = lambda x: np.asarray(x, fdt)  # noqa: E731
    i = lambda x: np.asarray(x, np.int64)  # noqa: E731
    return SamplerRow(
        temperature=f(temperature), top_k=i(params.top_k), top_p=f(params.top_p), min_p=f(params.min_p),
        repetition=f(params.repetition_penalty), presence=f(params.presence_penalty),
        frequency=f(params.frequency_penalty), min_tokens=i(params.min_tokens),
        ignore_eos=np.asarray(bool(params.ignore_eos)), top_logprobs=i(params.top_logprobs),
        seed_lo=np.asarray(lo, np.uint32), seed_hi=np.asarray(hi, np.uint32), sample_index=i(sample_index),
        logit_bias=bias.astype(fdt), stop_mask=stop, prompt_seen=seen,
    )


def row_bytes(vocab_size: int, float_bytes: int = 4) -> int:
    """Device bytes one slot's sampler row costs, with a decode step's working set:
    the dense tables (logit bias in the float type, stop ids and prompt tokens as
    bools, completion counts as int32) plus about four ``(V,)`` float temporaries a
    step makes per row (processed logits, log-probs, noise, their sum)."""
    return vocab_size * (float_bytes + 1 + 1 + 4 + 4 * float_bytes) + 256
