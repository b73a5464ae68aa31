"""Sampling: request parameters, the counter-based random stream and the reference sampler."""

from polyengine.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
