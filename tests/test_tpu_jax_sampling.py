"""What only the JAX sampler of tpu_jax has: its stream without x64.

JAX runs without 64-bit types by default, so the port computes the stream's 24-bit
integers (``x >> 8`` of Threefry-2x32's first word) in uint32; they must equal the
core's for seeds over the whole 64-bit range and steps and sample indices at both ends
of their ranges. The contract both device samplers keep against the core's reference
(float64 uniforms bit for bit, noise, ties, the sampler up to float32 noise, overrides,
refusals) is in ``tests/test_device_samplers.py``, run on this port and the torch one.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from polyengine.sampling import threefry as ref_threefry  # noqa: E402
from polyengine.sampling.rows import split_seed  # noqa: E402

from polyengine.backends.tpu_jax import sampling as smp  # noqa: E402

from sampler_cases import edge_seeds  # noqa: E402


def test_uniform_bits_equal_the_core_without_x64():
    vocab = 49152
    rng = np.random.default_rng(1)
    seeds = edge_seeds(rng, 23)  # 32 rows
    steps = [0, 2**20 - 1, 0, 2**20 - 1] + [int(s) for s in rng.integers(0, 2**20, len(seeds) - 4)]
    samples = [0, 4095, 4095, 0] + [int(s) for s in rng.integers(0, 4096, len(seeds) - 4)]
    lo, hi = zip(*(split_seed(s) for s in seeds))
    ctr = smp.counter_hi(jnp.asarray(steps, jnp.int32), jnp.asarray(samples, jnp.int32))
    bits = np.asarray(smp.uniform_bits(jnp.asarray(lo, jnp.uint32), jnp.asarray(hi, jnp.uint32),
                                       jnp.arange(vocab, dtype=jnp.uint32), ctr))  # (32, V) uint32, no x64
    assert bits.dtype == np.uint32
    for row, (seed, step, index) in enumerate(zip(seeds, steps, samples)):
        x0, _ = ref_threefry.threefry2x32(*split_seed(seed), np.arange(vocab), step + (index << 20))
        assert np.array_equal(bits[row], x0 >> 8), (seed, step, index)
