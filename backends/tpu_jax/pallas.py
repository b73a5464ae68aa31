"""Paged decode attention on JAX's Pallas TPU kernel (option ``paged_attention``).

With ``page_size``, a decode step's attention either gathers each row's pages into a
contiguous copy per layer (``"gather"``: the shared forward's path, any platform) or
reads them in place with the Pallas paged-attention kernel JAX ships
(``jax.experimental.pallas.ops.tpu.paged_attention``; ``"pallas"``). The pool's layout,
``[layers, kv_heads, pages, page_size, head_dim]`` (:mod:`.paged`), is the kernel's per
layer, so it takes one layer's pools as they are. The kernel enters through the shared
forward's ``StepSpec.paged_attention`` hook: the torch side hands it the queries, the
layer's pools, the page table's columns of the step's width bucket and each row's
length, and it runs as JAX inside the traced step (torchax's ``call_jax``).

The kernel is a TPU kernel. On another platform ``"pallas"`` runs it under Pallas's TPU
interpreter (``pltpu.force_tpu_interpret_mode``: every grid step simulated on the host,
far slower than the gather), which is how the CPU tests prove the path: its output, its
page-table handling and its sharding, against the gather path. ``"auto"`` is the kernel
on a TPU when K/V are 16-bit, the gather anywhere else: the kernel reads K/V in
bfloat16 (its loads convert them), so a float32 engine keeps the gather's float32 reads.

Sharding: the kernel is one device's program, so on a mesh of several devices it runs
under ``shard_map``: queries and pools split over the KV heads' mesh axis (each device
attends its own heads, as the contiguous path does), rows over the slots' axis (the
pool is whole in every ``dp`` group).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

__all__ = ["resolve", "pages_per_block", "attention", "torch_hook"]

# One compute block of the kernel spans at most this many positions (pages x page_size).
BLOCK_POSITIONS = 128


def resolve(mode: str, platform: str, dtype: str) -> str:
    """Option ``paged_attention`` on ``platform``: ``"gather"``, ``"pallas"`` (the kernel
    compiled for a TPU) or ``"interpret"`` (the kernel under Pallas's TPU interpreter)."""
    if mode == "auto":
        return "pallas" if platform == "tpu" and dtype in ("bfloat16", "float16") else "gather"
    if mode == "pallas" and platform != "tpu":
        return "interpret"
    return mode


def pages_per_block(width: int, page_size: int) -> int:
    """The kernel's pages per compute block for a table of ``width`` pages: the largest
    divisor of ``width`` (the kernel needs one) spanning at most :data:`BLOCK_POSITIONS`."""
    limit = max(1, BLOCK_POSITIONS // page_size)
    return max(d for d in range(1, min(width, limit) + 1) if width % d == 0)


def attention(q, k_pool, v_pool, pages, lengths, *, plan, interpret: bool, scale: float, softcap):
    """One layer's decode attention on the kernel: ``q`` (B, heads, head_dim) after RoPE,
    ``k_pool``/``v_pool`` (kv_heads, pages, page_size, head_dim), ``pages`` (B, P) int32,
    ``lengths`` (B,) int32; returns (B, heads, head_dim) in ``q``'s dtype."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    block = pages_per_block(pages.shape[1], k_pool.shape[2])
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)  # the kernel does not scale its logits

    def local(q, k_pool, v_pool, pages, lengths):
        out = paged_attention(q, k_pool, v_pool, lengths, pages, pages_per_compute_block=block,
                              attn_logits_soft_cap=softcap)
        return out.astype(q.dtype)

    mode = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    with mode:  # a context of tracing: the pallas_call traced inside it runs interpreted
        if plan.mesh.devices.size == 1:
            return local(q, k_pool, v_pool, pages, lengths)
        slots, = plan.spec(("slots",), lengths.shape)
        heads = plan.spec(("kv_heads",), k_pool.shape[:1])[0]  # q's heads follow the pool's
        pool = PartitionSpec(heads, None, None, None)
        return jax.shard_map(local, mesh=plan.mesh, check_vma=False,
                             in_specs=(PartitionSpec(slots, heads, None), pool, pool, PartitionSpec(slots, None),
                                       PartitionSpec(slots)),
                             out_specs=PartitionSpec(slots, heads, None))(q, k_pool, v_pool, pages, lengths)


def torch_hook(plan, interpret: bool):
    """The shared forward's ``StepSpec.paged_attention`` for torchax-traced steps: the
    torch side's tensors handed to :func:`attention` as JAX arrays and back."""
    from torchax.interop import call_jax

    def paged_attention(q, k_pool, v_pool, pages, lengths, scale, softcap):
        fn = functools.partial(attention, plan=plan, interpret=interpret, scale=scale, softcap=softcap)
        return call_jax(fn, q, k_pool, v_pool, pages, lengths)

    return paged_attention
