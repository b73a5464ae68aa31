"""The sampler's random stream: Threefry-2x32 (20 rounds) on NumPy uint32.

This module is the bit-exact definition every backend reproduces on its device. It
holds the block function (Salmon et al. 2011, as in Random123 and JAX's
``threefry_2x32``) and the one way polyengine turns it into per-token uniforms; what
the sampler does with them lives in :mod:`polyengine.sampling.sampler`.

Only 32-bit add, xor and rotate are used, so the same numbers come out of NumPy,
XLA, CUDA or a Neuron core; there is no floating point until the final
``uniforms`` conversion. That value needs 25 significant bits, so it is exact in
float64; a device computing it in float32 rounds it (half an ulp at most), one of the
"float noise" sources the conformance suite allows for.
"""

from __future__ import annotations

import numpy as np

from polyengine.errors import InvalidRequest
from polyengine.sampling.params import MAX_SAMPLES, MAX_STEPS

__all__ = ["threefry2x32", "uniforms", "gumbel"]

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)
_MASK32 = (1 << 32) - 1


def _as_u32(x: object) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype == np.uint32:
        return arr
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"threefry2x32 takes integer words, got dtype {arr.dtype}")
    # Reduce with a mask in a 64-bit type first: casting a negative or wide integer
    # straight to uint32 is not something every NumPy version defines the same way.
    wide = np.uint64 if arr.dtype.kind == "u" else np.int64
    return (arr.astype(wide) & wide(_MASK32)).astype(np.uint32)


def threefry2x32(key0, key1, x0, x1) -> tuple[np.ndarray, np.ndarray]:
    """Threefry-2x32-20 of counter ``(x0, x1)`` under key ``(key0, key1)``.

    Arguments are integer arrays or scalars (taken mod 2**32) and broadcast together;
    the two output words are uint32 arrays of the broadcast shape. Identical to
    ``jax.extend.random.threefry_2x32(keypair=(key0, key1), count=[x0..., x1...])``.
    """
    k0, k1, c0, c1 = np.broadcast_arrays(_as_u32(key0), _as_u32(key1), _as_u32(x0), _as_u32(x1))
    shape = c0.shape
    # Work on 1-d arrays: NumPy checks overflow on uint32 *scalars* (and warns), but
    # array ufuncs wrap silently, which is the modular arithmetic Threefry means.
    k0, k1 = k0.reshape(-1), k1.reshape(-1)
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    y0 = c0.reshape(-1) + ks[0]
    y1 = c1.reshape(-1) + ks[1]
    spill = np.empty_like(y1)
    # Five groups of four rounds; after group i (from 0) the key words (i+1, i+2) mod 3
    # are injected, plus i+1 into the second word. In-place updates cut the time for a
    # 50k-token vocabulary by a third (it runs once per sampled token).
    for group in range(5):
        for r in _ROTATIONS[group % 2]:
            y0 += y1
            np.left_shift(y1, np.uint32(r), out=spill)
            y1 >>= np.uint32(32 - r)
            y1 |= spill
            y1 ^= y0
        y0 += ks[(group + 1) % 3]
        y1 += ks[(group + 2) % 3]
        y1 += np.uint32(group + 1)
    return y0.reshape(shape), y1.reshape(shape)


def _check_position(step: int, sample_index: int) -> None:
    # Both share the counter's second word (step + 2**20 * sample_index), so a value
    # out of range would silently alias another position's stream.
    if not 0 <= step < MAX_STEPS:
        raise InvalidRequest(
            f"step {step} is outside [0, {MAX_STEPS}): the random stream addresses at most "
            f"{MAX_STEPS} completion tokens per sample"
        )
    if not 0 <= sample_index < MAX_SAMPLES:
        raise InvalidRequest(
            f"sample_index {sample_index} is outside [0, {MAX_SAMPLES}): at most {MAX_SAMPLES} "
            f"samples per request (n)"
        )


def uniforms(seed: int, token_ids: np.ndarray, step: int, sample_index: int) -> np.ndarray:
    """One uniform in (0, 1) per token id, float64, same shape as ``token_ids``.

    Key ``(seed mod 2**32, (seed >> 32) mod 2**32)``, counter
    ``(token_id, step + 2**20 * sample_index)``; ``u = ((x >> 8) + 0.5) * 2**-24``
    from the first output word ``x``. The half offset keeps ``u`` strictly inside
    (0, 1), so ``-log(-log(u))`` is always finite.
    """
    seed, step, sample_index = int(seed), int(step), int(sample_index)
    _check_position(step, sample_index)
    ids = np.asarray(token_ids)
    x, _ = threefry2x32(
        seed & _MASK32, (seed >> 32) & _MASK32, ids, (step + MAX_STEPS * sample_index) & _MASK32
    )
    return ((x >> np.uint32(8)).astype(np.float64) + 0.5) * 2.0**-24


def gumbel(seed: int, token_ids: np.ndarray, step: int, sample_index: int) -> np.ndarray:
    """Standard Gumbel noise ``-log(-log(u))`` from :func:`uniforms` (float64)."""
    return -np.log(-np.log(uniforms(seed, token_ids, step, sample_index)))
