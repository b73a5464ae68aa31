"""The cuda_torch backend's options (imports no torch: read by ``polyengine backends
--verbose`` and by other backends' refusals without starting torch)."""

from __future__ import annotations

from polyengine.engine import Option

from polyengine.backends.torch_common.options import SHARED_OPTIONS

__all__ = ["OPTIONS"]

OPTIONS = {
    **SHARED_OPTIONS,
    "device": Option("", "'' picks cuda:0 (a GPU must be present), or 'cuda[:N]'; 'cpu' runs this device path "
                         "on the CPU as a test stand-in (use backend 'cpu' to run on a CPU)"),
    # not verified on a GPU in this project's CI, hence off by default (docs/cuda_torch.md)
    "cuda_graphs": Option(False, "replay decode steps as CUDA graphs (never run on a GPU here)"),
}
