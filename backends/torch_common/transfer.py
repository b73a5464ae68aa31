"""Host data onto a torch device without waiting for the device.

A copy from pageable host memory to a GPU waits for every kernel queued before it
(CUDA stages it through a pinned bounce buffer only once the stream is idle), so one
``torch.tensor(values, device="cuda")`` at the start of a decode step makes step n+1
wait for step n, and the pipelining the async results promise cannot happen. The
copies here go through page-locked (pinned) memory with ``non_blocking=True``: the
host returns at once and the copy runs in stream order. PyTorch's pinned-memory
allocator keeps the buffer alive until that copy has run, so the caller may drop it.

On the CPU nothing moves: the values become a tensor where they are.

``fill_row`` writes one Python value into one row of a device tensor as a fill kernel
(the value travels as a kernel argument): indexing assignment with a Python number
may instead copy a 0-dim host tensor, which is the synchronizing kind of copy.

What must never happen inside a step (``.item()``, ``.tolist()``, ``int(t)`` on a
device tensor, ``torch.tensor(host data)``) is checked by the tests with a recording
dispatch mode (``tests/host_sync_probe.py``), which flags host data entering a step
that did not come through :func:`to_device`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["to_device", "fill_row", "pack_results"]

# The packed result fields that hold float32 values (bit-cast to int32 in the buffer).
_FLOAT_FIELDS = frozenset({"logprobs", "top_logprobs"})


def to_device(values: np.ndarray | Sequence[Any] | torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (host data: an array, a list of numbers, a CPU tensor) as a tensor on
    ``device`` in ``dtype``, without a synchronizing copy."""
    if isinstance(values, torch.Tensor):
        host = values
    else:
        arr = np.asarray(values)
        if any(s < 0 for s in arr.strides):
            arr = np.ascontiguousarray(arr)
        host = torch.from_numpy(arr)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)  # converted on the host, before anything moves
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def fill_row(tensor: torch.Tensor, row: int, value: Any) -> None:
    """``tensor[row] = value`` for a Python number, as a fill kernel on the tensor's device."""
    tensor.narrow(0, int(row), 1).fill_(value)


def pack_results(layout: Any, **fields: torch.Tensor) -> torch.Tensor:
    """A step's results as one int32 buffer ``(rows, layout.width)`` on the device, each
    field (``tokens``, ``valid``, ``lengths``, and with log-probs ``logprobs``,
    ``top_ids``, ``top_logprobs``) placed at the columns of ``layout`` (a
    :class:`~polyengine.engine.ResultLayout`), float fields bit-cast: the one place a
    torch backend writes the protocol's packed layout."""
    rows = fields["tokens"].numel() // layout.k
    parts = []
    for name, cols in layout.columns.items():
        value = fields[name].reshape(rows, cols.stop - cols.start)
        parts.append(value.to(torch.float32).contiguous().view(torch.int32) if name in _FLOAT_FIELDS
                     else value.to(torch.int32))
    return torch.cat(parts, dim=1)
