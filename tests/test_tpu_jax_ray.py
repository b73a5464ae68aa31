"""The Ray engines of tpu_jax on a simulated two-node Ray cluster on this machine.

One cluster serves every test here (``ray.cluster_utils.Cluster``: a head node and a
second node, each a raylet with its own object store, all on loopback): engines with
default placement run two local workers, ``spread_workers`` puts one on each node.
The tests start Ray themselves and shut it down; nothing listens beyond loopback
(checked). Order matters only for cost: the worker-death test runs last, since it
kills the shared workers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time

import pytest

# Read when ray is imported: every Ray listener on 127.0.0.1, no token under ~/.ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
pytest.importorskip("jax")
ray = pytest.importorskip("ray")

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.driver import LLM  # noqa: E402
from polyengine.errors import InvalidRequest  # noqa: E402
from polyengine.models import load_model  # noqa: E402

from polyengine.backends.tpu_jax.ray_engine import RayTpuEngine, WorkerLost  # noqa: E402

pytest_plugins = ["pytester"]
CFG = EngineConfig(max_slots=4, max_prefill_length=24, max_cache_length=64)
PROMPTS = [[1, 5, 9, 4, 2], [1, 7, 3], [1, 2, 8, 8, 2, 6, 6]]
SAMPLING = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), SamplingParams(seed=3, max_tokens=9, n=2),
            SamplingParams(seed=4, temperature=0.7, top_p=0.9, max_tokens=10, logprobs=True, top_logprobs=2)]


def _public_listeners() -> set[tuple[str, int]]:
    """TCP sockets listening on an address other than loopback (from /proc/net)."""
    out = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            addr, port = fields[1].split(":")
            if name == "tcp":
                ip = ".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0))
                loop = ip.startswith("127.")
            else:  # ::1, or ::ffff:127.x.x.x
                loop = addr in ("00000000000000000000000001000000",) or (addr[:24] == "0000000000000000FFFF0000" and addr[-2:] == "7F")
                ip = addr
            if not loop:
                out.add((ip, int(port, 16)))
    return out


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:
        pytest.skip("ray was imported before this module could keep it on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER)")
    if ray.is_initialized():
        ray.shutdown()
    before = _public_listeners()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths are length-limited
    # Ray records the cluster's address in its default temp folder whatever temp_dir says,
    # and fails if that folder does not exist (a fresh machine, or another run removed it).
    from ray._common.utils import get_ray_address_file

    os.makedirs(os.path.dirname(get_ray_address_file(None)), exist_ok=True)
    # The workers inherit JAX_* settings: tiny models compile faster unoptimized.
    optimizations = os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS")
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    small = 80 * 2**20
    # Logical CPUs (a worker reserves one): room for the worker groups the tests keep
    # alive at once (two workers, two spread ones, a prefill worker, replacements).
    # Ray starts its workers at niceness 15; beside the other test worker (pytest -n 2)
    # and the background neuron run they got the leftovers of the CPU, and this file took
    # 18 minutes. The raylets read RAY_* settings from their environment.
    niceness = os.environ.get("RAY_worker_niceness")
    os.environ["RAY_worker_niceness"] = "0"
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "object_store_memory": small, "include_dashboard": False, "temp_dir": temp})
    c.add_node(num_cpus=4, object_store_memory=small)
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield {"listeners_before": before, "cluster": c}
    finally:
        ray.shutdown()
        c.shutdown()
        if niceness is None:
            os.environ.pop("RAY_worker_niceness", None)
        else:
            os.environ["RAY_worker_niceness"] = niceness
        shutil.rmtree(temp, ignore_errors=True)
        if optimizations is None:
            os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
        else:
            os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = optimizations


@pytest.fixture(scope="module")
def model():
    return load_model("random:tiny-gqa")


@pytest.fixture(scope="module")
def single_process(model):
    from polyengine.backends.tpu_jax.engine import TpuJaxEngine

    return [[o.token_ids for o in c.outputs] for c in LLM.from_engine(TpuJaxEngine(model, CFG), tools=False).generate(PROMPTS, SAMPLING)]


def _tokens(engine) -> list[list[list[int]]]:
    return [[o.token_ids for o in c.outputs] for c in LLM.from_engine(engine, tools=False).generate(PROMPTS, SAMPLING)]


@pytest.mark.slow
def test_two_workers_equal_the_single_process_engine_on_loopback(cluster, model, single_process):
    eng = RayTpuEngine(model, CFG)
    info = eng.group.info
    assert [i["rank"] for i in info] == [0, 1] and all(i["process_count"] == 2 and i["devices"] == 2 for i in info)
    # XLA:CPU's memory-minimizing scheduler in every worker (xla_flags.py): set by the worker,
    # or inherited from this process's XLA_FLAGS, where importing the steps had set it
    from polyengine.backends.tpu_jax.xla_flags import FLAG

    assert all(i["scheduler"] in ("set", "user") and FLAG in i["xla_flags"] for i in info), info
    assert "tp=2" in eng.device  # the two KV heads split over the two processes
    assert _tokens(eng) == single_process
    new = _public_listeners() - cluster["listeners_before"]
    assert not new, f"listening beyond loopback: {new}"


@pytest.mark.slow
def test_workers_spread_over_the_two_nodes(cluster, model, single_process):
    eng = RayTpuEngine(model, CFG.model_copy(update={"options": {"spread_workers": True, "devices_per_worker": 2}}))
    nodes = {i["node"] for i in eng.group.info}
    assert len(nodes) == 2 and {n["NodeID"] for n in ray.nodes() if n["Alive"]} == nodes
    assert all(i["devices"] == 4 and i["local_devices"] == 2 for i in eng.group.info)
    assert _tokens(eng) == single_process


@pytest.mark.slow
def test_batched_prefill_on_the_ray_engine(cluster, model, single_process):
    """Option batched_prefill=on: the leader declares the capability and its prefill_batch
    is one call of the workers' engines; each entry, fresh or continuing a prefix, gives
    the prompt, first token and logits that prefill gives on the same engine, and the
    driver (which batches a step's pieces) gives the single-process engine's outputs."""
    import numpy as np

    from polyengine.engine import PrefillRequest

    plain = RayTpuEngine(model, CFG)
    assert not plain.capabilities.batched_prefill  # "auto" on the CPU: off, as tpu_jax
    del plain
    eng = RayTpuEngine(model, CFG.model_copy(update={"options": {"batched_prefill": "on"}}))
    assert eng.capabilities.batched_prefill
    params, greedy = eng.load_params(), SamplingParams(temperature=0, max_tokens=4)
    head, _ = eng.prefill(params=params, tokens=[1, 5, 9], sampling=greedy)
    requests = [PrefillRequest(tokens=[1, 7, 3], sampling=greedy),
                PrefillRequest(tokens=[4, 2], sampling=greedy, existing_prefix=head),
                PrefillRequest(tokens=PROMPTS[2], sampling=greedy)]
    for req, (prefix, first) in zip(requests, eng.prefill_batch(params=params, requests=requests)):
        alone, want = eng.prefill(params=params, tokens=req.tokens, sampling=req.sampling,
                                  existing_prefix=req.existing_prefix)
        assert list(prefix.prompt_tokens) == list(alone.prompt_tokens)
        assert first.tokens[0, 0] == want.tokens[0, 0]
        np.testing.assert_allclose(prefix.host_logits(), alone.host_logits(), rtol=1e-5, atol=1e-5)
    assert _tokens(eng) == single_process


@pytest.mark.slow
def test_batched_prefill_rule_on_the_ray_engine(cluster, pytester, tmp_path):
    """The conformance suite's prefill_batch rule (18g) and its differential programs (the
    driver batching a step's pieces) on the Ray engine with option batched_prefill=on,
    where prefill_batch is one call of the workers' engines."""
    from differential_report import SHAPE_MODELS_ONLY

    report = tmp_path / "ray-batched.json"
    rec = pytester.inline_run("--pyargs", "polyengine.conformance", "--polyengine-backend", "tpu_jax_ray",
                              "--polyengine-option", "batched_prefill=on", "-p", "no:cacheprovider",
                              "--polyengine-report-json", str(report), "--polyengine-differential-examples", "4",
                              "-k", f"(test_prefill_batch or test_differential) and {SHAPE_MODELS_ONLY}")
    failed = [r.nodeid for r in rec.getreports("pytest_runtest_logreport") if r.failed]
    assert not failed, failed
    ran = [t["id"] for t in json.loads(report.read_text())["tests"] if t["status"] == "passed"]
    assert any(i.startswith("test_prefill_batch") for i in ran) and any(i.startswith("test_differential") for i in ran)


@pytest.mark.slow
def test_on_tpu_hosts_each_worker_takes_one_hosts_chips(cluster, model, single_process):
    """Two nodes carrying Ray's ``TPU`` resource (4 chips each, as a TPU VM registers
    them) join the simulated cluster: the engine places exactly one worker on each,
    each holding the host's 4 chips, through a STRICT_SPREAD placement group. (JAX
    still runs on the CPU here: the resource is what a TPU VM registers, the chips are
    simulated.)"""
    c = cluster["cluster"]
    tpu_nodes = [c.add_node(num_cpus=2, object_store_memory=80 * 2**20, resources={"TPU": 4}) for _ in range(2)]
    try:
        c.wait_for_nodes()
        eng = RayTpuEngine(model, CFG)
        assert eng.tpu == 4
        placement = eng.group.placement.bundle_specs
        assert placement == [{"CPU": 1, "TPU": 4}] * 2
        nodes = {i["node"] for i in eng.group.info}
        assert nodes == {n.node_id for n in tpu_nodes}
        used = {n["NodeID"]: n for n in ray.nodes()}
        assert all(used[n]["Resources"]["TPU"] == 4 for n in nodes)
        assert _tokens(eng) == single_process
        with pytest.raises(InvalidRequest, match="need more TPU hosts than the Ray cluster.s 2"):
            RayTpuEngine(model, CFG.model_copy(update={"options": {"num_workers": 3}}))
        eng.group.kill()
    finally:
        for node in tpu_nodes:
            c.remove_node(node)
    # Without TPU hosts, 'tpu' is refused and 'auto' places CPU workers as before.
    with pytest.raises(InvalidRequest, match="no node of the Ray cluster has the 'TPU' resource"):
        RayTpuEngine(model, CFG.model_copy(update={"options": {"accelerator": "tpu"}}))


@pytest.mark.slow
def test_each_node_is_checked_for_the_share_its_workers_hold(cluster, model):
    """Spread over two nodes, each node holds half of the devices' arrays: the leader
    checks each node's share against the memory its workers report (here bounded by a
    simulated limit), not the whole model against one host."""
    from polyengine.errors import InsufficientMemory
    from polyengine.memory import MARGIN_MIN, check_fits, simulated_limit

    from polyengine.backends.tpu_jax.footprint import device_needs

    spread = CFG.model_copy(update={"options": {"spread_workers": True}})
    per_device = sum(device_needs(model.config, CFG, dtype="float32", dp=1, tp=2).values())
    one_node, whole = per_device, 2 * per_device  # tp=2 over the two nodes' single devices
    between = MARGIN_MIN + (one_node + whole) // 2
    with simulated_limit(between):
        with pytest.raises(InsufficientMemory):  # what checking the whole model on one host refused
            check_fits("the whole model", {"all": whole})
        eng = RayTpuEngine(model, spread)  # each node's share fits
        assert len({i["node"] for i in eng.group.info}) == 2
    with simulated_limit(MARGIN_MIN + one_node // 2):
        with pytest.raises(InsufficientMemory, match=r"host memory of Ray node 127\.0\.0\.1 .*1 worker\(s\), 1 device"):
            RayTpuEngine(model, spread)


@pytest.mark.slow
def test_disaggregated_greedy_output_equals_interleaved(cluster, model):
    """Prompts prefilled on a prefill worker and handed over as portable prefixes
    through the object store decode to the same greedy tokens as prompts prefilled
    on the decode workers themselves (n=2 included: bulk_insert of a handed-over
    prefix), and so do prompts that share a 17-token start, prefilled in chunks of 4
    (a stream decodes meanwhile) through the driver's prefix cache: each piece continues
    a prefix the pool exported (the prefill worker imports, continues and exports it),
    and the later prompts continue the cached shared start (its full page)."""
    greedy = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2, logprobs=True)]
    prompts = [[1, 5, 9, 4, 2], [3, 3, 8, 1, 7, 7, 2, 9, 10, 11]]
    shared = list(range(40, 57))
    chunked = [shared + [5 + i, 9, 2 * i + 1] for i in range(3)]

    def run(eng, batch=prompts, sampling=greedy):
        return [[o.token_ids for o in c.outputs] for c in LLM.from_engine(eng, tools=False).generate(batch, sampling)]

    interleaved = run(RayTpuEngine(model, CFG))
    eng = RayTpuEngine(model, CFG.model_copy(update={"options": {"prefill_workers": 1}}))
    assert "disaggregated" in eng.device
    prefix, _ = eng.prefill(params=eng.load_params(), tokens=prompts[0], sampling=greedy[0])
    assert type(prefix.kv).__name__ == "PortableHandle" and isinstance(ray.get(prefix.kv.ref), bytes)
    assert run(eng) == interleaved
    whole = RayTpuEngine(model, CFG.model_copy(update={"prefix_cache_bytes": 0, "prefill_chunk": 0}))
    want = [run(whole, [p], greedy[:1])[0] for p in chunked]
    pieces = RayTpuEngine(model, CFG.model_copy(update={"options": {"prefill_workers": 1}, "prefill_chunk": 4}))
    llm = LLM.from_engine(pieces, tools=False)
    stream = llm.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    llm.step()
    got = []
    for p in chunked:
        req = llm.submit(p, greedy[0])
        while not req.done:
            llm.step()
        got.append(req.completion)
    assert not stream.done  # it decoded the whole time: every prompt went in pieces of 4
    stream.cancel()
    assert [[c.token_ids] for c in got] == want
    # The page-level cache: the second prompt already reuses the shared start's full page
    # (16 of its 17 tokens), as the third does.
    assert [c.usage.cached_tokens for c in got] == [0, 16, 16] and llm.scheduler.prefix_cache.stats.hits == 2
    # The prefill lane (capability prefill_lane, declared with prefill workers): a prompt
    # longer than the step's budget prefills on them while the stream decodes, the same
    # completion as the chunked run's.
    assert pieces.capabilities.prefill_lane and not whole.capabilities.prefill_lane
    laned = RayTpuEngine(model, CFG.model_copy(update={"options": {"prefill_workers": 1}, "prefill_chunk": 4,
                                                        "max_num_batched_tokens": 4, "prefix_cache_bytes": 0}))
    llm = LLM.from_engine(laned, tools=False)
    stream = llm.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    llm.step()
    req = llm.submit(chunked[0], greedy[0])
    while not req.done:
        llm.step()
    assert llm.scheduler.lane_prefills == 1 and [req.completion.token_ids] == want[0]
    stream.cancel()


