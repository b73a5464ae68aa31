"""Realistic sampler misimplementations, as the streams they draw.

Each fault is expressed in the reference's own parameters: a backend with the fault
draws exactly what the reference draws with the rewritten request. The honesty layer
uses them to name a fault when a backend's tokens are exactly the faulty stream, and
the honesty and sampler layers to prove their checks can tell each fault apart from
correct behaviour (a check without that power is a suite bug).
"""

from __future__ import annotations

from typing import Any, Callable

from polyengine.sampling import SamplingParams

__all__ = ["FAULTS"]


def _scaled(sp: SamplingParams, names: tuple[str, ...]) -> SamplingParams:
    """``sp`` with these additive terms multiplied by the temperature: the same stream a
    backend that adds them *after* dividing by the temperature draws."""
    t = sp.temperature or 1.0
    update: dict[str, Any] = {}
    for name in names:
        value = getattr(sp, name)
        update[name] = {k: v * t for k, v in value.items()} if isinstance(value, dict) else value * t
    return sp.model_copy(update=update)  # not validated: a scaled penalty may leave the API's range


# name -> (what the faulty backend's stream equals, what the message says). Each check
# with a fault asserts that the fault's stream differs from the correct one (power).
FAULTS: dict[str, tuple[Callable[[SamplingParams], SamplingParams], str]] = {
    "bias_after_temperature": (
        lambda sp: _scaled(sp, ("logit_bias",)),
        "logit_bias is applied after the temperature division (the tokens are exactly those drawn with the bias "
        "multiplied by the temperature); it must be added to the raw logits before the penalties and the "
        "temperature (DESIGN.md 'Sampling semantics', step 1)",
    ),
    "penalties_after_temperature": (
        lambda sp: _scaled(sp, ("presence_penalty", "frequency_penalty")),
        "presence/frequency penalties are applied after the temperature division (the tokens are exactly those "
        "drawn with the penalties multiplied by the temperature); they must be subtracted from the logits before "
        "dividing by the temperature (DESIGN.md 'Sampling semantics', step 2)",
    ),
    "min_tokens_off_by_one": (
        lambda sp: sp.model_copy(update={"min_tokens": max(0, sp.min_tokens - 1)}),
        "EOS is let through one step early (the tokens are exactly those drawn with min_tokens - 1): EOS and the "
        "stop token ids must be masked while the completion is shorter than min_tokens (step < min_tokens)",
    ),
}
