"""A WebSocket attach client for tests (capability ``websocket_attach``): connect as a browser would (the
credential and organisation as offered subprotocols, an Origin), send frames, read frames until the exit; a
raw handshake whose refusal (status and error body, before any switch) a test can read; and a whole exchange on a
plain socket, for messages the server refuses while they are still being sent."""

from __future__ import annotations

import base64
import http.client
import os
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import aiohttp
from sandboxd_harness import Response, send

from sbx.api import frames


def offered(token: str | None = None, org: str | None = None) -> list[str]:
    """The subprotocols a browser offers: sbx-stream.v1, then bearer.<token> and org.<name> when given."""
    found = [frames.WEBSOCKET_PROTOCOL]
    if token is not None:
        found.append(frames.WEBSOCKET_BEARER_PREFIX + token)
    if org is not None:
        found.append(frames.WEBSOCKET_ORG_PREFIX + org)
    return found


@dataclass
class Seen:
    """What came back: output of both streams, the exit code (None: no exit frame), the close code and reason."""

    out: bytes = b""
    exit_code: int | None = None
    close_code: int | None = None
    close_reason: str = ""
    messages: list[bytes] = field(default_factory=list)


class WsAttach:
    """One attach WebSocket; ``async with WsAttach.connect(...) as client``."""

    def __init__(self, session: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.session = session
        self.ws = ws

    @classmethod
    async def connect(
        cls, base_url: str, path: str, *, socket_path: Path | None = None, token: str | None = None,
        org: str | None = None, origin: str | None = None,
    ) -> WsAttach:  # fmt: skip
        connector = aiohttp.UnixConnector(path=str(socket_path)) if socket_path is not None else None
        session = aiohttp.ClientSession(connector=connector)
        try:
            ws = await session.ws_connect(
                base_url + path, protocols=offered(token, org), headers={"Origin": origin} if origin else None,
                autoping=True, timeout=aiohttp.ClientWSTimeout(ws_close=5),
            )  # fmt: skip
        except BaseException:
            await session.close()
            raise
        return cls(session, ws)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.ws.close()
        await self.session.close()

    async def send(self, *sent: tuple[bytes, bytes]) -> None:
        """One binary message holding these frames (type, payload)."""
        await self.ws.send_bytes(b"".join(frames.encode_frame(kind, payload) for kind, payload in sent))

    async def resize(self, rows: int, cols: int) -> None:
        await self.ws.send_bytes(frames.resize_frame(rows, cols))

    async def read(self, until: bytes | None = None, after: bytes = b"", timeout_secs: float = 30.0) -> Seen:
        """Read messages until ``until`` is in the output (past the first ``after``), or (None) until the
        connection closes."""
        seen = Seen()
        while True:
            message = await self.ws.receive(timeout=timeout_secs)
            if message.type != aiohttp.WSMsgType.BINARY:
                # The code the server's close frame carried (the connection may be cut right after it).
                closing = message.type == aiohttp.WSMsgType.CLOSE
                seen.close_code = int(message.data) if closing else self.ws.close_code
                seen.close_reason = str(message.extra or "")
                return seen
            seen.messages.append(message.data)
            # Every message holds whole frames (decode_message refuses anything else).
            for frame in frames.decode_message(message.data, frames.SERVER_TYPES):
                if frame.type in (frames.STDOUT, frames.STDERR):
                    seen.out += frame.payload
                elif frame.type == frames.EXIT:
                    seen.exit_code = struct.unpack(">i", frame.payload)[0]
            rest = seen.out.split(after, 1)[1] if after and after in seen.out else b"" if after else seen.out
            if until is not None and until in rest:
                return seen


def handshake(
    conn: http.client.HTTPConnection, path: str, protocols: list[str], headers: dict[str, str] | None = None
) -> Response:
    """A WebSocket handshake on ``conn`` that the server is expected to refuse: its status and error body."""
    hdrs = {
        "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode(),
        "Sec-WebSocket-Protocol": ", ".join(protocols), **(headers or {}),
    }  # fmt: skip
    return send(conn, "GET", path, headers=hdrs)


def exchange(
    sock: socket.socket, host: str, path: str, messages: list[bytes], token: str | None = None
) -> Seen:
    """One attach WebSocket on a connected blocking ``sock``: the handshake (the token as ``Authorization``), each of
    ``messages`` sent as one binary message, then every server message until the server's close frame or the end.

    A server may refuse a message too big from its header and close while the rest is still being sent: the send
    then fails, and what the server sent before is read all the same. (The aiohttp client cannot do that: a failed
    write makes asyncio drop the bytes it had not read yet, the close frame among them.)"""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n"
        f"Sec-WebSocket-Protocol: {frames.WEBSOCKET_PROTOCOL}\r\n{auth}\r\n".encode()
    )
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed during the handshake: {got!r}"
        got += chunk
    head, got = got.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 101 "), head
    try:
        for message in messages:
            # A client frame must be masked; the all-zero key leaves the payload as it is.
            n = len(message)
            size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n) if n < 65536 \
                else bytes([0x80 | 127]) + struct.pack(">Q", n)  # fmt: skip
            sock.sendall(b"\x82" + size + b"\0\0\0\0" + message)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused while being sent: the answer is read below
    seen = Seen()
    while True:
        found = _server_frame(got)
        if found is None:
            try:
                chunk = sock.recv(1 << 20)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return seen  # ended without a close frame: close_code stays None
            got += chunk
            continue
        opcode, payload, got = found
        if opcode == 0x8:
            seen.close_code = struct.unpack(">H", payload[:2])[0] if len(payload) >= 2 else None
            seen.close_reason = payload[2:].decode()
            return seen
        if opcode == 0x2:
            seen.messages.append(payload)
            for frame in frames.decode_message(payload, frames.SERVER_TYPES):
                if frame.type in (frames.STDOUT, frames.STDERR):
                    seen.out += frame.payload
                elif frame.type == frames.EXIT:
                    seen.exit_code = struct.unpack(">i", frame.payload)[0]


def _server_frame(buf: bytes) -> tuple[int, bytes, bytes] | None:
    """(opcode, payload, the rest) of the whole server frame (never masked) at the start of ``buf``, or None."""
    if len(buf) < 2:
        return None
    n, at = buf[1] & 0x7F, 2
    if n == 126:
        n, at = (struct.unpack(">H", buf[2:4])[0], 4) if len(buf) >= 4 else (-1, 0)
    elif n == 127:
        n, at = (struct.unpack(">Q", buf[2:10])[0], 10) if len(buf) >= 10 else (-1, 0)
    if n < 0 or len(buf) < at + n:
        return None
    return buf[0] & 0x0F, buf[at : at + n], buf[at + n :]