@pytest.mark.slow
def test_pages_on_the_ray_engine(cluster, model, pytester, tmp_path):
    """Paged K/V on the workers (option page_size, kv_pages: a bounded pool): the page
    rules hold through the leader's view of the workers' pool (conformance/pages.py);
    the driver admits by pages over a pool too small for every request at once,
    preempts, and gives the single-process paged engine's tokens; a prompt that shares
    two full pages with a cached one reuses them; and the conformance suite's page,
    prefix and portable-tail tests pass with the option (a tail imported onto a held
    prefix shares its pages on the workers: rule 21c)."""
    from polyengine.conformance.pages import page_rule_problems

    from polyengine.backends.tpu_jax.engine import TpuJaxEngine

    cfg = CFG.model_copy(update={"options": {"page_size": 8, "kv_pages": 20}})
    eng = RayTpuEngine(model, cfg)
    assert eng.capabilities.page_size == 8 and eng.pages.capacity == 20 and eng.pages.free == 20
    assert page_rule_problems(eng, eng.load_params(), list(range(3, 15)), [1, 2, 3, 4, 5]) == []
    shared = [1, 5, 9, 4, 2, 6, 6, 3] * 2
    prompts = [shared + [7], [1, 7, 3], [1, 2, 8, 8, 2, 6, 6] * 2, shared + [8, 8]]
    sampling = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 3 + [
        SamplingParams(seed=5, temperature=0.8, max_tokens=40, ignore_eos=True, n=2)]

    def run(engine):
        llm = LLM.from_engine(engine, tools=False)
        done = llm.generate(prompts, sampling)
        return [[o.token_ids for o in c.outputs] for c in done], llm.page_stats

    want, _ = run(TpuJaxEngine(model, cfg))
    got, stats = run(eng)
    assert got == want
    assert stats["total"] == 20 and stats["preemptions"] > 0, stats
    assert stats["in_use"] == eng.pages.held > 0  # the prefix cache's pages, as the workers count them
    llm = LLM.from_engine(eng, tools=False)
    cached = [llm.generate([p], sampling[0])[0].usage.cached_tokens for p in (prompts[0], prompts[3])]
    assert cached == [0, 16]  # the first prompt's two full pages
    report = tmp_path / "ray-paged.json"
    rec = pytester.inline_run("--pyargs", "polyengine.conformance", "--polyengine-backend", "tpu_jax_ray",
                              "-p", "no:cacheprovider", "--polyengine-report-json", str(report),
                              "--polyengine-option", "page_size=16",
                              "-k", "(test_page_rules or test_prefix_reuse or test_truncate or test_portable_prefix_tail)"
                                    " and not bfloat16")
    failed = [r.nodeid for r in rec.getreports("pytest_runtest_logreport") if r.failed]
    assert not failed, failed
    ran = [t["id"] for t in json.loads(report.read_text())["tests"] if t["status"] == "passed"]
    assert {"test_page_rules", "test_portable_prefix_tail_shares_pages"} <= set(ran), ran


