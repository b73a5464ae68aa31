"""The source of truth: the reference backend in float64 plus the core's sampler.

Every "compare with the reference" check asks this module what a correct backend
would produce: the logits after any token sequence, and the token stream a request
draws (greedy or seeded) with the decision margin at each step, so a divergence can be
judged a near tie (reported) or a bug (failed).

The logits come from the reference engine's own ``prefill`` with ``existing_prefix``
(each new token extends the longest cached prefix by one position, as a decode step
does), so the oracle is the reference backend, not a second implementation of it.

This module is the suite's one seam to the reference backend: the models, the layers
and the portable-prefix exchange reach it only through :func:`reference_engine`,
:func:`reference_logits` and :class:`ReferenceOracle`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from polyengine.engine import Capabilities, EngineConfig, Prefix
from polyengine.models import Model
from polyengine.sampling import RowState, SamplingParams, draw_scores, process_logits, raw_logprobs

from polyengine.conformance.faults import Fault

__all__ = ["Decision", "ReferenceOracle", "oracle_for", "decide", "reference_engine", "reference_logits", "mirror_engine"]

# Long enough for any prompt plus completion the suite builds (the test engines hold 64).
_ORACLE_LIMITS = EngineConfig(max_slots=1, max_prefill_length=192, max_cache_length=256)
_PROBE = SamplingParams(temperature=0.0, seed=0)


@dataclass(frozen=True)
class Decision:
    """What a correct sampler chooses at one step, and by how much it wins."""

    token: int
    gap: float  # decision score of the winner minus the runner-up (inf: forced or no rival)
    forced: bool = False


def reference_engine(model: Model, config: EngineConfig):
    """A reference backend engine (the oracle's own kind) for ``model``, with ``config``'s
    limits and buckets (the backend's options are the backend's: the reference has none)."""
    from polyengine.backends.reference.engine import ReferenceEngine

    return ReferenceEngine(model, config.model_copy(update={"options": {}}))


def mirror_engine(model: Model, config: EngineConfig, capabilities: Capabilities):
    """The reference engine (float64, ``config``'s limits and buckets) declaring no more
    than ``capabilities``: the same sampling parameters, ``max_top_logprobs``, and
    optional features. The differential layer runs every program call on it beside the
    backend, so a call the backend must refuse is one this engine refuses, with the
    error a backend must raise (undeclared features raise UnsupportedFeature)."""
    from polyengine.engine import EngineBase

    engine = reference_engine(model, config.model_copy(update={"dtype": "float64"}))
    engine.capabilities = engine.capabilities.model_copy(update={
        "sampling_params": capabilities.sampling_params, "max_top_logprobs": capabilities.max_top_logprobs,
        "bulk_insert": capabilities.bulk_insert, "portable_prefix": capabilities.portable_prefix,
        "prefix_reuse": capabilities.prefix_reuse, "token_masks": capabilities.token_masks,
    })
    undeclared = {"bulk_insert": not capabilities.bulk_insert, "export_prefix": not capabilities.portable_prefix,
                  "import_prefix": not capabilities.portable_prefix}
    for method, missing in undeclared.items():
        if missing:  # the kit's own refusal, as a backend without the feature has it
            setattr(engine, method, getattr(EngineBase, method).__get__(engine))
    return engine


def reference_logits(model: Model, prompt: Sequence[int]) -> np.ndarray:
    """Float64 logits after ``prompt`` on a model that has no oracle yet (its EOS ids,
    say, are still being chosen)."""
    engine = reference_engine(model, _ORACLE_LIMITS)
    prefix, _ = engine.prefill(params=engine.load_params(), tokens=list(prompt), sampling=_PROBE)
    return prefix.logits


def decide(logits: np.ndarray, row: RowState, eos_token_ids: Sequence[int], fault: Fault | None = None) -> Decision:
    """The core sampler's choice on ``logits`` with its winning margin (or, with a
    ``fault``, the choice of a sampler with that fault).

    Greedy: the scores are the processed logits. Sampling: processed log-probs plus the
    row's Gumbel noise, exactly what :func:`polyengine.sampling.sample` maximises.
    """
    if fault is not None:
        row = RowState(fault.request(row.params), row.sample_index, row.step, row.prompt_tokens, row.completion_tokens,
                       row.token_mask)
        x = process_logits(logits, row, eos_token_ids, pipeline=fault.pipeline())
        return Decision(fault.drawer()(x, row), float("nan"))
    x = draw_scores(process_logits(logits, row, eos_token_ids), row)
    order = np.argsort(-x, kind="stable")  # ties to the lowest id, like the sampler
    top = int(order[0])
    rival = x[order[1]] if x.shape[0] > 1 else -np.inf
    gap = float(x[top] - rival) if np.isfinite(rival) else float("inf")
    return Decision(top, gap)


class _LogitsMemo:
    """The reference's logits per (model fingerprint, context), kept for the whole process
    up to ``limit`` contexts, least recently used dropped first.

    The logits of a context are a function of the model and the tokens alone, so every
    oracle of the process shares them: the differential layer's programs are seeded, and
    each run of the suite in one process (the honest variants, the broken backends, the
    reference beside them) and each program Hypothesis runs again while it shrinks a
    failing one asks for the same contexts. Only the logits are kept (a few KiB each);
    K/V stay per oracle, cleared per program. The arrays are read-only: they are shared.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._data: OrderedDict[tuple[str, tuple[int, ...]], np.ndarray] = OrderedDict()

    def get(self, model: str, key: tuple[int, ...]) -> np.ndarray | None:
        logits = self._data.get((model, key))
        if logits is not None:
            self._data.move_to_end((model, key))
        return logits

    def put(self, model: str, key: tuple[int, ...], logits: np.ndarray) -> None:
        logits.flags.writeable = False
        self._data[(model, key)] = logits
        self._data.move_to_end((model, key))
        while len(self._data) > self.limit:
            self._data.popitem(last=False)


# ~2 KiB of float64 logits each for the test models' vocabularies: at most ~70 MiB.
_LOGITS = _LogitsMemo(limit=32768)


class ReferenceOracle:
    """Float64 reference logits and token streams for one test model."""

    def __init__(self, model: Model, context: int | None = None):
        """``context``: the engine context of the configuration judged (long-RoPE picks its
        factors by it: an edge configuration's below the original context has its own
        logits); None for the suite's usual ones, all past any original context."""
        self.model = model
        self.eos_token_ids = tuple(model.eos_token_ids)
        limits = _ORACLE_LIMITS if context is None else _ORACLE_LIMITS.model_copy(
            update={"max_cache_length": context, "max_prefill_length": min(context, _ORACLE_LIMITS.max_prefill_length)})
        self.engine = reference_engine(model, limits)
        self.params = self.engine.load_params()
        # the logits memo is by model and context: a context of its own keeps its own entries
        self._memo_key = model.fingerprint if context is None else f"{model.fingerprint}@context={context}"
        self._prefixes: dict[tuple[int, ...], Prefix] = {}

    def clear(self) -> None:
        """Forget every cached context's K/V (an oracle of random programs would otherwise
        keep each one's K/V for good); their logits stay in the process's memo."""
        self._prefixes.clear()

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Float64 logits ``(vocab,)`` of the last position after ``tokens``."""
        key = tuple(int(t) for t in tokens)
        hit = self._prefixes.get(key)
        if hit is not None:
            return hit.logits
        known = _LOGITS.get(self._memo_key, key)
        if known is not None:
            return known
        return self._prefix(key).logits

    def _prefix(self, key: tuple[int, ...]) -> Prefix:
        """The reference's prefix of ``key``, extending the longest one cached."""
        base, start = None, 0
        for n in range(len(key) - 1, 0, -1):
            if key[:n] in self._prefixes:
                base, start = self._prefixes[key[:n]], n
                break
        prefix, _ = self.engine.prefill(params=self.params, tokens=list(key[start:]), sampling=_PROBE, existing_prefix=base)
        self._prefixes[key] = prefix
        _LOGITS.put(self._memo_key, key, prefix.logits)
        return prefix

    def raw_logprobs(self, tokens: Sequence[int]) -> np.ndarray:
        return raw_logprobs(self.logits(tokens))

    def kv(self, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """K (after RoPE) and V of the prompt, ``(layers, kv_heads, len, head_dim)`` float64."""
        key = tuple(int(t) for t in tokens)
        return (self._prefixes.get(key) or self._prefix(key)).kv

    def stream(
        self,
        prompt: Sequence[int],
        sampling: SamplingParams,
        steps: int,
        *,
        sample_index: int = 0,
        forced: Mapping[int, int] | None = None,
        fault: Fault | None = None,
        masks: Mapping[int, np.ndarray] | None = None,
    ) -> list[Decision]:
        """The first ``steps`` completion tokens a correct backend produces (with a
        ``fault``: a backend with that fault).

        ``forced={j: token}`` makes completion position ``j`` that token, as
        ``generate(overrides=...)`` does when it replaces the token a slot feeds next;
        the step counter still advances over it (forced tokens count).
        ``masks={j: words}`` samples completion position ``j`` under that allowed-token
        mask (``prefill(token_mask=...)`` for position 0, ``generate(token_masks=...)``
        after).
        """
        masks = dict(masks or {})
        if sampling.seed is None:
            raise ValueError("oracle streams need a seeded request")  # suite bug
        forced = dict(forced or {})
        prompt = [int(t) for t in prompt]
        completion: list[int] = []
        out: list[Decision] = []
        for step in range(steps):
            if step in forced:
                d = Decision(int(forced[step]), float("inf"), forced=True)
            else:
                row = RowState(sampling, sample_index, step, np.array(prompt), np.array(completion, np.int64),
                               masks.get(step))
                d = decide(self.logits(prompt + completion), row, self.eos_token_ids, fault)
            out.append(d)
            completion.append(d.token)
        return out


_ORACLES: dict[str, ReferenceOracle] = {}


def oracle_for(model: Model) -> ReferenceOracle:
    """One oracle per model (by fingerprint), shared by every run in the process: the
    models are deterministic and the oracle only ever adds to its cache."""
    key = model.fingerprint
    if key not in _ORACLES:
        _ORACLES[key] = ReferenceOracle(model)
    return _ORACLES[key]
