"""The tpu_jax backend on this machine's JAX platform (the CPU here): discovery,
refusals, compilation, portable prefixes across backends, and the observability
switches. The whole conformance suite runs on it in tests/test_conformance_cli.py, the
driver smoke test in tests/test_backend_smoke.py; sharding, quantization and Ray have
files of their own (tests/test_tpu_jax_{sharding,quant,ray}.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import importlib.util  # noqa: E402

jax = pytest.importorskip("jax")
if importlib.util.find_spec("torchax") is None:  # not importorskip: torchax imports only through compat
    pytest.skip("torchax is not installed (pip install 'polyengine[tpu]')", allow_module_level=True)
from polyengine.backends.tpu_jax.compat import import_torchax  # noqa: E402

import_torchax()

import polyengine  # noqa: E402
from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.backends.reference.engine import ReferenceEngine  # noqa: E402
from polyengine.backends.tpu_jax import plugin  # noqa: E402
from polyengine.backends.tpu_jax.engine import TpuJaxEngine  # noqa: E402
from polyengine.driver import LLM  # noqa: E402
from polyengine.errors import InvalidRequest, UnsafeCache  # noqa: E402
from polyengine.models import load_model  # noqa: E402
from polyengine.plugins import reset_registry  # noqa: E402
from polyengine.prefix import PortablePrefix  # noqa: E402

from imports import assert_imports_light  # noqa: E402

CFG = EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=64)


pytestmark = pytest.mark.usefixtures("jax_compile_less")  # tiny models: compile time over run time


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny-gqa")


@pytest.fixture(scope="module")
def engine(model):
    """One engine for the tests that only drive it (its programs compile once)."""
    return TpuJaxEngine(model, CFG)


# -- discovery ----------------------------------------------------------------------------


def test_listing_backends_imports_no_jax_torch_or_ray():
    assert_imports_light("import polyengine; bs = {b.name: b for b in polyengine.list_backends()}; "
                         "assert bs['tpu_jax'].probe().available and bs['tpu_jax_ray'].probe().available")


def test_a_present_tpu_ranks_first_and_its_cpu_path_below_the_cpu_backend(monkeypatch):
    reset_registry()
    try:
        assert polyengine.select_backend("auto").name == "cpu"  # no TPU, no GPU here
        order = {b.name: b.spec.priority for b in polyengine.list_backends()}
        assert order["reference"] < order["tpu_jax"] < order["cpu"]
        monkeypatch.setattr(plugin, "tpu_devices", lambda: ["/dev/vfio/0"])
        monkeypatch.setattr(plugin, "libtpu_installed", lambda: True)
        reset_registry()
        info = polyengine.select_backend("auto")
        assert info.name == "tpu_jax" and info.probe().accelerator and info.spec.accelerator_priority > 100
        monkeypatch.setattr(plugin, "libtpu_installed", lambda: False)  # device files alone: no TPU runtime
        assert not plugin.probe().accelerator and "libtpu" in plugin.probe().reason
    finally:
        reset_registry()


# -- engine behaviour ---------------------------------------------------------------------


@pytest.mark.parametrize(("options", "phrase"), [
    ({"quantize": "int4"}, "quantize='int4'"),
    ({"kv_quantize": "fp8"}, "kv_quantize='fp8'"),
    ({"attention": "flash"}, "attention='flash'"),
    ({"platform": "no_such_platform"}, "platform='no_such_platform'"),
    ({"candidates": 0}, "candidates=0"),
    ({"tensor_parallel": 4}, "4 devices but only 1"),
    ({"sharding_rules": {"heads": "pp"}}, "'heads' to 'pp'"),
    ({"sharding_rules": {"experts": "tp"}}, "'experts'"),
])
def test_bad_options_are_refused_before_anything_compiles(model, options, phrase):
    with pytest.raises(InvalidRequest) as exc:
        TpuJaxEngine(model, CFG.model_copy(update={"options": options}))
    assert phrase in str(exc.value)


@pytest.mark.parametrize("buckets", [(8, 16, 24), (24,), (5, 7, 24)])
def test_continuation_pairs_are_exactly_the_reachable_ones(model, buckets):
    """Warm-up's (prefix bucket, new tokens bucket) pairs equal those found by running
    every chain of continuations a request can make (prefix lengths and buckets as the
    engine stores them), with no pair left out and none extra."""
    eng = TpuJaxEngine(model, CFG.model_copy(update={"prefill_buckets": buckets}))
    limit, bucket = CFG.max_prefill_length, eng.config.bucket_for
    seen, states = set(), {(bucket(s), s) for s in range(1, limit)}
    todo = list(states)
    while todo:
        p, s = todo.pop()
        for n in range(1, limit - s + 1):
            seen.add((p, bucket(n)))
            nxt = (eng.continued_bucket(p, bucket(n)), s + n)
            if s + n < limit and nxt not in states:
                states.add(nxt)
                todo.append(nxt)
    assert eng.continuation_pairs() == sorted(seen)


@pytest.mark.parametrize("paged", [{}, {"page_size": 16, "kv_pages": 128}], ids=["contiguous", "paged"])
def test_no_compilation_after_warmup_whatever_the_workload(model, paged):
    """Warm-up compiles every bucket; then a randomized mix (prompt lengths over every
    bucket, n, greedy and sampled requests with every parameter, overrides, frees and
    re-inserts, exported and imported prefixes, prompts continuing earlier prefixes,
    continued ones included, at any length) compiles nothing: every program is counted
    through jax.monitoring's backend-compile event. Paged K/V too (tests/test_tpu_jax_paged.py),
    every page-table width bucket warmed up; its pool is bounded (kv_pages), large enough
    for every prefix the workload keeps: an unbounded pool that grows has a new shape,
    compiled once per size."""
    compiles: list[str] = []

    def listener(event, seconds, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kw.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        eng = TpuJaxEngine(model, CFG.model_copy(update={"options": {"warmup": True, **paged},
                                                          "prefill_buckets": (8, 16, 24)}))
        params = eng.load_params()
        warm = len(compiles)
        assert warm > 0
        report = eng.bench_report()
        _check_bench_report(report, eng)
        assert len(report["compile"]) == warm  # every compilation is attributed to the engine
        # Bucket 8 is this test's own (the module's engine has 16 and 24): compiled here.
        rows = {(r["program"], r["bucket"]): r["source"] for r in report["compile"]}
        if paged:  # a prefill's K/V into pages (the prefill program is the contiguous run's, reused), and
            # one decode program per page-table width bucket (64 positions in pages of 16: 1, 2, 4 pages)
            assert rows[("write_pages_step", "8")] == "compiled", rows
            assert {b for p, b in rows if p == "paged_forward_step"} == {"1", "2", "4"}, rows
        else:
            assert rows[("prefill_step", "8")] == rows[("insert_kv_step", "8")] == "compiled", rows
        state = eng.init_decode_state()
        rng = np.random.default_rng(0)
        live: dict[int, int] = {}  # slot -> prompt length
        made: list = []  # prefixes that may be continued (any earlier one: they stay valid)
        for step in range(80):
            free = [s for s in range(CFG.max_slots) if s not in live]
            if free and rng.random() < 0.5:
                n = int(rng.integers(1, len(free) + 1))
                sp = _random_request(rng, eng.vocab_size, n)
                head = made[int(rng.integers(len(made)))] if made and rng.random() < 0.5 else None
                room = CFG.max_prefill_length - (0 if head is None else head.true_length)
                if room < 1:
                    head, room = None, CFG.max_prefill_length
                prompt = rng.integers(0, eng.vocab_size, int(rng.integers(1, room + 1))).tolist()
                prefix, _ = eng.prefill(params=params, tokens=prompt, sampling=sp, existing_prefix=head)
                if rng.random() < 0.3:
                    prefix = eng.import_prefix(eng.export_prefix(prefix))
                made.append(prefix)
                slots = [int(s) for s in rng.choice(free, n, replace=False)]
                if n == 1 and rng.random() < 0.5:
                    state = eng.insert(prefix, state, slots[0])
                else:
                    state, _ = eng.bulk_insert(prefix, state, slots)
                live.update({s: prefix.true_length for s in slots})
            overrides = {s: int(rng.integers(eng.vocab_size)) for s in live if rng.random() < 0.2}
            state, result = eng.generate(params, state, overrides=overrides)
            full = {s for s, n in live.items() if n + result.lengths[s] >= CFG.max_cache_length}
            assert all(result.valid[s, 0] for s in set(live) - full) and not any(result.valid[s, 0] for s in full)
            for s in list(live):
                if rng.random() < 0.15 or s in full:
                    state = eng.free_resource(state, s)
                    del live[s]
        assert compiles[warm:] == [], f"compiled after warm-up: {compiles[warm:]}"
        assert eng.bench_report()["compile"] == report["compile"]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _greedy_run(engine, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int]]:
    """Prefill ``prompt`` greedily into slot 0 and decode ``steps`` tokens: (the prefix's
    logits on the host, the tokens)."""
    params = engine.load_params()
    sp = SamplingParams(temperature=0, ignore_eos=True)
    prefix, _ = engine.prefill(params=params, tokens=prompt, sampling=sp)
    logits = np.asarray(prefix.to_host(prefix.logits), np.float64)
    state = engine.insert(prefix, engine.init_decode_state(), 0)
    tokens = [prefix.first_token]
    for _ in range(steps):
        state, result = engine.generate(params, state)
        tokens.append(int(result.tokens[0, 0]))
    engine.free_resource(state, 0)
    return logits, tokens


def test_engines_share_programs_by_shape_and_keep_their_own_weights(model):
    """Programs are cached per static config, weights are arguments: a second engine of
    the same shapes with other weights compiles nothing and gives its own weights'
    results (the reference's for each model, and not the first engine's); an engine of
    another model shape (a wider MLP) compiles its own model programs (prefill, the
    decode forward) and none of the slot rows' programs (the sampler's), which depend on
    the vocabulary, slots and mesh only, nor the KV cache's (the empty cache, the K/V
    half of insert, the prefix copy), which depend on the K/V shape only."""
    from polyengine.models import Model, ModelConfig

    rng = np.random.default_rng(11)
    weights = {name: (1.0 if name.endswith("norm.weight") else 0.0) + 0.2 * rng.standard_normal(shape)
               for name, shape in model.config.weight_shapes().items()}
    twin = Model(model.config, {n: w.astype(np.float32) for n, w in weights.items()}, source="twin")
    wide = model.config.model_copy(update={"intermediate_size": 2 * model.config.intermediate_size})
    assert isinstance(wide, ModelConfig)
    other_shape = Model(wide, {n: (1.0 if n.endswith("norm.weight") else 0.0) + 0.2 * rng.standard_normal(s).astype(
        np.float32) for n, s in wide.weight_shapes().items()}, source="wide")
    compiles: list[str] = []

    def listener(event, seconds, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kw.get("fun_name", "?").removeprefix("jit(").removesuffix(")"))

    prompt = [1, 9, 4, 4, 7, 2, 30, 5]
    first = TpuJaxEngine(model, CFG)
    first_logits, first_tokens = _greedy_run(first, prompt, 6)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        got = {}
        for m in (twin, other_shape):
            compiles.clear()
            got[m.source] = _greedy_run(TpuJaxEngine(m, CFG), prompt, 6), sorted(compiles)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    for m in (model, twin, other_shape):
        logits, tokens = first_logits, first_tokens
        if m is not model:
            (logits, tokens), compiled = got[m.source]
        want_logits, want_tokens = _greedy_run(ReferenceEngine(m, CFG), prompt, 6)
        assert np.abs(logits - want_logits).max() < 1e-4 * max(1.0, np.abs(want_logits).max()), m.source
        assert tokens == want_tokens, m.source
    (twin_logits, twin_tokens), twin_compiled = got["twin"]
    assert twin_compiled == [], twin_compiled
    assert np.abs(twin_logits - first_logits).max() > 0.1 and twin_tokens != first_tokens
    assert got["wide"][1] == ["forward_step", "prefill_step"], got["wide"][1]


def test_a_prefill_and_the_continuations_in_its_bucket_share_one_program(model):
    """``prefill_step`` is one program per (new tokens bucket, output bucket): a plain
    prefill is the continuation of an empty prefix. On the ladder (16, 24) a continuation
    of a bucket-16 prefix by 17 tokens (bucket 24, stored in 24) runs the plain 24-token
    prefill's executable, and one by 8 tokens (bucket 16, stored in 24) compiles the one
    program (16 in 24) that a bucket-24 prefix continued by 3 tokens then reuses. Each
    result equals a plain prefill of the whole prompt."""
    from polyengine.models import Model

    rng = np.random.default_rng(5)
    # Another MLP width: no other test's engine compiled this model's programs.
    cfg = model.config.model_copy(update={"intermediate_size": 3 * model.config.intermediate_size})
    fresh = Model(cfg, {n: (1.0 if n.endswith("norm.weight") else 0.0) + 0.2 * rng.standard_normal(s).astype(np.float32)
                        for n, s in cfg.weight_shapes().items()}, source="fresh")
    eng = TpuJaxEngine(fresh, CFG)
    params = eng.load_params()
    sp = SamplingParams(temperature=0, logprobs=True)
    prompt = rng.integers(0, eng.vocab_size, CFG.max_prefill_length).tolist()

    def prefill_programs(run):
        """``run()``'s result and the model programs it compiled (the prefix copy and the
        first token's sampler are not the model's)."""
        before = len(eng.compiles.rows)
        out = run()
        rows = eng.compiles.rows[before:]
        return out, [(r["program"], r["bucket"]) for r in rows if r["program"] not in ("widen_prefix", "first_token_step")]

    def same(prefix, n):
        whole, _ = eng.prefill(params=params, tokens=prompt[:n], sampling=sp)
        got, want = (np.asarray(p.to_host(p.logits)) for p in (prefix, whole))
        assert prefix.true_length == n and prefix.first_token == whole.first_token
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())

    _, compiled = prefill_programs(lambda: eng.prefill(params=params, tokens=prompt[:22], sampling=sp))
    assert compiled == [("prefill_step", "24")]
    (head, _), compiled = prefill_programs(lambda: eng.prefill(params=params, tokens=prompt[:5], sampling=sp))
    assert compiled == [("prefill_step", "16")]
    (longer, _), compiled = prefill_programs(
        lambda: eng.prefill(params=params, tokens=prompt[5:22], sampling=sp, existing_prefix=head))
    assert compiled == [] and longer.kv.k.shape[2] == 24  # the plain prefill's (24, 24) program
    same(longer, 22)
    (mid, _), compiled = prefill_programs(
        lambda: eng.prefill(params=params, tokens=prompt[5:13], sampling=sp, existing_prefix=head))
    assert compiled == [("prefill_step", "16 in 24")] and mid.kv.k.shape[2] == 24
    same(mid, 13)
    (last, _), compiled = prefill_programs(
        lambda: eng.prefill(params=params, tokens=prompt[13:16], sampling=sp, existing_prefix=mid))
    assert compiled == []
    same(last, 16)


def _check_bench_report(report: dict, eng: TpuJaxEngine) -> None:
    """The shape ``polyengine bench`` reads: ``compile`` rows, scalars otherwise."""
    for row in report["compile"]:
        assert set(row) == {"program", "bucket", "seconds", "source"}, row
        assert isinstance(row["program"], str) and isinstance(row["bucket"], str), row
        assert isinstance(row["seconds"], float) and row["seconds"] >= 0 and row["source"] in ("compiled", "cache"), row
    scalars = {k: v for k, v in report.items() if k != "compile"}
    assert all(isinstance(v, (str, int, float)) for v in scalars.values()), scalars
    assert report["devices"] == 1 and report["mesh"] == eng.plan.describe() and report["warm-up seconds"] > 0


def test_the_compile_log_tells_xla_compiles_from_persistent_cache_reads(tmp_path):
    """bench_report's ``source``: a program read from JAX's persistent compilation
    cache is ``"cache"``. A subprocess: the cache settings are process-wide."""
    code = f"""
