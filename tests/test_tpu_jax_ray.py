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
import threading
import time

import numpy as np
import pytest

# Read when ray is imported: every Ray listener on 127.0.0.1, no token under ~/.ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
pytest.importorskip("jax")
ray = pytest.importorskip("ray")

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.driver import LLM  # noqa: E402
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
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "object_store_memory": small, "include_dashboard": False, "temp_dir": temp})
    c.add_node(num_cpus=4, object_store_memory=small)
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield {"listeners_before": before}
    finally:
        ray.shutdown()
        c.shutdown()
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
def test_disaggregated_greedy_output_equals_interleaved(cluster, model):
    """Prompts prefilled on a prefill worker and handed over as portable prefixes
    through the object store decode to the same greedy tokens as prompts prefilled
    on the decode workers themselves (n=2 included: bulk_insert of a handed-over
    prefix)."""
    greedy = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2, logprobs=True)]
    prompts = [[1, 5, 9, 4, 2], [3, 3, 8, 1, 7, 7, 2, 9, 10, 11]]
    run = lambda eng: [[o.token_ids for o in c.outputs] for c in LLM.from_engine(eng, tools=False).generate(prompts, greedy)]  # noqa: E731
    interleaved = run(RayTpuEngine(model, CFG))
    eng = RayTpuEngine(model, CFG.model_copy(update={"options": {"prefill_workers": 1}}))
    assert "disaggregated" in eng.device
    prefix, _ = eng.prefill(params=eng.load_params(), tokens=prompts[0], sampling=greedy[0])
    assert type(prefix.kv).__name__ == "PortableHandle" and isinstance(ray.get(prefix.kv.ref), bytes)
    assert run(eng) == interleaved


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
    # minutes through Ray and test the same sampler program as the single-process run.
    rec = pytester.inline_run("--pyargs", "polyengine.conformance", "--polyengine-backend", "tpu_jax_ray",
                              "-p", "no:cacheprovider", "--polyengine-report-json", str(report),
                              "-k", "not test_sampling_support and not test_sampling_distribution")
    failed = [r.nodeid for r in rec.getreports("pytest_runtest_logreport") if r.failed]
    assert not failed, failed
    doc = json.loads(report.read_text())
    assert doc["backend"] == "tpu_jax_ray" and "2 process(es)" in doc["device"]["backend"]


@pytest.mark.slow
def test_a_dead_worker_fails_requests_in_bounded_time_and_a_new_engine_runs(cluster, model, single_process):
    """Kill one worker's process while a request streams: the stream ends with
    WorkerLost (not a hang) within the bound, further calls fail at once, and a new
    engine (new workers) generates the right tokens."""
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
    assert _tokens(RayTpuEngine(model, CFG)) == single_process
