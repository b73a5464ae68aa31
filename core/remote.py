"""Bounded waits for external systems (a Ray cluster, a worker): each ends in time.

A wait for something on the network (joining a cluster at an address the user gave,
a call into a worker) must not hang a command for minutes: it gets a timeout, an
option with a default where it is used, and ends in :class:`~polyengine.errors.Unreachable`
naming the address. :func:`check_reachable` opens (and closes) a TCP connection first,
so a refused or unroutable address fails in at most the timeout, before a client
library starts its own, much longer, retries; :func:`call_with_deadline` bounds a call
that may still hang after that (a port that accepts but never answers). The core
imports no client library: the callers pass their call in.
"""

from __future__ import annotations

import socket
import threading
from typing import Any, Callable
from urllib.parse import urlsplit

from polyengine.errors import Unreachable

__all__ = ["host_port", "check_reachable", "call_with_deadline"]


def host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port``, ``[v6]:port`` or ``scheme://host:port``; None
    for an address without a port (Ray's ``"auto"``, a bare host)."""
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return parts.hostname, port


def check_reachable(address: str, timeout: float, what: str) -> None:
    """Raise Unreachable unless a TCP connection to ``address`` opens within ``timeout``
    seconds (an address without a port is not checked)."""
    target = host_port(address)
    if target is None:
        return
    try:
        with socket.create_connection(target, timeout=timeout):
            pass
    except OSError as exc:
        reason = "timed out" if isinstance(exc, (socket.timeout, TimeoutError)) else (exc.strerror or str(exc))
        raise Unreachable(f"cannot reach {what} at {address}: {reason} (within {timeout:g} s); check the address "
                          f"and that it is running and reachable from here", address=address) from None


_SILENT = "the connection opened but nothing came back: not the service expected there, or it is stuck"


def call_with_deadline(fn: Callable[[], Any], timeout: float, *, address: str, what: str, why: str = _SILENT) -> Any:
    """``fn()``'s result, or Unreachable if it has not returned within ``timeout`` seconds
    (``why`` says what that probably means).

    ``fn`` runs on a daemon thread; Python cannot stop a thread, so a call that hangs
    stays behind until it returns (the error says so: the process should be restarted
    before trying the same address again). Its exceptions are re-raised here."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"polyengine-wait-{what}", daemon=True).start()
    if not done.wait(timeout):
        raise Unreachable(f"{what} at {address} did not answer within {timeout:g} s ({why}); check it, and restart "
                          f"this process before trying again", address=address)
    if "error" in box:
        raise box["error"]
    return box.get("result")
