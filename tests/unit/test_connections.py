"""What a connection may do before it authenticates, on a real listening socket (sbx.web.connections): malformed
requests get the error body, idle and half-sent request heads are cut, and a flood of unauthenticated
connections holds a bounded number of descriptors without keeping an honest client out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from sbx.web.connections import ConnectionGate, GatedRunner
from sbx.web.guard import make_guard
from sbx.web.http import error_middleware

TOKEN = "t0ken"
HOST = b"Host: localhost\r\n"

#: Requests aiohttp's parser refuses; each used to get aiohttp's plain text answer.
MALFORMED = [
    ("request line over 8190 bytes", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n" + HOST + b"\r\n"),
    ("bad chunk size", b"POST /x HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"),
    ("transfer-encoding with content-length",
     b"POST /x HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n"),
    ("NUL in a header", b"GET /x HTTP/1.1\r\n" + HOST + b"X-A: a\x00b\r\n\r\n"),
    ("CR in a header", b"GET /x HTTP/1.1\r\n" + HOST + b"X-A: a\rb\r\n\r\n"),
    ("header over 8190 bytes", b"GET /x HTTP/1.1\r\n" + HOST + b"X-A: " + b"a" * 9000 + b"\r\n\r\n"),
    ("200 headers", b"GET /x HTTP/1.1\r\n" + HOST + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n"),
    ("bad method", b"G@T /x HTTP/1.1\r\n" + HOST + b"\r\n"),
    ("bad version", b"GET /x HTTP/9.9\r\n" + HOST + b"\r\n"),
    ("content-length not a number", b"POST /x HTTP/1.1\r\n" + HOST + b"Content-Length: abc\r\n\r\n"),
    ("negative content-length", b"POST /x HTTP/1.1\r\n" + HOST + b"Content-Length: -1\r\n\r\n"),
    ("content-length twice", b"POST /x HTTP/1.1\r\n" + HOST + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nab"),
    ("space in a header name", b"GET /x HTTP/1.1\r\n" + HOST + b"X A: 1\r\n\r\n"),
    ("folded header", b"GET /x HTTP/1.1\r\n" + HOST + b"X-A: 1\r\n folded\r\n\r\n"),
    ("unknown transfer-encoding", b"POST /x HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: gzip\r\n\r\n"),
    ("chunked not last", b"POST /x HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked, gzip\r\n\r\n"),
    ("non-ASCII target", b"GET /\xff HTTP/1.1\r\n" + HOST + b"\r\n"),
    ("TLS on the HTTP port", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40 + b"\r\n\r\n"),
    ("header without a colon", b"GET /x HTTP/1.1\r\n" + HOST + b"nocolon\r\n\r\n"),
    ("LF line endings", b"GET /x HTTP/1.1\nHost: localhost\n\n"),
    ("chunk size overflow",
     b"POST /x HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffffffff\r\nabc\r\n"),
]  # fmt: skip


class Server:
    def __init__(self, runner: GatedRunner) -> None:
        self.runner = runner
        self.gate = runner.gate
        self.port = int(runner.addresses[0][1])

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def exchange(self, raw: bytes, timeout: float = 5.0) -> bytes:
        reader, writer = await self.connect()
        try:
            writer.write(raw)
            await writer.drain()
            return await asyncio.wait_for(reader.read(), timeout)
        finally:
            writer.close()


async def _serve(idle_timeout_secs: float) -> AsyncIterator[Server]:
    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[error_middleware, make_guard(frozenset(), frozenset(), TOKEN)])
    app.router.add_route("*", "/x", handler)
    runner = GatedRunner(
        app, ConnectionGate(max_unauthenticated=5), access_log=None, keepalive_timeout=idle_timeout_secs
    )
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield Server(runner)
    finally:
        await runner.cleanup()


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    """A server that cuts a connection without a whole request head after 1 s."""
    async for s in _serve(1.0):
        yield s


@pytest.fixture
async def patient_server() -> AsyncIterator[Server]:
    """The same with the default 30 s, so that a test sees the cap alone at work."""
    async for s in _serve(30.0):
        yield s


@pytest.mark.parametrize(("raw"), [pytest.param(raw, id=name) for name, raw in MALFORMED])
async def test_malformed_requests_get_the_error_body(server: Server, raw: bytes) -> None:
    answer = await server.exchange(raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].endswith(b"400 Bad Request"), answer[:200]
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_request"
    assert error["message"].startswith("malformed HTTP request: ") and len(error["message"]) < 200
    assert error["message"].isascii() and "\n" not in error["message"]


@pytest.mark.parametrize("sent", [b"", b"GET /x HTTP/1.1\r\nHos"], ids=["nothing", "half a request head"])
async def test_a_connection_without_a_whole_request_head_is_cut(server: Server, sent: bytes) -> None:
    reader, writer = await server.connect()
    writer.write(sent)
    await writer.drain()
    started = asyncio.get_running_loop().time()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server, no answer
    assert asyncio.get_running_loop().time() - started < 3
    writer.close()


async def test_idle_floods_hold_a_bounded_number_and_never_keep_an_honest_client_out(
    patient_server: Server,
) -> None:
    server = patient_server
    idle = [await server.connect() for _ in range(8)]
    await asyncio.sleep(0.2)
    assert len(server.gate.unauthenticated) == 5  # the three oldest were closed to make room
    closed = [await asyncio.wait_for(r.read(), 0.5) == b"" for r, _ in idle[:3]]
    assert closed == [True, True, True]
    # A refused token does not authenticate; a good one does, and that connection stops counting.
    denied = await server.exchange(b"GET /x HTTP/1.1\r\n" + HOST + b"Connection: close\r\n\r\n")
    assert b" 401 " in denied.split(b"\r\n")[0]
    reader, writer = await server.connect()
    writer.write(b"GET /x HTTP/1.1\r\n" + HOST + f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
    await writer.drain()
    assert b" 200 " in (await reader.readuntil(b"\r\n"))
    await asyncio.sleep(0.1)
    # Five idle ones were left; the refused one's and the authenticated one's arrivals each closed the oldest,
    # the refused one is gone, and the authenticated one no longer counts.
    assert len(server.gate.unauthenticated) == 4
    for _, w in idle:
        w.close()
    writer.close()
    await asyncio.sleep(0.2)
    assert server.gate.unauthenticated == {}  # nothing leaks when clients go
