"""Stand-in for NxD's collectives over the tensor-parallel group (``mappings``): each core
is a thread, the collective meets at a barrier. While tracing (one run for the shapes,
as NxD traces one SPMD program) they return what the shapes need."""

import torch

from neuronx_distributed._device import context


def reduce_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) over the tensor-parallel group."""
    ctx = context()
    if ctx is None or ctx.tp == 1 or ctx.group is None:
        return x
    return ctx.group.all_reduce(ctx.rank, x)


def gather_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """All-gather along the last dimension, in rank order."""
    ctx = context()
    if ctx is None or ctx.tp == 1:
        return x
    if ctx.group is None:
        return torch.cat([x] * ctx.tp, dim=-1)
    return ctx.group.all_gather_last(ctx.rank, x)
