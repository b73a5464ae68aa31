"""The cuda_torch backend's options (imports no torch: read by ``polyengine backends
--verbose`` and by other backends' refusals without starting torch)."""

from __future__ import annotations

from polyengine.engine import Option
from polyengine.models.blocks import BLOCK_FORMATS, FLOAT_FORMATS

from polyengine.backends.torch_common.options import SHARED_OPTIONS

__all__ = ["OPTIONS", "WEIGHT_FORMATS"]

OPTIONS = {
    **SHARED_OPTIONS,
    "device": Option("", "'' picks cuda:0 (a GPU must be present), or 'cuda[:N]'; 'cpu' runs this device path "
                         "on the CPU as a test stand-in (use backend 'cpu' to run on a CPU)"),
    # off by default until the conformance suite has run with it on a GPU (docs/cuda_torch.md)
    "cuda_graphs": Option(False, "replay decode steps as CUDA graphs (equal to eager on an H200, docs/cuda_torch.md)"),
}

# The weight formats the engine computes on as stored (Capabilities.weight_formats, and
# `polyengine backends --verbose` without starting torch): the float ones, and every GGUF
# block format repacked at load (torch_common/blocks.py: Q4_0/Q4_1/Q4_K on torch's int4
# op where it runs, the others as int8 values with their group scales). Any other format
# is converted to float32 one tensor at a time as it loads, then to the compute dtype.
WEIGHT_FORMATS = (*FLOAT_FORMATS, *BLOCK_FORMATS)
