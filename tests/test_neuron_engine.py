"""The neuron engine on its CPU compile path: speculation against plain decoding, async
against sync, rollback over several tokens, the artifact cache (a warm start and a
second checkpoint compile nothing) and no recompilation over a random workload.

Engines use the conformance suite's limits and the session's artifact cache
(tests/neuron_support.py), so they load the graphs the suite compiled (plain decoding,
the default); only speculation's graphs (``speculation=2``, one model) and two more
prefill buckets are compiled here. Greedy and sampled streams are compared exactly:
speculation verifies drafts with the slot's own stream, so it changes how many tokens
a step yields, never which.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from neuron_support import LIMITS, config, shared_cache  # noqa: E402

from polyengine import EngineConfig, Override, SamplingParams  # noqa: E402
from polyengine.backends.neuron.compile import COUNTS  # noqa: E402
from polyengine.backends.neuron.engine import NeuronEngine  # noqa: E402
from polyengine.backends.reference.engine import ReferenceEngine  # noqa: E402
from polyengine.conformance.models import build_model  # noqa: E402
from polyengine.driver import LLM  # noqa: E402
from polyengine.errors import InvalidRequest  # noqa: E402

PROMPTS = [[1, 5, 9, 4, 2], [1, 7, 3], [1, 2, 8, 8, 2, 6, 6, 11, 30, 4, 4, 9], [40, 41]]
MIXED = [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(seed=3, max_tokens=25, frequency_penalty=0.6, repetition_penalty=1.2),
    SamplingParams(seed=4, temperature=0.7, top_p=0.9, top_k=20, max_tokens=30, logprobs=True, top_logprobs=2),
    SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),  # runs into the cache limit
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return build_model("mha_tied")


def _generate(engine, prompts=PROMPTS, sampling=MIXED):
    llm = LLM.from_engine(engine, tools=False)
    return [c.outputs for c in llm.generate(prompts, sampling)], llm


def test_speculative_greedy_equals_plain_greedy_and_reports_acceptance(model):
    spec, llm = _generate(NeuronEngine(model, config(speculation=2)))
    plain, plain_llm = _generate(NeuronEngine(model, config()))
    assert llm.engine.capabilities.tokens_per_step == 2
    assert plain_llm.engine.capabilities.tokens_per_step == 1  # plain decoding is the default
    for a, b in zip(spec, plain):
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert [o.finish_reason for o in a] == [o.finish_reason for o in b]
    np.testing.assert_allclose(spec[2][0].logprobs, plain[2][0].logprobs, atol=1e-5)
    assert len(spec[3][0].token_ids) == LIMITS["max_cache_length"] - len(PROMPTS[3])  # up to the cache limit
    stats = llm.engine.speculation_stats(llm.scheduler.state)
    print("speculation on mha_tied (draft: 1 of 2 layers):", stats)
    assert stats["row_steps"] > 0 and 1.0 <= stats["tokens_per_step"] <= 2.0
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
    assert stats["tokens"] == stats["row_steps"] * (1 + stats["acceptance_rate"])
    report = llm.engine.bench_report()  # the engine's totals: here, its one decode state
    assert report["speculation_acceptance"] == stats["acceptance_rate"] and report["tokens_per_step"] == 2
    assert report["speculation_proposed"] == stats["row_steps"] and report["speculation_accepted"] == stats["tokens"] - stats["row_steps"]


@pytest.mark.parametrize("compiler", ["export", "inductor"])
def test_plain_greedy_equals_the_reference(model, compiler):
    got, _ = _generate(NeuronEngine(model, config(compiler=compiler)), PROMPTS[:2], MIXED[:2])
    want, _ = _generate(ReferenceEngine(model, EngineConfig(**LIMITS)), PROMPTS[:2], MIXED[:2])
    assert [o[0].token_ids for o in got] == [o[0].token_ids for o in want]


def test_async_equals_sync(model):
    sampling = MIXED[:3] + [SamplingParams(n=2, seed=8, max_tokens=12, presence_penalty=0.4)]
    runs = []
    for async_steps in (True, False):
        eng = NeuronEngine(model, config(async_steps=async_steps))
        assert eng.capabilities.async_results is async_steps
        outs, _ = _generate(eng, PROMPTS, sampling)
        runs.append([[(o.token_ids, o.logprobs) for o in c] for c in outs])
    assert runs[0] == runs[1]


def _reference_forced(model, prompt, sampling, forced_at, token, total):
    """The reference one token per step, forcing ``token`` at completion ``forced_at``."""
    ref = ReferenceEngine(model, EngineConfig(**LIMITS))
    params = ref.load_params()
    state = ref.init_decode_state()
    prefix, first = ref.prefill(params=params, tokens=prompt, sampling=sampling)
    state = ref.insert(prefix, state, 0)
    out = [int(first.tokens[0, 0])]
    while len(out) < total:
        overrides = None
        if len(out) == forced_at + 1:
            out[forced_at] = token
            overrides = {0: Override(token, forced_at)}
        state, res = ref.generate(params, state, overrides=overrides)
        out.append(int(res.tokens[0, 0]))
    return out


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0, frequency_penalty=1.5, repetition_penalty=1.3),
    SamplingParams(seed=21, temperature=0.9, presence_penalty=0.8, frequency_penalty=0.5),
], ids=["greedy-penalties", "sampled-penalties"])
def test_an_override_inside_a_speculative_step_rolls_back_counts_and_cache(model, sampling):
    """Force a token at the first position of a two-token result: the second is dropped,
    the penalty counts and the step counter roll back, and what follows equals the
    reference forced at the same position."""
    eng = NeuronEngine(model, config(async_steps=False, speculation=2))
    params, state = eng.load_params(), eng.init_decode_state()
    prompt = [1, 5, 9, 4, 2]
    prefix, first = eng.prefill(params=params, tokens=prompt, sampling=sampling)
    state = eng.insert(prefix, state, 2)
    out = [int(first.tokens[0, 0])]
    forced_at, last = None, 1
    while len(out) < 24:
        overrides = None
        if forced_at is None and last == 2 and len(out) >= 6:
            forced_at = len(out) - 2
            token = (out[forced_at] + 17) % eng.vocab_size
            del out[forced_at:]
            out.append(token)
            overrides = {2: Override(token, forced_at)}
        state, res = eng.generate(params, state, overrides=overrides)
        got = res.row_tokens(2)
        last = len(got)
        out.extend(got)
    assert forced_at is not None, "no step accepted a draft: the test did not reach its case"
    want = _reference_forced(model, prompt, sampling, forced_at, token, len(out))
    assert out == want


INDUCTOR = {"compiler": "inductor"}  # the compiler that keeps artifacts on disk (the default, export, keeps none)


def test_a_second_checkpoint_and_a_warm_start_compile_nothing(model, tmp_path):
    NeuronEngine(model, config(**INDUCTOR))  # the session cache holds this config (compiled here if run alone)
    before = dict(COUNTS)
    other = build_model("mha_tied", seed=99)
    eng = NeuronEngine(other, config(**INDUCTOR))
    assert COUNTS == before and {r["source"] for r in eng.compile_report} == {"memory"}
    # A new process with a fresh Inductor cache, every C++ build recorded (in-process:
    # one compile thread) and graph compilation disabled: it loads, builds no kernel.
    code = textwrap.dedent("""
        import json, torch
        import torch._inductor.cpp_builder as cb
        builds, build = [], cb.CppBuilder.build
        def spy(self):
            builds.append(self.get_target_file_path())
            return build(self)
        cb.CppBuilder.build = spy
        torch._inductor.standalone_compile = None  # any graph compile would fail here
        from polyengine import SamplingParams
        from polyengine.backends.neuron.compile import COUNTS
        from polyengine.backends.neuron.engine import NeuronEngine
        from polyengine.conformance.models import build_model
        from polyengine.driver import LLM
        from neuron_support import config
        eng = NeuronEngine(build_model("mha_tied", seed=99), config(compiler="inductor"))
        out = LLM.from_engine(eng, tools=False).generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=6))
        print(json.dumps({"counts": dict(COUNTS), "sources": sorted({r["source"] for r in eng.compile_report}),
                          "bench": sorted({r["source"] for r in eng.bench_report()["compile"]}),
                          "tokens": out[0].token_ids, "builds": builds}))
    """)
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "POLYENGINE_NEURON_CACHE": str(shared_cache()), "PYTHONPATH": os.path.dirname(__file__)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, "\n".join(line for line in proc.stderr.splitlines() if "Warning" in line) + proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["counts"].get("compiled", 0) == 0 and doc["sources"] == ["disk"] and len(doc["tokens"]) == 6
    assert doc["bench"] == ["cache"]
    # Inductor preprocesses its precompiled header once per process (g++ -E, to check
    # that the header is current); no kernel, header or wrapper is compiled.
    assert all(path.endswith(".i") for path in doc["builds"]), doc["builds"]
    want = LLM.from_engine(eng, tools=False).generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=6))
    assert doc["tokens"] == want[0].token_ids


def test_bench_report_has_a_row_per_graph_and_a_warm_engine_reports_only_cache(model):
    """The shape ``polyengine bench`` reads: ``compile`` rows (program, bucket, seconds,
    source) and scalar statistics; a second engine of the same config (another
    checkpoint) gets every graph from the cache."""
    before = COUNTS["compiled"]
    cold = NeuronEngine(model, config(speculation=2)).bench_report()  # compiled here, or loaded from the session
    programs = {("context_encoding", "prompt 24"), ("context_continuation", "prefix 24, prompt 24"),
                ("context_encoding", "batch 2, prompt 24"), ("context_encoding", "batch 4, prompt 24"),  # batched_prefill
                ("speculation", "batch 4, kv 65"), ("draft_token_generation", "batch 4, kv 65")}
    assert {(r["program"], r["bucket"]) for r in cold["compile"]} == programs
    for row in cold["compile"]:
        assert set(row) == {"program", "bucket", "seconds", "source"} and row["source"] in ("compiled", "cache")
        assert isinstance(row["seconds"], float) and row["seconds"] >= 0
    assert cold["graphs_compiled"] == COUNTS["compiled"] - before == sum(r["source"] == "compiled" for r in cold["compile"])
    assert all(isinstance(v, (int, float)) for k, v in cold.items() if k != "compile")
    assert cold["speculation_proposed"] == 0 and cold["tokens_per_step"] == 2
    warm = NeuronEngine(build_model("mha_tied", seed=99), config(speculation=2)).bench_report()
    assert [(r["program"], r["bucket"], r["source"]) for r in warm["compile"]] == [
        (r["program"], r["bucket"], "cache") for r in cold["compile"]]
    assert warm["graphs_compiled"] == 0 and warm["compile_seconds"] == 0.0 and warm["graphs_from_cache"] == 6
    plain = NeuronEngine(model, config()).bench_report()
    assert {r["program"] for r in plain["compile"]} == {"context_encoding", "context_continuation", "token_generation"}
    assert "speculation_acceptance" not in plain


def test_a_prompt_beyond_every_bucket_is_refused_naming_them(model):
    eng = NeuronEngine(model, config())
    with pytest.raises(InvalidRequest, match=r"fits no context-encoding bucket \(buckets: 24\)"):
        eng.prefill(params=eng.load_params(), tokens=list(range(1, 26)), sampling=SamplingParams(seed=1))


@pytest.mark.parametrize("compiler", ["export", "inductor"])
def test_no_recompilation_after_warm_up_over_a_random_workload(model, monkeypatch, tmp_path, compiler):
    """Random prompts over three prefill buckets, prompts continuing any earlier prefix
    (continued ones too) at any length, single and bulk inserts, frees, overrides
    anywhere in a slot's last result and mixed sampling: every call runs a graph the
    warm-up built. Compiling, exporting or loading anything afterwards fails the test.
    On ``export`` (the default) with speculation and three prefill buckets; on
    ``inductor`` plain decoding over the suite's one bucket (the graphs the warm-start
    test compiles: each Inductor graph costs 10-60 CPU s)."""
    options = dict(prefill_buckets=(8, 16, 24), speculation=2)
    files = None
    if compiler == "inductor":
        # A copy of the session's cache of this test's own: other processes of the session
        # (pytest -n 2's other worker) may add files to the shared one while this test
        # watches its copy for writes.
        cache = tmp_path / "cache"
        shutil.copytree(shared_cache(), cache, ignore=shutil.ignore_patterns(".*"))
        options = dict(compiler="inductor", cache_dir=str(cache))
    eng = NeuronEngine(model, config(**options))
    if compiler == "inductor":
        files = sorted(p.name for p in cache.iterdir())
    before = dict(COUNTS)
    import polyengine.backends.neuron.cache as cache_mod

    def refuse(*a, **k):
        raise AssertionError("a graph was compiled, exported or loaded after warm-up")

    monkeypatch.setattr(cache_mod, "compile_graph", refuse)
    monkeypatch.setattr(cache_mod, "load_graph", refuse)
    monkeypatch.setattr(torch._inductor, "standalone_compile", refuse)
    monkeypatch.setattr(torch.export, "export", refuse)
    rng = random.Random(20261130)
    params, state = eng.load_params(), eng.init_decode_state()
    live: dict[int, list[int]] = {}  # slot -> [prompt length, completion length, tokens in its last result]
    made: list = []  # earlier prefixes, which stay valid and may be continued
    continued = 0
    for _ in range(120):
        free = [s for s in range(eng.max_concurrent_decodes) if s not in live]
        if free and rng.random() < 0.4:
            head = rng.choice(made) if made and rng.random() < 0.5 else None
            if head is not None and head.true_length >= 24:
                head = None
            room = 24 - (0 if head is None else head.true_length)
            continued += head is not None
            prompt = [rng.randrange(eng.vocab_size) for _ in range(rng.randint(1, room))]
            sp = SamplingParams(seed=rng.randrange(2**64), temperature=rng.choice([0, 0.5, 1.3]),
                                top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.8]), min_p=rng.choice([0, 0.1]),
                                frequency_penalty=rng.choice([0, 0.7]), logit_bias={rng.randrange(256): 2.0},
                                logprobs=True, top_logprobs=rng.randint(0, 5), n=min(len(free), rng.randint(1, 3)))
            prefix, _ = eng.prefill(params=params, tokens=prompt, sampling=sp, existing_prefix=head)
            made.append(prefix)
            if sp.n == 1:
                state = eng.insert(prefix, state, free[0])
            else:
                state, _ = eng.bulk_insert(prefix, state, free[: sp.n])
            live.update({s: [prefix.true_length, 1, 1] for s in free[: sp.n]})
        if live and rng.random() < 0.15:
            slot = rng.choice(sorted(live))
            state = eng.free_resource(state, slot)
            del live[slot]
        overrides = {slot: Override(rng.randrange(eng.vocab_size), length - rng.randint(1, last))
                     for slot, (_, length, last) in live.items() if last and rng.random() < 0.2}
        state, res = eng.generate(params, state, overrides=overrides)
        for slot in list(live):
            live[slot][1:] = [int(res.lengths[slot]), int(res.valid[slot].sum())]
            if live[slot][0] + live[slot][1] >= eng.max_cache_length:
                state = eng.free_resource(state, slot)
                del live[slot]
    assert COUNTS == before and continued > 5
    if files is not None:
        assert sorted(p.name for p in cache.iterdir()) == files


def test_export_keeps_nothing_on_disk_and_exports_a_configuration_once(model, tmp_path, monkeypatch):
    """The default CPU compiler: no artifact file (nor the cache folder) is written, a
    second engine of the same configuration (another checkpoint) exports nothing, and
    ``cache_dir``, which it would not use, is refused rather than ignored."""
    root = tmp_path / "never"
    monkeypatch.setenv("POLYENGINE_NEURON_CACHE", str(root))
    cfg = EngineConfig(**{**LIMITS, "max_cache_length": 48})  # a cache of its own: exported here, not by another test
    first = NeuronEngine(model, cfg)
    assert first.compiler == "export" and first.device.startswith("cpu (compile path: torch.export, run without")
    assert {r["source"] for r in first.compile_report} == {"compiled"} and not root.exists()
    before = dict(COUNTS)
    second = NeuronEngine(build_model("mha_tied", seed=99), cfg)
    assert COUNTS == before and {r["source"] for r in second.compile_report} == {"memory"}
    with pytest.raises(InvalidRequest, match="option cache_dir applies to the compilers that keep artifacts"):
        NeuronEngine(model, EngineConfig(**LIMITS, options={"cache_dir": str(tmp_path)}))


def test_an_exported_graph_refuses_shapes_outside_its_bucket(model):
    """A static graph runs only with its bucket's shapes and dtypes (eager ops would
    accept others): a prompt padded to the wrong bucket is refused, naming the input."""
    eng = NeuronEngine(model, config())
    graph, weights = eng.graphs[("context", 24)], tuple(eng.load_params().tensors[n] for n in eng._names)
    logits, _, _ = graph(weights, torch.zeros((1, 24), dtype=torch.int64), torch.tensor([3]))
    assert logits.shape == (1, eng.vocab_size)
    with pytest.raises(ValueError, match=r"static graph called outside its bucket \(input \d+: \(\(1, 16\)"):
        graph(weights, torch.zeros((1, 16), dtype=torch.int64), torch.tensor([3]))
    with pytest.raises(ValueError, match="outside its bucket"):
        graph(weights, torch.zeros((1, 24), dtype=torch.int32), torch.tensor([3]))


@pytest.mark.neuron
def test_on_neuron_hardware_greedy_equals_the_reference(model, tmp_path):
    """Where Neuron devices, torch-neuronx and neuronx-distributed are present: the same
    graphs as one NxD model on the NeuronCores give the reference's greedy tokens."""
    eng = NeuronEngine(model, EngineConfig(**LIMITS, dtype="float32", options={
        "compiler": "neuronx", "cache_dir": str(tmp_path)}))
    got, _ = _generate(eng, PROMPTS[:2], MIXED[:2])
    want, _ = _generate(ReferenceEngine(model, EngineConfig(**LIMITS)), PROMPTS[:2], MIXED[:2])
    assert [o[0].token_ids for o in got] == [o[0].token_ids for o in want]


def test_speculation_is_one_option_away_and_refused_where_it_cannot_apply(model):
    """Plain decoding by default; ``speculation=k`` turns it on; a draft of a 1-layer model,
    or draft_layers without speculation, is refused before anything compiles."""
    assert NeuronEngine.OPTIONS["speculation"].default == 1
    one_layer = build_model("mha_tied").config.model_copy(update={"num_hidden_layers": 1})
    weights = {k: v for k, v in model.weights.items() if not k.startswith("model.layers.1.")}
    from polyengine.models import Model

    with pytest.raises(InvalidRequest, match="needs a model of 2 layers or more"):
        NeuronEngine(Model(one_layer, weights), config(speculation=2))
    with pytest.raises(InvalidRequest, match="draft_layers=1 applies only with speculation >= 2"):
        NeuronEngine(model, config(draft_layers=1))
    with pytest.raises(InvalidRequest, match="speculation=0 of backend .neuron.: must be >= 1"):
        NeuronEngine(model, config(speculation=0))