import jax, jax.numpy as jnp
from polyengine.backends.tpu_jax.observe import CompileLog
jax.config.update("jax_compilation_cache_dir", {str(tmp_path)!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
x = jnp.ones(3)
def program():  # a new function each time: same HLO, nothing reused in memory
    def double(x):
        return x * 2 + 1
    return jax.jit(double)
log = CompileLog(per_bucket=("double",))
with log.track(16):
    program()(x)
with log.track(32):
    program()(x)
program()(x + 1)  # not tracked
print([(r["program"], r["bucket"], r["source"]) for r in log.rows])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[('double', '16', 'compiled'), ('double', '32', 'cache')]", out.stderr[-2000:]


def _random_request(rng, vocab: int, n: int) -> SamplingParams:
    kw = {"seed": int(rng.integers(0, 2**63)), "n": n, "temperature": float(rng.choice([0.0, 0.7, 1.3]))}
    for key, values in (("top_k", [0, 1, 5, 200]), ("top_p", [1.0, 0.5, 0.95]), ("min_p", [0.0, 0.1]),
                        ("repetition_penalty", [1.0, 1.3]), ("presence_penalty", [0.0, 0.5]),
                        ("frequency_penalty", [0.0, -0.5]), ("min_tokens", [0, 3]), ("top_logprobs", [0, 3, 20])):
        kw[key] = values[int(rng.integers(len(values)))]
    kw["logprobs"] = kw["top_logprobs"] > 0 or bool(rng.random() < 0.3)
    if rng.random() < 0.3:
        kw["logit_bias"] = {int(rng.integers(vocab)): 3.0}
    if rng.random() < 0.3:
        kw["stop_token_ids"] = [int(rng.integers(vocab))]
    return SamplingParams(**kw)


def test_option_compile_cache_keeps_programs_for_the_next_process(tmp_path):
    """``compile_cache``: a second process reads every program of the same engine from
    the private folder instead of compiling it, and gets the same tokens; a relative
    path and a folder others can write are refused before anything compiles."""
    folder = tmp_path / "jax-cache"
    code = f"""
import json
from polyengine import EngineConfig, SamplingParams
from polyengine.backends.tpu_jax.engine import TpuJaxEngine
from polyengine.models import load_model
eng = TpuJaxEngine(load_model("random:tiny-gqa"), EngineConfig(max_slots=2, max_prefill_length=8, max_cache_length=16,
                   options={{"compile_cache": {str(folder)!r}}}))
params = eng.load_params()
prefix, _ = eng.prefill(params=params, tokens=[1, 5, 9], sampling=SamplingParams(temperature=0, ignore_eos=True))
state, out = eng.generate(params, eng.insert(prefix, eng.init_decode_state(), 0))
print(json.dumps([[r["program"], r["source"]] for r in eng.bench_report()["compile"]] + [int(out.tokens[0, 0])]))
"""
    env = {**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    (*first, token1), (*second, token2) = runs
    assert first and {s for _, s in first} == {"compiled"}, first
    assert [p for p, _ in second] == [p for p, _ in first] and {s for _, s in second} == {"cache"}, second
    assert token1 == token2
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    model = load_model("random:tiny-gqa")
    with pytest.raises(InvalidRequest, match="relative path"):
        TpuJaxEngine(model, CFG.model_copy(update={"options": {"compile_cache": "jax-cache"}}))
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(UnsafeCache, match="another user could plant"):
        TpuJaxEngine(model, CFG.model_copy(update={"options": {"compile_cache": str(shared)}}))


# -- portable prefixes across backends ---------------------------------------------------


def _continue(engine, prefix, steps: int) -> list[int]:
    params = engine.load_params()
    state = engine.insert(prefix, engine.init_decode_state(), 1)
    tokens = [prefix.first_token]
    for _ in range(steps):
        state, result = engine.generate(params, state)
        tokens.append(int(result.tokens[1, 0]))
    return tokens


@pytest.mark.parametrize("other", ["reference", "cuda_torch"])
def test_portable_prefixes_cross_backends_both_ways(model, engine, other):
    """A prefix exported by the reference (or cuda_torch) backend imports and decodes
    here, and ours there: greedy continuations equal those of the exporting backend."""
    if other == "reference":
        peer = ReferenceEngine(model, CFG)
    else:
        pytest.importorskip("torch")
        from polyengine.backends.cpu.engine import CpuEngine

        peer = CpuEngine(model, CFG)
    prompt, sp = [1, 9, 4, 4, 7, 2], SamplingParams(temperature=0, seed=5, ignore_eos=True)
    for src, dst in ((peer, engine), (engine, peer)):
        prefix, _ = src.prefill(params=src.load_params(), tokens=prompt, sampling=sp)
        want = _continue(src, prefix, 8)
        data = src.export_prefix(prefix).to_bytes()  # what crosses hosts: safetensors bytes
        got = _continue(dst, dst.import_prefix(PortablePrefix.from_bytes(data)), 8)
        assert got == want, (src.name, dst.name)


# -- observability -----------------------------------------------------------------------


def test_memory_reports_after_load_and_warmup_and_a_trace(model, tmp_path):
    eng = TpuJaxEngine(model, CFG.model_copy(update={"options": {"trace_dir": str(tmp_path), "trace_steps": 2}}))
    params = eng.load_params()
    eng.warmup()
    for when in ("after weights load", "after warm-up"):
        report = eng.memory_reports[when]
        assert report["device_bytes_in_use"] > 0 and report["host_bytes_resident"] > 0, report
        assert report["host_bytes_limit"] >= report["host_bytes_resident"]
    assert eng.memory_reports["after warm-up"]["device_bytes_in_use"] >= eng.memory_reports["after weights load"]["device_bytes_in_use"]
    state = eng.init_decode_state()
    prefix, _ = eng.prefill(params=params, tokens=[1, 2, 3], sampling=SamplingParams(seed=1))
    state = eng.insert(prefix, state, 0)
    for _ in range(3):
        state, _ = eng.generate(params, state)
    assert not eng.profiler.tracing and eng.profiler.steps == 2
    assert list(tmp_path.rglob("*.xplane.pb")), "no trace file written"


def test_the_torchax_compatibility_module_adds_only_missing_overloads():
    import torch

    from polyengine.backends.tpu_jax.compat import REMOVED_OVERLOADS, RemovedOverload, import_torchax

    import_torchax()
    for op, overload in REMOVED_OVERLOADS:
        packet = getattr(torch.ops.aten, op)
        assert hasattr(packet, overload)
    present = getattr(torch.ops.aten.prod, "dim_int")
    assert not isinstance(present, RemovedOverload)


@pytest.mark.tpu
def test_on_a_tpu(model):
    """On TPU hardware: the engine runs on the chips in bfloat16 by default, and its
    greedy tokens follow the reference's except at bfloat16 near ties (the reference
    margin at the first divergence is below the conformance suite's bf16 tie_gap)."""
    from polyengine.sampling import raw_logprobs

    eng = TpuJaxEngine(model, CFG)
    assert eng.device.startswith("tpu") and eng.dtype == "bfloat16"
    ref = ReferenceEngine(model, CFG)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = [1, 5, 9, 4, 2]
    got = LLM.from_engine(eng, tools=False).generate([prompt], sp)[0].outputs[0].token_ids
    want = LLM.from_engine(ref, tools=False).generate([prompt], sp)[0].outputs[0].token_ids
    step = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if step is not None:
        prefix, _ = ref.prefill(params=ref.load_params(), tokens=prompt + want[:step], sampling=SamplingParams(seed=0))
        top2 = np.sort(raw_logprobs(prefix.host_logits()))[-2:]
        assert top2[1] - top2[0] < 0.2, (step, got, want)
