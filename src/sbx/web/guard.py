"""A node's request guard (spec: Transport): Host, then Origin, then the bearer token, before any handler. On a
WebSocket route the token may come as an offered ``bearer.<token>`` subprotocol (``sbx.web.websocket``)."""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Middleware

from sbx.api.errors import ForbiddenOrigin, Unauthorized
from sbx.net.loopback import host_header_name, is_loopback
from sbx.web.connections import mark_authenticated
from sbx.web.http import Handler
from sbx.web.websocket import authorization


def make_guard(
    allowed_hosts: frozenset[str], allowed_origins: frozenset[str], token: str | None
) -> Middleware:
    """The request guard: Host, then Origin, then the bearer token, before any handler runs."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host", "")
        name = host_header_name(host)
        if not name or not (is_loopback(name) or name in allowed_hosts):
            raise ForbiddenOrigin(
                f"Host {host!r} is not served here: use a loopback name or add it to [server] allowed_hosts"
            )
        origin = request.headers.get("Origin")
        if origin is not None and origin not in allowed_origins:
            raise ForbiddenOrigin(f"Origin {origin!r} is not allowed: add it to [server] allowed_origins")
        if token is not None:
            given = authorization(request) or ""
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise Unauthorized("missing or wrong token: send Authorization: Bearer <token>")
        mark_authenticated(request)
        return await handler(request)

    return guard
