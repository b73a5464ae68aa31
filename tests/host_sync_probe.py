"""A recording stand-in for a GPU's synchronizing transfers, usable on the CPU.

On CUDA, a decode step that reads a device value on the host (``.item()``,
``.tolist()``, ``int(t)``, ``bool(t)``: all ``aten._local_scalar_dense``) waits for the
device, and one that brings host data in through pageable memory (``torch.tensor(...)``,
``torch.from_numpy(...).to(device)``) waits for the kernels queued before it. On the
CPU neither costs anything, so a test cannot time them; it can see them.

:class:`HostDataProbe` is a ``TorchDispatchMode`` that knows which storages are "on
the device": the tensors it is given (weights, the decode state) and every tensor an
op creates while it records. An op that reads any other tensor is reading host data
that came in without going through ``torch_common.transfer.to_device`` (whose outputs
the probe is told about through :meth:`HostDataProbe.staged`); a
``_local_scalar_dense`` (or ``.tolist()``/``.numpy()`` of a device tensor, which on the
CPU dispatch nothing) is a sync. Both are recorded with the op and the line.

Blind spots (so a clean probe is necessary, not sufficient): a storage whose address
is reused by a later host tensor, and factory ops that forget ``device=`` (harmless on
the CPU, an error on a GPU, which the device check catches).
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any, Iterable, Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostDataProbe", "probing"]

_SYNC = {torch.ops.aten._local_scalar_dense.default}
# Creating a tensor from Python data: on a GPU, the data then crosses from pageable memory.
_FROM_HOST = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class HostDataProbe(TorchDispatchMode):
    """Record syncs and host data entering ops; see the module docstring."""

    def __init__(self, device_tensors: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.known: set[int] = set()
        self.findings: list[str] = []
        for t in device_tensors:
            self.staged(t)

    def staged(self, tree: Any) -> Any:
        """Mark the tensors of ``tree`` as device data (what crossed properly)."""
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor) and t.numel():
                self.known.add(_ptr(t))
        return tree

    def _found(self, what: str) -> None:
        """Record ``what`` with the innermost line of polyengine that caused it."""
        where = next((f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                      for f in reversed(traceback.extract_stack()) if "polyengine" in f.filename
                      or "/backends/" in f.filename), "?")
        self.findings.append(f"{what} at {where}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC:
            self._found(f"sync: {func} (.item(), .tolist() or a Python conversion of a device value)")
        elif func in _FROM_HOST:
            self._found(f"host data: {func} (torch.tensor of Python data)")
        else:
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.numel() and _ptr(t) not in self.known:
                    self._found(f"host data: a {tuple(t.shape)} {t.dtype} tensor into {func}")
        out = func(*args, **kwargs)
        self.staged(out)
        return out


@contextlib.contextmanager
def probing(device_tensors: Iterable[torch.Tensor], *, watch_transfers: bool = True) -> Iterator[HostDataProbe]:
    """Record inside the block; ``to_device`` results count as device data (patched on
    every module that imported it)."""
    import polyengine.backends.torch_common.transfer as transfer

    probe = HostDataProbe(device_tensors)
    patched = []
    original = transfer.to_device
    if watch_transfers:
        import sys


        def staged_to_device(*args, **kwargs):
            with torch.utils._python_dispatch._disable_current_modes():
                out = original(*args, **kwargs)
            return probe.staged(out)

        for mod in list(sys.modules.values()):
            if getattr(mod, "to_device", None) is original:
                patched.append(mod)
                mod.to_device = staged_to_device
    # On the CPU, .tolist() and .numpy() read memory without dispatching an op; on a
    # device they are a copy to the host that waits for the device.
    readers = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def reader(name):
        def read(self, *args, **kwargs):
            if self.numel() and _ptr(self) in probe.known:
                probe._found(f"sync: Tensor.{name}() of a device tensor")
            return readers[name](self, *args, **kwargs)
        return read

    for name in readers:
        setattr(torch.Tensor, name, reader(name))
    try:
        with probe:
            yield probe
    finally:
        for name, fn in readers.items():
            setattr(torch.Tensor, name, fn)
        for mod in patched:
            mod.to_device = original
