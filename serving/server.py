"""Run the app on one machine with uvicorn: bind, serve, shut down gracefully.

SIGTERM (or SIGINT) stops accepting connections at once, lets in-flight requests run
for up to ``shutdown_timeout`` seconds, cancels what is left (which frees its slots),
stops the engine and returns 0. A SIGTERM repeated during the stop is part of it: the
process still ends with 0, never with SIGTERM's default action.
"""

from __future__ import annotations

import signal
import socket
import sys
from typing import Any

from polyengine.errors import PolyengineError

__all__ = ["bind", "serve"]


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: any free port), not yet listening,
    so the port is ours while the model loads but nobody connects before we serve."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        raise PolyengineError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port or --host") from None
    return sock


def serve(app: Any, sock: socket.socket, *, shutdown_timeout: float, log_level: str = "info",
          access_log: bool = False) -> int:
    """Serve ``app`` on the bound socket until SIGTERM or SIGINT; the exit status."""
    import uvicorn

    config = uvicorn.Config(app, lifespan="on", timeout_graceful_shutdown=shutdown_timeout,
                            log_level=log_level, access_log=access_log)
    server = uvicorn.Server(config)
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"polyengine serve: listening on http://{shown}:{port}", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal it shut down on, which would end the process with
    # SIGTERM's default action; a graceful stop exits 0, so that re-raise lands here.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run(sockets=[sock])
    # From here the process only closes the engine and exits: a repeated SIGTERM (an
    # orchestrator or a user sending it twice) belongs to the stop already under way.
    # Restoring the default action let one that landed meanwhile end a clean, bounded
    # shutdown with -15; a Python handler is not enough either, since the interpreter puts
    # SIG_DFL back when it finalizes, while SIG_IGN stays to the end.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return 0 if server.started else 1
