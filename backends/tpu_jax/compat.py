"""Importing torchax on torch 2.13: the one place that knows about the mismatch.

torchax 0.0.13 (the newest on PyPI) names, at import time, 21 named-tensor
(``Dimname``) overloads of aten ops that torch 2.13 removed (``aten.prod.dim_Dimname``,
``aten.unbind.Dimname``, ...): ``import torchax`` raises AttributeError. The fix is
upstream (torchax 0.0.14) but not released. Until it is, :func:`import_torchax` puts
an inert placeholder under each missing name before the first import; torchax only
uses them as dictionary keys and decomposition-table entries, and no traced program
can reach a removed overload, so nothing ever calls one. A placeholder is added only
where the overload is missing, so this is harmless on a torch that still has them;
delete the placeholder code once a torchax that imports on torch 2.13 ships.

Second fix: torchax 0.0.13 returns a lazy ``View`` for basic slicing, and indexing
such a View with a tensor fails (``'View' object has no attribute '_elem'``), which
the shared model does (``rows[anchor, 0]``). ``force_materialize_views`` turns views
into plain tensors; XLA removes the copies, so traced programs are unchanged.

Everything in this backend imports torchax through :func:`import_torchax`.
"""

from __future__ import annotations

import threading

__all__ = ["import_torchax", "REMOVED_OVERLOADS"]

# (op, overload) pairs torchax 0.0.13 names that torch 2.13 no longer has.
REMOVED_OVERLOADS = (
    ("all", "dimname"), ("all", "dimname_out"), ("index_add", "dimname"), ("index_copy", "dimname"),
    ("index_copy_", "dimname"), ("index_fill", "Dimname_Scalar"), ("index_fill", "Dimname_Tensor"),
    ("index_fill_", "Dimname_Scalar"), ("index_fill_", "Dimname_Tensor"), ("norm", "names_ScalarOpt_dim"),
    ("norm", "names_ScalarOpt_dim_dtype"), ("norm", "names_dtype_out"), ("norm", "names_out"),
    ("prod", "dim_Dimname"), ("std", "correction_names"), ("std", "correction_names_out"), ("std", "names_dim"),
    ("std", "names_out"), ("std_mean", "correction_names"), ("std_mean", "names_dim"), ("unbind", "Dimname"),
)

_lock = threading.Lock()


class RemovedOverload:
    """Stands in for an aten overload this torch no longer has; calling it is a bug."""

    def __init__(self, name: str):
        self._name = name

    def name(self) -> str:
        return self._name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} was removed from torch; torchax named it only in its tables")

    def __repr__(self) -> str:
        return f"<removed overload {self._name}>"


def _add_placeholders(torch) -> list[str]:
    added = []
    for op, overload in REMOVED_OVERLOADS:
        packet = getattr(torch.ops.aten, op, None)
        if packet is None:
            continue
        try:
            getattr(packet, overload)
        except AttributeError:
            setattr(packet, overload, RemovedOverload(f"aten.{op}.{overload}"))
            added.append(f"{op}.{overload}")
    return added


def import_torchax():
    """``torchax``, imported so that it works on this torch (see the module docstring)."""
    with _lock:
        import torch

        _add_placeholders(torch)
        import torchax

        torchax.default_env().config.force_materialize_views = True
        return torchax
