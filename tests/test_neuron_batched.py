"""Batched prefill on the neuron engine's CPU compile path (option ``batched_prefill``;
docs/neuron.md, "Batched prefill"): fresh prompts of one prefill bucket in one
context-encoding graph of 2 or 4 rows, each entry getting what its own ``prefill``
gives (logits within float32 rounding, the same first token, K/V that decode the same
tokens), on the contiguous cache and on pages; the parts a batch splits into; a bounded
pool that runs out part way gives every block back; ``off`` leaves the kit's loop; on
the Neuron path (the stand-in) ``auto`` is off and ``on`` adds the batched models to the
NxD program, where each entry gets what its own prefill gives.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.backends.neuron.engine import NeuronEngine, _split  # noqa: E402
from polyengine.engine import PrefillRequest  # noqa: E402
from polyengine.errors import InsufficientMemory, InvalidRequest  # noqa: E402
from polyengine.models import load_model  # noqa: E402

CFG = EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=64, dtype="float32",
                   prefill_buckets=(8, 24))
STANDIN = Path(__file__).resolve().parent / "neuron_standin"
LENGTHS = (5, 11, 7, 3, 20, 9, 14, 6)  # bucket 8: 5, 7, 3, 6; bucket 24: 11, 20, 9, 14


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny-gqa")


@pytest.fixture
def standin(monkeypatch, tmp_path):
    """torch_neuronx and neuronx_distributed from tests/neuron_standin (removed afterwards);
    yields a folder for artifact caches."""
    import sys

    monkeypatch.syspath_prepend(str(STANDIN))
    import neuronx_distributed.trace.model_builder as mb

    save, load = torch.jit.save, torch.jit.load
    monkeypatch.setattr(torch.jit, "save", lambda obj, f, *a, **k: mb.save(obj, f) if isinstance(obj, mb.Executor)
                        else save(obj, f, *a, **k))
    monkeypatch.setattr(torch.jit, "load", lambda f, *a, **k: mb.load(f) or load(f, *a, **k))
    yield tmp_path
    for name in [m for m in sys.modules if m.split(".")[0] in ("torch_neuronx", "neuronx_distributed")]:
        del sys.modules[name]


def _engine(model, **options):
    return NeuronEngine(model, CFG.model_copy(update={"options": options}))


def _requests(head=None):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 280, n).tolist() for n in LENGTHS]
    sampling = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=40 + i, max_tokens=8)
                for i in range(len(prompts))]
    reqs = [PrefillRequest(p, s) for p, s in zip(prompts, sampling)]
    if head is not None:  # a continuation among them: its own prefill, in order
        reqs.insert(3, PrefillRequest(prompts[0][:4], sampling[0], head))
    return reqs


def _decoded(eng, params, prefixes, steps=6):
    """Each prefix inserted into its own slot (four at a time) and decoded greedily."""
    out = []
    for at in range(0, len(prefixes), 4):
        state = eng.init_decode_state()
        group = prefixes[at: at + 4]
        for slot, prefix in enumerate(group):
            state = eng.insert(prefix, state, slot)
        rows = [[] for _ in group]
        for _ in range(steps):
            state, res = eng.generate(params, state)
            for slot in range(len(group)):
                rows[slot] += [int(t) for t in res.tokens[slot, : int(res.lengths[slot])]]
        for slot in range(len(group)):
            state = eng.free_resource(state, slot)
        out += rows
    return out


@pytest.mark.parametrize("options", [{}, {"async_steps": False}, {"page_size": 4}, {"page_size": 8, "kv_pages": 40}],
                         ids=["contiguous", "sync", "pages", "bounded-pool"])
def test_each_entry_gets_what_its_own_prefill_gives(tiny, options):
    eng = _engine(tiny, **options)
    assert eng.capabilities.batched_prefill and eng.prefill_batch_sizes == (2, 4)
    assert {name for name in eng.graphs if name[0] == "context_batch"} >= {
        ("context_batch", n, p) for n in (2, 4) for p in (8, 24)} or eng.pages is not None
    params = eng.load_params()
    head, _ = eng.prefill(params=params, tokens=[7, 8, 9, 10, 11], sampling=SamplingParams(temperature=0.0))
    reqs = _requests(head)
    calls = []
    real = eng._prefill_rows
    eng._prefill_rows = lambda params, p, rows: calls.append((p, len(rows))) or real(params, p, rows)
    batch = eng.prefill_batch(params=params, requests=reqs)
    # bucket 8's four prompts as one graph of 4, bucket 24's four as one of 4; the continuation alone
    assert sorted(calls) == [(8, 4), (24, 4)]
    single = [eng.prefill(params=params, tokens=r.tokens, sampling=r.sampling, existing_prefix=r.existing_prefix)
              for r in reqs]
    for i, ((got, got_first), (want, want_first)) in enumerate(zip(batch, single)):
        assert list(got.prompt_tokens) == list(want.prompt_tokens), i
        np.testing.assert_allclose(got.logits.numpy(), want.logits.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"entry {i}")
        assert int(got_first.tokens[0, 0]) == int(want_first.tokens[0, 0]), i
        gk, wk = eng.export_prefix(got), eng.export_prefix(want)
        np.testing.assert_allclose(np.asarray(gk.k), np.asarray(wk.k), rtol=1e-5, atol=1e-5, err_msg=f"entry {i}")
    assert _decoded(eng, params, [p for p, _ in batch]) == _decoded(eng, params, [p for p, _ in single])


def test_the_parts_a_batch_splits_into():
    assert _split(7, (2, 4)) == [(0, 4), (4, 2)]  # the seventh alone
    assert _split(8, (2, 4)) == [(0, 4), (4, 4)]
    assert _split(3, (2, 4)) == [(0, 2)]
    assert _split(5, (2,)) == [(0, 2), (2, 2)]
    assert _split(1, (2, 4)) == [] and _split(0, (2,)) == []


def test_a_pool_that_runs_out_part_way_gives_every_block_back(tiny):
    eng = _engine(tiny, page_size=8, kv_pages=9)  # 9 blocks: bucket 8's four prompts take 4, bucket 24's need 8
    params = eng.load_params()
    reqs = _requests()
    with pytest.raises(InsufficientMemory, match="K/V page pool"):
        eng.prefill_batch(params=params, requests=reqs)
    assert eng.pages.held == 0
    done = eng.prefill_batch(params=params, requests=reqs[:4])  # 5, 11, 7 and 3 tokens: 5 blocks of 8
    assert eng.pages.held == sum(len(p.kv.pages) for p, _ in done) == 5


def test_a_refused_entry_prefills_nothing(tiny):
    eng = _engine(tiny, page_size=4)
    params = eng.load_params()
    reqs = _requests()
    with pytest.raises(InvalidRequest, match="prefill_batch entry 2"):
        eng.prefill_batch(params=params, requests=[*reqs[:2], PrefillRequest([tiny.config.vocab_size], reqs[0].sampling)])
    assert eng.pages.held == 0


def test_off_and_two_slots(tiny):
    eng = _engine(tiny, batched_prefill="off")
    assert not eng.capabilities.batched_prefill and eng.prefill_batch_sizes == ()
    assert not any(name[0] == "context_batch" for name in eng.graphs)
    two = NeuronEngine(tiny, CFG.model_copy(update={"max_slots": 2}))
    assert two.prefill_batch_sizes == (2,)


def test_the_neuron_path_leaves_auto_off_and_runs_on_by_construction(tiny, standin):
    """On Neuron devices (compiler='neuronx', here through tests/neuron_standin) "auto"
    builds no batched models; "on" adds context models of 2 and 4 rows to the NxD program
    (the call's shapes pick one), and each entry gets what its own prefill gives."""
    auto = _engine(tiny, compiler="neuronx", cache_dir=str(standin / "a"))
    assert not auto.capabilities.batched_prefill and auto.prefill_batch_sizes == ()
    eng = _engine(tiny, compiler="neuronx", cache_dir=str(standin / "b"), batched_prefill="on")
    assert eng.capabilities.batched_prefill and eng.on_device.description()["prefill_batch"] == [2, 4]
    assert {f"context_{n}x{p}" for n in (2, 4) for p in (8, 24)} <= set(eng.on_device.spec().models)
    from neuronx_distributed._device import RECORD

    params = eng.load_params()
    reqs = _requests()
    RECORD.clear()
    batch = eng.prefill_batch(params=params, requests=reqs)
    assert sorted(c["model"] for c in RECORD.calls) == ["context_4x24", "context_4x8"]  # one call per bucket
    single = [eng.prefill(params=params, tokens=r.tokens, sampling=r.sampling) for r in reqs]
    for i, ((got, got_first), (want, want_first)) in enumerate(zip(batch, single)):
        np.testing.assert_allclose(got.logits.numpy(), want.logits.numpy(), rtol=1e-5, atol=1e-5, err_msg=f"entry {i}")
        assert int(got_first.tokens[0, 0]) == int(want_first.tokens[0, 0]), i
    assert _decoded(eng, params, [p for p, _ in batch]) == _decoded(eng, params, [p for p, _ in single])
