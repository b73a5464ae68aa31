"""Stand-in for NxD's process-group state: the tensor-parallel size and this core's rank."""

from neuronx_distributed._device import context


def get_tensor_model_parallel_size() -> int:
    ctx = context()
    return 1 if ctx is None else ctx.tp


def get_tensor_model_parallel_rank() -> int:
    ctx = context()
    return 0 if ctx is None else ctx.rank
