"""A prefill continuing a prefix extends the prefix's contiguous K/V buffer in place when
the positions after it are still unwritten (torch_common's ``_kv_run``; docs/prefix-caching.md,
"Pieces extend their prefix in place"): the prefix itself, a second continuation of it
and everything inserted from either must read exactly what separate copies would."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from polyengine import EngineConfig, SamplingParams
from polyengine.models import load_model
from polyengine.plugins import create_engine

GREEDY = SamplingParams(temperature=0, max_tokens=1)


@pytest.fixture(scope="module")
def tiny():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model("random:tiny-gqa")


@pytest.fixture(scope="module", params=["cpu", "cuda_torch"])
def engine(request, tiny):
    # contiguous K/V: the runs (a paged engine's prefixes are page lists; the cpu backend's default)
    options = {"device": "cpu"} if request.param == "cuda_torch" else {"page_size": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = create_engine(request.param, model=tiny, config=EngineConfig(
            max_slots=2, max_prefill_length=64, max_cache_length=128, options=options))
    return eng, eng.load_params()


def _kv(prefix):
    k, v = prefix.kv
    return k.clone(), v.clone()


def _ids(rng, eng, n):
    return rng.integers(1, eng.vocab_size, n).astype(np.int32)


def test_pieces_extend_one_buffer_and_equal_a_whole_prefill(engine):
    eng, params = engine
    rng = np.random.default_rng(0)
    toks = _ids(rng, eng, 40)
    whole, _ = eng.prefill(params=params, tokens=toks, sampling=GREEDY)
    p, _ = eng.prefill(params=params, tokens=toks[:10], sampling=GREEDY)
    first = p
    runs = {id(p.kv.run)}
    for a, b in ((10, 17), (17, 30), (30, 40)):
        p, _ = eng.prefill(params=params, tokens=toks[a:b], sampling=GREEDY, existing_prefix=p)
        runs.add(id(p.kv.run))
    # on a host whose cache grows with use, room for twice the length: 10 -> 20 -> 40 positions
    # (the buckets round up), so fewer buffers than pieces; never one per piece
    assert len(runs) < 4 if eng.torch_device.type == "cpu" else len(runs) == 4
    assert p.true_length == 40 and first.true_length == 10
    for got, want in zip(p.kv, whole.kv):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(p.logits, whole.logits, atol=2e-5, rtol=0)


def test_a_continued_prefix_keeps_its_kv_and_a_second_continuation_copies(engine):
    eng, params = engine
    rng = np.random.default_rng(1)
    base, _ = eng.prefill(params=params, tokens=_ids(rng, eng, 12), sampling=GREEDY)
    before = _kv(base)
    tail_a, tail_b = _ids(rng, eng, 9), _ids(rng, eng, 9)
    a, _ = eng.prefill(params=params, tokens=tail_a, sampling=GREEDY, existing_prefix=base)
    b, _ = eng.prefill(params=params, tokens=tail_b, sampling=GREEDY, existing_prefix=base)
    if eng.torch_device.type == "cpu":
        assert a.kv.run is base.kv.run  # the first continuation wrote after the prefix in place
    assert b.kv.run is not a.kv.run  # the room after base was taken: the second one copied
    for got, want in zip(_kv(base), before):
        assert torch.equal(got, want)  # the prefix reads what it read before either continuation
    # each continuation equals the same prompt prefilled whole (b did not overwrite a's positions)
    for cont, tail in ((a, tail_a), (b, tail_b)):
        whole, _ = eng.prefill(params=params, tokens=np.concatenate([base.prompt_tokens, tail]), sampling=GREEDY)
        for got, want in zip(cont.kv, whole.kv):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    # a truncated head of a continued prefix continues by copying, never over the longer one's positions
    head = eng.truncate_prefix(params=params, prefix=a, length=15)
    c, _ = eng.prefill(params=params, tokens=tail_b[:4], sampling=GREEDY, existing_prefix=head)
    assert c.kv.run is not a.kv.run
    whole_a, _ = eng.prefill(params=params, tokens=np.concatenate([base.prompt_tokens, tail_a]), sampling=GREEDY)
    for got, want in zip(a.kv, whole_a.kv):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
