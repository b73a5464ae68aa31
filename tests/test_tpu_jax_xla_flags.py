"""tpu_jax asks XLA:CPU for its memory-minimizing scheduler (backends/tpu_jax/xla_flags.py):
with the concurrency-optimized one, a program that dequantizes its matrices from
parameters held every dequantized matrix at once (a float32 copy of the model per step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")

from polyengine.backends.tpu_jax import xla_flags  # noqa: E402

# Eight int8 matrices, each dequantized then multiplied in turn: the shape of a step on a
# file's blocks. Memory-minimizing: about one float32 matrix of temporaries at a time;
# concurrency-optimized: all eight at once.
_PROGRAM = r"""
import json, os
import jax, jax.numpy as jnp
from polyengine.backends.tpu_jax import steps

def step(x, qs):
    for q in qs:
        x = jnp.tanh(x @ (q.astype(jnp.float32) * 0.01))
    return x

x, qs = jnp.ones((1, 512)), [jnp.ones((512, 512), jnp.int8) for _ in range(8)]
temp = jax.jit(step).lower(x, qs).compile().memory_analysis().temp_size_in_bytes
print(json.dumps({"done": steps.XLA_CPU_SCHEDULER, "flags": os.environ.get("XLA_FLAGS", ""), "temp": temp}))
"""
_MATRIX = 512 * 512 * 4


def _run(xla_flags_env: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if xla_flags_env is not None:
        env["XLA_FLAGS"] = xla_flags_env
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_steps_makes_programs_dequantize_one_matrix_at_a_time():
    """A fresh process: importing the steps appends the flag to the user's XLA_FLAGS
    (kept), and a program compiled afterwards holds about one dequantized matrix; with the
    user's own choice of the concurrency-optimized scheduler the same program holds all
    eight (what the flag is for, and proof the measurement can tell them apart)."""
    ours = _run("--xla_force_host_platform_device_count=1")
    assert ours["done"] == "set", ours
    assert ours["flags"] == f"--xla_force_host_platform_device_count=1 {xla_flags.FLAG}", ours
    assert ours["temp"] <= 2 * _MATRIX, ours
    theirs = _run(f"--{xla_flags.OPTION}=true")
    assert theirs["done"] == "user" and theirs["flags"] == f"--{xla_flags.OPTION}=true", theirs
    assert theirs["temp"] >= 8 * _MATRIX, theirs


def test_the_flag_is_left_alone_when_set_late_or_unknown(monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setenv("XLA_FLAGS", f"--{xla_flags.OPTION}=true")
    assert xla_flags.prefer_memory_scheduler() == "user"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert xla_flags.prefer_memory_scheduler() == "late"
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(xla_flags, "jaxlib_knows", lambda option: False)
    assert xla_flags.prefer_memory_scheduler() == "unknown"
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"  # untouched each time


def test_jaxlib_knows_its_flags_by_name():
    assert xla_flags.jaxlib_knows(xla_flags.OPTION)
    assert xla_flags.jaxlib_knows("xla_force_host_platform_device_count")
    assert not xla_flags.jaxlib_knows("xla_no_such_flag_in_any_jaxlib")
