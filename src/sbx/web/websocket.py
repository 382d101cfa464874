"""The WebSocket form of attach, server side (both servers): the credential and organisation a browser offers as
subprotocols, the handshake, and the frames of each client message (capability ``websocket_attach``).

A browser cannot set ``Authorization`` (or any header) on a WebSocket, and a token in the URL would reach access
logs and the browser's history, so the client offers two subprotocols: ``sbx-stream.v1`` and ``bearer.<token>``
(on a gateway also ``org.<name>``, as ``X-Sandbox-Org``). The answer names ``sbx-stream.v1`` alone: the token is
never echoed. These subprotocols are read only on a WebSocket route (``WEBSOCKET_PATHS``), and only when the
request has no ``Authorization`` header of its own. The request guard (Host, Origin) runs first, as for every
request, so a page of a foreign origin is refused before its credential is looked at.

Messages: each binary message holds one or more whole ``sbx-stream/1`` frames, both ways. A text message closes
the connection with 1003 (unsupported data), a message that is not whole client frames with 1007 (invalid
payload); the reason says what was wrong. A ping every ``HEARTBEAT_SECS`` finds a client that went away
without closing, so it never holds an attach slot for long.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Final

from aiohttp import WSCloseCode, WSMsgType, web

from sbx.api import frames
from sbx.api.endpoints import ENDPOINTS
from sbx.api.errors import InvalidRequest

#: Path patterns of the WebSocket endpoints (the catalogue's ``upgrade="websocket"``).
WEBSOCKET_PATHS: Final = frozenset(ep.path for ep in ENDPOINTS if ep.upgrade == "websocket")
#: Seconds between pings; a client that has not answered within half of it is closed.
HEARTBEAT_SECS: Final = 30.0
#: Largest client message (bytes): a frame at its limit with its header, or several smaller ones. A longer one
#: is closed with 1009 (message too big).
MAX_MESSAGE_BYTES: Final = frames.MAX_PAYLOAD_BYTES + frames.HEADER_BYTES
#: Seconds a server waits for the client's answer to its close.
CLOSE_TIMEOUT_SECS: Final = 2.0
#: Longest close reason a WebSocket close frame carries (bytes).
_MAX_REASON_BYTES: Final = 123


def is_websocket_route(request: web.BaseRequest) -> bool:
    """Whether the request matched a WebSocket endpoint of the catalogue."""
    match_info = getattr(request, "match_info", None)
    resource = match_info.route.resource if match_info is not None else None
    return resource is not None and resource.canonical in WEBSOCKET_PATHS


def offered_protocols(request: web.BaseRequest) -> list[str]:
    """The subprotocols the client offered, in its order."""
    return [
        p.strip() for value in request.headers.getall("Sec-WebSocket-Protocol", []) for p in value.split(",")
    ]


def _offered(request: web.BaseRequest, prefix: str) -> list[str]:
    if not is_websocket_route(request):
        return []
    return [p[len(prefix) :] for p in offered_protocols(request) if p.startswith(prefix)]


def authorization(request: web.BaseRequest) -> str | None:
    """The request's ``Authorization`` header; on a WebSocket route without one, ``Bearer <token>`` from an
    offered ``bearer.<token>`` subprotocol (the first one)."""
    given = request.headers.get("Authorization")
    if given is not None:
        return given
    tokens = _offered(request, frames.WEBSOCKET_BEARER_PREFIX)
    return f"Bearer {tokens[0]}" if tokens else None


def offered_orgs(request: web.BaseRequest) -> list[str]:
    """Organisations offered as ``org.<name>`` subprotocols on a WebSocket route (a gateway reads them as
    ``X-Sandbox-Org`` values)."""
    return _offered(request, frames.WEBSOCKET_ORG_PREFIX)


def check_websocket(request: web.Request) -> None:
    """InvalidRequest (400) unless the request is a WebSocket handshake offering ``sbx-stream.v1``."""
    protocol = frames.WEBSOCKET_PROTOCOL
    handshake = request.headers.get("Upgrade", "").strip().lower() == "websocket"
    # Ours is checked first: aiohttp logs the offered subprotocols (a bearer token among them) when none is
    # one it knows.
    if handshake and protocol not in offered_protocols(request):
        raise InvalidRequest(f"offer the WebSocket subprotocol {protocol} (Sec-WebSocket-Protocol)")
    if not handshake or not _response().can_prepare(request).ok:
        raise InvalidRequest(
            "this endpoint is a WebSocket: send a WebSocket handshake (Connection: Upgrade, Upgrade: websocket, "
            f"Sec-WebSocket-Version: 13, Sec-WebSocket-Key) offering the subprotocol {protocol}"
        )


def _response() -> web.WebSocketResponse:
    # aiohttp refuses a message of max_msg_size bytes itself (its bound is exclusive), hence the + 1.
    return web.WebSocketResponse(
        protocols=(frames.WEBSOCKET_PROTOCOL,), heartbeat=HEARTBEAT_SECS, max_msg_size=MAX_MESSAGE_BYTES + 1,
        timeout=CLOSE_TIMEOUT_SECS, compress=False,
    )  # fmt: skip


async def accept(request: web.Request) -> web.WebSocketResponse:
    """Answer the handshake (101, subprotocol ``sbx-stream.v1``) and return the open WebSocket; call
    :func:`check_websocket` first."""
    ws = _response()
    await ws.prepare(request)
    return ws


async def close(ws: web.WebSocketResponse, code: int, reason: str) -> None:
    """Close with ``code`` and ``reason`` (cut to what a close frame holds)."""
    await ws.close(code=code, message=reason.encode()[:_MAX_REASON_BYTES])


async def client_frames(ws: web.WebSocketResponse) -> AsyncIterator[list[frames.Frame]]:
    """The frames of each binary message until the client closes; a text message (1003) or a message that is
    not whole client frames (1007) closes the connection, with the reason, and ends the iteration."""
    async for message in ws:
        if message.type == WSMsgType.BINARY:
            try:
                found = frames.decode_message(message.data, frames.CLIENT_TYPES)
            except InvalidRequest as exc:
                await close(ws, WSCloseCode.INVALID_TEXT, exc.message)
                return
            yield found
        elif message.type == WSMsgType.TEXT:
            await close(ws, WSCloseCode.UNSUPPORTED_DATA, "send binary messages of sbx-stream/1 frames")
            return
        else:
            return
