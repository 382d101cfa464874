"""Upgrading an aiohttp request to a raw stream (the plumbing under attach and tunnels)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from sbx.web.http import error_middleware
from sbx.web.upgrade import check_upgrade, finished_response, upgrade


async def _server() -> tuple[web.AppRunner, int]:
    async def echo(request: web.Request) -> web.StreamResponse:
        check_upgrade(request, "sbx-test/1")
        stream = await upgrade(request, "sbx-test/1")
        while data := await stream.reader.read(65536):
            stream.writer.write(data.upper())
            await stream.writer.drain()
        stream.writer.write_eof()  # half-close: the client read to EOF
        await stream.close()
        return finished_response()

    app = web.Application(middlewares=[error_middleware])
    app.add_routes([web.get("/echo", echo)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


async def test_upgrade_echo_and_half_close() -> None:
    runner, port = await _server()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET /echo HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: sbx-test/1\r\n\r\n"
        )
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101 ")
        assert b"Upgrade: sbx-test/1" in head
        payload = b"abc" * 100_000
        writer.write(payload)
        await writer.drain()
        writer.write_eof()
        got = await asyncio.wait_for(reader.read(), 10)
        assert got == payload.upper()
        writer.close()
    finally:
        await runner.cleanup()


async def test_plain_get_is_400_with_error_body() -> None:
    runner, port = await _server()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /echo HTTP/1.1\r\nHost: localhost\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ")
        writer.close()
    finally:
        await runner.cleanup()
