"""cuda_torch's decode step queues without waiting for the step before it.

On a GPU, a step that copies host data in through pageable memory, or reads a device
value on the host, waits for the kernels queued before it, so the overlap of step
n+1's launch with step n's work (what ``async_results`` promises) cannot happen. No
GPU is at hand here, so these tests run the step's torch path (the one CUDA runs: CPU
kernels off, steps on the caller's thread) under ``tests/host_sync_probe.py``'s
recording dispatch mode, which flags both. The probe's own power is tested first:
each kind of mistake it must catch, planted in a step, is caught.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from host_sync_probe import probing  # noqa: E402

from polyengine import EngineConfig, Override, SamplingParams  # noqa: E402
from polyengine.backends.cuda_torch.engine import CudaEngine  # noqa: E402
from polyengine.backends.reference.engine import ReferenceEngine  # noqa: E402
from polyengine.models import load_model  # noqa: E402
from polyengine.sampling.masks import pack_mask  # noqa: E402

CFG = EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=64)
# The torch path, on this thread (a dispatch mode is thread-local).
TORCH_PATH = {"device": "cpu"}  # the device path, run on the CPU as a stand-in
REQUESTS = [
    ([1, 5, 9, 4, 2], SamplingParams(temperature=0, max_tokens=20)),
    ([3, 3, 8], SamplingParams(seed=7, temperature=0.9, top_p=0.9, top_k=12, frequency_penalty=0.5,
                               repetition_penalty=1.2, logit_bias={5: 1.5}, logprobs=True, top_logprobs=3)),
]


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny-gqa")


def _device_tensors(engine: CudaEngine, params, state) -> list[torch.Tensor]:
    """What lives on the device before the probe starts: weights and the decode state."""
    s = state.sampler.state.as_dict().values()
    paged = [] if state.page_table is None else [state.page_table]
    return [*params.tensors.values(), state.k, state.v, *s, state.next_tokens, state.total, state.prompt_len,
            state.occupied, *paged]


def _started(engine: CudaEngine):
    params, state = engine.load_params(), engine.init_decode_state()
    for slot, (prompt, sp) in enumerate(REQUESTS):
        prefix, _ = engine.prefill(params=params, tokens=prompt, sampling=sp)
        state = engine.insert(prefix, state, slot)
    return params, state


@pytest.mark.parametrize("options", [{}, {"page_size": 4}], ids=["contiguous", "paged"])
def test_steps_inserts_and_overrides_take_no_host_data_and_never_sync(model, options):
    """Paged, the steps cross page edges and copy shared pages: page-table rows come in
    through pinned memory like every other host input."""
    eng = CudaEngine(model, CFG.model_copy(update={"options": {**TORCH_PATH, **options}}))
    params, state = _started(eng)
    state, first = eng.generate(params, state)
    first.tokens  # read outside the probe: the driver reads results after queuing the next step
    prefix, _ = eng.prefill(params=params, tokens=[7, 7, 1], sampling=SamplingParams(seed=3, presence_penalty=0.4))
    results = []
    kv = eng._paged.tensors if eng.pages is not None else prefix.kv
    with probing([*_device_tensors(eng, params, state), *kv, prefix.logits]) as probe:
        for _ in range(3):
            state, res = eng.generate(params, state)
            results.append(res)
        state = eng.insert(prefix, state, 2)  # a request joins while steps are queued
        state, res = eng.generate(params, state, overrides={0: Override(11, 4)})  # a forced token
        results.append(res)
        allowed = np.zeros(eng.vocab_size, dtype=bool)
        allowed[[3, 9, 20]] = True
        state, res = eng.generate(params, state, token_masks={2: pack_mask(allowed)})  # structured output's mask
        results.append(res)
        state = eng.free_resource(state, 1)
        state, res = eng.generate(params, state)
        results.append(res)
    assert probe.findings == [], "\n".join(probe.findings)
    # The lengths the device counted equal the host's count (read after the probe): slot 0
    # was forced at its latest position (4), which keeps its count, then advanced.
    assert [int(r.lengths[0]) for r in results] == [3, 4, 5, 6, 7, 8]
    assert int(results[4].tokens[2, 0]) in (3, 9, 20)
    assert int(results[-1].valid[1, 0]) == 0 and int(results[-1].lengths[1]) == 0
    assert int(results[-1].lengths[2]) == 4


@pytest.mark.parametrize("options", [{}, {"page_size": 16, "kv_pages": 9}], ids=["contiguous", "paged"])
def test_the_device_counts_give_the_reference_tokens_with_an_override_and_a_full_cache(model, options):
    """Lengths, positions and the live mask now come from the device's counts: greedy
    tokens through an override and up to the cache limit equal the reference's."""
    from polyengine.driver import LLM

    prompts = [[1, 5, 9, 4, 2], [40, 41]]
    sp = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # runs into the cache limit
    want = [c.token_ids for c in LLM.from_engine(ReferenceEngine(model, CFG), tools=False).generate(prompts, sp)]
    eng = CudaEngine(model, CFG.model_copy(update={"options": {**TORCH_PATH, **options}}))
    got = [c.token_ids for c in LLM.from_engine(eng,
                                                tools=False).generate(prompts, sp)]
    assert got == want and len(got[1]) == CFG.max_cache_length - 2


# -- the probe catches what it must ------------------------------------------------------


@pytest.mark.parametrize("mistake", ["torch.tensor of host lists", "from_numpy", "item", "tolist", "host mask to device"])
def test_the_probe_flags_a_step_that_brings_host_data_in_or_syncs(model, monkeypatch, mistake):
    import numpy as np

    eng = CudaEngine(model, CFG.model_copy(update={"options": TORCH_PATH}))
    params, state = _started(eng)
    step = CudaEngine._step

    def planted(self, params, state, forced, live, positions, kv_len, num_top, words):
        if mistake == "torch.tensor of host lists":
            (torch.tensor(positions, device=self.torch_device) + 1).sum()
        elif mistake == "from_numpy":
            (torch.from_numpy(np.asarray(positions)).to(self.torch_device) + 1).sum()
        elif mistake == "item":
            int(state.total.max())
        elif mistake == "tolist":
            state.occupied.tolist()
        else:
            mask = torch.zeros(state.num_slots, dtype=torch.bool)
            mask[live] = True
            state.next_tokens.masked_fill(mask.to(self.torch_device), 0)
        return step(self, params, state, forced, live, positions, kv_len, num_top, words)

    monkeypatch.setattr(CudaEngine, "_step", planted)
    with probing(_device_tensors(eng, params, state)) as probe:
        eng.generate(params, state)
    assert probe.findings, f"the probe missed {mistake!r}"
