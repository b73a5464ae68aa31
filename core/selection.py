"""Choosing a backend: a name, or ``"auto"``.

``auto`` ranks only data the specs carry (nothing here knows a backend by name):
among the backends that can run here, those whose probe reports their accelerator
present come first, by ``accelerator_priority``; then CPU paths by ``priority``;
ties by name. A backend whose probe says ``by_name_only`` is never picked by ``auto``.
"""

from __future__ import annotations

from polyengine.discovery import BackendInfo, get_registry
from polyengine.errors import BackendUnavailable, UnknownBackend

__all__ = ["select_backend", "auto_rank"]


def auto_rank(info: BackendInfo) -> tuple:
    """Sort key of ``backend="auto"`` (smallest wins) for a usable backend."""
    present = info.probe().accelerator
    spec = info.spec
    return (0, -spec.accelerator_priority, info.name) if present else (1, -spec.priority, info.name)


def select_backend(backend: str = "auto") -> BackendInfo:
    """Resolve a backend name (or ``"auto"``) to a usable backend, or raise why not."""
    backends = get_registry().backends()
    if backend != "auto":
        if backend not in backends:
            raise UnknownBackend(backend, list(backends))
        info = backends[backend]
        info.require_usable()
        return info
    usable = [b for b in backends.values() if b.usable and not b.probe().by_name_only]
    if not usable:
        why = "; ".join(f"{b.name}: {b.probe().reason or 'unavailable'}" for b in backends.values()) or "no backends are installed"
        hints = sorted({b.install_hint for b in backends.values() if b.install_hint and not b.broken})
        raise BackendUnavailable(
            "auto", f"no backend can run here ({why})",
            " or ".join(hints) if hints else "install polyengine (it ships the reference backend) or a backend plugin",
        )
    return min(usable, key=auto_rank)