@pytest.mark.slow
def test_a_reference_prefix_decodes_on_the_disaggregated_engine(cluster, model):
    """Cross-backend disaggregation: the reference backend prefills, the Ray engine
    imports the portable prefix and decodes what the reference decodes."""
    from polyengine.backends.reference.engine import ReferenceEngine

    ref = ReferenceEngine(model, CFG)
    sp = SamplingParams(temperature=0, seed=1, ignore_eos=True)
    ref_params = ref.load_params()
    prefix, _ = ref.prefill(params=ref_params, tokens=[1, 9, 4, 4, 7, 2], sampling=sp)
    state = ref.insert(prefix, ref.init_decode_state(), 0)
    want = [prefix.first_token] + [int(ref.generate(ref_params, state)[1].tokens[0, 0]) for _ in range(8)]
    eng = RayTpuEngine(model, CFG.model_copy(update={"options": {"prefill_workers": 1}}))
    params = eng.load_params()
    mine = eng.import_prefix(ref.export_prefix(prefix))
    state = eng.insert(mine, eng.init_decode_state(), 2)
    got = [mine.first_token]
    for _ in range(8):
        state, result = eng.generate(params, state)
        got.append(int(result.tokens[2, 0]))
    assert got == want
    back = eng.export_prefix(eng.prefill(params=params, tokens=[1, 9, 4, 4, 7, 2], sampling=sp)[0])
    again = ref.import_prefix(back)
    assert again.first_token == prefix.first_token


