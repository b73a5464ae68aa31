"""Sampling: request parameters, the counter-based random stream and the reference sampler."""

from polyengine.sampling.params import SamplingParams, StructuredOutput
from polyengine.sampling.sampler import (
    PIPELINE,
    SAMPLING_ORDER,
    RowState,
    SampleOutput,
    draw_scores,
    draw_token,
    filtered_probs,
    process_logits,
    raw_logprobs,
    sample,
)
from polyengine.sampling.threefry import gumbel, threefry2x32, uniforms

__all__ = [
    "SamplingParams",
    "StructuredOutput",
    "RowState",
    "SampleOutput",
    "sample",
    "process_logits",
    "draw_scores",
    "draw_token",
    "PIPELINE",
    "SAMPLING_ORDER",
    "filtered_probs",
    "raw_logprobs",
    "threefry2x32",
    "uniforms",
    "gumbel",
]
