"""Numerics at each model's configuration edges, derived from its parameters.

A rule that switches at a model parameter is right or wrong at its edge: a sliding
window exactly as long as the context, the first position past a RoPE scaling's
original context (and, for long-RoPE, an engine context below, at and above it: the
short factors up to it, the long ones beyond), the first length past a prefill bucket,
the last id of an allowed-token mask's 32-bit word (its sign bit) and a vocabulary
that ends inside a word. :func:`edges` derives them from the model's config; each edge
is an engine configuration plus prompt lengths, and the test compares prefill logits at
each length and a greedy stream decoded across the edge with a reference engine built
with the same configuration (the oracle's fixed context would pick other long-RoPE
factors below the original context).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from polyengine.engine import EngineConfig
from polyengine.sampling import SamplingParams
from polyengine.sampling.masks import pack_mask

from polyengine.conformance import layer
from polyengine.conformance.harness import LIMITS, VARIANTS
from polyengine.conformance.models import DEFAULT_MODEL, MODEL_NAMES, build_model
from polyengine.conformance.oracle import reference_engine
from polyengine.conformance.stats import rel_l2

__all__ = ["Edge", "edges"]

WORD = 32  # bits per allowed-token mask word (polyengine.sampling.masks)


@dataclass(frozen=True)
class Edge:
    name: str
    changes: tuple[tuple[str, Any], ...]  # EngineConfig fields beside the suite's LIMITS
    lengths: tuple[int, ...]  # prompt lengths at the edge
    masks: tuple[tuple[int, ...], ...] = field(default=())  # allowed ids of masks at the vocabulary's word edge
    decode: int = 4  # greedy tokens decoded across the edge (first token included)


def edges(name: str) -> list[Edge]:
    """The edge configurations of test model ``name``, from its parameters."""
    c = build_model(name).config
    top = LIMITS["max_prefill_length"]
    near = lambda at: tuple(n for n in (at - 1, at, at + 1) if 1 <= n <= top)  # noqa: E731
    out = []
    if c.sliding_window:
        out.append(Edge(f"window {c.sliding_window}", (), near(c.sliding_window)))
    scaling = c.rope_scaling
    original = getattr(scaling, "original_max_position_embeddings", None) if scaling is not None else None
    if original and near(original):
        out.append(Edge(f"{scaling.rope_type} original context {original}: positions", (), near(original)))
    if original and scaling.rope_type == "longrope":
        # the factors switch on the engine's context: decode to the cache limit, across the original context
        for cache in (original - 1, original, original + 1):
            prefill = min(top, cache - 5)
            out.append(Edge(f"longrope: context {cache} vs original {original}",
                            (("max_cache_length", cache), ("max_prefill_length", prefill)), (prefill,),
                            decode=cache - prefill))
    if name == DEFAULT_MODEL:
        buckets = VARIANTS["buckets"]["prefill_buckets"]
        out.append(Edge(f"prefill buckets {buckets}", (("prefill_buckets", buckets),),
                        tuple(sorted({n for b in buckets for n in near(b)}))))
    v = c.vocab_size
    last_word = v - (v % WORD or WORD)
    out.append(Edge(f"vocabulary {v} ({'a whole' if v % WORD == 0 else 'inside a'} mask word)", (), (5,),
                    masks=((v - 1,), tuple(range(last_word, v)), (last_word - 1, v - 1))))
    return out


def _reference_greedy(ref, params, prompt: list[int], steps: int) -> list[int]:
    prefix, first = ref.prefill(params=params, tokens=prompt, sampling=SamplingParams(temperature=0.0, seed=0))
    return [int(first.tokens[0, 0])] + _greedy_rest(ref, params, prefix, steps)


def _greedy_rest(engine, params, prefix, steps: int) -> list[int]:
    # a decode state of its own, freed after: the engine may be one the other layers share
    state = engine.insert(prefix, engine.init_decode_state(), 0)
    out = []
    while len(out) < steps - 1:
        state, r = engine.generate(params, state)
        toks = r.row_tokens(0)
        if not toks:
            break
        out.extend(int(t) for t in toks)
    engine.free_resource(state, 0)
    return out[: steps - 1]


@layer("numerics")
class EdgeLayer:
    @pytest.mark.parametrize("model", MODEL_NAMES)
    def test_edges(self, conformance, model, request):
        """At each edge :func:`edges` derives from the model's parameters (window, RoPE
        original context and long-RoPE contexts below/at/above it, prefill buckets, the
        mask word at the vocabulary's end): prefill logits at each length and a greedy
        stream decoded across the edge equal a reference engine's of the same
        configuration; masks at the word edge give their allowed ids. An edge that is an
        engine configuration of its own (the long-RoPE contexts) also runs the
        differential layer's random programs there (``EDGE_EXAMPLES``), compared with a
        mirror and an oracle of that configuration."""
        conformance.require_architecture(model)
        harness, dtype = conformance.harness, conformance.dtype
        caps = conformance.capabilities
        tie = conformance.tolerance("tie_gap", dtype, model).value
        for edge in edges(model):
            key = ("edge", model, edge.changes)
            if key not in harness.cache:
                config = harness.config(dtype, **dict(edge.changes))
                ref = reference_engine(build_model(model), config.model_copy(update={"dtype": "float64"}))
                # the margins of a divergence: the same context, prompts up to the cache limit (buckets are invisible)
                wide = reference_engine(build_model(model), EngineConfig(
                    max_slots=1, max_cache_length=config.max_cache_length, dtype="float64"))
                # the engines the other layers built already where the edge is theirs: a compiled
                # backend compiles only the long-RoPE contexts anew
                variant = next((v for v, changes in VARIANTS.items() if changes == dict(edge.changes)), None)
                eng = conformance.engine(model, dtype, variant) if variant else harness.build_for(model, config)
                harness.cache[key] = (eng, ref, ref.load_params(), wide, wide.load_params())
            eng, ref, ref_params, wide, wide_params = harness.cache[key]
            own = edge.changes and not any(changes == dict(edge.changes) for changes in VARIANTS.values())
            params = harness.params(eng)
            for n in edge.lengths:
                prompt = conformance.prompt(n, 400 + n, model)
                what = f"model {model}, {edge.name}, prompt of {n} tokens"
                prefix, first = eng.prefill(params=params, tokens=prompt, sampling=SamplingParams(temperature=0.0, seed=0))
                want_prefix, _ = ref.prefill(params=ref_params, tokens=prompt, sampling=SamplingParams(temperature=0.0, seed=0))
                conformance.within("logits_rel_l2", rel_l2(np.asarray(prefix.host_logits(), np.float64), want_prefix.logits),
                                   dtype, model, what=f"{what}: prefill logits vs a reference engine of that configuration")
                got = [int(first.tokens[0, 0])] + _greedy_rest(eng, params, prefix, edge.decode)
                want = _reference_greedy(ref, ref_params, prompt, edge.decode)
                for t, (a, b) in enumerate(zip(got, want)):
                    if a == b:
                        continue
                    ref_prefix, _ = wide.prefill(params=wide_params, tokens=prompt + want[:t],
                                                 sampling=SamplingParams(temperature=0.0, seed=0))
                    top2 = np.sort(np.asarray(ref_prefix.logits, np.float64))[-2:]
                    gap = float(top2[1] - top2[0])
                    conformance.measure("tie_gap", gap, dtype, model, where=what)
                    if gap < tie:
                        conformance.note(f"{what}: greedy step {t}: {a} vs {b} at a near tie ({gap:.3g})")
                        break
                    raise AssertionError(f"{what}: greedy step {t} (position {n + t}) is {a}, a reference engine of this "
                                         f"configuration decodes {b} (margin {gap:.3g} above tie_gap {tie:g}); "
                                         f"greedy so far {got[:t]}")
            for allowed in edge.masks if caps.token_masks else ():
                ids = np.zeros(ref.vocab_size, bool)
                ids[list(allowed)] = True
                words = pack_mask(ids)
                prompt = conformance.prompt(5, 499, model)
                _, first = eng.prefill(params=params, tokens=prompt, sampling=SamplingParams(temperature=0.0, seed=0),
                                       token_mask=words)
                want_prefix, want = ref.prefill(params=ref_params, tokens=prompt,
                                                sampling=SamplingParams(temperature=0.0, seed=0), token_mask=words)
                tok, want_tok = int(first.tokens[0, 0]), int(want.tokens[0, 0])
                if tok != want_tok and tok in allowed:
                    # another allowed id is a near tie of the reference's (a lossy option set's
                    # rounding), judged by the same tie_gap as the greedy streams above
                    logits = np.asarray(want_prefix.logits, np.float64)
                    gap = float(logits[want_tok] - logits[tok])
                    conformance.measure("tie_gap", gap, dtype, model,
                                        where=f"model {model}, {edge.name}: masked prefill")
                    if gap < tie:
                        conformance.note(f"model {model}, {edge.name}: a greedy prefill under a mask drew {tok}, the "
                                         f"reference {want_tok}, at a near tie ({gap:.3g})")
                        continue
                assert tok == want_tok, (f"model {model}, {edge.name}: a greedy prefill whose mask allows only "
                                         f"{list(allowed)} drew {tok}, the reference {want_tok} (the mask's last word: "
                                         f"bits past the vocabulary, bit 31 the sign bit of an int32 word)")
            if own:
                _edge_programs(conformance, request, model, edge, eng, harness.config(dtype, **dict(edge.changes)))


def _edge_programs(conformance, request, model: str, edge: Edge, engine, config) -> None:
    """The differential layer's programs on an edge's own engine configuration: the calls
    the numerics above do not make there (continuations, bulk inserts, overrides, sampled
    streams, exports) meet the edge too. Seeded by the model and the edge."""
    from polyengine.conformance.harness import SEEDS
    from polyengine.conformance.layer_differential import EDGE_EXAMPLES, EXAMPLES, edge_setup, run_programs

    given = request.config.getoption("polyengine_differential_examples", None)
    examples = EDGE_EXAMPLES if given is None else max(1, given * EDGE_EXAMPLES // EXAMPLES)
    index = [e.name for e in edges(model)].index(edge.name)
    seed = SEEDS["differential"] + 1000 + 10 * MODEL_NAMES.index(model) + index
    rerun = f'-k "{conformance.test_id}"' + (f" --polyengine-differential-examples {given}" if given else "")
    try:
        run_programs(conformance, model, examples=examples, seed=seed, rerun=rerun,
                     setup=edge_setup(conformance, model, engine, config))
    except AssertionError as exc:
        raise AssertionError(f"model {model}, {edge.name}: the differential layer's programs at this edge: {exc}") from None
