"""Run by tests/test_tpu_jax_sharding.py in a subprocess: ``python _tpu_jax_sharded.py N``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before JAX starts.

For each mesh the test names, the same workload runs on an unsharded engine (one
device) and a sharded one: the prefill logits of every prompt, and the tokens and
log-probs of greedy and sampled requests through the driver (two of them with n=2,
so bulk_insert and several slots run at once). Prints one JSON object: per mesh the
largest logits difference, whether the token streams are equal, the largest log-prob
difference, and how the weights and the KV cache are laid out.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from polyengine import EngineConfig, SamplingParams
from polyengine.driver import LLM
from polyengine.errors import InvalidRequest
from polyengine.models import load_model

from polyengine.backends.tpu_jax.engine import TpuJaxEngine

CFG = EngineConfig(max_slots=8, max_prefill_length=24, max_cache_length=64)
# All within the first prefill bucket (16): one prefill program per engine.
PROMPTS = [[1, 5, 9, 4, 2], [1, 7, 3], [1, 2, 8, 8, 2, 6, 6, 3, 1, 9, 12, 40, 41], list(range(3, 19))]
SAMPLING = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(seed=3, max_tokens=16, n=2, logprobs=True),
    SamplingParams(seed=4, temperature=0.7, top_p=0.9, max_tokens=16, logprobs=True, top_logprobs=3),
    SamplingParams(seed=5, temperature=1.2, top_k=7, repetition_penalty=1.2, n=2, max_tokens=12),
]
# device count -> (model, options) of each sharded engine
MESHES = {
    4: [("random:tiny-gqa", {}),  # chosen: tp 2 (the KV heads), dp 2
        ("random:tiny-qwen2", {"tensor_parallel": 2, "data_parallel": 1, "sharding_rules": {"vocab": "tp"}})],
    8: [("random:tiny-gqa", {"tensor_parallel": 2, "data_parallel": 4}),
        ("random:tiny", {"tensor_parallel": 4, "data_parallel": 2, "sharding_rules": {"vocab": "tp"}})],
}


def run(engine):
    params = engine.load_params()
    logits = [engine.prefill(params=params, tokens=p, sampling=SamplingParams(seed=0))[0].host_logits() for p in PROMPTS]
    done = LLM.from_engine(engine, tools=False).generate(PROMPTS, SAMPLING)
    tokens = [[o.token_ids for o in c.outputs] for c in done]
    logprobs = [lp for c in done for o in c.outputs for lp in (o.logprobs or [])]
    return np.stack(logits), tokens, np.asarray(logprobs)


def main(devices: int) -> None:
    import jax

    assert len(jax.devices()) == devices, jax.devices()
    out = {"devices": devices, "meshes": [], "refusals": []}
    baselines = {}
    for name, options in MESHES[devices]:
        model = load_model(name)
        if name not in baselines:
            baselines[name] = run(TpuJaxEngine(model, CFG.model_copy(update={"options": {"tensor_parallel": 1, "data_parallel": 1}})))
        engine = TpuJaxEngine(model, CFG.model_copy(update={"options": options}))
        logits, tokens, logprobs = run(engine)
        want_logits, want_tokens, want_logprobs = baselines[name]
        params = engine.load_params()
        arrays = engine.init_decode_state().arrays
        cache = arrays.k
        # What device 0 holds, beside what the memory checks (footprint.device_needs) count.
        needs = engine._needs()
        held = {"weights": sum(x.addressable_shards[0].data.nbytes for x in params.values()),
                "cache": sum(x.addressable_shards[0].data.nbytes for x in (arrays.k, arrays.v))}
        counted = {"weights": next(v for k, v in needs.items() if "weights" in k),
                   "cache": next(v for k, v in needs.items() if "KV cache" in k)}
        out["meshes"].append({
            "model": name, "options": options, "mesh": dict(engine.plan.mesh.shape),
            "kv_heads": model.config.num_key_value_heads,
            "logits_max_abs_diff": float(np.abs(logits - want_logits).max()),
            "logits_scale": float(np.abs(want_logits).max()),
            "tokens_equal": tokens == want_tokens,
            "logprobs_max_abs_diff": float(np.abs(logprobs - want_logprobs).max()) if len(logprobs) else 0.0,
            "q_proj_spec": list(params["model.layers.0.self_attn.q_proj.weight"].sharding.spec),
            "embed_spec": list(params["model.embed_tokens.weight"].sharding.spec),
            "q_proj_shard_shape": list(params["model.layers.0.self_attn.q_proj.weight"].addressable_shards[0].data.shape),
            "cache_spec": list(cache.sharding.spec),
            "cache_shard_shape": list(cache.addressable_shards[0].data.shape),
            "device": engine.device, "device0_bytes": held, "counted_bytes": counted,
        })
    # A mesh the model cannot be split over is refused before anything compiles.
    for name, options in (("random:tiny-gqa", {"tensor_parallel": 4}), ("random:tiny-gqa", {"data_parallel": 3})):
        try:
            TpuJaxEngine(load_model(name), CFG.model_copy(update={"options": options}))
            out["refusals"].append({"options": options, "error": None})
        except InvalidRequest as exc:
            out["refusals"].append({"options": options, "error": str(exc)})
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]))
