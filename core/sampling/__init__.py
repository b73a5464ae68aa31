"""Sampling: request parameters, the counter-based random stream and the reference sampler."""

from polyengine.sampling.params import SamplingParams
from polyengine.sampling.sampler import (
    RowState,
    SampleOutput,
    filtered_probs,
    process_logits,
    raw_logprobs,
    sample,
)
from polyengine.sampling.threefry import gumbel, threefry2x32, uniforms

__all__ = [
    "SamplingParams",
    "RowState",
    "SampleOutput",
    "sample",
    "process_logits",
    "filtered_probs",
    "raw_logprobs",
    "threefry2x32",
    "uniforms",
    "gumbel",
]
