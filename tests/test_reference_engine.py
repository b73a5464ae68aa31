"""Reference-engine behaviour the conformance suite does not cover: prefix provenance
and the memory check before allocating."""

from __future__ import annotations

import pytest

from polyengine import EngineConfig, SamplingParams
from polyengine.backends.reference.engine import ReferenceEngine
from polyengine.errors import InvalidRequest
from polyengine.models import load_model
from polyengine.models.loader import InsufficientMemory

CFG = EngineConfig(max_slots=2, max_prefill_length=16, max_cache_length=32)


def test_a_prefix_from_other_weights_is_refused():
    a, b = load_model("random:tiny"), load_model("random:tiny?seed=1")  # same shapes, other weights
    ea, eb = ReferenceEngine(a, CFG), ReferenceEngine(b, CFG)
    prefix, _ = ea.prefill(params=ea.load_params(), tokens=[1, 2, 3], sampling=SamplingParams(temperature=0))
    with pytest.raises(InvalidRequest, match="other weights"):
        eb.insert(prefix, eb.init_decode_state(), 0)
    with pytest.raises(InvalidRequest, match="other weights"):
        eb.prefill(params=eb.load_params(), tokens=[4], sampling=SamplingParams(), existing_prefix=prefix)
    # the same Model object behind two engines shares prefixes
    ea2 = ReferenceEngine(a, CFG)
    ea2.insert(prefix, ea2.init_decode_state(), 1)


def test_a_prefix_longer_than_this_engine_accepts_is_refused():
    model = load_model("random:tiny")
    big = ReferenceEngine(model, EngineConfig(max_slots=1, max_prefill_length=40, max_cache_length=64))
    small = ReferenceEngine(model, CFG)
    prefix, _ = big.prefill(params=big.load_params(), tokens=list(range(1, 31)), sampling=SamplingParams())
    with pytest.raises(InvalidRequest, match="30 tokens"):
        small.insert(prefix, small.init_decode_state(), 0)


def test_weights_copy_and_caches_that_do_not_fit_are_refused_before_allocating(monkeypatch):

    model = load_model("random:tiny")
    monkeypatch.setattr("polyengine.memory.available_host_memory", lambda: 300 << 20)
    ReferenceEngine(model, CFG)  # small: fits
    with pytest.raises(InsufficientMemory) as exc:
        ReferenceEngine(model, EngineConfig(max_slots=4000, max_prefill_length=256, max_cache_length=512))
    msg = str(exc.value)
    assert "KV caches of 4000 slots" in msg and "float64 copy of the weights" in msg
    assert exc.value.needed > exc.value.available == 300 << 20
