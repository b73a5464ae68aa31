"""Threefry-2x32 (20 rounds) in torch: the core's random stream on any torch device.

A port of :mod:`polyengine.sampling.threefry` (the definition) that computes the
same bits with tensor ops, batched over rows: ``uniforms(seed_lo, seed_hi, token_ids,
counter_hi)`` gives one uniform per (row, token), and ``gumbel`` turns them into the
noise the sampler's Gumbel-max draw adds. Nothing here knows about sampling
parameters; :mod:`.sampling` decides which rows draw and what the counter words are.

    words = threefry2x32(k0, k1, x0, x1)          # int32 bit patterns, broadcast together
    u = uniforms(seed_lo, seed_hi, ids, ctr, dtype=torch.float64)   # (B, V) in (0, 1)

Integer formulation: torch has no uint32 arithmetic (``add`` is not implemented for
``torch.uint32`` in 2.13), so words are int32 *bit patterns*. int32 addition wraps
modulo 2**32 on every backend we target (CPU vector and scalar kernels, CUDA, XLA,
where it is defined behaviour), which is exactly Threefry's modular add; the
arithmetic right shift is made logical with a mask. An int64 formulation (values in
[0, 2**32), masked after each add) is kept beside it because it avoids any reliance
on signed wrap-around; it moves twice the bytes and measured slower on CPU, and JAX
without x64 cannot run it, so int32 is the default.

Precision: ``u = ((x >> 8) + 0.5) * 2**-24`` needs 25 significant bits. In float64 it
is exact and equals the core's uniforms bit for bit; in float32 ``uniforms`` rounds
``+ 0.5`` to even, bit-equal to rounding the core's value to float32 (and the top
value to exactly 1.0). ``gumbel`` therefore never goes through a float32 ``u``: it
builds ``-log(u)`` from float32-exact pieces, so its noise is finite and within a few
ulps of the reference's (the "float noise" docs/design.md allows a device sampler).
"""

from __future__ import annotations

import torch

from polyengine.sampling.rows import split_seed  # the core's; re-exported for the port's users

__all__ = ["threefry2x32", "threefry2x32_int64", "uniforms", "gumbel", "gumbel_from_bits", "counter_hi", "split_seed", "int32_bits"]

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA
_MASK32 = (1 << 32) - 1


def int32_bits(value: int) -> int:
    """A 32-bit word (taken mod 2**32) as the Python int of the int32 with the same bits."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def _as_i32_bits(x: torch.Tensor) -> torch.Tensor:
    """Integer tensor -> int32 holding its low 32 bits (int64 values in [0, 2**32) or int32)."""
    if x.dtype == torch.int32:
        return x
    # int64 -> int32 conversion keeps the low 32 bits (two's complement truncation).
    return (x & _MASK32).to(torch.int32)


def threefry2x32(k0: torch.Tensor, k1: torch.Tensor, x0: torch.Tensor, x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32-20 of counter ``(x0, x1)`` under key ``(k0, k1)``; int32 bit patterns.

    Inputs are integer tensors (int32 bit patterns, or int64 holding values mod 2**32)
    that broadcast together; the two output words are int32 tensors of the broadcast
    shape whose bits equal :func:`polyengine.sampling.threefry.threefry2x32`'s uint32.
    """
    k0, k1, x0, x1 = (_as_i32_bits(t) for t in (k0, k1, x0, x1))
    k2 = k0 ^ k1 ^ int32_bits(_PARITY)
    ks = (k0, k1, k2)
    shape = torch.broadcast_shapes(k0.shape, k1.shape, x0.shape, x1.shape)
    # Materialise both words at full shape once, then update them in place: the 20
    # rounds are ~115 elementwise ops over (rows, vocab), and fresh allocations for
    # each would double the memory traffic.
    y0 = (x0 + k0).expand(shape).contiguous()
    y1 = (x1 + k1).expand(shape).contiguous()
    spill = torch.empty_like(y1)
    for group in range(5):
        for r in _ROTATIONS[group % 2]:
            y0 += y1
            # rotl(y1, r) on int32 bits: the arithmetic >> drags the sign bit in, so
            # keep only the r bits that wrap around.
            torch.bitwise_right_shift(y1, 32 - r, out=spill)
            spill &= (1 << r) - 1
            y1 <<= r
            y1 |= spill
            y1 ^= y0
        y0 += ks[(group + 1) % 3]
        y1 += ks[(group + 2) % 3]
        y1 += group + 1
    return y0, y1