@pytest.mark.slow
def test_conformance_on_the_ray_engine(cluster, pytester, tmp_path):
    report = tmp_path / "ray.json"
    # A named subset (docs/tpu_jax.md): the sampler's 1000-draw statistics tests take
    # minutes through Ray and test the same sampler program as the single-process run;
    # the further architectures' models run in the single-process suite (the workers run
    # that engine), so here only the shape models do.
    from differential_report import SHAPE_MODELS_ONLY

    # The differential layer at 4 programs per configuration, not 10: the workers run
    # tpu_jax's engine, whose own run (test_conformance_cli.py) draws the full budget; here
    # the programs check what Ray adds (transport, async results, worker state). For the
    # same reason the numerics against the reference run in float32 only: bfloat16 changes
    # the workers' arithmetic, which the single-process run checks, not what crosses Ray
    # (35 of this test's 184 s here).
    numerics = "(test_prefill_logits_match_reference or test_decode_logprobs_match_reference or " \
               "test_greedy_matches_reference)"
    # The configuration edges (contexts at the original context, lengths at windows and
    # buckets) are the workers' engine arithmetic, run whole by the single-process suite;
    # nothing that crosses Ray changes at a model parameter's edge.
    rec = pytester.inline_run("--pyargs", "polyengine.conformance", "--polyengine-backend", "tpu_jax_ray",
                              "-p", "no:cacheprovider", "--polyengine-report-json", str(report),
                              "--polyengine-differential-examples", "4",
                              "-k", f"not test_sampling_support and not test_sampling_distribution and not test_edges"
                                    f" and {SHAPE_MODELS_ONLY}"
                                    f" and not ({numerics} and bfloat16)")
    failed = [r.nodeid for r in rec.getreports("pytest_runtest_logreport") if r.failed]
    assert not failed, failed
    doc = json.loads(report.read_text())
    assert doc["backend"] == "tpu_jax_ray" and "2 process(es)" in doc["device"]["backend"]
    ran = [t["id"] for t in doc["tests"] if t["status"] == "passed"]
    assert any(i.startswith("test_decode_logprobs_match_reference[") and i.endswith("-float32]") for i in ran)
    assert not any(i.startswith("test_decode_logprobs_match_reference[") and "bfloat16" in i for i in ran)


