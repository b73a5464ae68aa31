"""Speculation: the draft model and the acceptance count.

The draft is the target truncated to its first ``draft_layers`` layers, then the
target's own final norm and LM head (self-speculation, LayerSkip's early exit). That
choice keeps speculation free of a second checkpoint and of a second prefill: the
draft's K/V for its layers are exactly the target's (same weights, same inputs), so
the draft reads and writes the first ``draft_layers`` layers of the target's cache, a
view of it. The verify pass rewrites every position it covers in every layer, so the
cache only ever keeps the target's own values.

The draft proposes with the slot's sampler: the same parameters and stream (the
uniforms depend on seed, token and step, not on the model), so a sampled request's
draft proposes what the target draws wherever the two distributions agree, not only
its argmax. It runs the token-generation graph of the draft's config, ``k - 1`` times
per step on a copy of the sampler state; the verify pass (graphs.TokenGeneration with
``tokens = k``) decides. This module knows nothing of buckets or compilers.
"""

from __future__ import annotations

import re

import torch

from polyengine.errors import InvalidRequest
from polyengine.models import ModelConfig

from polyengine.backends.torch_common.model import TorchWeights

__all__ = ["draft_config", "draft_weights", "Acceptance"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def draft_config(config: ModelConfig, layers: int) -> ModelConfig:
    """The target's config with its first ``layers`` layers (1 <= layers < the target's)."""
    if not 1 <= layers < config.num_hidden_layers:
        raise InvalidRequest(
            f"option draft_layers={layers}: the draft is the target's first layers, so it needs "
            f"1..{config.num_hidden_layers - 1} of its {config.num_hidden_layers} layers"
        )
    return config.truncated(layers)


def draft_weights(weights: TorchWeights, config: ModelConfig) -> TorchWeights:
    """The target's tensors for ``config``'s layers (the same tensors, not copies)."""
    keep = {}
    for name, tensor in weights.tensors.items():
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) < config.num_hidden_layers:
            keep[name] = tensor
    return TorchWeights(config, keep)


class Acceptance:
    """Running totals of speculation steps, kept on the device (read without stalling
    the pipeline only when asked): rows that ran a step, and tokens they emitted."""

    def __init__(self, tokens_per_step: int, device: torch.device):
        self.k = tokens_per_step
        self._totals = torch.zeros(2, dtype=torch.int64, device=device)  # (row-steps, tokens emitted)

    def add(self, valid: torch.Tensor) -> None:
        """One step's ``valid`` columns ``(rows, k)`` as int32."""
        self._totals += torch.stack([valid[:, 0].sum(), valid.sum()]).to(torch.int64)

    def report(self) -> dict[str, float | int]:
        """``row_steps``, ``tokens``, ``tokens_per_step``, draft tokens ``proposed``
        (``k - 1`` a row-step) and ``accepted``, and ``acceptance_rate``, their ratio
        (drafts cut by a slot's cache limit count as proposed, not accepted)."""
        rows, tokens = (int(x) for x in self._totals.tolist())
        drafts = rows * (self.k - 1)
        return {
            "row_steps": rows,
            "tokens": tokens,
            "tokens_per_step": tokens / rows if rows else 0.0,
            "proposed": drafts,
            "accepted": tokens - rows,
            "acceptance_rate": (tokens - rows) / drafts if drafts else 0.0,
        }
