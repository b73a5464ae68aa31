"""Broken backends right everywhere but at one configuration edge of a model
(docs/conformance.md, "Edges"), each caught by ``test_edges[<model>]`` (one of them by the
differential layer's programs it runs at an edge configuration). Registered with
the others by tests/broken_backends.py."""

from __future__ import annotations

import numpy as np

from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.backends.reference.model import ReferenceParams
from polyengine.sampling.masks import SlotMasks


class WindowOneLongEngine(ReferenceEngine):
    """A sliding window of w attends w + 1 positions (an inclusive bound): right while
    the context is within the window, wrong from its first position past it."""

    def load_params(self):
        params = super().load_params()
        if params.config.sliding_window:
            params.config = params.config.model_copy(update={"sliding_window": params.config.sliding_window + 1})
        return params


class LongRopeAlwaysLongEngine(ReferenceEngine):
    """Long-RoPE always takes its long factors, as for a context past the original one:
    right for every engine whose context exceeds it (the suite's 64), wrong at or below."""

    def load_params(self):
        if self._params is None:
            context = max(self.max_cache_length, 4 * self.model.config.max_position_embeddings)
            self._params = ReferenceParams.from_model(self.model, self.np_dtype, context=context)
        return self._params


class LongRopeContinuationEngine(ReferenceEngine):
    """A continuation (``prefill(existing_prefix=...)``) rotates its new tokens with the
    long-RoPE long factors whatever the engine's context: right wherever the context
    exceeds the original one (the suite's 64, and c0 + 1), wrong at or below it. The edge
    numerics prefill and decode without continuing a prefix: only the differential
    layer's programs at the edge configurations meet it."""

    def prefill(self, *, params, tokens, sampling, existing_prefix=None, token_mask=None):
        if existing_prefix is not None:
            if getattr(self, "_long", None) is None:
                context = max(self.max_cache_length, 4 * self.model.config.max_position_embeddings)
                self._long = ReferenceParams.from_model(self.model, self.np_dtype, context=context)
            params = self._long
        return super().prefill(params=params, tokens=tokens, sampling=sampling, existing_prefix=existing_prefix,
                               token_mask=token_mask)


class MaskSignBitEngine(ReferenceEngine):
    """Unpacks a mask word with an arithmetic shift: a word whose bit 31 is set (the id at
    the end of a 32-id word, e.g. the last id of a 256-id vocabulary) allows its whole word."""

    @staticmethod
    def _smear(words: np.ndarray) -> np.ndarray:
        w = np.array(words, np.int32, copy=True)
        w[w < 0] = -1
        return w

    def check_token_mask(self, token_mask, sampling, **kw):
        mask = super().check_token_mask(token_mask, sampling, **kw)
        return None if mask is None else self._smear(mask)

    def check_token_masks(self, token_masks, last_result, **kw):
        masks = super().check_token_masks(token_masks, last_result, **kw)
        return None if masks is None else SlotMasks(self._smear(masks.words), masks.masked)


class BucketEdgeEngine(ReferenceEngine):
    """With prefill buckets, a prompt exactly as long as a bucket takes its logits one
    position early (the last true token counted as padding): right at every other length."""

    def _forward(self, params, tokens, starts, k_caches, v_caches):
        out = super()._forward(params, tokens, starts, k_caches, v_caches)
        buckets = self.config.prefill_buckets
        if buckets and tokens.shape[1] in buckets and tokens.shape[1] > 1 and tokens[0, -1] != 0 and starts[0] == 0:
            out = out.copy()
            out[:, -1] = out[:, -2]
        return out


_EDGES = "test_edges and "
EDGE_BROKEN = {
    "broken_window_edge": WindowOneLongEngine,
    "broken_longrope_context": LongRopeAlwaysLongEngine,
    "broken_longrope_continuation": LongRopeContinuationEngine,
    "broken_mask_sign_bit": MaskSignBitEngine,
    "broken_bucket_edge": BucketEdgeEngine,
}
EDGE_CAUGHT_BY = {
    "broken_window_edge": (_EDGES + "mistral", "test_edges[mistral]", "window 5"),
    "broken_longrope_context": (_EDGES + "phi3", "test_edges[phi3]", "longrope: context 31 vs original 32"),
    "broken_longrope_continuation": (_EDGES + "phi3", "test_edges[phi3]",
                                     "longrope: context 31 vs original 32: the differential layer's programs at this edge"),
    "broken_mask_sign_bit": (_EDGES + "mha_tied", "test_edges[mha_tied]", "vocabulary 256"),
    "broken_bucket_edge": (_EDGES + "mha_tied", "test_edges[mha_tied]", "prefill buckets (8, 16, 24)"),
}
