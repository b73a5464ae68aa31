"""The tpu_jax engine's paged decode attention on JAX's Pallas TPU kernel (option
``paged_attention``; backends/tpu_jax/pallas.py), proved on this machine's CPU under
Pallas's TPU interpreter: the kernel call against a float64 reference of each row's
pages, the engine's steps against the gather path (greedy and seeded, page edges, a
continuation, a truncation, bulk_insert, a freed and reused slot), the traced step
holding the kernel, and the same on a mesh of two CPU devices (``tp`` 2 and ``dp`` 2,
under ``shard_map``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
if importlib.util.find_spec("torchax") is None:  # not importorskip: torchax imports only through compat
    pytest.skip("torchax is not installed (pip install 'polyengine[tpu]')", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

from polyengine import EngineConfig, SamplingParams  # noqa: E402
from polyengine.errors import InvalidRequest  # noqa: E402
from polyengine.models import load_model  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_tpu_jax_paged import CFG, SAMPLINGS, _run, on_two_cpu_devices  # noqa: E402

pytestmark = pytest.mark.usefixtures("jax_compile_less")  # tiny models: compile time over run time

# The kernel reads K/V in bfloat16 (its loads convert them): against the float32 gather
# the log-probs of the tiny model move by ~2e-4 (measured), the tokens not at all.
LOGPROB_ATOL = 2e-3


def _one_device_plan():
    from polyengine.backends.tpu_jax.sharding import plan_mesh

    return plan_mesh(load_model("random:tiny-gqa").config, 4, jax.devices()[:1], tensor_parallel=1, data_parallel=1)


def _reference(q, k_pool, v_pool, pages, lengths, scale, softcap):
    """Float64 attention of each row over its pages' first ``length`` positions."""
    q, k_pool, v_pool = (np.asarray(x, np.float64) for x in (q, k_pool, v_pool))
    b, heads, hd = q.shape
    kvh, _, ps, _ = k_pool.shape
    out = np.zeros_like(q)
    for row in range(b):
        n = int(lengths[row])
        ids = np.asarray(pages[row])
        keys = k_pool[:, ids].reshape(kvh, -1, hd)[:, :n]
        vals = v_pool[:, ids].reshape(kvh, -1, hd)[:, :n]
        for h in range(heads):
            s = keys[h // (heads // kvh)] @ q[row, h] * scale
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max())
            out[row, h] = (w / w.sum()) @ vals[h // (heads // kvh)]
    return out


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("page_size", [4, 16])
def test_the_kernel_attends_each_rows_pages_as_the_float64_reference(page_size, softcap):
    from polyengine.backends.tpu_jax.pallas import attention

    rng = np.random.default_rng(page_size)
    b, heads, kvh, hd, width = 4, 6, 2, 32, 4
    pool_pages = 3 * width

    def bf16(*shape):  # values bfloat16 holds exactly: the kernel's conversion of K/V changes nothing
        return np.asarray(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16).astype(jnp.float32))

    q, k_pool, v_pool = bf16(b, heads, hd), bf16(kvh, pool_pages, page_size, hd), bf16(kvh, pool_pages, page_size, hd)
    pages = np.stack([rng.permutation(pool_pages)[:width] for _ in range(b)]).astype(np.int32)
    # one position, a page's edge, the middle of a page, every position of the table
    lengths = np.asarray([1, page_size, 2 * page_size + page_size // 2, width * page_size], np.int32)
    got = attention(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(pages),
                    jnp.asarray(lengths), plan=_one_device_plan(), interpret=True, scale=0.125, softcap=softcap)
    want = _reference(q, k_pool, v_pool, pages, lengths, 0.125, softcap)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=2e-5)


def test_the_option_resolves_by_platform_and_dtype_and_a_block_divides_the_table():
    from polyengine.backends.tpu_jax.pallas import pages_per_block, resolve

    assert resolve("auto", "tpu", "bfloat16") == "pallas" and resolve("auto", "tpu", "float32") == "gather"
    assert resolve("auto", "cpu", "bfloat16") == "gather" and resolve("gather", "tpu", "bfloat16") == "gather"
    assert resolve("pallas", "cpu", "float32") == "interpret" and resolve("pallas", "tpu", "float32") == "pallas"
    assert [pages_per_block(w, 16) for w in (1, 2, 4, 8, 16, 256, 7, 12)] == [1, 2, 4, 8, 8, 8, 7, 6]
    assert pages_per_block(64, 4) == 32 and pages_per_block(3, 256) == 1


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny-gqa")


def _engine(model, **options):
    from polyengine.backends.tpu_jax.engine import TpuJaxEngine

    return TpuJaxEngine(model, CFG.model_copy(update={"options": options}))


def test_pallas_needs_pages(tiny):
    with pytest.raises(InvalidRequest, match="paged_attention='pallas' reads K/V pages: set page_size"):
        _engine(tiny, paged_attention="pallas")
    assert _engine(tiny).paged_kernel == "gather"  # auto, contiguous
    assert _engine(tiny, page_size=4).paged_kernel == "gather"  # auto on the CPU
    # what `polyengine generate` prints under "backend:"
    assert "pages gathered per layer" in _engine(tiny, page_size=4).speed_paths()["kv"]
    assert "under Pallas's TPU interpreter" in _engine(tiny, page_size=4, paged_attention="pallas").speed_paths()["kv"]
    assert _engine(tiny).speed_paths()["kv"].startswith("one contiguous cache row per slot")


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_the_kernels_steps_equal_the_gathers(tiny, sampling):
    gather, kernel = _engine(tiny, page_size=4), _engine(tiny, page_size=4, paged_attention="pallas")
    assert kernel.paged_kernel == "interpret"
    want, want_lp, want_kv = _run(gather, SAMPLINGS[sampling])
    got, got_lp, got_kv = _run(kernel, SAMPLINGS[sampling])
    assert got == want
    np.testing.assert_allclose(got_lp, want_lp, rtol=0, atol=LOGPROB_ATOL)
    for a, b in zip(want_kv, got_kv):  # prefill writes the pages the same way on both
        np.testing.assert_array_equal(a, b)


def test_the_traced_step_holds_the_kernel_and_the_gathers_does_not(tiny):
    from polyengine.backends.tpu_jax import paged

    def step_jaxpr(eng) -> str:
        eng.load_params()
        state = eng.init_decode_state()
        k, v = eng._paged.peek()
        ops = eng._paged.ops([], [])
        no = np.zeros(eng.cfg.slots, np.int32)
        return str(jax.make_jaxpr(lambda *a: paged.paged_forward_step(*a, cfg=eng.cfg, width=2,
                                                                      kernel=eng.paged_kernel))(
            eng.load_params(), k, v, state.arrays.table, ops, state.arrays.rows, no, no.astype(bool)))

    assert "pallas_call" in step_jaxpr(_engine(tiny, page_size=4, paged_attention="pallas"))
    assert "pallas_call" not in step_jaxpr(_engine(tiny, page_size=4))


def _sharded_main() -> None:
    """In the subprocess: the greedy workload on one device with the gather, and on a
    mesh of two with the kernel (tp 2 over the KV heads; dp 2 over the slots)."""
    from polyengine.backends.tpu_jax.engine import TpuJaxEngine

    assert len(jax.devices()) == 2, jax.devices()
    jax.config.update("jax_disable_most_optimizations", True)
    model = load_model("random:tiny-gqa")
    one = {"tensor_parallel": 1, "data_parallel": 1, "page_size": 4}
    want = _run(TpuJaxEngine(model, CFG.model_copy(update={"options": one})), SAMPLINGS["greedy"])
    out = {}
    for name, options in (("tp2", {"tensor_parallel": 2, "data_parallel": 1}),
                          ("dp2", {"tensor_parallel": 1, "data_parallel": 2})):
        eng = TpuJaxEngine(model, CFG.model_copy(update={"options": {
            **options, "page_size": 4, "paged_attention": "pallas"}}))
        got = _run(eng, SAMPLINGS["greedy"])
        out[name] = {"mesh": eng.plan.describe(), "kernel": eng.paged_kernel, "tokens_equal": got[0] == want[0],
                     "logprobs_max_abs_diff": float(np.abs(got[1] - want[1]).max())}
    print("RESULT " + json.dumps(out))


def test_the_kernel_on_two_cpu_devices_equals_the_gather_on_one():
    out = on_two_cpu_devices(__file__)
    assert out["tp2"]["mesh"] == "mesh dp=1 x tp=2" and out["dp2"]["mesh"] == "mesh dp=2 x tp=1"
    for what, r in out.items():
        assert r["kernel"] == "interpret" and r["tokens_equal"], (what, r)
        assert r["logprobs_max_abs_diff"] <= LOGPROB_ATOL, (what, r)


if __name__ == "__main__" and sys.argv[1:] == ["sharded"]:
    _sharded_main()