def threefry2x32_int64(k0: torch.Tensor, k1: torch.Tensor, x0: torch.Tensor, x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same function on int64 values in [0, 2**32) (masked after every add).

    Kept as the formulation that relies on no wrap-around; returns int64 words.
    """
    k0, k1, x0, x1 = (t.to(torch.int64) & _MASK32 for t in (k0, k1, x0, x1))
    ks = (k0, k1, k0 ^ k1 ^ _PARITY)
    shape = torch.broadcast_shapes(k0.shape, k1.shape, x0.shape, x1.shape)
    y0 = ((x0 + k0) & _MASK32).expand(shape).contiguous()
    y1 = ((x1 + k1) & _MASK32).expand(shape).contiguous()
    spill = torch.empty_like(y1)
    for group in range(5):
        for r in _ROTATIONS[group % 2]:
            y0 += y1
            y0 &= _MASK32
            torch.bitwise_right_shift(y1, 32 - r, out=spill)  # logical: y1 < 2**32
            y1 <<= r
            y1 &= _MASK32
            y1 |= spill
            y1 ^= y0
        y0 += ks[(group + 1) % 3]
        y0 &= _MASK32
        y1 += ks[(group + 2) % 3]
        y1 += group + 1
        y1 &= _MASK32
    return y0, y1


def counter_hi(step: torch.Tensor, sample_index: torch.Tensor) -> torch.Tensor:
    """The counter's second word ``step + 2**20 * sample_index`` as int32 bits.

    The value is below 2**32, so int32 arithmetic (which wraps) gives its exact bits;
    no 64-bit integer is needed (JAX runs without x64 by default).
    """
    return step.to(torch.int32) + (sample_index.to(torch.int32) << 20)


def uniforms(
    seed_lo: torch.Tensor,
    seed_hi: torch.Tensor,
    token_ids: torch.Tensor,
    ctr_hi: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    int64: bool = False,
) -> torch.Tensor:
    """One uniform in (0, 1) per element of the broadcast shape, in ``dtype``.

    ``seed_lo``/``seed_hi`` are the key words (e.g. ``(B, 1)``), ``token_ids`` the
    first counter word (e.g. ``(1, V)`` or ``(B, K)``), ``ctr_hi`` the second
    (:func:`counter_hi`, e.g. ``(B, 1)``). ``u = ((x >> 8) + 0.5) * 2**-24`` from the
    first output word. Bit-exact with the core in float64.
    """
    if int64:
        x, _ = threefry2x32_int64(seed_lo, seed_hi, token_ids, ctr_hi)
        top = x >> 8
    else:
        x, _ = threefry2x32(seed_lo, seed_hi, token_ids, ctr_hi)
        top = (x >> 8) & 0xFFFFFF  # logical shift of the int32 bits
    u = top.to(dtype)
    u += 0.5
    u *= 2.0**-24
    return u


def gumbel(
    seed_lo: torch.Tensor, seed_hi: torch.Tensor, token_ids: torch.Tensor, ctr_hi: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(u))`` from the stream's uniforms, in ``dtype``.

    float64: the reference's formula on the exact ``u``. float32: ``u`` itself would
    round (the largest one to exactly 1.0, giving ``+inf`` noise about once per 2**24
    tokens), so ``-log(u)`` is computed from inputs that are exact in float32:
    ``-log((m + 0.5) * 2**-24)`` for ``m = x >> 8 < 2**23``, and
    ``-log1p(-(2**24 - m - 0.5) * 2**-24)`` above. Both arguments need at most 24
    significant bits, so the noise is finite and within a few ulps of the reference's.
    """
    x, _ = threefry2x32(seed_lo, seed_hi, token_ids, ctr_hi)
    return gumbel_from_bits((x >> 8) & 0xFFFFFF, dtype)


def gumbel_from_bits(m: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gumbel noise of ``u = (m + 0.5) * 2**-24`` for integer ``m`` in [0, 2**24) (see :func:`gumbel`)."""
    if dtype == torch.float64:
        u = (m.to(dtype) + 0.5) * 2.0**-24
        return -torch.log(-torch.log(u))
    # In place where possible: this runs over (rows, vocab) every step, and each fresh
    # temporary costs as much as the op that fills it.
    upper = m >= 1 << 23
    low = m.to(dtype)
    low += 0.5
    low *= 2.0**-24  # u, exact where m < 2**23
    low.log_().neg_()
    high = ((1 << 24) - 1 - m).to(dtype)
    high += 0.5
    high *= -(2.0**-24)  # u - 1, exact where m >= 2**23
    high.log1p_().neg_()
    return torch.where(upper, high, low).log_().neg_()
