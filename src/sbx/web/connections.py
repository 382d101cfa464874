"""What a server allows a connection before it has proved who it is, and the answer to a request that is not
HTTP at all.

- **Header and idle timeout.** A connection that has sent no whole request head within ``IDLE_TIMEOUT_SECS``
  (30) of opening, or of its previous answer, is closed: a client that sends nothing, or a request head a
  byte at a time, holds nothing for long. (aiohttp's keep-alive timer does this once it is short; 30 s is past
  the 15 s after which aiohttp's own clients drop an idle connection, so they never reuse one being closed.)
- **Unauthenticated connections.** On TCP at most ``max_unauthenticated`` (256) connections may be open that
  have not yet made a request the server authenticated (a valid token or key); a new one past that closes the
  oldest of them. A flood of idle connections thus holds at most that many descriptors, and never keeps out a
  client that connects and asks at once (it is the newest). The request guard (a node's) or the gateway's
  authentication marks a connection with :func:`mark_authenticated`. A unix socket is not counted: its file
  permissions decide who connects. A connection that asks for something open to anyone (a gateway's public
  service) may be taken out of this count by whoever keeps its own (:func:`anonymous_connection`,
  :meth:`GatedRequestHandler.hold`): it then leaves that count when it authenticates or closes.
- **Malformed requests** (a request line over 8190 bytes, a bad chunk size, both Transfer-Encoding and
  Content-Length, a NUL or CR in a header, ...) are answered with the spec's error body (400, code
  ``invalid_request``, what was wrong in a short escaped phrase), never aiohttp's plain text, and the connection
  is closed. They are logged at most once a second per server (a flood must not fill the log).

aiohttp has no hook for these, so the toolkit's runner makes its own request handler class (a subclass of
aiohttp's, one override each) for the server it builds.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web, web_protocol

from sbx.api.codec import encode
from sbx.api.errors import Internal, InvalidRequest

log = logging.getLogger(__name__)

#: Seconds a connection may wait for a whole request head (after opening, or after its previous answer).
IDLE_TIMEOUT_SECS = 30.0
#: TCP connections that have not made an authenticated request, at most, per server.
MAX_UNAUTHENTICATED = 256
#: Seconds between two log lines about malformed requests or refused connections.
LOG_EVERY_SECS = 1.0
#: Longest part of aiohttp's reason for a malformed request repeated in the answer.
MAX_REASON_CHARS = 120


@dataclass
class ConnectionGate:
    """The per-server count of TCP connections not yet authenticated, and the log throttle."""

    max_unauthenticated: int = MAX_UNAUTHENTICATED
    #: Unauthenticated connections, oldest first (a dict keeps insertion order).
    unauthenticated: dict[web_protocol.RequestHandler, None] = field(default_factory=dict)
    refused: int = 0
    malformed: int = 0
    _last_log: float = 0.0

    def note(self, what: str, **extra: Any) -> None:
        """Log ``what`` at most once every LOG_EVERY_SECS, with the counts so far."""
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_SECS:
            self._last_log = now
            log.warning(
                what, extra={"refused_total": self.refused, "malformed_total": self.malformed, **extra}
            )


class GatedRequestHandler(web_protocol.RequestHandler):
    """aiohttp's request handler with the gate, the timeouts and the JSON answer to malformed requests."""

    gate: ConnectionGate
    #: Whether this connection counts (TCP; a unix socket's does not).
    counted: bool = False
    #: Whether a request of this connection was authenticated.
    proven: bool = False
    #: Run once when the connection authenticates or closes (see :meth:`hold`).
    _on_leave: Callable[[], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        self.counted = True
        gate = self.gate
        while len(gate.unauthenticated) >= gate.max_unauthenticated:
            oldest = next(iter(gate.unauthenticated))
            del gate.unauthenticated[oldest]
            gate.refused += 1
            gate.note("closed the oldest unauthenticated connection", limit=gate.max_unauthenticated)
            oldest.force_close()
            if oldest.transport is not None:
                oldest.transport.close()
        gate.unauthenticated[self] = None

    def connection_lost(self, exc: BaseException | None) -> None:
        self.gate.unauthenticated.pop(self, None)
        self._leave()
        super().connection_lost(exc)

    def authenticated(self) -> None:
        """This connection made an authenticated request: it no longer counts against the gate, nor where
        :meth:`hold` put it."""
        self.proven = True
        self.gate.unauthenticated.pop(self, None)
        self._leave()

    def hold(self, on_leave: Callable[[], None]) -> None:
        """Someone else counts this unauthenticated connection from now on: it leaves the gate's count, and
        ``on_leave`` runs once when it authenticates or closes (a later call replaces an earlier one)."""
        self.gate.unauthenticated.pop(self, None)
        self._on_leave = on_leave

    def _leave(self) -> None:
        on_leave, self._on_leave = self._on_leave, None
        if on_leave is not None:
            on_leave()

    def idle(self) -> bool:
        """Whether the connection is waiting for its next request: none being answered, none read and waiting
        for its handler (aiohttp's own test before its keep-alive timer closes a connection)."""
        waiter = self._waiter
        return self.transport is not None and waiter is not None and not waiter.done()

    def close_idle(self) -> None:
        """Close an idle keep-alive connection, as the idle timeout does: the client sees the connection end
        between two requests, and opens a new one for its next."""
        self.force_close()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was sent already; the connection is cut")
        if status >= 500:
            error: InvalidRequest | Internal = Internal("the server could not read this request")
            log.exception("unhandled error reading a request", exc_info=exc)
        else:
            # aiohttp's reason, first line only (the rest points into the bytes sent), escaped and cut short.
            text = str(getattr(exc, "message", None) or message or "").strip()
            reason = text.splitlines()[0].rstrip(" :") if text else "not a well-formed HTTP request"
            self.gate.malformed += 1
            self.gate.note("malformed request answered", status=status)
            error = InvalidRequest(f"malformed HTTP request: {ascii(reason[:MAX_REASON_CHARS])[1:-1]}")
        response = web.Response(status=status, body=encode(error.to_body()), content_type="application/json")
        response.force_close()
        return response


def mark_authenticated(request: web.BaseRequest) -> None:
    """Note that ``request``'s connection proved who it is (a request guard or authentication calls this)."""
    handler = request.protocol
    if isinstance(handler, GatedRequestHandler):
        handler.authenticated()


def anonymous_connection(request: web.BaseRequest) -> GatedRequestHandler | None:
    """``request``'s connection when it counts (TCP) and has not authenticated yet; None otherwise."""
    handler = request.protocol
    if isinstance(handler, GatedRequestHandler) and handler.counted and not handler.proven:
        return handler
    return None


class GatedServer(web.Server):
    """A server whose connections use :class:`GatedRequestHandler` with this server's gate."""

    def __init__(self, gate: ConnectionGate, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handler_class = type("Handler", (GatedRequestHandler,), {"gate": gate})

    def __call__(self) -> web_protocol.RequestHandler:
        # aiohttp's own __call__, with the class swapped: the keyword arguments are the runner's.
        return self.handler_class(self, loop=self._loop, **self._kwargs)  # type: ignore[no-any-return]


class GatedRunner(web.AppRunner):
    """An AppRunner whose server is a :class:`GatedServer`."""

    def __init__(self, app: web.Application, gate: ConnectionGate, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.gate = gate

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()
        # aiohttp builds its Server in Application._make_handler; the same one, with the gated handler class.
        return GatedServer(
            self.gate, plain.request_handler, request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation, loop=plain._loop, **plain._kwargs,
        )  # fmt: skip