@pytest.mark.slow
def test_a_dead_worker_fails_requests_in_bounded_time_and_a_new_engine_runs(cluster, model, single_process):
    """Kill one worker's process while a request streams: the stream ends with
    WorkerLost (not a hang) within the bound, further calls fail at once, and a new
    engine (new workers) generates the right tokens. Through the AsyncLLM (what the
    server runs), a lost worker makes the engine dead: the request fails with
    WorkerLost (an EngineDead), later ones are refused at once, and ``dead`` says so."""
    import asyncio

    from polyengine.driver import AsyncLLM
    from polyengine.errors import EngineDead

    eng = RayTpuEngine(model, CFG.model_copy(update={"options": {"step_timeout_s": 120}}))
    victim = eng.group.info[1]["pid"]
    llm = LLM.from_engine(eng, tools=False)
    stream = llm.stream([1, 5, 9, 4, 2], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    got = [next(stream) for _ in range(3)]
    assert got
    os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerLost, match="worker died"):
        for _ in stream:
            pass
    assert time.monotonic() - start < 30
    with pytest.raises(WorkerLost):
        eng.init_decode_state()
    fresh = RayTpuEngine(model, CFG.model_copy(update={"options": {"step_timeout_s": 120}}))
    assert _tokens(fresh) == single_process
    served = AsyncLLM.from_llm(LLM.from_engine(fresh, tools=False))
    os.kill(fresh.group.info[1]["pid"], signal.SIGKILL)

    async def main():
        request = await asyncio.wait_for(served.submit([1, 5, 9], SamplingParams(max_tokens=4)), 30)
        with pytest.raises(WorkerLost, match="worker died"):
            await asyncio.wait_for(request.result(), 60)
        with pytest.raises(EngineDead, match="worker died"):
            await asyncio.wait_for(served.submit([1, 2], SamplingParams(max_tokens=2)), 5)
        await asyncio.wait_for(served.shutdown(timeout=0), 30)

    asyncio.run(main())
    assert isinstance(served.dead, WorkerLost)
