"""Sharding on CPU host devices: sharded tokens and logits equal unsharded ones.

Each device count runs in a subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
set before JAX starts (tests/_tpu_jax_sharded.py does the work). Bounds: token streams
(greedy and sampled, n=2 included) identical; prefill logits within 1e-5 of their scale
and log-probs within 1e-5 (a sharded reduction adds in another order: float32 rounding,
measured ~1e-7); every weight and cache really split as the mesh says, and device 0
holding exactly the weight and cache bytes the memory checks count for it
(``footprint.device_needs``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

HERE = Path(__file__).resolve().parent


def _run(devices: int) -> dict:
    # Tiny models: XLA's optimizations cost more compile time than they save.
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "_tpu_jax_sharded.py"), str(devices)], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("devices", [4, 8])
def test_sharded_equals_unsharded(devices):
    out = _run(devices)
    assert out["devices"] == devices and out["meshes"]
    for m in out["meshes"]:
        what = f"{m['model']} {m['options']} (mesh {m['mesh']})"
        assert m["tokens_equal"], what
        assert m["logits_max_abs_diff"] <= 1e-5 * (1 + m["logits_scale"]), (what, m["logits_max_abs_diff"])
        assert m["logprobs_max_abs_diff"] <= 1e-5, (what, m["logprobs_max_abs_diff"])
        tp, dp = m["mesh"]["tp"], m["mesh"]["dp"]
        assert tp * dp <= devices
        if tp > 1:  # q_proj split by heads, the cache by KV heads
            assert m["q_proj_spec"][0] == "tp", what
            assert m["cache_shard_shape"][2] * tp == m["kv_heads"], what
        if dp > 1 and "slots" not in m["options"].get("sharding_rules", {}):
            assert m["cache_shard_shape"][1] * dp == 8, what  # 8 slots split over dp
        if m["options"].get("sharding_rules", {}).get("vocab") == "tp":
            assert m["embed_spec"][0] == "tp", what
        # The memory checks (the engine's and the Ray leader's per host) count exactly what a device holds.
        assert m["device0_bytes"] == m["counted_bytes"], what
    chosen = [m for m in out["meshes"] if not m["options"]]
    if chosen:  # tiny-gqa has 2 KV heads: tp 2, the rest over the slots
        assert chosen[0]["mesh"] == {"dp": devices // 2, "tp": 2}
    errors = {json.dumps(r["options"]): r["error"] for r in out["refusals"]}
    assert "tensor_parallel=4" in errors['{"tensor_parallel": 4}'] and "2 KV heads" in errors['{"tensor_parallel": 4}']
    assert "data_parallel=3" in errors['{"data_parallel": 3}'] and "8 slots" in errors['{"data_parallel": 3}']
