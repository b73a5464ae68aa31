"""Run the app on one machine with uvicorn: bind, serve, shut down gracefully.

SIGTERM (or SIGINT) stops accepting connections at once, lets in-flight requests run
for up to ``shutdown_timeout`` seconds, then cancels what is left through the engine
(``drain``), so that a cut stream still ends with an in-band error event and
``[DONE]`` and a waiting client gets a 503, never a silently closed connection; then
the engine stops and the command returns 0. A SIGTERM repeated during the stop is part
of it: the process still ends with 0, never with SIGTERM's default action.

Connections are bounded in time (uvicorn bounds only idle keep-alive ones): one that
has not sent a complete request head within ``header_timeout`` seconds of opening, or
of its previous response, is closed. So a client that opens connections and sends
nothing, or a header a byte at a time, holds each for seconds, not forever, and a few
hundred of them cannot lock others out. The body's bounds are the app's (``_Guard``).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from typing import Any, Awaitable, Callable

from polyengine.errors import PolyengineError

__all__ = ["bind", "serve", "DRAIN_MARGIN_S"]

# uvicorn's own graceful-shutdown bound is this much longer than ours, so the engine's
# cancellation (in-band errors) always comes first and uvicorn's task cancellation never.
DRAIN_MARGIN_S = 5.0


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
          access_log: bool = False, header_timeout: float = 10.0, idle_timeout: float = 5.0,
          drain: Callable[[float], Awaitable[None]] | None = None) -> int:
    """Serve ``app`` on the bound socket until SIGTERM or SIGINT; the exit status.
    ``drain(timeout)`` runs on the first signal: it lets requests finish for up to
    ``timeout`` seconds and cancels the rest (``AsyncLLM.shutdown``)."""
    import uvicorn

    config = uvicorn.Config(app, lifespan="on", log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=shutdown_timeout + (DRAIN_MARGIN_S if drain else 0.0),
                            timeout_keep_alive=idle_timeout)
    config.load()
    config.http_protocol_class = _with_header_timeout(config.http_protocol_class, header_timeout)
    server = _Server(config, drain, shutdown_timeout)
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


class _Server:
    """Built lazily (below) so that importing this module needs no uvicorn."""

    def __new__(cls, config: Any, drain: Any, timeout: float) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                first = not self.should_exit
                super().handle_exit(sig, frame)
                loop = getattr(self, "_polyengine_loop", None)
                if first and drain is not None and loop is not None:
                    # A signal handler runs between two bytecodes of the loop's own
                    # thread: hand the work to the loop instead of running it here.
                    loop.call_soon_threadsafe(lambda: setattr(self, "_drain", asyncio.ensure_future(drain(timeout))))

            async def serve(self, sockets: Any = None) -> None:
                self._polyengine_loop = asyncio.get_running_loop()
                await super().serve(sockets=sockets)

        return Server(config)


def _with_header_timeout(base: type, seconds: float) -> type:
    """uvicorn's HTTP protocol class, plus a deadline for each request head.

    Armed when a connection opens and after each response; when it fires, the
    connection is closed unless a request is in flight (its head arrived: the app's
    body bound takes over). Works the same for the httptools and h11 protocols, which
    both start a new ``cycle`` once a head is complete."""

    class HeaderTimeout(base):  # type: ignore[valid-type,misc]
        _head_timer: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(seconds, self._head_expired)

        def _head_expired(self) -> None:
            self._head_timer = None
            cycle = getattr(self, "cycle", None)
            in_flight = cycle is not None and not cycle.response_complete
            if not in_flight and not self.transport.is_closing():
                self.transport.close()

    HeaderTimeout.__name__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeout
